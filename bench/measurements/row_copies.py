"""A step's saves and loads through the connector's copier: row copies (runs in one copy) against the
indexed gather and scatter they replaced, beside a plain copy of the same bytes, in one run.

    .venv/bin/python bench/measurements/row_copies.py [--blocks 256] [--repeat 5] [--threads 1]

CPU tensors in vLLM's CPU layout; the tiny model's shape and a 7B-like one (28 layers, 4 KV heads, head
dim 128). Engine blocks are scattered (vLLM's free queue hands them out in any order), pool pages come
in runs (the pool's free list) or scattered (``--scattered-pages``). GB/s counts the bytes moved once.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from kvpool_sidecar.engines.blocks import PageCopier, engine_layers
from kvpool_sidecar.storage import reference

SHAPES = ((2, 1, 64), (28, 4, 128))  # layers, kv heads, head dim


def indexed(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """What move_rows did before: one gather into a temporary, one indexed scatter."""
    dst[dst_rows.long()] = src[src_rows.long()]


def timed(fn: Callable[[], None], repeat: int) -> float:
    fn()  # once untimed: pages touched
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256, help="blocks a step saves, then loads")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a copy lane's thread)")
    parser.add_argument("--scattered-pages", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for layers, heads, dim in SHAPES:
        measure(layers, heads, dim, args, g)


def measure(layers: int, heads: int, dim: int, args: argparse.Namespace, g: torch.Generator) -> None:
    """One shape's figures, printed on one line."""
    block_size, engine_blocks = 32, 4 * args.blocks
    kv = {f"layer.{i}": torch.randn(engine_blocks, heads, block_size, 2 * dim, generator=g) for i in range(layers)}
    copier = PageCopier(engine_layers(kv, engine_blocks))
    pool = torch.zeros(args.blocks + 64, layers, 2 * block_size * heads * dim)
    blocks = torch.randperm(engine_blocks, generator=g)[: args.blocks].tolist()
    pages = (torch.randperm(len(pool), generator=g)[: args.blocks] if args.scattered_pages
             else torch.arange(args.blocks)).tolist()
    nbytes = args.blocks * pool[0].numel() * pool.element_size()
    flat_src = torch.randn(nbytes // 4, generator=g)
    flat_dst = torch.zeros_like(flat_src)
    figures = {"plain copy": timed(lambda: flat_dst.copy_(flat_src), args.repeat)}
    for name, move in (("indexed (before)", indexed), ("row runs (now)", reference.move_rows)):
        copier._kernels = type("K", (), {"move_rows": staticmethod(move)})
        figures[f"save {name}"] = timed(lambda: copier.save(pool, blocks, pages), args.repeat)
        figures[f"load {name}"] = timed(lambda: copier.load(pool, pages, blocks), args.repeat)
    print(f"{layers} layers x {heads} kv heads x {dim}, {args.blocks} blocks ({nbytes / 2**20:.0f} MiB): "
          + ", ".join(f"{k} {nbytes / v / 1e9:.2f} GB/s" for k, v in figures.items()), flush=True)

if __name__ == "__main__":
    main()
