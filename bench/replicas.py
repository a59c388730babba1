"""Replicas sharing one cache (issue 66): peer fetch throughput between two sidecars on this machine.

    .venv/bin/python bench/replicas.py                  # 64 MiB fetches of Qwen2.5-7B-shaped pages, 10 rounds
    .venv/bin/python bench/replicas.py --mib 16 --rounds 5
    .venv/bin/python bench/replicas.py --huge-shm         # /dev/shm as a tmpfs in huge pages (needs unshare -m)

A real ``kvpool-sidecar serve --peer-port`` (the source) holds one prompt of ``--mib`` MiB of the pool's own
pages per round, saved through its engine channel as an engine saves them (random KV) just before the round.
This process is the reader: a sidecar with its own shared pool and NIXL agent whose peer client fetches each
round's prompt from the source (the whole path: the control round trip, the source's hold, the admission here, the NIXL
READ of the held pages into fresh pages, the commit, the done) and checks the bytes against the source's.
Beside each fetch, in the same run, plain copies of the same number of bytes: one core's ``memcpy``
(``np.copyto``; a NIXL read is one kernel copy on one core) between two halves of a second shared segment laid
out as a pool (shared memory, in 4 KiB pages unless the machine lets tmpfs use huge pages, as both pools are)
and between two buffers of process memory (which the kernel backs with huge pages), and torch's ``copy_`` of
the shared segment (every core). The first ``--warmup`` rounds touch the pages for the first time and are not
counted; the figures are medians. ``--huge-shm`` runs the same in a mount namespace of its own whose
``/dev/shm`` is a tmpfs mounted ``huge=always`` (both pools in 2 MiB pages: the kernel's single copy pins a
page at a time, and 4 KiB pages cost it roughly 40 % of its speed on this machine).

Two vLLM replicas with their own sidecars (tokens computed, TTFT with and without the hint) are not built
here yet: they need the engine's lookup path to fetch (issue 66's next part).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sidecar"))

from kvpool_sidecar import wire  # noqa: E402
from kvpool_sidecar.config import SidecarConfig  # noqa: E402
from kvpool_sidecar.engines.link import Connection  # noqa: E402
from kvpool_sidecar.keys import WorkloadMeta  # noqa: E402
from kvpool_sidecar.peers.host import pool_keys  # noqa: E402
from kvpool_sidecar.peers.keys import TransferKeys  # noqa: E402
from kvpool_sidecar.peers.node import Peers  # noqa: E402
from kvpool_sidecar.service.state import Sidecar  # noqa: E402
from kvpool_sidecar.storage import KVStorage, ModelShape  # noqa: E402

MODEL = "bench@replicas"
FETCH = "peer fetch (NIXL READ, the whole fetch path)"
SHM = "plain copy, one core, the pool's shared memory"
ANON = "plain copy, one core, process memory"
TORCH = "plain copy, torch copy_ (every core), shared memory"
KEYS = TransferKeys.parse("bench " + "k" * 40)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_source(folder: Path, shape: ModelShape, page_size: int, pages: int) -> tuple[subprocess.Popen, int, int,
                                                                                         str]:
    (folder / "config.yaml").write_text(f"pageSize: {page_size}\neviction: {{policy: lru}}\n"
                                        "pinning: {autoPin: {enabled: false}}\n")
    (folder / "keys").write_text(f"bench {'k' * 40}\n")
    port, peer_port, sock = free_port(), free_port(), str(folder / "engine.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool_sidecar.cli", "serve", "--port", str(port), "--pages", str(pages), "--kv-shape",
         f"{shape.layers},{shape.kv_heads},{shape.head_dim},{shape.dtype}", "--config", str(folder / "config.yaml"),
         "--engine-socket", sock, "--transfer-key-file", str(folder / "keys"), "--peer-port", str(peer_port),
         "--peer-host", "127.0.0.1", "--log-level", "warning"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "sidecar")}, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200:
                return proc, port, peer_port, sock
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the source sidecar did not start")
        time.sleep(0.1)


def fill(sock: str, blocks: list[bytes], page_size: int) -> torch.Tensor:
    """Save and commit the blocks on the source as an engine would; returns their KV."""
    conn = Connection(sock, wire.Hello(wire.PROTOCOL, "scheduler", f"fill-{blocks[0].hex()}", MODEL), 10.0)
    attached = KVStorage.attach(conn.welcome.storage)
    try:
        n = len(blocks) * page_size
        admitted = conn.step(wire.Step(admits=[wire.Admit("fill", blocks, n)])).admits[0]
        assert isinstance(admitted, wire.Admitted), admitted
        kv = torch.randn((len(blocks), *attached.kv.shape[1:]), dtype=torch.float32).to(attached.kv.dtype)
        with attached.writing(admitted.fence):
            attached.kv[admitted.page_ids] = kv
        conn.step(wire.Step(commits=[wire.Commit("fill", n)], releases=["fill"]))
        return kv
    finally:
        attached.close()
        conn.close()


def in_huge_shm(argv: list[str]) -> int:
    """This benchmark again, in a mount namespace whose /dev/shm is a tmpfs in huge pages."""
    script = (f"mount -t tmpfs -o size=2g,huge=always tmpfs /dev/shm && grep -q huge=always /proc/self/mounts && "
              f"exec {sys.executable} {Path(__file__).resolve()} {' '.join(argv)}")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], check=False)
    if done.returncode:
        print("could not run in a mount namespace with a huge-page /dev/shm (unshare -m and mount need root)",
              file=sys.stderr)
    return done.returncode


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="MiB of pages per fetch")
    parser.add_argument("--shape", default="28,4,128,bfloat16", help="layers,kv_heads,head_dim,dtype of a page")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--huge-shm", action="store_true", help="/dev/shm as a tmpfs mounted huge=always")
    args = parser.parse_args()
    if args.huge_shm:
        return in_huge_shm([a for a in sys.argv[1:] if a != "--huge-shm"])
    layers, heads, dim, dtype = args.shape.split(",")
    shape = ModelShape(int(layers), int(heads), int(dim), dtype)
    page_bytes = shape.bytes_per_page(args.page_size)
    per_fetch = max(1, (args.mib << 20) // page_bytes)
    nbytes = per_fetch * page_bytes
    rounds = args.warmup + args.rounds
    print(f"{per_fetch} pages of {page_bytes} bytes ({args.page_size} tokens of {args.shape}) a fetch: "
          f"{nbytes / 2**20:.1f} MiB; {args.rounds} rounds after {args.warmup} of warm-up; medians")
    with tempfile.TemporaryDirectory(prefix="kvp-bench-") as tmp:
        # Room for two rounds' prompts: each round's is saved just before its fetch, the last but one evicted.
        proc, _, peer_port, sock = start_source(Path(tmp), shape, args.page_size, 2 * per_fetch + 8)
        try:
            return measure(shape, args.page_size, per_fetch, nbytes, rounds, sock, peer_port, args.warmup)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def measure(shape: ModelShape, page_size: int, per_fetch: int, nbytes: int, rounds: int, sock: str, peer_port: int,
            warmup: int) -> int:
    pages = per_fetch + 8  # a fetch's pages and some slack: each round's fetch evicts the last round's
    storage = KVStorage(shape, page_size, pages=pages, shared=True)
    plain = KVStorage(shape, page_size, pages=2 * per_fetch, shared=True)  # the plain copy's two regions
    plain.kv.fill_(1)
    config = SidecarConfig.model_validate({"pageSize": page_size, "eviction": {"policy": "lru"},
                                           "workloads": {"toB": {"isolationPercent": 0}},
                                           "pinning": {"autoPin": {"enabled": False}}})
    sidecar = Sidecar(config, pages, storage=storage, transfer_keys=KEYS)
    peer = ("127.0.0.1", peer_port)
    peers = Peers(sidecar, KEYS, members=frozenset({peer}))
    peers.agent.populate()  # as `serve` does at start
    runs: list[int] = []
    read = peers.agent.read

    def counted(descs: list, name: str) -> object:
        runs.append(len(descs))
        return read(descs, name)

    peers.agent.read = counted  # type: ignore[method-assign]
    anon_src, anon_dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    shm_bytes = plain.kv.view(-1).view(torch.uint8).numpy()
    shm_src, shm_dst = shm_bytes[:nbytes], shm_bytes[nbytes:]
    figures: dict[str, list[float]] = {FETCH: [], SHM: [], ANON: [], TORCH: []}
    loop = asyncio.new_event_loop()
    try:
        for r in range(rounds):
            blocks = [f"r{r}b{i}".encode() for i in range(per_fetch)]
            source_kv = fill(sock, blocks, page_size)
            start = time.perf_counter()
            result = loop.run_until_complete(peers.client.fetch(peer, MODEL, blocks, WorkloadMeta(), 30.0))
            fetch = time.perf_counter() - start
            if result.result != "hit" or result.pages != per_fetch:
                raise RuntimeError(f"round {r}: the fetch answered {result}")
            _, got = sidecar.pool.cached_prefix(block_hashes=pool_keys(MODEL, blocks))
            if not torch.equal(storage.kv[got], source_kv):
                raise RuntimeError(f"round {r}: the fetched bytes differ from the source's")
            timed = {FETCH: fetch}
            for name, copy in ((SHM, lambda: np.copyto(shm_dst, shm_src)),
                               (ANON, lambda: np.copyto(anon_dst, anon_src)),
                               (TORCH, lambda: plain.kv[per_fetch:].copy_(plain.kv[:per_fetch]))):
                start = time.perf_counter()
                copy()
                timed[name] = time.perf_counter() - start
            if r >= warmup:
                for name, seconds in timed.items():
                    figures[name].append(gbps(nbytes, seconds))
    finally:
        loop.run_until_complete(peers.client.close())
        loop.close()
        peers.agent.close()
        sidecar.close()
        storage.close()
        plain.close()
    fetch_median = statistics.median(figures[FETCH])
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"{name:<52} {median:6.2f} GB/s (min {min(values):.2f}, max {max(values):.2f})")
    for name in list(figures)[1:]:
        print(f"peer fetch / {name}: {fetch_median / statistics.median(figures[name]):.2f}x")
    print(f"descriptors per fetch (runs of pages contiguous on both sides): {sorted(set(runs))}; "
          "bytes equal to the source's in every round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
