"""GB/s of each KV kernel against plain torch indexing.

    .venv/bin/python bench/kernels.py                 # here: the torch path on the CPU
    .venv/bin/python bench/kernels.py --device cuda   # a GPU: compiled Triton vs torch, beside peak bandwidth

Bytes counted: read + written (a page move reads and writes each byte once; write_kv reads K and V
and writes them). Kernels and the torch reference run the same operations, in turn, on the same data.
"""

from __future__ import annotations

import argparse
import time

import torch
from kvpool_sidecar.storage import reference
from kvpool_sidecar.storage.backend import Backend, choose_backend


def timed(fn, sync, repeat: int) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def peak_bandwidth_gbs(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pages", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backend = choose_backend(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kv = torch.zeros((args.pages, args.layers, 2, args.page_size, args.kv_heads, args.head_dim), dtype=dtype,
                     device=device)
    page_bytes = kv[0].numel() * kv.element_size()
    moves = max(1, args.pages // 4)
    src = torch.randperm(args.pages, device=device)[:moves]
    dst = torch.randperm(args.pages, device=device)[:moves]
    dst = dst[~torch.isin(dst, src)][: len(src)]
    src = src[: len(dst)]
    tokens = min(args.pages * args.page_size, 8192)
    qkv = torch.randn(tokens, 3 * args.kv_heads, args.head_dim, device=device).to(dtype)
    key, value = qkv[:, args.kv_heads : 2 * args.kv_heads], qkv[:, 2 * args.kv_heads :]
    slots = torch.randperm(args.pages * args.page_size, device=device)[:tokens]
    impls = {"torch": reference}
    if backend is Backend.TRITON:
        from kvpool_sidecar.storage import kernels

        impls["triton"] = kernels
    print(f"device {device}, kernels {backend.value}, {args.pages} pages of {page_bytes / 2**20:.2f} MiB, {dtype}")
    peak = peak_bandwidth_gbs(device)
    if peak:
        print(f"peak memory bandwidth (from the device's clock and bus): {peak:.0f} GB/s")
    write_bytes = 2 * 2 * key.numel() * key.element_size()
    move_bytes = 2 * len(src) * page_bytes
    print(f"{'kernel':<14}" + "".join(f"{name + ' GB/s':>14}" for name in impls))
    for label, nbytes, call in (
        ("write_kv", write_bytes, lambda m: m.write_kv(kv, 0, key, value, slots)),
        ("copy_pages", move_bytes, lambda m: m.copy_pages(kv, src, dst)),
        ("gather_pages", move_bytes, lambda m: m.gather_pages(kv, src)),
        ("scatter_pages", move_bytes, lambda m, buf=kv[: len(src)].reshape(len(src), -1).clone():
            m.scatter_pages(kv, dst, buf)),
    ):
        row = f"{label:<14}"
        for module in impls.values():
            seconds = timed(lambda module=module, call=call: call(module), sync, args.repeat)
            row += f"{nbytes / seconds / 1e9:>14.1f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
