"""A real ``kvpool-sidecar serve`` process and a real vLLM engine (tiny random model) wired by the connector."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
from kvpool_sidecar.service.server import instance_name
from kvpool_sidecar.storage.segment import release_instance
from support import CLUSTER_KEYS, free_port, socket_path
from tiny_model import KV_SHAPE, VOCAB

BLOCK = 32  # vLLM's CPU attention wants a multiple of 32
CONNECTOR = "kvpool_sidecar.engines.vllm"
SIDECAR_BIN = str(Path(sys.executable).with_name("kvpool-sidecar"))


class SidecarProcess:
    """``kvpool-sidecar serve`` on 127.0.0.1 with an embedded shared CPU pool; restartable on its port."""

    def __init__(self, folder: Path, pages: int = 256, config: dict[str, Any] | None = None,
                 kv_shape: str = KV_SHAPE, peers: tuple[str, ...] | None = None) -> None:
        """``peers``: serve the pool to peers on a port of its own (:attr:`peer_port`) and fetch from these
        members (``--peers``), proving the tests' cluster key; None: no peer side."""
        self.folder = folder
        self.peers = peers
        self.peer_port = free_port() if peers is not None else None
        self.kv_shape = kv_shape
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.socket = socket_path()
        self.pages = pages
        self.config_path = folder / "config.yaml"
        self.write_config(config or {"pageSize": BLOCK, "eviction": {"policy": "lru"}})
        self.proc: subprocess.Popen | None = None

    def write_config(self, config: dict[str, Any]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        os.replace(tmp, self.config_path)  # atomic, as kubelet's projection is

    def peer_args(self) -> list[str]:
        if self.peers is None:
            return []
        keyfile = self.folder / "cluster-key"
        keyfile.write_text("".join(f"{kid} {secret.decode()}\n" for kid, secret in CLUSTER_KEYS.keys))
        members = ["--peers", ",".join(self.peers)] if self.peers else []
        return ["--peer-port", str(self.peer_port), "--peer-host", "127.0.0.1", "--transfer-key-file", str(keyfile),
                *members]

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it to serve (:meth:`wait_ready`): two start side by side."""
        self.proc = subprocess.Popen(
            [SIDECAR_BIN, "serve", "--port", str(self.port), "--pages", str(self.pages), "--kv-shape", self.kv_shape,
             "--config", str(self.config_path), "--log-level", "warning", "--engine-socket", self.socket,
             # A lapsed session's pages come back after 2 s here (30 s by default), within the tests' waits.
             "--engine-quarantine-seconds", "2", *self.peer_args()],
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the sidecar did not start")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> str:
        """SIGKILL: no clean-up runs, its shared-memory segment stays (the restart takes it over); returns its name."""
        assert self.proc is not None
        name = httpx.get(self.url + "/v1/storage/handle").json()["name"]
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        return name

    def terminate(self) -> None:
        """SIGTERM: a graceful exit, which leaves the segment too (the restart takes it over)."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        """Done with this sidecar: stopped, and the segment an exit may leave removed."""
        self.terminate()
        release_instance(instance_name(self.port))

    def get(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=5).json()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


def engine_env() -> dict[str, str | None]:
    """What the engine's processes must (not) inherit: the tests' Triton interpreter stays in pytest."""
    return {"TRITON_INTERPRET": None, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@contextmanager
def environment(changes: dict[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in changes}
    for k, v in changes.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def connector_config(sidecar_socket: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": CONNECTOR, "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # A lookup may take 100 ms here, not the default 2 ms: on a busy 2-core machine a round trip
        # past 2 ms serves the request without the pool (by design), which these tests would read as a
        # missed load. The budget itself is tested in tests/sidecar/test_engine_connector.py.
        "kv_connector_extra_config": {"socket": sidecar_socket, "timeout_s": 1.0, "lookup_wait_ms": 100.0, **extra},
    }


def make_engine(model_dir: Path, sidecar_socket: str | None, *, gpu_blocks: int = 80,
                kv_events_endpoint: str | None = None, tensor_parallel: int = 1, **extra: Any) -> Any:
    """A vLLM engine with the kvpool connector, or without when ``sidecar_socket`` is None, and with its
    own prefix cache on, as the manifests ship it (:func:`generate` empties it before each request, so
    that what the engine does not compute comes from kvpool); ``kv_events_endpoint``: vLLM's ZMQ KV event
    publisher on (connecting there) and the engine's own cache off (the stream then holds kvpool's
    pages alone)."""
    from vllm import LLM
    from vllm.config import KVEventsConfig

    kwargs: dict[str, Any] = dict(
        model=str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=2048, seed=0, enforce_eager=True,
        num_gpu_blocks_override=gpu_blocks, enable_prefix_caching=kv_events_endpoint is None,
        gpu_memory_utilization=0.3,
    )
    env = engine_env()
    if tensor_parallel > 1:  # one core per rank, bound by hand (vLLM-CPU finds no NUMA node to bind)
        kwargs.update(tensor_parallel_size=tensor_parallel, distributed_executor_backend="mp")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tensor_parallel))
    if sidecar_socket is not None:
        kwargs["kv_transfer_config"] = connector_config(sidecar_socket, **extra)
    if kv_events_endpoint is not None:
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=kv_events_endpoint, topic="kv")
    with environment(env):
        return LLM(**kwargs)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def reset_engine_cache(llm: Any) -> None:
    """Empty vLLM's own prefix cache. vLLM refuses while blocks are in use: a finished request's stay the
    engine's until its saves' copies are done (a step or two after it returned its output)."""
    deadline = time.monotonic() + 10
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "vLLM's own prefix cache could not be reset"
        time.sleep(0.01)


def generate(llm: Any, tokens: list[int], *, params: dict[str, Any] | None = None, max_tokens: int = 12,
             fresh: bool = False) -> tuple[list[int], int]:
    """Greedy tokens and how many prompt tokens the engine did not compute. ``fresh``: the engine ignores
    every cache (vLLM's skip_reading_prefix_cache): what it computes alone, the baseline. Otherwise the
    engine's own prefix cache is emptied first (kvpool's tier is not): its hit is kvpool's."""
    from vllm import SamplingParams

    if not fresh and llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        reset_engine_cache(llm)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, skip_reading_prefix_cache=fresh or None,
                        extra_args={"kv_transfer_params": params} if params else None)
    out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)
