"""One-shot GPU check (issue 50): the connector's copy path between the host pool and an engine's KV on
the device, against the device's pinned-memcpy peak, in one run.

    .venv/bin/python bench/gpu.py                 # on a machine with CUDA
    .venv/bin/python bench/gpu.py --device cpu    # the same code on the CPU (checks the script, not a GPU)

Figures: host->device and device->host GB/s of a plain pinned copy (the ceiling), then of
``PageCopier.load`` / ``save`` moving ``--pages`` pages of the mid-size model's shape between a shared
pool (``KVStorage``, host shared memory, as the sidecar allocates it) and engine layers on the device in
vLLM's split layout ``[2, blocks, block_size, kv_heads, head_dim]``, with the pool registered with the
device as a worker registers it (``engines.copies.register_host``) and the device half of each copy in
``--kernels`` (the best for the device when unset), called directly and through the worker's copy lane
(a copy stream). Bytes moved are checked bit for bit.
"""

from __future__ import annotations

import argparse
import time

import torch
from kvpool_sidecar.engines.blocks import PageCopier, engine_layers
from kvpool_sidecar.engines.copies import CopyQueue, register_host
from kvpool_sidecar.storage import KVStorage, ModelShape

MID = ModelShape(layers=8, kv_heads=1, head_dim=64, dtype="float32")  # bench/serve.py's mid-size model


def timed(device: torch.device, fn, repeat: int) -> float:
    """Seconds per call (CUDA events on a GPU)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pages", type=int, default=256, help="pages moved per call (a step's loads or saves)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--kernels", choices=("triton", "torch"), default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    else:
        print("no GPU: the CPU path (these are not GPU figures)")
    bs, n = args.block_size, args.pages
    storage = KVStorage(MID, bs, pages=2 * n, shared=True)
    nbytes = n * MID.bytes_per_page(bs)
    unregister = register_host(storage.kv, device.type == "cuda")  # what the DMA engine reads directly
    lane = CopyQueue(device, "gpu-check")
    try:
        host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device.type == "cuda")
        dev = torch.empty_like(host, device=device)
        h2d = timed(device, lambda: dev.copy_(host, non_blocking=True), args.repeat)
        d2h = timed(device, lambda: host.copy_(dev, non_blocking=True), args.repeat)
        kv = {f"layer.{i}": torch.randn(2, 2 * n, bs, MID.kv_heads, MID.head_dim, device=device)
              for i in range(MID.layers)}
        copier = PageCopier(engine_layers(kv, 2 * n), backend=args.kernels)
        blocks, pages = list(range(n)), list(range(n, 2 * n))
        save = timed(device, lambda: copier.save(storage.kv, blocks, pages), args.repeat)
        load = timed(device, lambda: copier.load(storage.kv, pages, list(range(n, 2 * n))), args.repeat)
        same = all(torch.equal(t[:, n:], t[:, :n]) for t in kv.values())
        for t in kv.values():
            t[:, n:].zero_()
        lane_save = timed(device, lambda: lane.submit(lambda: copier.save(storage.kv, blocks, pages)).result(),
                          args.repeat)
        lane_load = timed(device, lambda: lane.submit(lambda: copier.load(storage.kv, pages, pages)).result(),
                          args.repeat)
        same = same and all(torch.equal(t[:, n:], t[:, :n]) for t in kv.values())
        gb = nbytes / 1e9
        print(f"{n} pages of {MID.bytes_per_page(bs) / 2**20:.2f} MiB ({gb:.2f} GB a call), block size {bs}")
        print("| copy | GB/s | x pinned peak |")
        print("|---|---|---|")
        for name, secs, peak in (("pinned memcpy host->device", h2d, h2d), ("pinned memcpy device->host", d2h, d2h),
                                 ("PageCopier.save (device->pool)", save, d2h),
                                 ("PageCopier.load (pool->device)", load, h2d),
                                 ("save on the copy lane", lane_save, d2h), ("load on the copy lane", lane_load, h2d)):
            print(f"| {name} | {gb / secs:.2f} | {peak / secs:.2f} |")
        print(f"loaded bytes equal the saved ones: {same}")
        return 0 if same else 1
    finally:
        lane.close()
        unregister()
        storage.close()


if __name__ == "__main__":
    raise SystemExit(main())
