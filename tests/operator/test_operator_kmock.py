"""The operator running for real (kopf) against KMock's Kubernetes emulator on 127.0.0.1."""

from __future__ import annotations

import io
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import kubernetes
import pytest
import yaml
from emulator import running_emulator
from kopf.testing import KopfRunner
from kubernetes.client.rest import ApiException
from kvpool_sidecar.client import SidecarClient
from support import free_port, kubelet_projection

GROUP, VERSION, PLURAL, NS = "kvpool.dev", "v1alpha1", "kvcachepolicies", "llm"
HANDLER_MODULES = ("kube_login", "kvpool_operator.handlers")


def operator_args() -> list[str]:
    """kopf registers handlers at import: forget the modules so that each run registers them again."""
    for module in HANDLER_MODULES:
        sys.modules.pop(module, None)
    return ["run", "-A", "--standalone", *(arg for m in HANDLER_MODULES for arg in ("-m", m))]


def wait_for(fn: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except ApiException as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s; last: {last!r}")


def wait_watching(emulator: Any) -> None:
    """Until kopf watches the policies: objects created earlier would be listed twice by the emulator
    (it ignores ?resourceVersion=), which a real API server never does."""
    wait_for(lambda: any(PLURAL in str(r.url) and r.params.get("watch") for r in list(emulator._requests)))


def policy(name: str, weights: dict | None = None, **spec: Any) -> dict:
    body = {"pageSize": 16, **spec}
    if weights:
        body["eviction"] = {"weights": weights}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "KVCachePolicy",
            "metadata": {"name": name, "namespace": NS}, "spec": body}


@pytest.fixture
def cluster() -> Iterator[tuple[Any, Any, Any]]:
    with running_emulator() as (_, emulator):
        with KopfRunner(operator_args()) as runner:
            wait_watching(emulator)
            yield kubernetes.client.CustomObjectsApi(), kubernetes.client.CoreV1Api(), emulator
        assert runner.exit_code == 0, runner.output


def bound_pod(name: str, policy: str | None, mounts: str | None = None, ip: str | None = None) -> dict:
    """A Running pod labelled kvpool.dev/policy: ``policy`` whose native kvpool-sidecar mounts ConfigMap
    ``mounts`` (kvpool-<policy> unless given) at /etc/kvpool."""
    labels = {"app": "chat", **({"kvpool.dev/policy": policy} if policy else {})}
    sidecar = {"name": "kvpool-sidecar", "image": "x", "restartPolicy": "Always",
               "volumeMounts": [{"name": "cfg", "mountPath": "/etc/kvpool"}]}
    volume = {"name": "cfg", "configMap": {"name": mounts or f"kvpool-{policy}", "optional": True}}
    return {"metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"initContainers": [sidecar], "containers": [{"name": "vllm", "image": "x"}], "volumes": [volume]},
            "status": {"phase": "Running", **({"podIP": ip} if ip else {})}}


def posted(emulator: Any, reason: str) -> list[dict]:
    """The Events posted with ``reason``."""
    return [r.data for r in list(emulator._requests) if "events" in str(r.url) and str(r.method).endswith("POST")
            and isinstance(r.data, dict) and r.data.get("reason") == reason]


def resync() -> None:
    """One round of the operator's periodic resync, now (the module kopf imported)."""
    sys.modules["kvpool_operator.handlers"].resync_all()


def status(api: Any, name: str) -> dict:
    return api.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name).get("status") or {}


def cond(st: dict, kind: str) -> dict:
    return {c["type"]: c for c in st.get("conditions", [])}.get(kind, {})


def configmap(core: Any, name: str) -> dict:
    return yaml.safe_load(core.read_namespaced_config_map(f"kvpool-{name}", NS).data["config.yaml"])


def test_create_update_invalid_delete(cluster):
    api, core, emulator = cluster
    core.create_namespaced_pod(NS, bound_pod("p1", "chat"))
    core.create_namespaced_pod(NS, bound_pod("p2", None, mounts="kvpool-chat"))  # no label: not the policy's
    api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy("chat", {"reuse": 0.6}))
    st = wait_for(lambda: (s := status(api, "chat")).get("observedGeneration") == 1 and s)
    assert cond(st, "Valid")["status"] == "True" and st["targetPods"] == 1 and st["configMap"] == "kvpool-chat"
    assert cond(st, "Bound")["status"] == "True" and cond(st, "ConfigMapOwned")["status"] == "True"
    first = configmap(core, "chat")
    assert first["eviction"]["weights"]["reuse"] == 0.6 and first["source"]["generation"] == 1
    owner = core.read_namespaced_config_map("kvpool-chat", NS).metadata.owner_references[0]
    created = api.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "chat")
    assert owner.uid == created["metadata"]["uid"] and owner.block_owner_deletion  # garbage-collected with it
    assert not created["metadata"].get("finalizers")  # nothing to wait for: deletion never needs the operator
    assert _events(emulator) == []  # kopf posts no Event of its own per handler run (Normal ones are off)

    # A hot parameter update: the ConfigMap and observedGeneration follow.
    api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "chat", {"spec": {"eviction": {"weights": {
        "reuse": 0.9}}}})
    wait_for(lambda: status(api, "chat").get("observedGeneration") == 2)
    second = configmap(core, "chat")
    assert second["eviction"]["weights"]["reuse"] == 0.9 and second["source"]["hash"] != first["source"]["hash"]

    # An invalid update: Valid=False naming the field, the ConfigMap untouched.
    api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "chat", {"spec": {"pageSize": 0}})
    st = wait_for(lambda: (s := status(api, "chat")).get("observedGeneration") == 3 and s)
    assert cond(st, "Valid")["status"] == "False" and "spec.pageSize" in cond(st, "Valid")["message"]
    assert cond(st, "Bound")["status"] == "True"  # kept from the last look
    assert configmap(core, "chat") == second
    events = wait_for(lambda: posted(emulator, "InvalidSpec"))
    assert "spec.pageSize" in events[0]["message"] and events[0]["type"] == "Warning"
    # kopf's own per-run Events (Normal) stay unposted: only warnings reach the namespace's Events.
    assert {e.get("type") for e in _events(emulator)} == {"Warning"}

    # Deleted: gone at once (no finalizer). The operator deletes nothing: the garbage collector takes the
    # ConfigMap through its ownerReference (the emulator has none, so it stays here).
    api.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "chat")
    wait_for(lambda: _policy_gone(api, "chat"))
    assert not [r for r in list(emulator._requests) if "configmaps" in str(r.url) and r.method == "DELETE"]


def _events(emulator: Any) -> list[dict]:
    return [r.data for r in list(emulator._requests) if "events" in str(r.url) and str(r.method).endswith("POST")
            and isinstance(r.data, dict)]


def _policy_gone(api: Any, name: str) -> bool:
    try:
        api.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_mis_bound_pods_are_surfaced_and_the_configmap_is_written_all_the_same(cluster):
    """Created mis-bound, fixed, becoming mis-bound: the Bound condition and one Warning each time; the
    ConfigMap is written throughout and Ready counts the bound pods."""
    api, core, emulator = cluster
    core.create_namespaced_pod(NS, bound_pod("good", "chat"))
    core.create_namespaced_pod(NS, bound_pod("stray", "chat", mounts="kvpool-api"))  # labelled chat, mounts api's
    api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy("chat"))
    st = wait_for(lambda: (s := status(api, "chat")).get("observedGeneration") == 1 and s)
    assert configmap(core, "chat")["source"]["name"] == "chat"  # not held back
    bound = cond(st, "Bound")
    assert bound["status"] == "False" and bound["reason"] == "PodsMisbound" and st["misboundPods"] == 1
    assert "stray (its kvpool-sidecar mounts ConfigMap kvpool-api at /etc/kvpool)" in bound["message"]
    assert st["targetPods"] == 1 and "good" not in bound["message"]
    assert [e["message"] for e in posted(emulator, "PodsMisbound")] == [bound["message"]]
    resync()
    assert len(posted(emulator, "PodsMisbound")) == 1  # still so at the resync: not said again

    core.patch_namespaced_pod("stray", NS, {"metadata": {"labels": {"kvpool.dev/policy": "api"}}})  # fixed
    resync()
    st = status(api, "chat")
    assert cond(st, "Bound")["status"] == "True" and st["misboundPods"] == 0 and st["targetPods"] == 1
    assert operator_sample("kvpool_operator_policy_misbound_pods", policy_namespace=NS, policy="chat") == 0

    core.patch_namespaced_pod("stray", NS, {"metadata": {"labels": {"kvpool.dev/policy": "chat"}}})  # again
    resync()
    st = status(api, "chat")
    assert cond(st, "Bound")["status"] == "False" and len(posted(emulator, "PodsMisbound")) == 2
    assert operator_sample("kvpool_operator_policy_misbound_pods", policy_namespace=NS, policy="chat") == 1  # alerted


def test_a_foreign_configmap_is_left_alone_and_reported(cluster):
    api, core, emulator = cluster
    core.create_namespaced_config_map(NS, {"metadata": {"name": "kvpool-mine", "namespace": NS},
                                           "data": {"config.yaml": "pageSize: 32\n"}})
    api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy("mine"))
    st = wait_for(lambda: (s := status(api, "mine")).get("observedGeneration") == 1 and s)
    owned = cond(st, "ConfigMapOwned")
    assert owned["status"] == "False" and owned["reason"] == "ForeignConfigMap" and "not the operator's" in \
        owned["message"]
    assert cond(st, "Ready")["status"] == "False" and cond(st, "Ready")["reason"] == "ForeignConfigMap"
    assert [e["message"] for e in posted(emulator, "ForeignConfigMap")] == [owned["message"]]
    api.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "mine")
    wait_for(lambda: _policy_gone(api, "mine"))
    assert core.read_namespaced_config_map("kvpool-mine", NS).data == {"config.yaml": "pageSize: 32\n"}
    assert not [r for r in list(emulator._requests) if "configmaps/kvpool-mine" in str(r.url)
                and r.method in ("PATCH", "PUT", "DELETE")]


def test_policies_are_deleted_with_the_operator_down_and_an_old_finalizer_goes_at_start():
    """Versions before schema 2 put kvpool.dev/finalizer on every policy: one deleted while the operator is
    down stays Terminating until the operator starts and removes it; one not deleted loses it too. A
    policy the operator handles gets none, so its deletion never waits for the operator."""
    with running_emulator() as (_, emulator):
        api = kubernetes.client.CustomObjectsApi()
        for name in ("old", "leaving"):
            body = policy(name)
            body["metadata"]["finalizers"] = ["kvpool.dev/finalizer"]
            api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
        api.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "leaving")
        assert api.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "leaving")["metadata"][
            "deletionTimestamp"]  # Terminating: the operator is down
        with KopfRunner(operator_args()) as runner:
            wait_watching(emulator)
            wait_for(lambda: _policy_gone(api, "leaving"))
            wait_for(lambda: not api.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "old")[
                "metadata"].get("finalizers"))
            api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy("new"))
            wait_for(lambda: status(api, "new").get("observedGeneration") == 1)
        assert runner.exit_code == 0, runner.output
        assert not api.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "new")["metadata"].get("finalizers")
        api.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "new")  # the operator is down
        assert _policy_gone(api, "new")


def _gone(core: Any, name: str) -> bool:
    try:
        core.read_namespaced_config_map(name, NS)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_restart_resumes_without_rewriting_configmaps():
    with running_emulator() as (_, emulator):
        api, core = kubernetes.client.CustomObjectsApi(), kubernetes.client.CoreV1Api()
        with KopfRunner(operator_args()):
            wait_watching(emulator)
            api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy("chat", {"reuse": 0.7}))
            wait_for(lambda: status(api, "chat").get("observedGeneration") == 1)
        version = core.read_namespaced_config_map("kvpool-chat", NS).metadata.resource_version
        writes = len([r for r in emulator._requests if "configmaps" in str(r.url) and r.method in ("POST", "PATCH")])
        before = len(emulator._requests)
        with KopfRunner(operator_args()) as runner:
            # The resume handler runs on the existing policy and writes its status again...
            wait_for(lambda: any("kvcachepolicies/chat" in str(r.url) and r.method == "PATCH"
                                 for r in list(emulator._requests)[before:]))
        assert runner.exit_code == 0
        # ...but the ConfigMap, already right, is not rewritten.
        assert core.read_namespaced_config_map("kvpool-chat", NS).metadata.resource_version == version
        after = len([r for r in emulator._requests if "configmaps" in str(r.url) and r.method in ("POST", "PATCH")])
        assert after == writes


def test_end_to_end_policy_patch_reaches_a_running_sidecar(cluster, tmp_path):
    """Patch a policy's weights -> the operator writes the ConfigMap -> kubelet-style projection ->
    a real `kvpool-sidecar serve` process reports the new weights within 5 s, cached pages intact."""
    api, core, _ = cluster
    api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy("e2e", {"reuse": 0.6}))
    wait_for(lambda: status(api, "e2e").get("observedGeneration") == 1)
    text = core.read_namespaced_config_map("kvpool-e2e", NS).data["config.yaml"]
    kubelet_projection(tmp_path, text, 1)
    port = free_port()
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "kvpool_sidecar.cli", "serve", "--config", str(tmp_path / "config.yaml"),
         "--port", str(port), "--pages", "512", "--log-level", "warning"],
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(url), timeout=60)
        with SidecarClient(url) as c:
            assert c.config()["config"]["eviction"]["weights"]["reuse"] == 0.6
            for i in range(5):
                prompt = list(range(i * 100, i * 100 + 64))
                c.admit(f"s{i}", prompt)
                c.commit(f"s{i}", 64)
                c.release(f"s{i}")
            cached = c.stats()["cached_pages"]
            api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "e2e", {"spec": {"eviction": {
                "weights": {"reuse": 0.9}}}})
            wait_for(lambda: yaml.safe_load(core.read_namespaced_config_map("kvpool-e2e", NS).data["config.yaml"])[
                "eviction"]["weights"]["reuse"] == 0.9)
            kubelet_projection(tmp_path, core.read_namespaced_config_map("kvpool-e2e", NS).data["config.yaml"], 2)
            wait_for(lambda: c.config()["config"]["eviction"]["weights"]["reuse"] == 0.9)
            assert c.config()["generation"] == 2
            assert c.stats()["cached_pages"] == cached and c.lookup(list(range(64))) == 64
            # A named prompt and a to-B window open all day reach the running sidecar the same way.
            window = {"start": "00:00", "end": "00:00", "isolationPercent": 40}
            prompt = {"name": "system", "model": "org/served", "tokens": list(range(64))}
            api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "e2e", {"spec": {
                "workloads": {"toB": {"schedule": [window]}}, "pinning": {"prompts": [prompt]}}})
            wait_for(lambda: "system" in core.read_namespaced_config_map("kvpool-e2e", NS).data["config.yaml"])
            kubelet_projection(tmp_path, core.read_namespaced_config_map("kvpool-e2e", NS).data["config.yaml"], 3)
            wait_for(lambda: c.config()["generation"] == 3)
            view = c.config()
            assert view["to_b_share_percent"] == 40 and c.stats()["partitions"]["toB"]["capacity"] == 204
            assert view["prompts"][0]["name"] == "system" and view["prompts"][0]["pinned"] == 0
            wait_for(lambda: "org/served" in (c.config()["prompts"][0]["problem"] or ""))  # no engine of it yet
            # Prompts past the pin quota of this pool (30 % of 512 pages): the sidecar refuses the config,
            # naming the field, and keeps the one in force.
            big = {**prompt, "tokens": list(range(16 * 154))}
            api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "e2e", {"spec": {"pinning": {
                "prompts": [big]}}})
            wait_for(lambda: "2463" in core.read_namespaced_config_map("kvpool-e2e", NS).data["config.yaml"])
            kubelet_projection(tmp_path, core.read_namespaced_config_map("kvpool-e2e", NS).data["config.yaml"], 4)
            wait_for(lambda: c.config()["last_error"] is not None)
            assert "pinning.prompts" in c.config()["last_error"] and c.config()["generation"] == 3
            assert c.stats()["cached_pages"] == cached
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=30)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def operator_sample(name: str, **labels: str) -> float:
    """A sample of the operator's /metrics (the registry ``kvpool-operator run --metrics-port`` serves)."""
    from kvpool_operator.metrics import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_operator_counts_reconciles_errors_and_pods_off_the_policys_hash(cluster, monkeypatch):
    """What the operator's alerts read: every handler run is counted and timed, a refused spec is an
    error, and each policy's targeted and synced pods are exported, so pods whose sidecar runs another
    config hash show as the difference."""
    api, core, _ = cluster
    sidecar = {"synced": False}

    def urlopen(url: str, timeout: float) -> io.BytesIO:  # the pod's sidecar /metrics: an old hash, or the policy's
        assert url == "http://10.0.0.7:9400/metrics"
        current = core.read_namespaced_config_map("kvpool-m", NS).metadata.annotations["kvpool.dev/config-hash"]
        digest = current if sidecar["synced"] else "0123abcd"
        return io.BytesIO(f'kvpool_config_info{{hash="{digest}",policy="lru",source="llm/m"}} 1\n'.encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    core.create_namespaced_pod(NS, bound_pod("p1", "m", ip="10.0.0.7"))
    pods = {"policy_namespace": NS, "policy": "m"}
    created = operator_sample("kvpool_operator_reconciles_total", handler="create")
    timed = operator_sample("kvpool_operator_reconcile_seconds_count", handler="create")
    api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy("m"))
    wait_for(lambda: status(api, "m").get("observedGeneration") == 1)
    assert operator_sample("kvpool_operator_reconciles_total", handler="create") == created + 1
    assert operator_sample("kvpool_operator_reconcile_seconds_count", handler="create") == timed + 1
    # The pod's sidecar runs another config: 1 pod targeted, none synced (KVPoolPodsOffPolicyHash).
    assert operator_sample("kvpool_operator_policy_target_pods", **pods) == 1
    assert operator_sample("kvpool_operator_policy_synced_pods", **pods) == 0

    # It runs the policy's config: the next reconcile counts it synced.
    sidecar["synced"] = True
    api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "m", {"spec": {"eviction": {"weights": {
        "reuse": 0.7}}}})
    wait_for(lambda: status(api, "m").get("observedGeneration") == 2)
    assert status(api, "m")["syncedPods"] == 1
    assert operator_sample("kvpool_operator_policy_synced_pods", **pods) == 1

    # An invalid spec: one error of the update handler (Valid=False in the policy's status).
    errors = operator_sample("kvpool_operator_reconcile_errors_total", handler="update", reason="invalid_spec")
    updates = operator_sample("kvpool_operator_reconciles_total", handler="update")
    api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "m", {"spec": {"pageSize": 0}})
    wait_for(lambda: cond(status(api, "m"), "Valid").get("status") == "False")
    assert operator_sample("kvpool_operator_reconcile_errors_total", handler="update",
                           reason="invalid_spec") == errors + 1
    assert operator_sample("kvpool_operator_reconciles_total", handler="update") == updates + 1

    # Deleted: its series go with it.
    api.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "m")
    wait_for(lambda: _policy_gone(api, "m"))
    wait_for(lambda: "policy=\"m\"" not in operator_text())


def operator_text() -> str:
    from kvpool_operator.metrics import REGISTRY
    from prometheus_client import generate_latest

    return generate_latest(REGISTRY).decode()
