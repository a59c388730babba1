"""The contract shared by the operator and the sidecar: the ``KVCachePolicy`` spec and the sidecar config.

Field names are camelCase, as in Kubernetes. Every model forbids unknown fields so that a typo in a
policy is an error that names the field, not a silently ignored setting; the one exception is a config
file of the next schema version (:data:`SCHEMA_VERSION`), written by a newer operator: the fields this
side does not know are ignored and named; and in a file of the previous one, the fields this version
removed (:data:`REMOVED_FIELDS`) are ignored (docs/upgrades.md). Plain Python + pydantic only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from kvpool_sidecar.fields import (  # ConfigError, LabelSelector and parse_duration: part of this contract too
    MAX_POLICY_NAME,
    POLICY_NAME,
    ClockTime,
    ConfigError,
    Duration,
    LabelSelector,
    StrictModel,
    canonical_digest,
    drop_unknown,
    minute_of_day,
    parse_duration,
)
from kvpool_sidecar.schema import (  # the schema's version and the pod binding: part of this contract too
    API_GROUP,
    API_VERSION,
    KIND,
    POLICY_LABEL,
    REMOVED_FIELDS,
    SCHEMA_KEY,
    SCHEMA_SKEW,
    SCHEMA_VERSION,
    bound_to,
    policy_label_selector,
    removal_reason,
    removed_since,
    schema_version_of,
)

EvictionPolicyName = Literal[
    "lru", "fifo", "lfu", "s3fifo", "workload_adaptive"
]
# Re-exported: what the contract's users import.
__all__ = ["API_GROUP", "API_VERSION", "KIND", "POLICY_LABEL", "REMOVED_FIELDS", "SCHEMA_KEY", "SCHEMA_SKEW",
           "ConfigError", "LabelSelector", "bound_to", "parse_duration", "policy_label_selector"]


class Weights(StrictModel):
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


class SelfTuning(StrictModel):
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


class Eviction(StrictModel):
    policy: EvictionPolicyName = "workload_adaptive"
    weights: Weights = Field(default_factory=Weights)
    selfTuning: SelfTuning = Field(default_factory=SelfTuning)
    admitByEvidence: bool = Field(default=True, description=(
        "a share protects no page of a class shown not to come back, nor does that class's save evict others; "
        "off: a share protects whatever fills it and a save evicts whatever the policy names"))


class ToCWorkload(StrictModel):
    timeWindow: Duration = Field(default="10m", description="reuse window")
    decayPerMinute: float = Field(default=0.15, gt=0, le=600, description="prior reuse decay rate")

    @property
    def window_seconds(self) -> float:
        return parse_duration(self.timeWindow)


class ShareWindow(StrictModel):
    """A daily window (UTC) in which to-B's share of the pool is another: business hours of a to-B
    tenant, a nightly batch. It starts at ``start`` and ends before ``end``; one that ends at or
    before its start runs past midnight."""

    start: ClockTime = Field(description="HH:MM (UTC) the window starts, inclusive")
    end: ClockTime = Field(description="HH:MM (UTC) the window ends, exclusive")
    isolationPercent: float = Field(ge=0, le=100, description="to-B's share of pages in the window")

    def minutes(self) -> set[int]:
        """The minutes of the day (0-1439) the window covers."""
        a, b = minute_of_day(self.start), minute_of_day(self.end)
        return set(range(a, b)) if a < b else set(range(a, 1440)) | set(range(0, b))


class ToBWorkload(ToCWorkload):
    timeWindow: Duration = Field(default="10s", description="reuse window")
    decayPerMinute: float = Field(default=6.0, gt=0, le=600, description="prior reuse decay rate")
    isolationPercent: float = Field(default=30, ge=0, le=100, description="share of pages for to-B")
    schedule: list[ShareWindow] = Field(default_factory=list, max_length=48, description=(
        "daily windows (UTC) with another to-B share; outside them isolationPercent holds"))

    @field_validator("schedule")
    @classmethod
    def _no_overlap(cls, windows: list[ShareWindow]) -> list[ShareWindow]:
        seen: set[int] = set()
        for i, window in enumerate(windows):
            mine = window.minutes()
            if seen & mine:
                raise ValueError(f"window {i} ({window.start}-{window.end}) overlaps an earlier one")
            seen |= mine
        return windows

    def isolation_at(self, minute_of_day: int) -> float:
        """To-B's share in force at a minute of the day (UTC): the one rule the schedule is read by."""
        for window in self.schedule:
            if minute_of_day in window.minutes():
                return window.isolationPercent
        return self.isolationPercent


class AdapterClass(StrictModel):
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


class Workloads(StrictModel):
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
class AutoPin(StrictModel):
    enabled: bool = True
    minPromptTokens: int | None = Field(default=None, ge=1, description=(
        "auto-pin every prompt at least this long, whether or not it comes back (unset: none)"))
    minPrefixQPS: float = Field(default=100, gt=0, description="auto-pin prefixes hotter than this")


MAX_PROMPT_TOKENS = 65_536  # token ids of all named prompts together: a ConfigMap holds 1 MiB


class PinnedPrompt(StrictModel):
    """A prompt the pool keeps resident (a system prompt, a shared document), named by its token ids
    as the engine sees them (vLLM's ``/tokenize`` gives them, chat template included). The sidecar
    pins its pages in the engine's key space once an engine serving ``model`` has saved them, or once it
    fetched them from a peer sidecar at start."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                      description="what status and metrics call it")
    model: str = Field(min_length=1, max_length=4096, description=(
        "the model the engines that look it up were started with (vLLM's --model: a hub name or path)"))
    tokens: list[Annotated[int, Field(ge=0, lt=2**63)]] = Field(
        min_length=1, max_length=MAX_PROMPT_TOKENS, description="its token ids; only its full pages are pinned")


class Pinning(StrictModel):
    quotaPercent: float = Field(default=30, ge=0, le=100, description="most pages that may be pinned")
    autoPin: AutoPin = Field(default_factory=AutoPin)
    prompts: list[PinnedPrompt] = Field(default_factory=list, max_length=64, description=(
        "prompts kept resident, counted against quotaPercent"))

    @field_validator("prompts")
    @classmethod
    def _named_once_and_small(cls, prompts: list[PinnedPrompt]) -> list[PinnedPrompt]:
        names = [p.name for p in prompts]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"prompt {twice[0]!r} is named twice")
        total = sum(len(p.tokens) for p in prompts)
        if total > MAX_PROMPT_TOKENS:
            raise ValueError(f"{total} token ids in all: at most {MAX_PROMPT_TOKENS} (a ConfigMap holds 1 MiB)")
        return prompts


class Tenancy(StrictModel):
    isolation: Literal["perTenant", "none"] = "perTenant"
    sharedPrefixes: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = Field(
        default_factory=list, max_length=1024,
        description="hex digests (32 lowercase hex digits) of first pages (unsalted) that every tenant may share, "
                    "e.g. a system prompt",
    )


class Learning(StrictModel):
    classBy: list[Literal["requestType", "turn"]] = Field(
        default_factory=lambda: ["turn"],
        description="what splits a workload class into statistics classes (empty: one fit per workload class)",
    )
    coldStartPeriod: Duration = Field(default="168h")
    minSamples: int = Field(default=5000, ge=1, description="reuses a class needs before its own fit is used")
    driftThresholdPercent: float = Field(default=20, gt=0, le=1000)
    refitOnDrift: bool = True


class PreEviction(StrictModel):
    enabled: bool = True
    lowWatermarkPercent: float = Field(default=10, ge=0, le=100, description="free pages kept by idle eviction")


class Routing(StrictModel):
    """How the cluster replay's simulated router (kvpool-sidecar replay --pods) sends each request to a pod."""

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

    @property
    def load_window_seconds(self) -> float:
        return parse_duration(self.loadWindow)


class KVCachePolicySpec(StrictModel):
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
        for i, window in enumerate(self.workloads.toB.schedule):
            if window.isolationPercent + self.pinning.quotaPercent > 100:
                raise ValueError(f"workloads.toB.schedule[{i}].isolationPercent + pinning.quotaPercent must not "
                                 "exceed 100")
        for prompt in self.pinning.prompts:
            if len(prompt.tokens) < self.pageSize:
                raise ValueError(f"pinning.prompts {prompt.name!r}: {len(prompt.tokens)} tokens fill no page of "
                                 f"{self.pageSize} (pageSize): nothing to pin")
        return self

    def at(self, minute_of_day: int) -> KVCachePolicySpec:
        """This spec with the to-B share its schedule sets at a minute of the day (UTC)."""
        share = self.workloads.toB.isolation_at(minute_of_day)
        if share == self.workloads.toB.isolationPercent:
            return self
        to_b = self.workloads.toB.model_copy(update={"isolationPercent": share})
        return self.model_copy(update={"workloads": self.workloads.model_copy(update={"toB": to_b})})


class PolicySource(StrictModel):
    """Where a rendered config came from; written by the operator beside the spec."""

    name: str = ""
    namespace: str = ""
    generation: int = 0
    hash: str = ""


class SidecarConfig(KVCachePolicySpec):
    """The sidecar's config file: the policy spec plus, when rendered by the operator, its source and the
    schema version it was written for."""

    schemaVersion: int | None = Field(default=None, ge=0, description=(
        "the config schema version the file was written for (unset: this sidecar's own)"))
    source: PolicySource | None = None
    _document: dict[str, Any] | None = PrivateAttr(default=None)  # the mapping it was read from
    _unknown: tuple[str, ...] = PrivateAttr(default=())
    _removed: tuple[str, ...] = PrivateAttr(default=())

    def spec(self) -> KVCachePolicySpec:
        """The policy spec, with what the file set marked as set (defaults fill the rest)."""
        return KVCachePolicySpec.model_validate(self.model_dump(exclude={"source", SCHEMA_KEY}, exclude_unset=True))

    @property
    def schema_version(self) -> int:
        return SCHEMA_VERSION if self.schemaVersion is None else self.schemaVersion

    @property
    def unknown_fields(self) -> tuple[str, ...]:
        """The fields of a newer schema's file that this sidecar does not know and ignored (dotted paths)."""
        return self._unknown

    @property
    def removed_fields(self) -> tuple[str, ...]:
        """The fields of an older schema's file that a later version removed, ignored (:data:`REMOVED_FIELDS`)."""
        return self._removed


def spec_document(spec: KVCachePolicySpec) -> dict[str, Any]:
    """The spec as given (the fields set, not the defaults: a sidecar of another schema version fills in its
    own), as the operator renders it into the config file."""
    return spec.model_dump(mode="json", exclude_unset=True, exclude={"source", SCHEMA_KEY})


def config_hash(document: dict[str, Any]) -> str:
    """The hash of a config file's mapping, its ``source`` and schema version aside: the one formula the
    operator (over what it renders) and the sidecar (over what it read, fields it does not know included)
    compute, so that a sidecar of another schema version reports the hash its operator expects."""
    return canonical_digest({k: v for k, v in document.items() if k not in ("source", SCHEMA_KEY)})


def spec_hash(spec: KVCachePolicySpec) -> str:
    """The hash a sidecar reports and the operator writes (:func:`config_hash`): of the file a config
    was read from, or of the spec as given."""
    document = spec._document if isinstance(spec, SidecarConfig) else None
    return config_hash(document if document is not None else spec_document(spec))


def _error_from(exc: ValidationError, prefix: str) -> ConfigError:
    first = exc.errors()[0]
    path = ".".join(str(p) for p in first["loc"])
    field = f"{prefix}.{path}" if prefix and path else (prefix or path)
    rule = first["msg"]
    if first["type"] == "extra_forbidden":
        rule = removal_reason(path) or "unknown field"
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
    """A config mapping (a file's, a PUT's). Unknown fields are refused, naming the field, but in a
    file of a newer schema version (by at most :data:`SCHEMA_SKEW`): there they are a newer operator's,
    ignored and listed in :attr:`SidecarConfig.unknown_fields`. In a file of an older schema version the
    fields a later one removed are ignored and listed in :attr:`SidecarConfig.removed_fields`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"config must be a mapping, got {type(data).__name__}")
    known, unknown, removed = data, [], []
    version = schema_version_of(data)
    if version > SCHEMA_VERSION:
        known, unknown = drop_unknown(SidecarConfig, data)
    elif version < SCHEMA_VERSION and data.get(SCHEMA_KEY) is not None:
        # An older operator's file: what a later version removed is dropped, not refused.
        gone = removed_since(version)
        removed = sorted(k for k in data if k in gone)
        known = {k: v for k, v in data.items() if k not in gone}
    try:
        config = SidecarConfig.model_validate(known)
    except ValidationError as exc:
        raise _error_from(exc, "") from None
    config._document = data
    config._unknown = tuple(unknown)
    config._removed = tuple(removed)
    return config


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
