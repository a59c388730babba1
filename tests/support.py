"""Test helpers: a live sidecar (uvicorn on 127.0.0.1, a free port) in a background thread."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from kvpool_sidecar.config import SidecarConfig, load_config
from kvpool_sidecar.engines.scheduler import SchedulerSide
from kvpool_sidecar.peers.keys import TransferKeys
from kvpool_sidecar.peers.node import Peers
from kvpool_sidecar.service.app import create_app
from kvpool_sidecar.service.state import Sidecar
from kvpool_sidecar.storage import KVStorage

# The production traces the repository ships (traces/README.md: source and licence).
TRACES = Path(__file__).resolve().parents[1] / "traces"
CLUSTER_KEYS = TransferKeys.parse("k1 " + "s" * 40)  # the tests' cluster key (peers prove it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_sidecar(
    config: SidecarConfig | None = None, *, pages: int = 256, config_path: Path | None = None,
    token: Any = None, poll_interval: float = 0.1, pre_evict_interval: float = 0.0,
    storage: KVStorage | None = None, transfer_keys: TransferKeys | None = None, engine_socket: str | None = None,
    engine_quarantine: float = 0.0, peers: frozenset[tuple[str, int]] | None = None, **limits: int,
) -> Iterator[tuple[str, Sidecar]]:
    """``peers``: the members this sidecar fetches from (``--peers``; it needs ``storage`` and ``transfer_keys``)."""
    if config is None:
        config = load_config(config_path) if config_path else SidecarConfig.model_validate(
            {"pageSize": 4, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}}}
        )
    sidecar = Sidecar(config, pages, config_path=config_path, storage=storage, transfer_keys=transfer_keys,
                      **limits)
    sidecar.mark_config_file_read(
        hashlib.sha256(config_path.read_bytes()).hexdigest() if config_path and config_path.exists() else None)
    app = create_app(sidecar, token=token, poll_interval=poll_interval, pre_evict_interval=pre_evict_interval,
                     engine_socket=engine_socket, engine_quarantine=engine_quarantine,
                     peers=None if peers is None else Peers(sidecar, transfer_keys, members=peers))
    with live_app(app) as url:
        yield url, sidecar


def socket_path() -> str:
    """A fresh Unix socket path short enough for the kernel's 107-byte limit."""
    return f"{tempfile.mkdtemp(prefix='kvp-', dir='/tmp')}/engine.sock"


@contextmanager
def live_app(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (a free port) from a thread; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=0.5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        raise RuntimeError("the app did not start")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def kubelet_projection(root: Path, data: dict, version: int) -> None:
    """Write a config the way kubelet projects a ConfigMap: a new timestamped dir, then an atomic swap
    of the ``..data`` symlink; ``config.yaml`` is a symlink through ``..data``."""
    import os

    import yaml

    target = root / f"..2026_11_29_{version}"
    target.mkdir()
    (target / "config.yaml").write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    tmp = root / "..data_tmp"
    tmp.symlink_to(target.name)
    os.replace(tmp, root / "..data")
    link = root / "config.yaml"
    if not link.is_symlink():
        link.symlink_to("..data/config.yaml")


def run_in_small_shm(driver: Path, *args: object, timeout: float = 240,
                     size: str = "64m") -> subprocess.CompletedProcess:
    """Run ``driver`` in a mount namespace of its own whose /dev/shm is a tmpfs of ``size`` (a pod's memory
    volume), with the tests' own modules importable; skips where unshare(1) or the mount is not allowed."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux) to give the test a /dev/shm of its own")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")
    script = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} {driver} "
              + " ".join(str(a) for a in args))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                          text=True, timeout=timeout, env=env)


class LongSteps(SchedulerSide):
    """The connector's scheduler side with steps as long as its lookup budget. A real engine's step
    lasts milliseconds or more, a test's plans follow each other within microseconds, and a step waits
    for its grows (the pages its saves take) a share of its duration at most: here each plan waits up to
    ``lookup_wait`` for them, so that a step's saves are planned in that step whatever the machine's load."""

    def step_budget(self) -> float:
        return self.lookup_wait
