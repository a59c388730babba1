"""The router over real HTTP: /v1/route, /v1/pods, metrics, config hot reload, and membership from a
static list or the Kubernetes API (KMock's emulator)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import pytest
import torch
import yaml
from emulator import running_emulator
from kvpool_sidecar.cli import main
from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.service.membership import Endpoint, KubernetesMembership, StaticMembership, parse_static
from kvpool_sidecar.service.router_app import RouterService, create_router_app
from support import live_app

PODS = {f"pod-{i}": Endpoint(f"http://10.0.0.{i}:8000", f"http://10.0.0.{i}:8100") for i in range(4)}
CONFIG = {"pageSize": 4, "routing": {"prefixPages": 2}}


def wait_for(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached")


class Members:
    """A membership source a test can change."""

    def __init__(self, pods: dict[str, Endpoint]) -> None:
        self.pods = dict(pods)

    def members(self) -> dict[str, Endpoint]:
        return dict(self.pods)


def serve(source: Any, config_path: Path | None = None, **kwargs: Any):
    config = SidecarConfig.model_validate(yaml.safe_load(config_path.read_text()) if config_path else CONFIG)
    service = RouterService(config, source, config_path=config_path, **kwargs)
    return service, live_app(create_router_app(service, membership_interval=0.05, config_interval=0.05))


def test_route_answers_the_owner_its_alternates_and_why():
    service, app = serve(StaticMembership(PODS))
    with app as url:
        first = httpx.post(url + "/v1/route", json={"tokens": list(range(40))}).json()
        assert first["reason"] == "owner" and first["url"] == PODS[first["pod"]].url
        assert [a["url"] for a in first["alternates"]] == [PODS[a["pod"]].url for a in first["alternates"]]
        assert len(first["alternates"]) == 2 and first["pod"] not in {a["pod"] for a in first["alternates"]}
        # Same first two pages (prefixPages=2), another tail: the same pod and key.
        again = httpx.post(url + "/v1/route", json={"tokens": list(range(8)) + [1] * 30}).json()
        assert (again["pod"], again["key"]) == (first["pod"], first["key"])
        short = httpx.post(url + "/v1/route", json={"tokens": [1, 2]}).json()
        assert short["reason"] == "unkeyed" and short["key"] is None
        pods = httpx.get(url + "/v1/pods").json()
        assert pods["mode"] == "bounded-hash+replicas" and sorted(p["pod"] for p in pods["pods"]) == sorted(PODS)
        assert sum(p["load"] for p in pods["pods"]) == pytest.approx(3, abs=0.01)
        text = httpx.get(url + "/metrics").text
    assert 'kvpool_router_decisions_total{reason="owner"} 2.0' in text
    assert "kvpool_router_pods 4.0" in text
    if shutil.which("promtool"):
        proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [({"tokens": []}, 422, "tokens"), ({"tokens": [1], "block_hashes": [2]}, 422, ""),
     ({"block_hashes": [1, 2], "num_tokens": 99}, 422, "num_tokens"), ({"tokens": ["a"]}, 422, "tokens.0")],
)
def test_a_bad_route_request_names_its_field(body: dict, status: int, field: str):
    service, app = serve(StaticMembership(PODS))
    with app as url:
        answer = httpx.post(url + "/v1/route", json=body)
        assert answer.status_code == status and answer.json()["field"] == field
    assert sum(service.router.decisions.values()) == 0


def test_no_pods_is_503_and_not_ready_until_pods_appear():
    members = Members({})
    service, app = serve(members)
    with app as url:
        assert httpx.get(url + "/readyz").status_code == 503
        answer = httpx.post(url + "/v1/route", json={"tokens": list(range(40))})
        assert answer.status_code == 503 and answer.json()["error"] == "no_pods"
        members.pods = {"pod-0": PODS["pod-0"]}
        wait_for(lambda: httpx.get(url + "/readyz").status_code == 200)
        assert httpx.post(url + "/v1/route", json={"tokens": list(range(40))}).json()["pod"] == "pod-0"


def test_a_leaving_pod_moves_only_its_keys():
    members = Members(PODS)
    service, app = serve(members, mode="prefix-hash")  # ring ownership alone, no load in the way
    prompts = [[i] * 8 for i in range(200)]
    with app as url, httpx.Client(base_url=url) as http:
        before = [http.post("/v1/route", json={"tokens": p}).json()["pod"] for p in prompts]
        members.pods.pop("pod-3")
        wait_for(lambda: len(http.get("/v1/pods").json()["pods"]) == 3)
        after = [http.post("/v1/route", json={"tokens": p}).json()["pod"] for p in prompts]
        metrics = http.get("/metrics").text
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == "pod-3" for b, _ in moved)
    assert 'kvpool_router_membership_changes_total{change="leave"} 1.0' in metrics


def test_config_is_hot_reloaded_and_a_bad_one_is_refused(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    service, app = serve(StaticMembership(PODS), config_path=path)
    a, b = list(range(8)) + [7] * 8, list(range(8)) + [9] * 8  # same first 2 pages, different 3rd and 4th
    with app as url:
        def key(tokens: list[int]) -> str:
            return httpx.post(url + "/v1/route", json={"tokens": tokens}).json()["key"]

        assert key(a) == key(b)
        path.write_text(yaml.safe_dump({**CONFIG, "routing": {"prefixPages": 4}}))
        wait_for(lambda: service.router.routing.prefixPages == 4)
        assert key(a) != key(b)
        path.write_text(yaml.safe_dump({**CONFIG, "routing": {"loadFactor": 0.5}}))
        wait_for(lambda: 'kvpool_router_config_reloads_total{result="invalid"} 1.0' in httpx.get(url + "/metrics").text)
        assert service.router.routing.prefixPages == 4 and service.router.routing.loadFactor == 1.25


def test_static_members_and_cli_errors(capsys):
    assert parse_static(["a=http://x:1/", "b=https://y:2,http://y:3"]) == {
        "a": Endpoint("http://x:1", "http://x:1"), "b": Endpoint("https://y:2", "http://y:3")}
    for bad in (["a"], ["a=ftp://x"], ["a=http://x", "a=http://y"], ["a=http://x,http://y,http://z"]):
        with pytest.raises(ValueError, match="--pod"):
            parse_static(bad)
    assert main(["router", "--pod", "nourl"]) == 2
    assert "use name=http://engine:port" in capsys.readouterr().err


def pod(name: str, labels: dict[str, str], ip: str | None = "10.1.0.1", ready: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "llm", "labels": labels},
            "spec": {"containers": [{"name": "engine", "image": "x"}]}, "status": status}


def test_kubernetes_membership_follows_the_policys_serving_pods():
    """The policy's pods are those labelled kvpool.dev/policy: NAME (the one binding), serving ones only."""
    bound = {"app": "chat", "kvpool.dev/policy": "chat"}
    with running_emulator():
        core = kubernetes.client.CoreV1Api()
        core.create_namespaced_pod("llm", pod("chat-0", bound, "10.1.0.1"))
        core.create_namespaced_pod("llm", pod("chat-1", bound, "10.1.0.2"))
        core.create_namespaced_pod("llm", pod("chat-2", bound, "10.1.0.3", ready=False))
        core.create_namespaced_pod("llm", pod("chat-3", bound, None))
        core.create_namespaced_pod("llm", pod("chat-4", {"app": "chat"}, "10.1.0.4"))  # no policy label
        core.create_namespaced_pod("llm", pod("api-0", {"app": "chat", "kvpool.dev/policy": "api"}, "10.1.0.9"))
        source = KubernetesMembership("llm", "chat", port=8000, sidecar_port=8100)
        assert source.members() == {"chat-0": Endpoint("http://10.1.0.1:8000", "http://10.1.0.1:8100"),
                                    "chat-1": Endpoint("http://10.1.0.2:8000", "http://10.1.0.2:8100")}
        service, app = serve(source)
        with app as url:
            pods = httpx.get(url + "/v1/pods").json()["pods"]
            assert [(p["pod"], p["sidecar_url"]) for p in pods] == [("chat-0", "http://10.1.0.1:8100"),
                                                                   ("chat-1", "http://10.1.0.2:8100")]
            core.delete_namespaced_pod("chat-0", "llm")
            wait_for(lambda: [p["pod"] for p in httpx.get(url + "/v1/pods").json()["pods"]] == ["chat-1"])
            assert httpx.post(url + "/v1/route", json={"tokens": list(range(40))}).json()["url"] == \
                "http://10.1.0.2:8000"


def test_a_router_without_static_members_needs_a_config_naming_its_policy(tmp_path):
    from kvpool_sidecar.service.server import RouterOptions, ServeError, build_router

    hand_written = tmp_path / "config.yaml"
    hand_written.write_text("pageSize: 16\n")
    for config in (None, str(hand_written)):
        with pytest.raises(ServeError, match="names no policy .*kvpool.dev/policy: NAME.*--pod"):
            build_router(RouterOptions(config=config, namespace="llm"))


def test_a_hot_prefix_warms_its_replica_from_the_owner():
    from kvpool_sidecar.client import SidecarClient
    from kvpool_sidecar.storage import KVStorage, ModelShape
    from support import CLUSTER_KEYS, live_sidecar

    sidecar_config = SidecarConfig.model_validate(
        {"pageSize": 4, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}}}
    )
    shape = ModelShape(1, 1, 4, "float32")
    prompt = list(range(50, 66))
    with live_sidecar(sidecar_config, pages=16, storage=KVStorage(shape, 4, pages=16),
                      transfer_keys=CLUSTER_KEYS) as (url_a, a), \
            live_sidecar(sidecar_config, pages=16, storage=KVStorage(shape, 4, pages=16),
                         transfer_keys=CLUSTER_KEYS) as (url_b, b):
        config = {"pageSize": 4, "routing": {"prefixPages": 1, "hotPrefixQPS": 0.01, "replicas": 1, "loadFactor": 10}}
        members = {"a": Endpoint("http://engine-a", url_a), "b": Endpoint("http://engine-b", url_b)}
        service = RouterService(SidecarConfig.model_validate(config), StaticMembership(members),
                                warm_replicas=True, warm_retry_seconds=0.05)
        with live_app(create_router_app(service)) as url, httpx.Client(base_url=url) as http:
            first = http.post("/v1/route", json={"tokens": prompt}).json()
            owner_url, owner = (url_a, a) if first["owner"] == "a" else (url_b, b)
            replica_url, replica = (url_b, b) if first["owner"] == "a" else (url_a, a)
            with SidecarClient(owner_url) as engine:  # the owner computes the prompt
                adm = engine.admit("s", prompt)
                owner.storage.kv[adm.page_ids] = torch.arange(4 * shape.bytes_per_page(4) // 4,
                                                              dtype=torch.float32).view(4, 1, 2, 4, 1, 4)
                engine.commit("s", 16)
                engine.release("s")
            reasons = []

            def copied() -> bool:
                reasons.append(http.post("/v1/route", json={"tokens": prompt}).json()["reason"])
                return 'kvpool_router_warmups_total{result="copied"} 1.0' in http.get("/metrics").text

            wait_for(copied)
            assert "replica" in reasons
            for _ in range(6):
                http.post("/v1/route", json={"tokens": prompt})
            time.sleep(0.2)
            assert 'kvpool_router_warmups_total{result="copied"} 1.0' in http.get("/metrics").text  # once only
        with SidecarClient(replica_url) as engine:
            assert engine.lookup(prompt) == 16  # the replica now serves the prefix without recomputing
            hit = engine.admit("r", prompt)
            assert torch.equal(replica.storage.gather_pages(hit.page_ids), owner.storage.gather_pages(adm.page_ids))


def test_a_router_token_guards_the_v1_api_but_not_probes():
    service = RouterService(SidecarConfig.model_validate(CONFIG), StaticMembership(PODS))
    with live_app(create_router_app(service, token="s3cret-token-0123456789")) as url:
        refused = httpx.post(url + "/v1/route", json={"tokens": list(range(40))})
        assert refused.status_code == 401 and refused.json()["field"] == "authorization"
        assert httpx.get(url + "/v1/pods").status_code == 401
        ok = httpx.post(url + "/v1/route", json={"tokens": list(range(40))},
                        headers={"authorization": "Bearer s3cret-token-0123456789"})
        assert ok.status_code == 200
        assert httpx.get(url + "/readyz").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    assert sum(service.router.decisions.values()) == 1  # the refused call routed nothing


def test_static_pods_that_stop_answering_leave_the_ring_and_come_back():
    """Issue 21: with 2 of 3 static pods dead, routes still named them and /readyz said ready."""
    from fastapi import FastAPI, Response
    from support import free_port

    state = {"healthy": True}
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:  # what live_app waits for
        return {"status": "ok"}

    @app.get("/health")
    async def health() -> Response:  # the engine's own health endpoint, as vLLM serves it
        return Response(status_code=200 if state["healthy"] else 503)

    def ready(http: httpx.Client, pods: int) -> bool:
        answer = http.get("/readyz")
        return (answer.json().get("pods") == pods) if answer.status_code == 200 else pods == 0

    with live_app(app) as alive:
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        members = {"a": Endpoint(alive, alive), "b": Endpoint(dead, dead), "c": Endpoint(dead + "/", dead)}
        service = RouterService(SidecarConfig(), StaticMembership(members), health_path="/health",
                                health_timeout=0.5)
        with live_app(create_router_app(service, membership_interval=0.2)) as url, httpx.Client(base_url=url) as http:
            assert http.get("/readyz").json() == {"status": "ready", "pods": 1, "listed": 3}
            for i in range(30):
                assert http.post("/v1/route", json={"tokens": list(range(i, i + 64))}).json()["pod"] == "a"
            state["healthy"] = False  # the last one fails too: off the ring within a poll
            wait_until(lambda: ready(http, 0))
            answer = http.get("/readyz")
            assert answer.status_code == 503 and "none of the 3 listed pods" in answer.json()["detail"]
            assert http.post("/v1/route", json={"tokens": list(range(64))}).status_code == 503
            state["healthy"] = True  # recovered: back on the ring
            wait_until(lambda: ready(http, 1))


def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the time limit"
        time.sleep(0.05)
