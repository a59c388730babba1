"""The contract shared by the operator and the sidecar: the ``KVCachePolicy`` spec and the sidecar config.

Field names are camelCase, as in Kubernetes. Every model forbids unknown fields so that a typo in a
policy is an error that names the field, not a silently ignored setting. Plain Python + pydantic only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

API_GROUP = "kvpool.dev"
API_VERSION = "v1alpha1"
KIND = "KVCachePolicy"

EvictionPolicyName = Literal[
    "lru", "fifo", "lfu", "s3fifo", "workload_adaptive"
]

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
DURATION_PATTERN = r"^(\d+(\.\d+)?(ms|s|m|h))+$"
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@functools.lru_cache(maxsize=256)  # windows are read per admission: a config holds a few durations
def parse_duration(text: str) -> float:
    """Seconds in a Kubernetes-style duration such as ``10s``, ``10m``, ``1h30m`` or ``168h``."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration: use a number with a unit ms, s, m or h, e.g. 10m")
    return sum(float(num) * _UNIT_SECONDS[unit] for num, unit in _DURATION_PART.findall(text))


def _positive_duration(text: str) -> str:
    if parse_duration(text) <= 0:
        raise ValueError(f"{text!r} must be longer than 0")
    return text


Duration = Annotated[str, Field(pattern=DURATION_PATTERN), AfterValidator(_positive_duration)]
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_KEY = re.compile(rf"^({_DNS_SUBDOMAIN}/)?{_LABEL_NAME}$")
LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")
POLICY_NAME = re.compile(rf"^{_DNS_SUBDOMAIN}$")
MAX_POLICY_NAME = 253 - len("kvpool-")  # the ConfigMap kvpool-<name> is a DNS subdomain too


def _label_key(key: str) -> str:
    prefix, _, _ = key.rpartition("/")
    if not LABEL_KEY.match(key) or len(prefix) > 253:
        raise ValueError(f"{key!r} is not a label key (an optional DNS prefix and '/', then 1-63 characters "
                         "of letters, digits, '-', '_' or '.', starting and ending with a letter or digit)")
    return key


def _label_value(value: str) -> str:
    if not LABEL_VALUE.match(value):
        raise ValueError(f"{value!r} is not a label value (at most 63 letters, digits, '-', '_' or '.', "
                         "starting and ending with a letter or digit)")
    return value


LabelKey = Annotated[str, Field(min_length=1, pattern=LABEL_KEY.pattern), AfterValidator(_label_key)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE.pattern), AfterValidator(_label_value)]


class ConfigError(ValueError):
    """A policy or config that breaks a rule; ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}" if field else rule)
        self.field = field
        self.rule = rule


class _Model(BaseModel):
    # Strict: `pageSize: true` is not 1 and "5" is not a number (YAML gives ints and floats their types).
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True, strict=True)



MAX_SELECTOR_ITEMS = 64  # labels, expressions or values in one selector: far past any real one, yet bounded


class LabelSelectorRequirement(_Model):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = Field(default_factory=list, max_length=MAX_SELECTOR_ITEMS)

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> LabelSelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs at least one value")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self


class LabelSelector(_Model):
    matchLabels: dict[str, str] = Field(default_factory=dict, max_length=MAX_SELECTOR_ITEMS)

    @field_validator("matchLabels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        # Checked here, not typed: a Kubernetes structural schema has no patternProperties.
        for key, value in labels.items():
            _label_key(key)
            _label_value(value)
        return labels
    matchExpressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=MAX_SELECTOR_ITEMS)

    def to_query(self) -> str:
        """The selector as the API server's ``labelSelector`` query string."""
        parts = [f"{k}={v}" for k, v in sorted(self.matchLabels.items())]
        for req in self.matchExpressions:
            if req.operator in ("In", "NotIn"):
                parts.append(f"{req.key} {req.operator.lower()} ({','.join(req.values)})")
            else:
                parts.append(req.key if req.operator == "Exists" else f"!{req.key}")
        return ",".join(parts)

    def matches(self, labels: dict[str, str]) -> bool:
        """Kubernetes label-selector semantics; an empty selector matches every pod."""
        if any(labels.get(k) != v for k, v in self.matchLabels.items()):
            return False
        for req in self.matchExpressions:
            present = req.key in labels
            if req.operator == "In" and (not present or labels[req.key] not in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


class Weights(_Model):
    """Score = reuse * P_reuse + locality * S_locality + timeWindow * T_window."""

    reuse: float = Field(default=0.6, ge=0, le=1, description="alpha: weight of the reuse probability")
    locality: float = Field(default=0.3, ge=0, le=1, description="beta: weight of the prompt position")
    timeWindow: float = Field(default=0.1, ge=0, le=1, description="gamma: weight of the time window")

    @model_validator(mode="after")
    def _not_all_zero(self) -> Weights:
        if self.reuse + self.locality + self.timeWindow <= 0:
            raise ValueError("at least one weight must be above 0")
        return self


# Each partition's candidates, 0 (LRU) first. The to-B partition's weigh the learned P(reuse | count)
# (up to about 0.85): beyond 0.3 (a page seen often held about half an hour longer) the weight won
# nowhere measured, and when the traffic turned it lost the most before the tuner followed. The shared
# partition's weigh the count's lift over a first-seen page (at most 0.5, CountLift), doubling from
# 0.03: the top credit is about the same, with a finer step where chat's choice lies (0.03-0.12).
DEFAULT_REUSE_WEIGHTS = (0.0, 0.008, 0.03, 0.06, 0.12, 0.24)
DEFAULT_TO_B_REUSE_WEIGHTS = (0.0, 0.01, 0.03, 0.1, 0.2, 0.3)


class SelfTuning(_Model):
    """Online choice of the reuse weight of workload_adaptive: sampled shadow caches replay the request stream under each candidate, and the live policy follows the best, with hysteresis."""  # noqa: E501 (one line: the CRD's description)

    enabled: bool = Field(default=True, description="off: the configured weights are used as they are")
    reuseWeights: list[Annotated[float, Field(ge=0, le=1)]] | None = Field(
        default=None, min_length=1, max_length=16,
        description="candidate alphas (0 is plain LRU) for every partition; the tuner starts at the smallest. "
                    "Unset: each partition's own (shared 0-0.24, to-B 0-0.3)",
    )
    sampleOneIn: Literal[1, 2, 4, 8, 16, 32] = Field(
        default=32,
        description="at most: the shadows follow one page key in this many (by hash), at that share of pages"
    )
    horizonRequests: int = Field(default=1000, ge=50, le=1_000_000, description="requests a shadow's hits decay over")
    marginPercent: float = Field(
        default=2.0, ge=0, le=100, description="how much better a candidate must do to be adopted"
    )

    @field_validator("reuseWeights")
    @classmethod
    def _distinct(cls, weights: list[float] | None) -> list[float] | None:
        if weights is None:
            return None
        if len(set(weights)) != len(weights):
            raise ValueError("candidates must be distinct")
        return sorted(weights)

    def candidates(self, to_b: bool) -> list[float]:
        """The candidate weights of the shared partition or (``to_b``) of the to-B one."""
        if self.reuseWeights is not None:
            return list(self.reuseWeights)
        return list(DEFAULT_TO_B_REUSE_WEIGHTS if to_b else DEFAULT_REUSE_WEIGHTS)


class Eviction(_Model):
    policy: EvictionPolicyName = "workload_adaptive"
    weights: Weights = Field(default_factory=Weights)
    selfTuning: SelfTuning = Field(default_factory=SelfTuning)


class ToCWorkload(_Model):
    timeWindow: Duration = Field(default="10m", description="reuse window")
    decayPerMinute: float = Field(default=0.15, gt=0, le=600, description="prior reuse decay rate")

    @property
    def window_seconds(self) -> float:
        return parse_duration(self.timeWindow)


class ToBWorkload(ToCWorkload):
    timeWindow: Duration = Field(default="10s", description="reuse window")
    decayPerMinute: float = Field(default=6.0, gt=0, le=600, description="prior reuse decay rate")
    isolationPercent: float = Field(default=30, ge=0, le=100, description="share of pages for to-B")


class AdapterClass(_Model):
    adapter: str = Field(min_length=1, max_length=128, description=(
        "a LoRA adapter's name as the engine serves it (vLLM's --lora-modules name)"))
    tenant: str | None = Field(default=None, min_length=1, max_length=256, description=(
        "the tenant of its requests (unset: the engine's)"))
    workloadClass: Literal["toC", "toB"] | None = Field(default=None, description=(
        "the class of its requests (unset: the engine's)"))

    @model_validator(mode="after")
    def _names_something(self) -> AdapterClass:
        if self.tenant is None and self.workloadClass is None:
            raise ValueError(f"adapter {self.adapter!r}: set its tenant, its workloadClass or both")
        return self


class Workloads(_Model):
    toC: ToCWorkload = Field(default_factory=ToCWorkload)
    toB: ToBWorkload = Field(default_factory=ToBWorkload)
    adapters: list[AdapterClass] = Field(default_factory=list, max_length=1024, description=(
        "requests the engine serves with a LoRA adapter get that adapter's tenant and class, whatever the "
        "engine's defaults or a gateway's parameters say; the rest keep them"))

    @field_validator("adapters")
    @classmethod
    def _one_rule_per_adapter(cls, rules: list[AdapterClass]) -> list[AdapterClass]:
        seen: set[str] = set()
        for rule in rules:
            if rule.adapter in seen:
                raise ValueError(f"adapter {rule.adapter!r} is named twice")
            seen.add(rule.adapter)
        return rules

    def adapter_rule(self, adapter: str) -> AdapterClass | None:
        """The rule for requests served with ``adapter`` (the one place the mapping is read)."""
        return next((rule for rule in self.adapters if rule.adapter == adapter), None) if adapter else None

    def window_of(self, workload_class: str) -> float:
        """A workload class's reuse window in seconds (to-C's for a class kvpool does not know): the
        one rule every window is read by (policies' credits, expiry, auto-pins, pre-eviction, fits)."""
        return (self.toB if workload_class == "toB" else self.toC).window_seconds


# Two rules. A prefix admitted more than minPrefixQPS times a second keeps the pages it reused pinned
# (its reuse is measured). A prompt of at least minPromptTokens is pinned for its length alone, nothing
# measured: unset by default, since on the shipped traces and held-out synth profiles it serves no more
# tokens than no auto-pin, and on to-B bursts half as many (bench/measurements/autopin.py, docs/decisions.md).
class AutoPin(_Model):
    enabled: bool = True
    minPromptTokens: int | None = Field(default=None, ge=1, description=(
        "auto-pin every prompt at least this long, whether or not it comes back (unset: none)"))
    minPrefixQPS: float = Field(default=100, gt=0, description="auto-pin prefixes hotter than this")


class Pinning(_Model):
    quotaPercent: float = Field(default=30, ge=0, le=100, description="most pages that may be pinned")
    autoPin: AutoPin = Field(default_factory=AutoPin)


class Tenancy(_Model):
    isolation: Literal["perTenant", "none"] = "perTenant"
    sharedPrefixes: list[str] = Field(
        default_factory=list, max_length=1024,
        description="hex digests of first pages (unsalted) that every tenant may share, e.g. a system prompt",
    )

    @field_validator("sharedPrefixes")
    @classmethod
    def _hex(cls, values: list[str]) -> list[str]:
        for v in values:
            if not re.fullmatch(r"[0-9a-f]{32}", v):
                raise ValueError(f"{v!r} is not a 32-digit lowercase hex page digest")
        return values


class Learning(_Model):
    classBy: list[Literal["requestType", "turn"]] = Field(
        default_factory=lambda: ["turn"],
        description="what splits a workload class into statistics classes (empty: one fit per workload class)",
    )
    coldStartPeriod: Duration = Field(default="168h")
    minSamples: int = Field(default=5000, ge=1, description="reuses a class needs before its own fit is used")
    driftThresholdPercent: float = Field(default=20, gt=0, le=1000)
    refitOnDrift: bool = True


class PreEviction(_Model):
    enabled: bool = True
    lowWatermarkPercent: float = Field(default=10, ge=0, le=100, description="free pages kept by idle eviction")


class Routing(_Model):
    """How a router in front of the policy's pods sends each request to the pod holding its prefix."""

    prefixPages: int = Field(
        default=4, ge=1, le=1024, description="pages whose chained hash is a request's routing key"
    )
    virtualNodes: int = Field(default=160, ge=1, le=4096, description="points per pod on the hash ring")
    loadFactor: float = Field(
        default=1.25, ge=1, le=10, description="bounded load: no pod takes more than this times the mean load"
    )
    loadWindow: Duration = Field(
        default="5m", description="load = requests routed, decayed over this window"
    )
    minLoad: float = Field(
        default=8, ge=1, description="a pod with less load than this is never overflowed: balancing starts once "
        "there is load to balance (an idle cluster keeps every prefix on its owner)"
    )
    hotPrefixQPS: float = Field(default=50, gt=0, description="a prefix hotter than this gets replica pods")
    replicas: int = Field(default=2, ge=0, le=2, description="extra pods that serve a hot prefix")

    @field_validator("loadWindow")
    @classmethod
    def _positive_window(cls, value: str) -> str:
        if parse_duration(value) <= 0:
            raise ValueError("must be longer than 0s")
        return value

    @property
    def load_window_seconds(self) -> float:
        return parse_duration(self.loadWindow)


class KVCachePolicySpec(_Model):
    selector: LabelSelector = Field(default_factory=LabelSelector)
    pageSize: int = Field(default=16, ge=1, le=4096, description="tokens per page")
    eviction: Eviction = Field(default_factory=Eviction)
    workloads: Workloads = Field(default_factory=Workloads)
    pinning: Pinning = Field(default_factory=Pinning)
    tenancy: Tenancy = Field(default_factory=Tenancy)
    learning: Learning = Field(default_factory=Learning)
    preEviction: PreEviction = Field(default_factory=PreEviction)
    routing: Routing = Field(default_factory=Routing)

    @model_validator(mode="after")
    def _shares_fit(self) -> KVCachePolicySpec:
        if self.workloads.toB.isolationPercent + self.pinning.quotaPercent > 100:
            raise ValueError(
                "workloads.toB.isolationPercent + pinning.quotaPercent must not exceed 100"
            )
        return self


class PolicySource(_Model):
    """Where a rendered config came from; written by the operator beside the spec."""

    name: str = ""
    namespace: str = ""
    generation: int = 0
    hash: str = ""


class SidecarConfig(KVCachePolicySpec):
    """The sidecar's config file: the policy spec plus, when rendered by the operator, its source."""

    source: PolicySource | None = None

    def spec(self) -> KVCachePolicySpec:
        return KVCachePolicySpec.model_validate(self.model_dump(exclude={"source"}))


def spec_hash(spec: KVCachePolicySpec) -> str:
    """A stable short hash of a spec's effective values (defaults filled in), as the operator writes it."""
    data = KVCachePolicySpec.model_validate(spec.model_dump(exclude={"source"})).model_dump(mode="json")
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _error_from(exc: ValidationError, prefix: str) -> ConfigError:
    first = exc.errors()[0]
    path = ".".join(str(p) for p in first["loc"])
    field = f"{prefix}.{path}" if prefix and path else (prefix or path)
    rule = first["msg"]
    if first["type"] == "extra_forbidden":
        rule = "unknown field"
    return ConfigError(field, rule.removeprefix("Value error, "))


def validate_spec(data: Any, prefix: str = "spec") -> KVCachePolicySpec:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {type(data).__name__}")
    try:
        return KVCachePolicySpec.model_validate(data)
    except ValidationError as exc:
        raise _error_from(exc, prefix) from None


def validate_config(data: Any) -> SidecarConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"config must be a mapping, got {type(data).__name__}")
    try:
        return SidecarConfig.model_validate(data)
    except ValidationError as exc:
        raise _error_from(exc, "") from None


def parse_config_text(text: str) -> SidecarConfig:
    """Parse a sidecar config file's text; empty text or ``{}`` means every default."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"not valid YAML: {exc}") from None
    return validate_config(data)


def load_config(path: str | Path) -> SidecarConfig:
    return parse_config_text(Path(path).read_text())


def load_policy(text: str) -> tuple[dict[str, Any], KVCachePolicySpec]:
    """Parse a whole ``KVCachePolicy`` manifest; returns its metadata and validated spec."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError("", "a KVCachePolicy manifest must be a mapping")
    if doc.get("kind") != KIND:
        raise ConfigError("kind", f"must be {KIND}")
    if doc.get("apiVersion") != f"{API_GROUP}/{API_VERSION}":
        raise ConfigError("apiVersion", f"must be {API_GROUP}/{API_VERSION}")
    meta = doc.get("metadata") or {}
    if not isinstance(meta, dict) or not meta.get("name"):
        raise ConfigError("metadata.name", "is required")
    name = meta["name"]
    if not isinstance(name, str) or len(name) > MAX_POLICY_NAME or not POLICY_NAME.match(name):
        raise ConfigError("metadata.name", f"must be a DNS subdomain (lower-case letters, digits, '-' and '.') of "
                          f"at most {MAX_POLICY_NAME} characters (its ConfigMap is kvpool-<name>)")
    namespace = meta.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not re.fullmatch(
            r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", namespace)):
        raise ConfigError("metadata.namespace", "must be a DNS label (lower-case letters, digits and '-', "
                          "at most 63 characters)")
    generation = meta.get("generation", 1)
    if type(generation) is not int or generation < 1:
        raise ConfigError("metadata.generation", "must be an integer of at least 1")
    return meta, validate_spec(doc.get("spec"))
