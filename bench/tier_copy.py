"""The tier's copies beside a plain copy of the same bytes (issue 65), through vLLM's own tiering manager.

    .venv/bin/python bench/tier_copy.py                  # 256 chunks of Qwen2.5-7B's KV (16 tokens each) a job
    .venv/bin/python bench/tier_copy.py --chunks 64 --rounds 3

Two engines' ``TieringOffloadingSpec`` managers (vLLM's classes, each with its real shared CPU primary
region) with ``KVPoolTier`` in front of one real ``kvpool-sidecar serve``. Each round, the writer stores
``--chunks`` new chunks (its cascade: the admission, the copy into the pool in slices under the session's
lock, the commit) and the reader promotes them (the hold answered first, then the copy into its primary
chunks and the fence check). A job's time runs from vLLM's submit to vLLM's manager taking the tier's
report in, the scheduler stepping all along. Beside them, in each round, one torch ``copy_`` of the same
bytes between two buffers of this process (anonymous memory, which the kernel backs with huge pages),
and one between the two engines' primary regions (files in ``/dev/shm``, as the pool is: the tier's
ceiling). The first rounds touch the pool's pages for the first time
and are not counted (``--warmup``); the figures are the medians of the others. The promoted bytes are
checked against what the writer stored.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
FIGURES = ("plain copy_, process memory", "plain copy_, shared memory (one primary region to the other)",
           "tier store (cascade)", "tier load (promotion)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=256, help="chunks a job moves")
    ap.add_argument("--chunk-tokens", type=int, default=16, help="tokens per offloaded chunk (a pool page)")
    ap.add_argument("--kv-shape", default="28,4,128,bfloat16", help="layers,kv_heads,head_dim,dtype")
    ap.add_argument("--rounds", type=int, default=9, help="rounds counted")
    ap.add_argument("--warmup", type=int, default=2, help="rounds first, not counted")
    args = ap.parse_args()
    layers, heads, dim, dtype = args.kv_shape.split(",")
    chunk = 2 * int(layers) * int(heads) * int(dim) * DTYPE_BYTES[dtype] * args.chunk_tokens
    with Sidecar(args, pages=3 * args.chunks) as sidecar:
        writer, reader = (tiering_manager(name, sidecar.socket, args, chunk) for name in ("writer", "reader"))
        try:
            times: dict[str, list[float]] = {what: [] for what in FIGURES}
            src = torch.full((args.chunks * chunk,), 7, dtype=torch.uint8)
            dst = torch.zeros_like(src)
            for r in range(args.warmup + args.rounds):
                keys = [make_key(secrets.token_bytes(32)) for _ in range(args.chunks)]
                took = (plain_copy(dst, src),  # both regions: the engine's mapping of a file in /dev/shm
                        plain_copy(primary(reader)[: args.chunks, :chunk], primary(writer)[: args.chunks, :chunk]),
                        store(writer, keys, fill=r), load(reader, keys, chunk, fill=r))
                if r >= args.warmup:
                    for what, t in zip(FIGURES, took, strict=True):
                        times[what].append(t)
        finally:
            writer.shutdown()
            reader.shutdown()
            for name in ("writer", "reader"):
                Path(f"/dev/shm/vllm_offload_{engine_id(name)}.mmap").unlink(missing_ok=True)
    total = args.chunks * chunk
    print(f"{args.chunks} chunks of {chunk:,} bytes a job ({total / 2**20:.0f} MiB), {args.rounds} rounds "
          f"after {args.warmup}, torch threads {torch.get_num_threads()}, {os.cpu_count()} cores")
    print("| copy | median s | GB/s | x plain copy (process memory) | x plain copy (shared memory) |")
    print("|---|---|---|---|---|")
    base = [statistics.median(times[what]) for what in FIGURES[:2]]
    for what in FIGURES:
        t = statistics.median(times[what])
        print(f"| {what} | {t:.4f} | {total / t / 1e9:.2f} | {base[0] / t:.2f} | {base[1] / t:.2f} |")
    return 0


class Sidecar:
    """``kvpool-sidecar serve`` with a shared pool of ``pages`` chunks, on a free port."""

    def __init__(self, args: argparse.Namespace, pages: int) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="kvpool-tier-copy-"))
        self.socket = str(self.folder / "engine.sock")
        config = self.folder / "config.yaml"
        config.write_text(f"pageSize: {args.chunk_tokens}\neviction: {{policy: lru}}\n"
                          "pinning: {autoPin: {enabled: false}}\n")
        self.port = 18000 + secrets.randbelow(2000)
        self.cmd = [str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", "--port", str(self.port),
                    "--pages", str(pages), "--kv-shape", args.kv_shape, "--config", str(config),
                    "--engine-socket", self.socket, "--log-level", "warning"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Sidecar:
        self.proc = subprocess.Popen(self.cmd)
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("the sidecar did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


def engine_id(name: str) -> str:
    return f"kvpool-bench-{os.getpid()}-{name}"


def tiering_manager(name: str, socket: str, args: argparse.Namespace, chunk: int):
    """vLLM's TieringOffloadingManager of one engine, kvpool its secondary tier; a primary tier of a job's
    chunks and some."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    aligned = -(-chunk // 4096) * 4096
    tier = {"type": "KVPoolTier", "module_path": "kvpool_sidecar.engines.tier", "socket": socket,
            "lookup_wait_ms": 1000}  # the copies are measured here, not the lookup budget
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": (args.chunks + 8) * aligned,
             "block_size": args.chunk_tokens, "secondary_tiers": [tier]}
    layers = tuple(f"layer.{i}" for i in range(int(args.kv_shape.split(",")[0])))
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(args.chunk_tokens, layers, 0),), worker_kv_bytes_per_block=chunk,
        enable_kv_cache_events=False, extra_config=extra, engine_id=engine_id(name),
        model=OffloadingModelConfig("bench/tier-copy", args.kv_shape.split(",")[3]),
        cache=OffloadingCacheConfig(args.chunk_tokens, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
    return TieringOffloadingSpec(config).get_manager()


def make_key(block_hash: bytes) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(block_hash, 0)


def step(m) -> None:
    """One scheduler step's end, as vLLM's connector calls it."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    m.on_schedule_end(ScheduleEndContext([], []))


def until_reported(m, what: str, timeout: float = 60.0) -> None:
    """Scheduler steps until vLLM's manager has taken every job's report in."""
    deadline = time.monotonic() + timeout
    while m.has_pending_work():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: never reported")
        step(m)
        time.sleep(0.001)  # a scheduler step's pace (a GPU's decode step takes longer)


def primary(m) -> torch.Tensor:
    return torch.from_numpy(np.asarray(m.primary_tier.get_kv_memoryview()).view(np.uint8))


def store(m, keys: list[bytes], fill: int) -> float:
    """vLLM's GPU->CPU store of ``keys`` (chunk i filled with ``fill + i``), then its cascade; the
    cascade's time."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(f"store-{fill}")
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    view = primary(m)
    for i, c in enumerate(out.store_spec.chunk_ids):
        view[int(c)].fill_((fill + i) % 251)
    start = time.perf_counter()
    m.complete_store(out.keys_to_store, ctx)  # -> KVPoolTier.submit_store
    until_reported(m, "the store")
    took = time.perf_counter() - start
    m.on_request_finished(ctx)
    return took


def load(m, keys: list[bytes], chunk: int, fill: int) -> float:
    """vLLM's lookups until the tier's hold is answered and every chunk is promoted; the promotion's time
    (from its submit), its bytes checked."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(f"load-{fill}")
    m.on_new_request(ctx)
    deadline = time.monotonic() + 60
    while True:
        results = [m.lookup(k, ctx) for k in keys]
        if all(r is LookupResult.HIT_PENDING for r in results):
            break  # promotions queued: submitted at this step's end
        if time.monotonic() > deadline or LookupResult.MISS in results:
            side = m.secondary_tiers[0].side
            tier = [side.lookup(ctx.req_id, k[:-4]) for k in keys]
            raise RuntimeError(f"the chunks were not found: {[(r, results.count(r)) for r in set(results)]}, "
                               f"the tier says {[(r, tier.count(r)) for r in set(tier)]}")
        step(m)
        time.sleep(0.001)
    start = time.perf_counter()
    step(m)  # -> KVPoolTier.submit_load
    until_reported(m, "the load")
    took = time.perf_counter() - start
    spec = m.prepare_load(keys, ctx)
    view = primary(m)
    for i, c in enumerate(spec.chunk_ids):
        row = view[int(c), :chunk]
        if not bool((row == (fill + i) % 251).all()):
            raise RuntimeError(f"chunk {i} was promoted with other bytes")
    m.complete_load(keys, ctx)
    m.on_request_finished(ctx)
    return took


def plain_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
