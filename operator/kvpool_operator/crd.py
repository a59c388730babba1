"""The KVCachePolicy CRD, generated from the pydantic spec model (the one contract).

The model's rules that a schema keyword cannot say are :data:`RULES`, CEL rules (``x-kubernetes-validations``)
the API server runs at admission, each beside the model's check it mirrors; :data:`LIST_TYPES` says which lists
are keyed (the server then refuses two items with one key, as the model does). tests/operator/test_admission.py
holds each rule and its model check to the same valid and invalid specs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvpool_sidecar.config import API_GROUP, API_VERSION, KIND, MAX_PROMPT_TOKENS, KVCachePolicySpec
from kvpool_sidecar.fields import DURATION_PATTERN, MAX_POLICY_NAME

from kvpool_operator.status import MAX_CONDITION_MESSAGE

PLURAL = "kvcachepolicies"
SINGULAR = "kvcachepolicy"
SHORT_NAMES = ["kvp"]


@dataclass(frozen=True)
class Rule:
    """A CEL rule of the CRD. ``at`` is the schema node that owns it (``self``): ``""`` the spec, a dotted
    path of spec fields, ``[]`` after a list for each of its items, ``"/"`` the resource itself (only there
    does CEL see ``metadata.name``, and a fieldPath could not name it: metadata has no schema). ``mirrors``
    names the model's check that refuses the same specs (None: a transition rule, which no spec alone breaks)."""

    name: str
    at: str
    rule: str
    message: str
    mirrors: str | None
    field_path: str | None = None
    reason: str | None = None

    def validation(self) -> dict[str, Any]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        if self.reason:
            out["reason"] = self.reason
        return out


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Inline $refs and turn pydantic's JSON schema into a Kubernetes structural schema."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _structural({**target, **extra}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "additionalProperties" and value is False:
            # Structural schemas prune unknown fields instead (the sidecar refuses them too, but for a file
            # one schema version newer than itself).
            continue
        if key == "default" and value is None:
            continue  # unset is the default: the API server leaves the field out and the model fills it
        if key == "anyOf" and any(v.get("type") == "null" for v in value):
            # Not nullable: the API server prunes a null there (then defaults it), so that null means unset, as
            # None does in the model, and CEL's has() tells a set field from an unset one.
            rest = [v for v in value if v.get("type") != "null"]
            merged = _structural(rest[0], defs) if len(rest) == 1 else {"anyOf": _structural(rest, defs)}
            out.update(merged)
            continue
        out[key] = _structural(value, defs)
    # JSON Schema 2020 writes exclusive bounds as numbers; Kubernetes' OpenAPI v3 wants a bound plus a flag.
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(flag), int | float) and not isinstance(out.get(flag), bool):
            out[bound] = out[flag]
            out[flag] = True
    if out.get("type") == "object" and "properties" in out:
        for prop in out["properties"].values():
            if prop.get("type") == "object" and "properties" in prop:
                prop.setdefault("default", {})  # so that nested defaults apply and CEL sees them
    return out


def _base_spec_schema() -> dict[str, Any]:
    raw = KVCachePolicySpec.model_json_schema()
    return _structural(raw, raw.get("$defs", {}))


def _duration_fields(node: dict[str, Any], path: str = "") -> list[str]:
    """The spec's duration fields (their schema's pattern is the model's :data:`DURATION_PATTERN`)."""
    if node.get("pattern") == DURATION_PATTERN:
        return [path]
    props = node.get("properties") or {}
    return [p for name, prop in props.items() for p in _duration_fields(prop, f"{path}.{name}".lstrip("."))]


def _window_covers(w: str, t: str) -> str:
    """CEL: window ``w`` covers the time of day ``t`` (HH:MM strings order as the times they name); one that
    ends at or before its start runs past midnight (the model's ShareWindow.minutes)."""
    return f"({w}.start < {w}.end ? {w}.start <= {t} && {t} < {w}.end : {w}.start <= {t} || {t} < {w}.end)"


# Two daily windows overlap iff one covers the other's start; each window overlaps itself, so a window
# that overlaps exactly one (itself) overlaps no other (and two equal windows are refused).
_NO_OVERLAP = (f"self.all(a, self.exists_one(b, {_window_covers('a', 'b.start')} || "
               f"{_window_covers('b', 'a.start')}))")

# A list the spec leaves out stays out (a model's default_factory is no schema default): has() guards it.
RULES: tuple[Rule, ...] = (
    Rule("shares fit", "",
         "self.workloads.toB.isolationPercent + self.pinning.quotaPercent <= 100.0",
         "workloads.toB.isolationPercent + pinning.quotaPercent must not exceed 100",
         "KVCachePolicySpec._shares_fit", field_path=".workloads.toB.isolationPercent"),
    Rule("scheduled shares fit", "",
         "!has(self.workloads.toB.schedule) || "
         "self.workloads.toB.schedule.all(w, w.isolationPercent + self.pinning.quotaPercent <= 100.0)",
         "each workloads.toB.schedule window's isolationPercent + pinning.quotaPercent must not exceed 100",
         "KVCachePolicySpec._shares_fit", field_path=".workloads.toB.schedule"),
    Rule("prompts fill a page", "",
         "!has(self.pinning.prompts) || self.pinning.prompts.all(p, size(p.tokens) >= self.pageSize)",
         "each of pinning.prompts needs at least pageSize tokens (fewer fill no page: nothing to pin)",
         "KVCachePolicySpec._shares_fit", field_path=".pinning.prompts"),
    Rule("page size immutable", "pageSize", "self == oldSelf",
         "pageSize is immutable: create a new policy for another page size (a sidecar takes a new one only "
         "when it restarts)", None),
    Rule("a weight above 0", "eviction.weights", "self.reuse + self.locality + self.timeWindow > 0.0",
         "eviction.weights: at least one weight must be above 0", "Weights._not_all_zero"),
    Rule("candidates distinct", "eviction.selfTuning.reuseWeights", "self.all(w, self.exists_one(x, x == w))",
         "eviction.selfTuning.reuseWeights: candidates must be distinct", "SelfTuning._distinct"),
    Rule("windows apart", "workloads.toB.schedule", _NO_OVERLAP,
         "workloads.toB.schedule: windows must not overlap (one whose end is at or before its start runs past "
         "midnight)", "ToBWorkload._no_overlap"),
    Rule("adapter classed", "workloads.adapters[]", "has(self.tenant) || has(self.workloadClass)",
         "workloads.adapters: set each adapter's tenant, its workloadClass or both", "AdapterClass._names_something",
         reason="FieldValueRequired"),
    # sum() is the Kubernetes CEL list library's (not standard CEL): of a list<int>, an int (0 when empty).
    Rule("prompt tokens bounded", "pinning.prompts", f"self.map(p, size(p.tokens)).sum() <= {MAX_PROMPT_TOKENS}",
         f"pinning.prompts: at most {MAX_PROMPT_TOKENS} token ids in all (a ConfigMap holds 1 MiB)",
         "Pinning._named_once_and_small"),
    # A duration is above 0 iff a digit of it is (its pattern holds).
    *(Rule(f"{path} above 0", path, "self.matches('[1-9]')", f"{path} must be longer than 0",
           "_positive_duration") for path in _duration_fields(_base_spec_schema())),
    Rule("name fits its ConfigMap", "/", f"size(self.metadata.name) <= {MAX_POLICY_NAME}",
         f"metadata.name: at most {MAX_POLICY_NAME} characters (its ConfigMap is kvpool-<name>)", "load_policy"),
)

# Lists whose items are told apart by a key (x-kubernetes-list-type: map): the API server refuses a second
# item with a key (and server-side apply merges by it). Every other list is atomic. A CEL rule for the same
# uniqueness costs the square of the list's length: over the cost budget at 1,024 adapters, and to no end
# beside this one. (Not a set for reuseWeights: the server tells 0 from 0.0 there, the model and CEL do not.)
LIST_TYPES: dict[str, tuple[str, list[str] | None, str]] = {
    "workloads.adapters": ("map", ["adapter"], "Workloads._one_rule_per_adapter"),
    "pinning.prompts": ("map", ["name"], "Pinning._named_once_and_small"),
}


def _node(schema: dict[str, Any], at: str) -> dict[str, Any]:
    """The node of ``schema`` (the spec's) that a rule's or a list type's ``at`` names."""
    node = schema
    for part in filter(None, at.split(".")):
        name, items = part.removesuffix("[]"), part.endswith("[]")
        node = node["properties"][name]
        if items:
            node = node["items"]
    return node


def _list_types(node: dict[str, Any], path: str = "") -> None:
    """Mark each list of the spec with its list type (:data:`LIST_TYPES`, or atomic)."""
    if node.get("type") == "array":
        kind, keys, _ = LIST_TYPES.get(path, ("atomic", None, ""))
        node["x-kubernetes-list-type"] = kind
        if keys:
            node["x-kubernetes-list-map-keys"] = keys
        _list_types(node["items"], path + "[]")
    for name, prop in (node.get("properties") or {}).items():
        _list_types(prop, f"{path}.{name}".lstrip("."))


def spec_schema() -> dict[str, Any]:
    schema = _base_spec_schema()
    _list_types(schema)
    for rule in RULES:
        if rule.at != "/":
            _node(schema, rule.at).setdefault("x-kubernetes-validations", []).append(rule.validation())
    return schema


# metav1.Condition's: a type is a qualified name, a reason CamelCase.
CONDITION_TYPE = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$")
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "observedGeneration": {"type": "integer"},
        "configHash": {"type": "string"},
        "configMap": {"type": "string"},
        "targetPods": {"type": "integer", "description": "Running pods labelled kvpool.dev/policy=<name> whose "
                       "sidecar mounts the policy's ConfigMap"},
        "syncedPods": {"type": "integer", "description": "of those, pods whose sidecar runs the policy's config"},
        "misboundPods": {"type": "integer", "description": "pods labelled for the policy whose sidecar does not "
                         "mount its ConfigMap (the Bound condition names them)"},
        "prompts": {
            "type": "array",
            "description": "each of pinning.prompts and the target pods that hold all of it pinned",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "items": {
                "type": "object",
                "required": ["name", "pinnedPods"],
                "properties": {"name": {"type": "string"}, "pinnedPods": {"type": "integer"}},
            },
        },
        "conditions": {  # metav1.Condition's schema, as the API conventions have it
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "items": {
                "type": "object",
                # As metav1.Condition: observedGeneration optional (an operator before it, in an upgrade or a
                # rollback, writes conditions without it).
                "required": ["type", "status", "lastTransitionTime", "reason", "message"],
                "properties": {
                    "type": {"type": "string", "maxLength": 316, "pattern": CONDITION_TYPE},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0,
                                           "description": "the metadata.generation the condition was set for"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                    "reason": {"type": "string", "minLength": 1, "maxLength": 1024, "pattern": CONDITION_REASON},
                    "message": {"type": "string", "maxLength": MAX_CONDITION_MESSAGE},
                },
            },
        },
    },
    "x-kubernetes-preserve-unknown-fields": True,  # kopf keeps its own bookkeeping here
}


def _condition(kind: str) -> str:
    return f'.status.conditions[?(@.type=="{kind}")].status'


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES},
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Policy", "type": "string", "jsonPath": ".spec.eviction.policy"},
                        {"name": "Valid", "type": "string", "jsonPath": _condition("Valid")},
                        {"name": "Ready", "type": "string", "jsonPath": _condition("Ready")},
                        {"name": "Synced", "type": "integer", "jsonPath": ".status.syncedPods"},
                        {"name": "Targets", "type": "integer", "jsonPath": ".status.targetPods"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-validations": [r.validation() for r in RULES if r.at == "/"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": STATUS_SCHEMA,
                            },
                        }
                    },
                }
            ],
        },
    }
