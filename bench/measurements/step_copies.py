"""A step's saves copied per request against batched (one gather and scatter per layer for the step).

    .venv/bin/python bench/measurements/step_copies.py [--requests 32] [--blocks 4]

CPU tensors in the engine's CPU layout, torch copies (what a CPU engine and, across devices, a GPU
engine run); the tiny model's shape and a 7B-like one (28 layers, 4 KV heads, head dim 128).
"""

from __future__ import annotations

import argparse
import time

import torch
from kvpool_sidecar.engines.blocks import PageCopier, engine_layers

SHAPES = ((2, 1, 64), (28, 4, 128))  # layers, kv heads, head dim


def timed(copier: PageCopier, pool: torch.Tensor, jobs: list[tuple[list[int], list[int]]], batched: bool,
          repeat: int) -> float:
    """Seconds per step: every job's blocks saved into its pages, in one call or one per job."""
    calls = [([b for _, bs in jobs for b in bs], [p for ps, _ in jobs for p in ps])] if batched else \
        [(blocks, pages) for pages, blocks in jobs]
    for blocks, pages in calls:  # once untimed: the pool's pages are touched
        copier.save(pool, blocks, pages)
    start = time.perf_counter()
    for _ in range(repeat):
        for blocks, pages in calls:
            copier.save(pool, blocks, pages)
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4, help="blocks each request saves in the step")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    block_size, engine_blocks = 32, 4096
    n = args.requests * args.blocks
    for layers, heads, dim in SHAPES:
        kv = {f"layer.{i}": torch.randn(engine_blocks, heads, block_size, 2 * dim) for i in range(layers)}
        copier = PageCopier(engine_layers(kv, engine_blocks))
        pool = torch.zeros(n, layers, 2 * block_size * heads * dim)
        jobs = [(list(range(j * args.blocks, (j + 1) * args.blocks)),
                 list(range(1000 + j * args.blocks, 1000 + (j + 1) * args.blocks))) for j in range(args.requests)]
        times = {name: timed(copier, pool, jobs, batched, args.repeat)
                 for name, batched in (("per request", False), ("batched", True))}
        print(f"{layers} layers x {heads} kv heads x {dim}: {args.requests} requests x {args.blocks} blocks, "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items())
              + f"; batched {times['per request'] / times['batched']:.2f}x faster", flush=True)


if __name__ == "__main__":
    main()
