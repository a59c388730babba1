"""A custom resource's admission as the API server does it with a CRD's schema, for the parts that the
model's own checks must agree with: nulls pruned and defaults applied, keyed lists' uniqueness
(``x-kubernetes-list-type`` map and set), and the CEL rules (``x-kubernetes-validations``) evaluated by
cel-python on the values typed as the schema types them (an ``integer`` a CEL int, a ``number`` a double
even when written 30).

What it does not do, and a real API server does: type-check a rule when the CRD is created (cel-python only
fails at run time, and only on the branches a spec takes), estimate a rule's cost against the budgets
(``maxItems`` and ``maxLength`` bound it: see the CRD), the schema's other keywords (jsonschema checks those:
test_operator_pure), ratcheting, and correlating the items of atomic lists and sets for transition rules.
A transition rule (one that reads ``oldSelf``) runs, as there, on an update where the old object has the field.
Kubernetes' CEL libraries beyond standard CEL are not in cel-python: the one a rule here uses, the list
library's ``sum()``, is implemented below as Kubernetes documents it.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import celpy
from celpy import celtypes


@dataclass(frozen=True)
class FieldError:
    path: str  # the field as the API server names it: spec.workloads.toB.schedule
    message: str
    rule: str | None = None  # the CEL rule that refused it (None: a list's keys)


def _sum(values: celtypes.ListType) -> celtypes.IntType:
    """Kubernetes' list library's ``<list<int>>.sum() -> int``, 0 for an empty list (the rules here sum ints
    only: a double in the list fails, as int + double does in CEL)."""
    return sum(values, celtypes.IntType(0))


@functools.lru_cache(maxsize=1)
def _environment() -> celpy.Environment:
    return celpy.Environment()  # builds its parser: a tenth of a second


@functools.cache
def _program(rule: str) -> celpy.Runner:
    env = _environment()
    return env.program(env.compile(rule), functions={"sum": _sum})


def prepared(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` as stored: unknown fields pruned, nulls of non-nullable fields pruned, then defaults applied
    (a default's own fields defaulted too)."""
    if isinstance(value, dict) and schema.get("type") == "object" and "properties" in schema:  # not metadata
        props = schema["properties"]
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields", False)
        out = {k: v for k, v in value.items()
               if (k in props or keep_unknown) and not (v is None and not props.get(k, {}).get("nullable"))}
        for name, prop in props.items():
            if name not in out and "default" in prop:
                out[name] = copy.deepcopy(prop["default"])
            if name in out:
                out[name] = prepared(out[name], prop)
        return out
    if isinstance(value, list) and schema.get("type") == "array":
        return [prepared(v, schema["items"]) for v in value]
    return value


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """A stored value as CEL sees it: typed by its schema, unknown fields left out."""
    kind = schema.get("type")
    if value is None:
        return None
    if kind == "object":
        props = schema.get("properties") or {}
        return celtypes.MapType({celtypes.StringType(k): to_cel(v, props[k]) for k, v in value.items() if k in props})
    if kind == "array":
        return celtypes.ListType([to_cel(v, schema["items"]) for v in value])
    if kind == "integer":
        return celtypes.IntType(value)
    if kind == "number":
        return celtypes.DoubleType(value)
    if kind == "boolean":
        return celtypes.BoolType(value)
    return celtypes.StringType(value)


def _root_view(obj: dict[str, Any], schema: dict[str, Any]) -> Any:
    """The resource as a root rule sees it: of metadata, only name and generateName."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k in ("name", "generateName")}
    props = {**schema["properties"], "metadata": {"type": "object", "properties": {
        "name": {"type": "string"}, "generateName": {"type": "string"}}}}
    return to_cel({**obj, "metadata": meta}, {**schema, "properties": props})


def _key(item: Any, keys: list[str] | None) -> Any:
    return repr(item) if keys is None else tuple(repr(item.get(k)) for k in keys)


class Admission:
    """The admission checks above of one CRD version's schema."""

    def __init__(self, crd: dict[str, Any]) -> None:
        self.schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def errors(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[FieldError]:
        """What the API server refuses in a create of ``obj`` (an update from ``old``), in schema order."""
        new = prepared(obj, self.schema)
        before = prepared(old, self.schema) if old is not None else None
        out: list[FieldError] = []
        self._walk(new, _root_view(new, self.schema), before, self.schema, "", out)
        return out

    def _walk(self, value: Any, cel: Any, old: Any, schema: dict[str, Any], path: str, out: list[FieldError]) -> None:
        """Check ``value`` (``cel`` as CEL sees it) and what it holds; ``old``: its correlated old value."""
        if value is None:
            return  # as there: no rule runs on an unset field
        for check in schema.get("x-kubernetes-validations") or []:
            transition = "oldSelf" in check["rule"]
            if transition and old is None:
                continue
            env = {"self": cel}
            if transition:
                env["oldSelf"] = _root_view(old, schema) if not path else to_cel(old, schema)
            try:
                result = _program(check["rule"]).evaluate(env)
            except celpy.CELEvalError as exc:
                out.append(FieldError(path.lstrip("."), f"evaluation error: {exc}", check["rule"]))
                continue
            if not isinstance(result, celtypes.BoolType):
                out.append(FieldError(path.lstrip("."), f"evaluation error: {result!r} is no bool", check["rule"]))
            elif not result:
                field = path + check.get("fieldPath", "")
                out.append(FieldError(field.lstrip("."), check["message"], check["rule"]))
        if isinstance(value, dict):
            for name, prop in (schema.get("properties") or {}).items():
                if name in value:
                    before = old.get(name) if isinstance(old, dict) else None
                    self._walk(value[name], cel.get(celtypes.StringType(name)), before, prop, f"{path}.{name}", out)
        elif isinstance(value, list):
            kind = schema.get("x-kubernetes-list-type", "atomic")
            keys = schema.get("x-kubernetes-list-map-keys")
            seen: set[Any] = set()
            olds = {_key(o, keys): o for o in old} if kind == "map" and isinstance(old, list) else {}
            for i, item in enumerate(value):
                key = _key(item, keys)
                if kind in ("map", "set") and key in seen:
                    out.append(FieldError(f"{path}[{i}]".lstrip("."), f"Duplicate value: {key}"))
                seen.add(key)
                self._walk(item, cel[i], olds.get(key), schema["items"], f"{path}[{i}]", out)
