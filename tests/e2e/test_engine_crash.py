"""An engine's life beside a live sidecar: vLLM's OpenAI server killed -9 with requests in flight leaks
nothing, and a server restarted on other weights (same shape, same folder) never loads the old model's KV.

Real processes: ``kvpool-sidecar serve`` and ``python -m vllm.entrypoints.openai.api_server`` with the
connector, clients over HTTP. Each server start costs about 25 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

if os.environ.get("KVPOOL_REQUIRE_ENGINE"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the engine tests need the vllm extra (make test installs it)")

from engine_support import BLOCK, SidecarProcess, connector_config, engine_env, prompt
from kvpool_sidecar.engines.tiny_model import build_tiny_model
from support import free_port


class Server:
    def __init__(self, model: Path, sidecar: SidecarProcess, folder: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        import json

        env = dict(os.environ)
        for k, v in engine_env().items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.log = open(folder / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
             "--block-size", str(BLOCK), "--max-model-len", "2048", "--enforce-eager", "--no-enable-prefix-caching",
             "--num-gpu-blocks-override", "80", "--gpu-memory-utilization", "0.3", "--port", str(self.port),
             "--host", "127.0.0.1", "--seed", "0",
             "--kv-transfer-config", json.dumps(connector_config(sidecar.socket))],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (folder / f"server-{self.port}.log").read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start")

    def complete(self, tokens: list[int], max_tokens: int = 8) -> list[int] | None:
        try:
            r = httpx.post(self.url + "/v1/completions", timeout=60, json={
                "model": self.model_name(), "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
        except httpx.HTTPError:
            return None
        return r.json()["choices"][0].get("token_ids") if r.status_code == 200 else None

    def model_name(self) -> str:
        if not hasattr(self, "_name"):
            self._name = httpx.get(self.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        return self._name

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


LOADED = 'kvpool_connector_tokens_total{direction="loaded"}'


def eventually(check, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def shared_prompts(n: int, seed: int) -> list[list[int]]:
    head = prompt(seed, 10 * BLOCK)
    return [head + prompt(seed + 1 + i, 3 * BLOCK + 7) for i in range(n)]


def crash_under_load(server: Server, sidecar: SidecarProcess) -> None:
    """Clients keep 8 requests in flight; the server is killed -9 while the pool holds their sequences."""
    stop = threading.Event()

    def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            server.complete(shared_prompts(1, 1000 + 31 * i + k)[0], max_tokens=48)
            k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sidecar.get("/v1/stats")["sequences"] < 3:
        assert time.monotonic() < deadline, "the engine never held sequences in the pool"
        time.sleep(0.02)
    server.kill()
    stop.set()
    lapsed_before = sidecar.metric("kvpool_engine_lapsed_sequences_total")
    deadline = time.monotonic() + 10
    while (stats := sidecar.get("/v1/stats"))["sequences"] or stats["in_use_pages"]:
        assert time.monotonic() < deadline, f"the dead engine's sequences leaked: {stats}"
        time.sleep(0.1)
    assert sidecar.metric("kvpool_engine_lapsed_sequences_total") >= lapsed_before
    for t in threads:
        t.join(70)


def test_killed_engines_leak_nothing_and_other_weights_never_load_the_old_models_kv(tmp_path):
    sidecar = SidecarProcess(tmp_path, pages=600, config={"pageSize": BLOCK, "eviction": {"policy": "lru"}})
    sidecar.start()
    model = build_tiny_model(tmp_path / "model", seed=0)
    try:
        server = Server(model, sidecar, tmp_path)
        probe = shared_prompts(2, 7)
        try:
            server.complete(probe[0])
            assert server.complete(probe[1]) is not None
            assert eventually(lambda: sidecar.metric(LOADED) >= 10 * BLOCK)  # the old model really uses the pool
        finally:
            crash_under_load(server, sidecar)
        assert sidecar.metric("kvpool_engine_lapsed_sequences_total") > 0
        # The same folder, new weights of the same shape (a model updated in place), the sidecar live.
        build_tiny_model(tmp_path / "model-new", seed=1)
        for f in (tmp_path / "model-new").glob("*.safetensors"):
            os.replace(f, model / f.name)
        server = Server(model, sidecar, tmp_path)
        try:
            before = sidecar.metric(LOADED)
            first = server.complete(probe[1])
            time.sleep(2.5)  # the connector reports at least once a second
            assert sidecar.metric(LOADED) == before  # nothing of the old model's KV was loaded
            server.complete(probe[0])  # its own KV now: the new model hits its own pages
            assert server.complete(probe[1]) == first
            assert eventually(lambda: sidecar.metric(LOADED) > before)
        finally:
            crash_under_load(server, sidecar)
    finally:
        sidecar.stop()
