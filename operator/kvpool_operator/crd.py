"""The KVCachePolicy CRD, generated from the pydantic spec model (the one contract)."""

from __future__ import annotations

import copy
from typing import Any

from kvpool_sidecar.config import API_GROUP, API_VERSION, KIND, KVCachePolicySpec

PLURAL = "kvcachepolicies"
SINGULAR = "kvcachepolicy"
SHORT_NAMES = ["kvp"]
CROSS_FIELD_RULES = [
    {
        "rule": "self.workloads.toB.isolationPercent + self.pinning.quotaPercent <= 100.0",
        "message": "workloads.toB.isolationPercent + pinning.quotaPercent must not exceed 100",
        "fieldPath": ".workloads.toB.isolationPercent",
    },
    {
        "rule": "self.eviction.weights.reuse + self.eviction.weights.locality + self.eviction.weights.timeWindow > 0.0",
        "message": "at least one of eviction.weights must be above 0",
        "fieldPath": ".eviction.weights",
    },
]


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
            rest = [v for v in value if v.get("type") != "null"]
            merged = _structural(rest[0], defs) if len(rest) == 1 else {"anyOf": _structural(rest, defs)}
            out.update(merged)
            out["nullable"] = True
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


def spec_schema() -> dict[str, Any]:
    raw = KVCachePolicySpec.model_json_schema()
    schema = _structural(raw, raw.get("$defs", {}))
    schema["x-kubernetes-validations"] = CROSS_FIELD_RULES
    return schema


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
            "items": {
                "type": "object",
                "required": ["name", "pinnedPods"],
                "properties": {"name": {"type": "string"}, "pinnedPods": {"type": "integer"}},
            },
        },
        "conditions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
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
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
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
