"""Run by test_copy_faults in a mount namespace of its own whose /dev/shm is a small tmpfs (the pod's
memory volume): a sidecar whose pool fills most of it is stopped (SIGTERM: a failed liveness probe, a
rollout), then killed -9, each time beside a live engine (the connector's two halves in this process,
still mapping the old pool), restarted, and must start; the engine then remaps and saves and loads
through it. Exits non-zero, with the reason, on any failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from kvpool_sidecar import wire
from kvpool_sidecar.engines.blocks import engine_layers
from kvpool_sidecar.engines.link import SidecarLink, fetch_welcome
from kvpool_sidecar.engines.scheduler import SchedulerSide, StepDone
from kvpool_sidecar.engines.worker import WorkerSide

PS = 4
KV_SHAPE = "4,8,64,float16"  # 32 KiB a page of 4 tokens
BLOCKS = 16


def start(port: int, pages: int, socket: str, config: Path, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", "--port", str(port), "--pages", str(pages),
         "--kv-shape", KV_SHAPE, "--config", str(config), "--engine-socket", socket,
         "--engine-quarantine-seconds", "1", "--log-level", "warning"],
        stdout=log.open("a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the sidecar exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    sys.exit("the sidecar did not start")


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def main() -> None:
    port, pages, folder = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    config = folder / "config.yaml"
    config.write_text(f"pageSize: {PS}\neviction: {{policy: lru}}\npinning: {{autoPin: {{enabled: false}}}}\n")
    socket, log = str(folder / "engine.sock"), folder / "sidecar.log"
    sidecar = start(port, pages, socket, config, log)
    one_pool = shm_used()

    g = torch.Generator().manual_seed(0)
    kv = {f"layer.{i}": torch.randn((BLOCKS, 8, PS, 128), generator=g).to(torch.float16) for i in range(4)}
    worker_hello = wire.Hello(wire.PROTOCOL, "worker", "engine", "m")
    worker = WorkerSide(lambda: fetch_welcome(socket, worker_hello, 2), engine_layers(kv, BLOCKS), PS)
    worker.attach(strict=True)
    side = SchedulerSide(SidecarLink(socket, wire.Hello(wire.PROTOCOL, "scheduler", "engine", "m")), PS,
                         session="engine", lookup_wait=1.0)

    def step(req: str, hashes: list[bytes], blocks: list[int]) -> tuple[int, set[int]]:
        """One request of len(hashes) full blocks and a last token: lookup, its loads or saves, finish.
        Returns the tokens the pool served and the blocks whose load failed."""
        prompt_len = len(hashes) * PS + 1
        deadline = time.monotonic() + 5
        while (hit := side.matched_tokens(req, hashes, prompt_len, 0, None)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        side.allocated(req, blocks, hit)
        plan = side.plan([(req, blocks, True, hit, prompt_len - hit)])
        worker.start_loads(plan.loads)
        failed = worker.finish_loads()
        worker.save(plan)
        deadline = time.monotonic() + 10
        report = StepDone()
        while plan.step not in report.steps:
            assert time.monotonic() < deadline, "the worker never reported its step"
            report.merge(worker.take_done() or StepDone())
            time.sleep(0.01)
        side.worker_done(report)
        if side.finished(req):
            side.sent({req})
        return hit, failed

    def round_trip(tag: str) -> bool:
        """Save a prompt from blocks 1-3, then load it into 5-7: True once both went through the pool."""
        hashes = [f"{tag}{i}".encode() for i in range(3)]
        for b in (5, 6, 7):
            for t in kv.values():
                t[b] = 0
        step(f"{tag}-save", hashes, [1, 2, 3, 4])
        time.sleep(0.05)  # the commit reaches the sidecar before the next lookup
        hit, failed = step(f"{tag}-load", hashes, [5, 6, 7, 8])
        if hit != 3 * PS or failed:
            return False
        for t in kv.values():
            assert torch.equal(t[5:8], t[1:4]), "loaded bytes differ from the saved ones"
        return True

    assert round_trip("before"), "the first sidecar served no round trip"
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    assert one_pool > free, f"the pool ({one_pool} bytes) should fill most of the volume ({free} free)"

    for how in (signal.SIGTERM, signal.SIGKILL):  # a graceful exit runs its clean-up, a SIGKILL none; the
        os.kill(sidecar.pid, how)  # engine keeps its mapping of the old pool either way
        sidecar.wait()
        sidecar = start(port, pages, socket, config, log)  # a pool of the same size must start
        assert shm_used() < one_pool * 1.5, f"after {how.name}: two pools' worth of the volume in use: {shm_used()}"
        deadline = time.monotonic() + 60  # the link's backoff (at most 10 s) and the worker's remap
        while not round_trip(f"after{int(time.monotonic() * 1000)}"):
            assert time.monotonic() < deadline, f"after {how.name}: the engine never saved and loaded through the " \
                "restarted sidecar"
            time.sleep(0.2)
    side.link.close()
    worker.close()
    sidecar.send_signal(signal.SIGTERM)
    sidecar.wait(10)
    print("restarted and served")


if __name__ == "__main__":
    main()
