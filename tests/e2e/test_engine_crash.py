"""An engine's life beside a live sidecar, under concurrent clients: the sidecar killed -9 and restarted
mid-load fails no request and changes no token; vLLM's OpenAI server killed -9 with requests in flight
(three times, the last with its saves' copies held back, so that it dies mid-copy) leaks nothing and
publishes no page it had not written; with every save held back a second, a flood beyond the tier gets
the tokens vLLM computes alone; a server restarted on other weights (same shape, same folder) never
loads the old model's KV.

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
from support import free_port
from tiny_model import build_tiny_model

DEV = Path(__file__).resolve().parents[2] / "dev"


class Server:
    def __init__(self, model: Path, sidecar: SidecarProcess, folder: Path, slow_saves: bool = False,
                 slow_loads: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        import json

        connector = connector_config(sidecar.socket)
        env = dict(os.environ)
        if slow_saves or slow_loads:  # copies held back before their first byte (dev/slow_copies.py): every
            # save's 1 s, or every layer of a step's loads 0.3 s
            connector.update(kv_connector="SlowCopiesConnector", kv_connector_module_path="slow_copies")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DEV), env.get("PYTHONPATH")]))
            env["KVPOOL_SLOW_SAVE_S"] = "1.0" if slow_saves else "0"
            env["KVPOOL_SLOW_LOAD_S"] = "0.3" if slow_loads else "0"
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
             "--kv-transfer-config", json.dumps(connector)],
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

    def complete(self, tokens: list[int], max_tokens: int = 8, salt: str | None = None) -> list[int] | None:
        body = {"model": self.model_name(), "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        if salt is not None:
            body["cache_salt"] = salt  # vLLM's own isolation: no cache of any tier matches
        try:
            r = httpx.post(self.url + "/v1/completions", timeout=60, json=body)
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


def load(server: Server, prompts: list[list[int]], clients: int = 8, salted: bool = False,
         during: threading.Event | None = None) -> list[list[int] | None]:
    """Every prompt completed by ``clients`` concurrent clients; outputs in prompt order (None: failed).
    ``during`` is set once a third of them are done."""
    out: list[list[int] | None] = [None] * len(prompts)
    lock = threading.Lock()
    todo = iter(range(len(prompts)))
    done = [0]

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            out[i] = server.complete(prompts[i], salt=f"baseline-{i}" if salted else None)
            with lock:
                done[0] += 1
                if during is not None and done[0] >= len(prompts) // 3:
                    during.set()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def crash_under_load(server: Server, sidecar: SidecarProcess, seed: int) -> list[list[int]]:
    """Clients keep 8 requests in flight; the server is killed -9 while the pool holds sequences of theirs
    (admissions whose loads or saves are in flight). Prompts from ``seed`` on: a kill reusing an earlier
    kill's prompts would find them saved and hold only brief load-only sequences. Returns each client's
    last prompt."""
    stop = threading.Event()
    last: list[list[int]] = [[] for _ in range(8)]

    def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            last[i] = shared_prompts(1, seed + 31 * i + k)[0]
            server.complete(last[i], max_tokens=48)
            k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sidecar.get("/v1/stats")["sequences"] < 1:
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
    return [p for p in last if p]


def test_the_engine_survives_its_sidecar_and_its_own_crashes_and_never_loads_another_models_kv(tmp_path):
    sidecar = SidecarProcess(tmp_path, pages=600, config={"pageSize": BLOCK, "eviction": {"policy": "lru"}})
    sidecar.start()
    model = build_tiny_model(tmp_path / "model", seed=0)
    prompts = [p for seed in range(4) for p in shared_prompts(6, 100 * seed)]
    try:
        server = Server(model, sidecar, tmp_path)
        try:
            baseline = load(server, prompts, salted=True)  # vLLM alone: no cache matches a salted prompt
            assert all(baseline)
            third = threading.Event()
            result: list = []
            runner = threading.Thread(target=lambda: result.append(load(server, prompts, during=third)))
            runner.start()
            assert third.wait(120)
            sidecar.kill()  # mid-load, no clean-up
            time.sleep(0.5)
            sidecar.start()
            runner.join(300)
            assert result[0] == baseline  # no request failed, no token changed
            loaded = sidecar.metric(LOADED)
            deadline = time.monotonic() + 60  # the link comes back after its backoff (at most 10 s)
            while not eventually(lambda: sidecar.metric(LOADED) > loaded, 1.5):  # kvpool used again
                assert time.monotonic() < deadline, "the engine never used the restarted sidecar"
                assert load(server, prompts) == baseline
        finally:
            crash_under_load(server, sidecar, 1000)  # kill 1 (its admissions are held only while their transfers
            # run, so whether it dies holding one is a race here: kill 3 below makes sure it does)
        # The same folder, new weights of the same shape (a model updated in place), the sidecar live.
        build_tiny_model(tmp_path / "model-new", seed=1)
        for f in (tmp_path / "model-new").glob("*.safetensors"):
            os.replace(f, model / f.name)
        probe = prompts[:2]
        server = Server(model, sidecar, tmp_path)
        try:
            before = sidecar.metric(LOADED)
            first = server.complete(probe[1])
            time.sleep(2.5)  # the connector reports at least once a second
            assert sidecar.metric(LOADED) == before  # nothing of the old model's KV was loaded
            assert first != baseline[1]  # other weights, other tokens
            server.complete(probe[0])  # its own KV now: the new model hits its own pages
            assert server.complete(probe[1]) == first
            assert eventually(lambda: sidecar.metric(LOADED) > before)
        finally:
            crash_under_load(server, sidecar, 3000)  # kill 2
        # Every save's copy held back a second, and a flood beyond the tier (48 prompts of 14 blocks: 672
        # pages through 600, each request's 15 blocks in vLLM's 80): the save lane skips what it cannot
        # write in time (save_skipped), requests are preempted with saves queued, pages are evicted and
        # reused; every answer is the one vLLM computes alone.
        server = Server(model, sidecar, tmp_path, slow_saves=True)
        flood = [prompt(7000 + i, 14 * BLOCK + 5) for i in range(48)]
        alone = load(server, flood, salted=True)
        assert all(alone)
        skipped = 'kvpool_connector_failures_total{operation="save_skipped"}'
        before = sidecar.metric(skipped)
        for _ in range(2):
            assert load(server, flood) == alone
        assert sidecar.metric(skipped) > before  # the back-pressure ran
        # Kill 3 on that server: the engine dies with saves queued and their sequences held. Nothing of
        # them is published: had a page been committed before its bytes were written, the next engine
        # would load zeros there and answer other tokens.
        lapsed = sidecar.metric("kvpool_engine_lapsed_sequences_total")
        in_flight = crash_under_load(server, sidecar, 5000)  # kill 3
        assert sidecar.metric("kvpool_engine_lapsed_sequences_total") > lapsed  # it died mid-transfer
        # The next server's loads are held back 0.3 s a layer: each attention layer must wait for its own
        # rows (a forward that read its blocks before they were loaded would answer other tokens).
        server = Server(model, sidecar, tmp_path, slow_loads=True)
        try:
            alone = [server.complete(p, salt="alone") for p in in_flight]
            assert all(alone) and [server.complete(p) for p in in_flight] == alone
            loaded = sidecar.metric(LOADED)
            assert [server.complete(p) for p in in_flight] == alone  # saved by the line above: loaded now
            assert eventually(lambda: sidecar.metric(LOADED) >= loaded + len(in_flight) * 10 * BLOCK)
        finally:
            server.stop()
    finally:
        sidecar.stop()
