"""The CRD's admission rules and the model's checks refuse the same policies: each CEL rule (and each keyed
list) is evaluated, by cel-python (tests/operator/admission.py), on a valid spec and on one that breaks
only that rule, beside the model; and every check of the model is one of them."""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import jsonschema
import pytest
import yaml
from admission import Admission
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool_operator.crd import LIST_TYPES, RULES, STATUS_SCHEMA, crd
from kvpool_operator.status import build_status
from kvpool_sidecar.config import (
    API_GROUP,
    API_VERSION,
    KIND,
    MAX_PROMPT_TOKENS,
    ConfigError,
    KVCachePolicySpec,
    load_policy,
    validate_spec,
)
from pydantic import AfterValidator, BaseModel

ROOT = Path(__file__).resolve().parents[2]
ADMISSION = Admission(crd())

# Every rule has work to do here: lists full, shares at their bound (40 + 30; a window's 70 + 30), windows
# touching without overlapping (one past midnight), a prompt of exactly one page.
VALID: dict[str, Any] = {
    "pageSize": 16,
    "eviction": {"weights": {"reuse": 0.5, "locality": 0, "timeWindow": 0},
                 "selfTuning": {"reuseWeights": [0, 0.1, 0.2]}},
    "workloads": {
        "toC": {"timeWindow": "10m"},
        "toB": {"timeWindow": "0.5s", "isolationPercent": 40, "schedule": [
            {"start": "09:00", "end": "17:00", "isolationPercent": 70},
            {"start": "22:00", "end": "02:00", "isolationPercent": 10},
            {"start": "17:00", "end": "22:00", "isolationPercent": 0},
        ]},
        "adapters": [{"adapter": "support", "tenant": "acme"}, {"adapter": "batch", "workloadClass": "toB"}],
    },
    "pinning": {"quotaPercent": 30, "prompts": [
        {"name": "system", "model": "m", "tokens": list(range(16))},
        {"name": "manual", "model": "m", "tokens": list(range(40))},
    ]},
    "learning": {"coldStartPeriod": "168h"},
    "routing": {"loadWindow": "5m"},
}


def policy(spec: dict[str, Any], name: str = "chat") -> dict[str, Any]:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": "llm"}, "spec": spec}


def model_refusal(obj: dict[str, Any]) -> ConfigError | None:
    try:
        load_policy(yaml.safe_dump({**obj, "spec": {}}))  # the manifest's checks, then (as there) the spec's
        validate_spec(obj["spec"])
    except ConfigError as exc:
        return exc
    return None


def setting(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change to the policy: ``path`` (dotted, list indexes as numbers) set to ``value``."""
    def change(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[int(last) if isinstance(node, list) else last] = value
    return change


def appending(path: str, item: Any) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        node: Any = obj
        for part in path.split("."):
            node = node[part]
        node.append(item)
    return change


DURATIONS = [r.at for r in RULES if r.mirrors == "_positive_duration"]
PROMPT = {"model": "m", "tokens": [1] * (MAX_PROMPT_TOKENS // 2)}
# Each rule's breach: the change to VALID, the field the model names, the field the API server names.
BREACHES: dict[str, tuple[Callable[[dict[str, Any]], None], str, str]] = {
    "shares fit": (setting("spec.workloads.toB.isolationPercent", 71), "spec",
                   "spec.workloads.toB.isolationPercent"),
    "scheduled shares fit": (setting("spec.workloads.toB.schedule.0.isolationPercent", 70.5), "spec",
                             "spec.workloads.toB.schedule"),
    "prompts fill a page": (setting("spec.pinning.prompts.0.tokens", list(range(15))), "spec",
                            "spec.pinning.prompts"),
    "a weight above 0": (setting("spec.eviction.weights.reuse", 0), "spec.eviction.weights",
                         "spec.eviction.weights"),
    "candidates distinct": (appending("spec.eviction.selfTuning.reuseWeights", 0.1),
                            "spec.eviction.selfTuning.reuseWeights", "spec.eviction.selfTuning.reuseWeights"),
    "windows apart": (appending("spec.workloads.toB.schedule", {"start": "01:59", "end": "02:00",
                                                                "isolationPercent": 0}),
                      "spec.workloads.toB.schedule", "spec.workloads.toB.schedule"),
    "adapter classed": (setting("spec.workloads.adapters.1", {"adapter": "batch", "workloadClass": None}),
                        "spec.workloads.adapters.1", "spec.workloads.adapters[1]"),
    "prompt tokens bounded": (setting("spec.pinning.prompts", [{"name": "a", **PROMPT}, {"name": "b", **PROMPT},
                                                               {"name": "c", "model": "m", "tokens": [1] * 16}]),
                              "spec.pinning.prompts", "spec.pinning.prompts"),
    **{f"{path} above 0": (setting(f"spec.{path}", "0.00s"), f"spec.{path}", f"spec.{path}") for path in DURATIONS},
    "name fits its ConfigMap": (setting("metadata.name", "a" * 247), "metadata.name", ""),
    # Keyed lists: the API server refuses the second item with a key.
    "workloads.adapters": (appending("spec.workloads.adapters", {"adapter": "support", "tenant": "other"}),
                           "spec.workloads.adapters", "spec.workloads.adapters[2]"),
    "pinning.prompts": (appending("spec.pinning.prompts", {"name": "system", "model": "n", "tokens": [1] * 16}),
                        "spec.pinning.prompts", "spec.pinning.prompts[2]"),
}
TRANSITION_RULES = {r.name for r in RULES if "oldSelf" in r.rule}


def test_a_breach_for_every_rule_and_keyed_list():
    assert set(BREACHES) == {r.name for r in RULES} - TRANSITION_RULES | set(LIST_TYPES)


def test_the_valid_spec_and_the_examples_pass_both():
    assert model_refusal(policy(VALID)) is None
    assert ADMISSION.errors(policy(VALID)) == []
    for path in sorted((ROOT / "crds" / "examples").glob("*.yaml")):
        assert ADMISSION.errors(yaml.safe_load(path.read_text())) == [], path.name


@pytest.mark.parametrize("name", sorted(BREACHES))
def test_a_spec_breaking_one_rule_is_refused_by_the_model_and_by_that_rule_alone(name):
    change, model_field, api_field = BREACHES[name]
    obj = policy(copy.deepcopy(VALID))
    change(obj)
    refusal = model_refusal(obj)
    assert refusal is not None and refusal.field == model_field, refusal
    errors = ADMISSION.errors(obj)
    assert [e.path for e in errors] == [api_field], errors
    rule = next((r for r in RULES if r.name == name), None)
    if rule is None:
        assert errors[0].message.startswith("Duplicate value")
    else:
        assert (errors[0].rule, errors[0].message) == (rule.rule, rule.message)


def test_page_size_is_immutable():
    old = policy(copy.deepcopy(VALID))
    unchanged = policy({**copy.deepcopy(VALID), "eviction": {"policy": "lru"}})
    assert ADMISSION.errors(unchanged, old=old) == []
    changed = policy({**copy.deepcopy(VALID), "pageSize": 32, "pinning": {"quotaPercent": 30}})
    assert ADMISSION.errors(changed) == []  # a new policy may have any page size
    [error] = ADMISSION.errors(changed, old=old)
    assert error.path == "spec.pageSize" and "create a new policy" in error.message
    # Unset in both: the default (16) in both, stored as such.
    assert ADMISSION.errors(policy({}), old=policy({})) == []
    assert [e.path for e in ADMISSION.errors(policy({"pageSize": 8}), old=policy({}))] == ["spec.pageSize"]


def test_a_candidate_written_twice_as_0_and_0_0_is_refused_by_both():
    obj = policy({"eviction": {"selfTuning": {"reuseWeights": [0, 0.0]}}})
    assert model_refusal(obj) is not None
    assert [e.path for e in ADMISSION.errors(obj)] == ["spec.eviction.selfTuning.reuseWeights"]


def window(start: int, end: int) -> dict[str, Any]:
    return {"start": f"{start // 60:02d}:{start % 60:02d}", "end": f"{end // 60:02d}:{end % 60:02d}",
            "isolationPercent": 0}


TIMES = st.sampled_from([0, 1, 59, 60, 600, 719, 720, 1380, 1439])  # the edges of the day and of hours


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(TIMES, TIMES), min_size=1, max_size=3))
def test_windows_overlap_for_the_model_exactly_when_for_the_crd(bounds):
    """The rule's string comparisons against the model's sets of minutes (past midnight, whole days, equal
    windows), with shares that fit (0)."""
    obj = policy({"workloads": {"toB": {"schedule": [window(a, b) for a, b in bounds]}}})
    assert (model_refusal(obj) is None) == (ADMISSION.errors(obj) == [])


def _checks(annotation: Any, seen: set[type]) -> set[str]:
    """The checks (validators) of the model ``annotation`` is or holds, by their qualified names."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *meta = typing.get_args(annotation)
        return _checks(base, seen) | {m.func.__qualname__ for m in meta if isinstance(m, AfterValidator)}
    if origin is not None:
        return set().union(*(_checks(arg, seen) for arg in typing.get_args(annotation)))
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)) or annotation in seen:
        return set()
    seen.add(annotation)
    decorators = annotation.__pydantic_decorators__
    found = {d.func.__qualname__ for d in [*decorators.model_validators.values(),
                                           *decorators.field_validators.values()]}
    for field in annotation.model_fields.values():
        found |= _checks(field.annotation, seen)
        found |= {m.func.__qualname__ for m in field.metadata if isinstance(m, AfterValidator)}
    return found


# The model's checks that no rule needs to mirror, and why.
UNMIRRORED = {
    "_clock_time": "the schema's pattern is the whole check",
    "LabelSelectorRequirement._values_fit_the_operator": "spec.selector goes (issue 68)",
    "LabelSelector._labels": "spec.selector goes (issue 68)",
    "_label_key": "spec.selector goes (issue 68)",
    "_label_value": "spec.selector goes (issue 68)",
}


def test_every_check_of_the_model_is_a_rule_of_the_crd():
    checks = _checks(KVCachePolicySpec, set())
    mirrored = {r.mirrors for r in RULES if r.mirrors} | {mirrors for _, _, mirrors in LIST_TYPES.values()}
    assert checks - set(UNMIRRORED) <= mirrored, f"checks no CRD rule mirrors: {checks - set(UNMIRRORED) - mirrored}"
    assert mirrored - checks == {"load_policy"}  # the manifest's check of metadata.name; the rest are the model's
    assert {r.name for r in RULES if r.mirrors is None} == TRANSITION_RULES


def test_status_conditions_follow_the_api_conventions():
    """metav1.Condition's schema: each condition with the generation it was set for, a CamelCase reason, a
    bounded message; one condition of a type."""
    first = build_status(generation=3, config_hash="a", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                         targets=2, synced=1, owned=(True, ""), policy="chat", misbound=[])
    # An invalid spec: Valid and Ready are set for it; the pods' conditions were not looked at, so they keep
    # the generation they were set for.
    bad = build_status(generation=5, config_hash="a", configmap="kvpool-chat",
                       valid=(False, "InvalidSpec", "spec.pageSize: " + "x" * 40000), targets=2,
                       synced=0, previous=first)
    expected = {"Valid": 5, "Ready": 5, "ConfigMapOwned": 3, "Bound": 3}
    for generation, status in ((3, first), (5, bad)):
        jsonschema.Draft4Validator(STATUS_SCHEMA).validate(status)
        assert {c["type"]: c["observedGeneration"] for c in status["conditions"]} == {
            kind: min(generation, gen) for kind, gen in expected.items()}
        assert ADMISSION.errors({**policy({}), "status": status}) == []
    # An operator from before observedGeneration (mid-upgrade, or rolled back) still writes its status.
    older = [{k: v for k, v in c.items() if k != "observedGeneration"} for c in first["conditions"]]
    jsonschema.Draft4Validator(STATUS_SCHEMA).validate({"conditions": older})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(STATUS_SCHEMA).validate(
            {"conditions": [{**first["conditions"][0], "reason": "not camel case"}]})
    twice = {"conditions": [first["conditions"][0]] * 2}
    assert [e.path for e in ADMISSION.errors({**policy({}), "status": twice})] == ["status.conditions[1]"]
