"""The operator's pure parts: CRD generation, rendering, status; no Kubernetes needed."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml
from kvpool_operator.cli import main
from kvpool_operator.crd import crd, spec_schema
from kvpool_operator.render import CONFIG_KEY, HASH_ANNOTATION, needs_update, render_configmap
from kvpool_operator.status import (
    PolicyRef,
    build_status,
    config_hash_from_metrics,
    conflicting_policy,
    prompt_status,
    prompts_pinned_from_metrics,
    target_pods,
)
from kvpool_sidecar.config import (
    ConfigError,
    KVCachePolicySpec,
    LabelSelector,
    load_policy,
    parse_config_text,
    spec_hash,
    validate_spec,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))


def test_committed_crd_matches_the_model():
    committed = yaml.safe_load((ROOT / "crds" / "kvcachepolicy.yaml").read_text())
    assert committed == crd(), "crds/kvcachepolicy.yaml drifted: run `kvpool-operator crd > crds/kvcachepolicy.yaml`"


def test_crd_shape():
    version = crd()["spec"]["versions"][0]
    assert crd()["spec"]["names"]["shortNames"] == ["kvp"] and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Policy", "Valid", "Ready", "Synced", "Targets",
                                                                          "Age"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    weights = spec["properties"]["eviction"]["properties"]["weights"]["properties"]
    assert weights["reuse"] == {"type": "number", "minimum": 0, "maximum": 1, "default": 0.6,
                                "description": weights["reuse"]["description"]}
    assert "lfu" in spec["properties"]["eviction"]["properties"]["policy"]["enum"]
    assert "$ref" not in yaml.safe_dump(spec) and "additionalProperties: false" not in yaml.safe_dump(spec)
    assert spec["x-kubernetes-validations"][0]["rule"].startswith("self.workloads.toB.isolationPercent")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_the_crd_schema_and_the_model(path):
    doc = yaml.safe_load(path.read_text())
    # Kubernetes' OpenAPI v3 schemas follow draft 4 for bounds (exclusiveMinimum is a flag).
    jsonschema.Draft4Validator(spec_schema()).validate(doc["spec"])
    load_policy(path.read_text())


def test_schema_and_model_reject_the_same_bounds():
    bad = {"eviction": {"weights": {"reuse": 2}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(spec_schema()).validate(bad)
    with pytest.raises(jsonschema.ValidationError):  # an exclusive bound: decayPerMinute > 0
        jsonschema.Draft4Validator(spec_schema()).validate({"workloads": {"toC": {"decayPerMinute": 0}}})
    with pytest.raises(ConfigError, match="spec.eviction.weights.reuse"):
        validate_spec(bad)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"pageSize": 0}, "spec.pageSize"),
        ({"eviction": {"policy": "mru"}}, "spec.eviction.policy"),
        ({"workloads": {"toC": {"timeWindow": "soon"}}}, "spec.workloads.toC.timeWindow"),
        ({"pinning": {"quotaPercent": 90}}, "spec"),
        ({"selector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
         "spec.selector.matchExpressions.0.operator"),
        ({"tenancy": {"sharedPrefixes": ["nothex"]}}, "spec.tenancy.sharedPrefixes.0"),
        ({"learning": {"driftThresholdPercent": 0}}, "spec.learning.driftThresholdPercent"),
        ({"unknown": 1}, "spec.unknown"),
    ],
)
def test_every_validation_error_names_the_field(spec, field):
    with pytest.raises(ConfigError) as err:
        validate_spec(spec)
    assert err.value.field == field and str(err.value).startswith(field + ":")


def test_rendered_configmap_is_what_the_sidecar_reads():
    meta, spec = load_policy((ROOT / "crds" / "examples" / "chat.yaml").read_text())
    cm = render_configmap("chat", "llm", 3, spec, owner_uid="uid-1")
    assert cm["metadata"]["name"] == "kvpool-chat" and cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    config = parse_config_text(cm["data"][CONFIG_KEY])
    assert config.spec() == spec
    assert config.source.generation == 3 and config.source.hash == spec_hash(spec)
    assert cm["metadata"]["annotations"][HASH_ANNOTATION] == spec_hash(spec)
    assert not needs_update(cm, render_configmap("chat", "llm", 3, spec, owner_uid="uid-1"))
    changed = KVCachePolicySpec.model_validate({**spec.model_dump(), "pageSize": 32})
    assert needs_update(cm, render_configmap("chat", "llm", 4, changed))
    assert needs_update(None, cm)


def test_rendered_file_carries_the_spec_as_given_and_its_schema_version():
    """Not the operator's defaults: a sidecar of another schema version fills in its own (docs/upgrades.md)."""
    from kvpool_sidecar.config import SCHEMA_VERSION, config_hash

    spec = validate_spec({"pageSize": 32, "eviction": {"weights": {"reuse": 0.5}}, "selector": {}})
    cm = render_configmap("chat", "llm", 2, spec)
    doc = yaml.safe_load(cm["data"][CONFIG_KEY])
    digest = cm["metadata"]["annotations"][HASH_ANNOTATION]
    assert doc == {"source": {"name": "chat", "namespace": "llm", "generation": 2, "hash": digest},
                   "schemaVersion": SCHEMA_VERSION, "pageSize": 32, "eviction": {"weights": {"reuse": 0.5}},
                   "selector": {}}
    # One formula (config_hash) on both sides: what the operator wrote is what the sidecar reports.
    assert digest == config_hash(doc) == spec_hash(spec) == spec_hash(parse_config_text(cm["data"][CONFIG_KEY]))


def pod(name: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": labels}}


def test_targets_and_conflicts_older_policy_wins():
    pods = [pod("a", app="chat"), pod("b", app="api"), pod("c", app="chat", tier="gold")]
    chat = PolicyRef("chat", "2026-01-01T00:00:00Z", LabelSelector(matchLabels={"app": "chat"}))
    gold = PolicyRef("gold", "2026-02-01T00:00:00Z", LabelSelector.model_validate(
        {"matchExpressions": [{"key": "tier", "operator": "Exists"}]}))
    api = PolicyRef("api", "2025-01-01T00:00:00Z", LabelSelector(matchLabels={"app": "api"}))
    assert [p["metadata"]["name"] for p in target_pods(chat.selector, pods)] == ["a", "c"]
    assert conflicting_policy(gold, [chat, gold, api], pods) == chat  # chat is older and shares pod c
    assert conflicting_policy(chat, [chat, gold, api], pods) is None  # the older one wins
    assert conflicting_policy(api, [chat, gold, api], pods) is None  # no shared pod


def test_status_conditions():
    ok = build_status(generation=2, config_hash="abc", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                      conflict=None, targets=3, synced=3)
    kinds = {c["type"]: c for c in ok["conditions"]}
    assert kinds["Valid"]["status"] == "True" and kinds["Ready"]["status"] == "True"
    assert ok["observedGeneration"] == 2 and ok["syncedPods"] == 3
    syncing = build_status(generation=3, config_hash="def", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                           conflict=None, targets=3, synced=1, previous=ok)
    ready = {c["type"]: c for c in syncing["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "Syncing" and "1 of 3" in ready["message"]
    bad = build_status(generation=4, config_hash="def", configmap="kvpool-chat",
                       valid=(False, "InvalidSpec", "spec.pageSize: too small"), conflict=None, targets=3, synced=3,
                       previous=syncing)
    valid = {c["type"]: c for c in bad["conditions"]}["Valid"]
    assert valid["status"] == "False" and "spec.pageSize" in valid["message"] and bad["configHash"] == "def"
    clash = build_status(generation=1, config_hash="x", configmap="kvpool-gold", valid=(True, "Validated", "ok"),
                         conflict=PolicyRef("chat", "", LabelSelector()), targets=1, synced=0)
    assert {c["type"]: c for c in clash["conditions"]}["Conflict"]["message"].startswith("pods are also selected by")


def test_transition_time_moves_only_on_a_flip():
    first = build_status(generation=1, config_hash="a", configmap="m", valid=(True, "Validated", "ok"), conflict=None,
                         targets=1, synced=1)
    again = build_status(generation=2, config_hash="a", configmap="m", valid=(True, "Validated", "ok"), conflict=None,
                         targets=1, synced=1, previous={**first, "conditions": [
                             {**c, "lastTransitionTime": "2020-01-01T00:00:00Z"} for c in first["conditions"]]})
    assert all(c["lastTransitionTime"] == "2020-01-01T00:00:00Z" for c in again["conditions"])


def test_synced_hash_comes_from_the_sidecar_metrics():
    text = '# HELP kvpool_config_info x\nkvpool_config_info{hash="0123abcd",policy="lru",source="llm/chat"} 1.0\n'
    assert config_hash_from_metrics(text) == "0123abcd"
    assert config_hash_from_metrics("kvpool_pages{state=\"free\"} 3\n") is None


def test_status_counts_the_synced_pods_holding_each_named_prompt_wholly_pinned():
    whole = ('kvpool_named_prompt_pages{kind="pinned",prompt="sys"} 3.0\n'
             'kvpool_named_prompt_pages{kind="total",prompt="sys"} 3.0\n')
    part = whole.replace('"sys"} 3.0\nkvpool', '"sys"} 1.0\nkvpool', 1)
    assert prompts_pinned_from_metrics(whole) == {"sys"} and prompts_pinned_from_metrics(part) == set()
    pods = [prompts_pinned_from_metrics(t) for t in (whole, part, "")]
    assert prompt_status(["sys", "doc"], pods) == [{"name": "sys", "pinnedPods": 1}, {"name": "doc", "pinnedPods": 0}]
    status = build_status(generation=1, config_hash="a", configmap="m", valid=(True, "Validated", "ok"),
                          conflict=None, targets=3, synced=3, prompts=prompt_status(["sys"], pods))
    assert status["prompts"] == [{"name": "sys", "pinnedPods": 1}]


def test_cli_render_and_crd(capsys, tmp_path):
    assert main(["render", "-f", str(ROOT / "crds" / "examples" / "api.yaml")]) == 0
    cm = yaml.safe_load(capsys.readouterr().out)
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "kvpool-api"
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "crds" / "examples" / "api.yaml").read_text().replace("pageSize: 16", "pageSize: -3"))
    assert main(["render", "-f", str(bad)]) == 2
    assert "spec.pageSize" in capsys.readouterr().err
    assert main(["crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == crd()


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d["spec"].update(pageSize=True), "spec.pageSize"),  # was rendered as 1
    (lambda d: d["spec"].update(pageSize="16"), "spec.pageSize"),
    (lambda d: d["spec"].setdefault("workloads", {}).update(toC={"timeWindow": "0s"}), "spec.workloads.toC.timeWindow"),
    (lambda d: d["spec"].setdefault("learning", {}).update(coldStartPeriod="0ms"), "spec.learning.coldStartPeriod"),
    (lambda d: d["spec"].update(selector={"matchExpressions": [{"key": "app", "operator": "In"}]}),
     "spec.selector.matchExpressions.0"),
    (lambda d: d["spec"].update(selector={"matchExpressions": [{"key": "app", "operator": "Exists", "values": ["x"]}]}),
     "spec.selector.matchExpressions.0"),
    (lambda d: d["spec"].update(selector={"matchLabels": {"my app": "x"}}), "spec.selector.matchLabels"),
    (lambda d: d["spec"].update(selector={"matchLabels": {"app": "a value"}}), "spec.selector.matchLabels"),
    (lambda d: d["metadata"].update(name="x" * 300), "metadata.name"),
    (lambda d: d["metadata"].update(name="../../etc/passwd"), "metadata.name"),
    (lambda d: d["metadata"].update(generation="abc"), "metadata.generation"),  # was a traceback
    (lambda d: d["metadata"].update(namespace="Not A Namespace"), "metadata.namespace"),
])
def test_render_refuses_a_bad_policy_naming_the_field(change, field, tmp_path, capsys):
    doc = yaml.safe_load((ROOT / "crds" / "examples" / "chat.yaml").read_text())
    change(doc)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["render", "-f", str(path)]) == 2
    err = capsys.readouterr()
    assert err.out == "" and f"error: {field}" in err.err and "Traceback" not in err.err


def test_run_serves_the_operators_metrics_on_its_port_while_it_runs(monkeypatch):
    """`kvpool-operator run --metrics-port P` serves the operator's metrics there while kopf runs (on
    loopback unless --metrics-host), and stops serving when the operator stops."""
    import httpx
    import kopf
    from support import free_port

    port = free_port()
    scraped: list[str] = []

    def kopf_run(**_: object) -> None:  # the operator running: Prometheus scrapes it
        scraped.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)

    monkeypatch.setattr(kopf, "run", kopf_run)
    assert main(["run", "--standalone", "--metrics-port", str(port)]) == 0
    assert 'kvpool_operator_reconciles_total{handler="resync"}' in scraped[0]
    assert 'kvpool_operator_reconcile_errors_total{handler="update",reason="invalid_spec"}' in scraped[0]
    assert "kvpool_operator_reconcile_seconds_bucket" in scraped[0]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1)
