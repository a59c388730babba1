"""The operator's pure parts: CRD generation, rendering, status; no Kubernetes needed."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml
from kvpool_operator.cli import main
from kvpool_operator.crd import crd, spec_schema
from kvpool_operator.render import CONFIG_KEY, HASH_ANNOTATION, needs_update, ownership, render_configmap
from kvpool_operator.status import (
    bind,
    build_status,
    config_hash_from_metrics,
    prompt_status,
    prompts_pinned_from_metrics,
    warnings,
)
from kvpool_sidecar.config import (
    ConfigError,
    KVCachePolicySpec,
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
        ({"selector": {"matchLabels": {"app": "chat"}}}, "spec.selector"),  # removed in schema version 2
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

    spec = validate_spec({"pageSize": 32, "eviction": {"weights": {"reuse": 0.5}}})
    cm = render_configmap("chat", "llm", 2, spec)
    doc = yaml.safe_load(cm["data"][CONFIG_KEY])
    digest = cm["metadata"]["annotations"][HASH_ANNOTATION]
    assert doc == {"source": {"name": "chat", "namespace": "llm", "generation": 2, "hash": digest},
                   "schemaVersion": SCHEMA_VERSION, "pageSize": 32, "eviction": {"weights": {"reuse": 0.5}}}
    # One formula (config_hash) on both sides: what the operator wrote is what the sidecar reports.
    assert digest == config_hash(doc) == spec_hash(spec) == spec_hash(parse_config_text(cm["data"][CONFIG_KEY]))


def pod(name: str, policy: str | None = "chat", mounts: str | None = "kvpool-chat", phase: str = "Running",
        native: bool = True, projected: bool = False) -> dict:
    """A pod labelled for ``policy`` whose kvpool-sidecar (a native sidecar, or a plain container) mounts
    ConfigMap ``mounts`` at /etc/kvpool (None: no sidecar)."""
    labels = {"app": "x", **({"kvpool.dev/policy": policy} if policy else {})}
    spec: dict = {"containers": [{"name": "vllm"}], "volumes": []}
    if mounts is not None:
        sidecar = {"name": "kvpool-sidecar", "volumeMounts": [{"name": "cfg", "mountPath": "/etc/kvpool/"}]}
        spec["initContainers" if native else "containers"] = [sidecar] if native else [{"name": "vllm"}, sidecar]
        source = {"configMap": {"name": mounts, "optional": True}}
        spec["volumes"] = [{"name": "cfg", **({"projected": {"sources": [source]}} if projected else source)}]
    return {"metadata": {"name": name, "labels": labels}, "spec": spec, "status": {"phase": phase}}


def test_a_policys_pods_are_those_labelled_for_it_and_mis_bound_ones_are_named():
    pods = [pod("a"), pod("b", native=False, projected=True), pod("other", policy="api", mounts="kvpool-api"),
            pod("unlabelled", policy=None), pod("wrong", mounts="kvpool-api"), pod("bare", mounts=None),
            pod("pending", phase="Pending"), pod("pending-wrong", mounts="kvpool-x", phase="Pending"),
            pod("done", phase="Succeeded", mounts="kvpool-x"),
            {**pod("leaving"), "metadata": {**pod("leaving")["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}]
    binding = bind("chat", pods)
    assert [p["metadata"]["name"] for p in binding.targets] == ["a", "b"]  # Running and bound
    assert binding.misbound == [("bare", "has no kvpool-sidecar container"),
                                ("pending-wrong", "its kvpool-sidecar mounts ConfigMap kvpool-x at /etc/kvpool"),
                                ("wrong", "its kvpool-sidecar mounts ConfigMap kvpool-api at /etc/kvpool")]
    nothing = pod("empty")
    nothing["spec"]["initContainers"][0]["volumeMounts"] = []
    assert bind("chat", [nothing]).misbound == [("empty", "its kvpool-sidecar mounts no ConfigMap at /etc/kvpool")]


def test_mis_bound_pods_are_surfaced_in_a_condition_and_one_warning_while_ready_counts_bound_pods():
    misbound = [(f"p{i}", "has no kvpool-sidecar container") for i in range(5)]
    status = build_status(generation=1, config_hash="abc", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                          owned=(True, ""), policy="chat", misbound=misbound, targets=2, synced=2)
    kinds = {c["type"]: c for c in status["conditions"]}
    bound = kinds["Bound"]
    assert bound["status"] == "False" and bound["reason"] == "PodsMisbound" and status["misboundPods"] == 5
    assert "p0 (has no kvpool-sidecar container); p1" in bound["message"] and "p3" not in bound["message"]
    assert "and 2 more" in bound["message"] and "kvpool.dev/policy=chat" in bound["message"]
    assert kinds["Ready"]["status"] == "True"  # the two bound pods run the config
    assert warnings(None, status) == [("PodsMisbound", bound["message"])]
    assert warnings(status, status) == []  # the same again at the next resync: quiet
    fewer = build_status(generation=1, config_hash="abc", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                         owned=(True, ""), policy="chat", misbound=misbound[:1], targets=2, synced=2, previous=status)
    assert [r for r, _ in warnings(status, fewer)] == ["PodsMisbound"]  # changed: said again
    fixed = build_status(generation=1, config_hash="abc", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                         owned=(True, ""), policy="chat", misbound=[], targets=3, synced=3, previous=fewer)
    assert {c["type"]: c for c in fixed["conditions"]}["Bound"]["status"] == "True" and warnings(fewer, fixed) == []


def managed(name: str = "kvpool-chat", policy: str | None = "chat", uid: str | None = None, kind: str = "KVCachePolicy",
            managed_by: str | None = "kvpool-operator") -> dict:
    labels = {k: v for k, v in (("app.kubernetes.io/managed-by", managed_by), ("kvpool.dev/policy", policy)) if v}
    meta: dict = {"name": name, "labels": labels}
    if uid:
        meta["ownerReferences"] = [{"kind": kind, "name": "chat", "uid": uid, "controller": True}]
    return {"metadata": meta, "data": {}}


def test_only_the_operators_own_configmap_is_written():
    assert ownership(managed(uid="u1"), "chat", "u1") == (True, "")
    assert ownership(managed(), "chat", "u1") == (True, "")  # rendered without an owner: adopted
    desired = render_configmap("chat", "llm", 1, KVCachePolicySpec(), owner_uid="u1")
    assert needs_update({**managed(), "data": desired["data"]}, desired)  # adopting writes the owner in
    assert not needs_update({**managed(uid="u1"), "data": desired["data"]}, desired)
    owned, why = ownership(managed(managed_by=None), "chat", "u1")  # someone else's
    assert not owned and "kvpool-chat is not the operator's" in why
    owned, why = ownership(managed(uid="u0"), "chat", "u1")  # a deleted policy's, awaiting the GC
    assert not owned and "controlled by KVCachePolicy chat (uid u0)" in why
    owned, why = ownership(managed(policy="api"), "chat", "u1")
    assert not owned and "labelled for policy 'api'" in why
    status = build_status(generation=1, config_hash=None, configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                          owned=(False, why), policy="chat", misbound=[], targets=1, synced=1)
    kinds = {c["type"]: c for c in status["conditions"]}
    assert kinds["ConfigMapOwned"]["reason"] == "ForeignConfigMap" and kinds["Ready"]["status"] == "False"
    assert warnings(None, status) == [("ForeignConfigMap", why)]


def test_status_conditions():
    ok = build_status(generation=2, config_hash="abc", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                      targets=3, synced=3)
    kinds = {c["type"]: c for c in ok["conditions"]}
    assert kinds["Valid"]["status"] == "True" and kinds["Ready"]["status"] == "True"
    assert ok["observedGeneration"] == 2 and ok["syncedPods"] == 3
    syncing = build_status(generation=3, config_hash="def", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                           targets=3, synced=1, previous=ok)
    ready = {c["type"]: c for c in syncing["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "Syncing" and "1 of 3" in ready["message"]
    bad = build_status(generation=4, config_hash="def", configmap="kvpool-chat",
                       valid=(False, "InvalidSpec", "spec.pageSize: too small"), targets=3, synced=3,
                       previous=syncing)
    valid = {c["type"]: c for c in bad["conditions"]}["Valid"]
    assert valid["status"] == "False" and "spec.pageSize" in valid["message"] and bad["configHash"] == "def"
    # An invalid spec looks at no pods: what the last look found about them stays.
    looked = build_status(generation=5, config_hash="def", configmap="kvpool-chat", valid=(True, "Validated", "ok"),
                          owned=(True, ""), policy="chat", misbound=[("p", "has no kvpool-sidecar container")],
                          targets=3, synced=3)
    refused = build_status(generation=6, config_hash="def", configmap="kvpool-chat",
                           valid=(False, "InvalidSpec", "spec.pageSize: too small"), targets=3, synced=3,
                           previous=looked)
    kept = {c["type"]: c for c in refused["conditions"]}
    assert kept["Bound"] == {c["type"]: c for c in looked["conditions"]}["Bound"] and "ConfigMapOwned" in kept


def test_transition_time_moves_only_on_a_flip():
    first = build_status(generation=1, config_hash="a", configmap="m", valid=(True, "Validated", "ok"),
                         targets=1, synced=1)
    again = build_status(generation=2, config_hash="a", configmap="m", valid=(True, "Validated", "ok"),
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
                          targets=3, synced=3, prompts=prompt_status(["sys"], pods))
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
    (lambda d: d["spec"].update(selector={"matchLabels": {"app": "chat"}}), "spec.selector"),  # removed
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


def test_the_resync_is_a_thread_of_its_own_every_interval_until_stopped(monkeypatch):
    """Not a kopf timer: a timer would put kopf's finalizer on every policy."""
    import threading

    import kvpool_operator.handlers as handlers

    rounds = threading.Semaphore(0)
    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 0.01)
    monkeypatch.setattr(handlers, "resync_all", rounds.release)
    resync = handlers.Resync()
    resync.start()
    assert rounds.acquire(timeout=5) and rounds.acquire(timeout=5)  # round after round
    resync.stop()
    assert resync._thread is not None and not resync._thread.is_alive()


def test_the_resync_works_from_each_policy_as_last_seen_not_as_its_round_began(monkeypatch):
    """A round takes seconds per policy (scrapes): a spec changed meanwhile (its change handler has written
    the new ConfigMap) or a policy deleted meanwhile is not synced from the round's old copy, which would
    roll the ConfigMap back and write a stale observedGeneration that no later round would ever fix."""
    import kubernetes
    import kvpool_operator.handlers as handlers

    def body(generation: int, observed: int) -> dict:
        return {"metadata": {"namespace": "llm", "name": "chat", "generation": generation, "uid": "u"},
                "spec": {"pageSize": 16}, "status": {"observedGeneration": observed}}

    seen = handlers.Seen()
    monkeypatch.setattr(handlers, "SEEN", seen)
    synced, patched = [], []
    monkeypatch.setattr(handlers, "_sync", lambda name, ns, meta, spec, status: synced.append(meta["generation"])
                        or {"observedGeneration": meta["generation"]})

    class Api:
        def patch_namespaced_custom_object_status(self, *args):
            patched.append(args[-1]["status"]["observedGeneration"])

    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", Api)
    seen.update({"type": "ADDED", "object": body(1, 1)})
    round_began = seen.snapshot()
    monkeypatch.setattr(seen, "snapshot", lambda: round_began)
    seen.update({"type": "MODIFIED", "object": body(2, 1)})  # the spec changed; its handler is under way
    handlers.resync_all()
    assert synced == [] and patched == []
    seen.update({"type": "MODIFIED", "object": body(2, 2)})  # the handler's status is in
    handlers.resync_all()
    assert synced == [2] and patched == [2]
    seen.update({"type": "DELETED", "object": body(2, 2)})
    handlers.resync_all()
    assert synced == [2]
