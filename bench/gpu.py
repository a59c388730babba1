"""One-shot GPU check (issues 50, 61): both engine paths on a real GPU, and the connector's copy path
against the device's pinned-memcpy peak, in one run.

    .venv/bin/python bench/gpu.py                 # on a machine with CUDA
    .venv/bin/python bench/gpu.py --device cpu    # the copy figures on the CPU (checks the script, not a GPU)

Engines (CUDA only; no network needed: the tiny random model is built offline, dev/tiny_model.py): a
``kvpool-sidecar serve`` process and, one after the other, vLLM on the GPU with its default CUDA-graph
mode through (1) its own ``OffloadingConnector`` with ``TieringOffloadingSpec`` and ``KVPoolTier``, the
shipped GPU path, and (2) ``KVPoolConnector`` with ``untested_cuda`` (its own copy streams and staged
transfers). Each serves prompts that share a prefix: what it computes alone (every cache skipped), then,
with vLLM's own caches emptied (its GPU prefix cache and, for (1), its CPU primary tier), the same
prompts again, their prefix from kvpool. It prints whether the tokens are identical and the tokens the
sidecar counted as loaded.

Copy figures: host->device and device->host GB/s of a plain pinned copy (the ceiling), then of
``PageCopier.load`` / ``save`` moving ``--pages`` pages of the mid-size model's shape between a shared
pool (``KVStorage``, host shared memory, as the sidecar allocates it) and engine layers on the device in
vLLM's split layout ``[2, blocks, block_size, kv_heads, head_dim]``, staged through page-locked buffers as
the worker stages them, the device half of each copy in ``--kernels`` (the best for the device when
unset), called directly and through the worker's copy lane (a copy stream). Bytes moved are checked bit
for bit.
"""

from __future__ import annotations

import argparse
import time

import torch
from kvpool_sidecar.engines.blocks import PageCopier, engine_layers
from kvpool_sidecar.engines.copies import CopyQueue
from kvpool_sidecar.service.server import instance_name
from kvpool_sidecar.storage import KVStorage, ModelShape
from kvpool_sidecar.storage.segment import release_instance

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
    ap.add_argument("--engine", choices=ENGINE_PATHS, help=argparse.SUPPRESS)  # one engine run (a child)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return engine_run(args.engine, args.socket, args.model)
    ok = copies(args)
    if torch.device(args.device).type == "cuda":
        ok = engines() and ok
    return 0 if ok else 1


def copies(args: argparse.Namespace) -> bool:
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    else:
        print("no GPU: the CPU path (these are not GPU figures)")
    bs, n = args.block_size, args.pages
    storage = KVStorage(MID, bs, pages=2 * n, shared=True)
    nbytes = n * MID.bytes_per_page(bs)
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
        return same
    finally:
        lane.close()
        storage.close()


ENGINE_PATHS = ("tier", "connector")
BLOCK = 16
PROMPTS = 8


def transfer_config(path: str, socket: str) -> dict:
    if path == "tier":  # the shipped GPU path (manifests/examples/inference.yaml), a small primary tier
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 << 20, "block_size": BLOCK,
                    "secondary_tiers": [{"type": "KVPoolTier", "module_path": "kvpool_sidecar.engines.tier",
                                         "socket": socket, "lookup_wait_ms": 100}]}}
    return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_sidecar.engines.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": socket, "lookup_wait_ms": 100, "untested_cuda": True}}


def engine_run(path: str, socket: str, model: str) -> int:
    """One engine on the GPU (a child process): prompts alone, then again from kvpool; prints the verdict."""
    import json
    import random

    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float16", block_size=BLOCK, max_model_len=2048, seed=0,
              enable_prefix_caching=True, gpu_memory_utilization=0.3, kv_transfer_config=transfer_config(path, socket))
    rng = random.Random(0)
    head = [rng.randrange(3, 500) for _ in range(20 * BLOCK)]
    prompts = [head + [rng.randrange(3, 500) for _ in range(3 * BLOCK + 5)] for _ in range(PROMPTS)]

    def run(fresh: bool) -> list[list[int]]:
        sp = SamplingParams(max_tokens=16, temperature=0.0, skip_reading_prefix_cache=fresh or None)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    alone = run(fresh=True)  # every cache skipped; the saves fill kvpool
    time.sleep(2)  # the saves' copies and commits land
    while not llm.reset_prefix_cache(reset_connector=True):  # vLLM's own caches emptied, kvpool's kept
        time.sleep(0.05)
    again = run(fresh=False)
    print(json.dumps({"path": path, "identical": again == alone}))
    return 0 if again == alone else 1


def engines() -> bool:
    """Both engine paths beside one sidecar process; prints tokens identical and kvpool's loaded tokens."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
    from tiny_model import build_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="kvpool-gpu-"))
    model = build_tiny_model(folder / "model", seed=0)
    config = folder / "config.yaml"
    config.write_text(f"pageSize: {BLOCK}\neviction: {{policy: lru}}\n")
    socket, port = str(folder / "engine.sock"), 18123
    from tiny_model import KV_SHAPE

    shape = KV_SHAPE.replace("float32", "float16")
    sidecar = subprocess.Popen([str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", "--port", str(port),
                                "--pages", "4096", "--kv-shape", shape, "--config", str(config),
                                "--engine-socket", socket, "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    ok = True
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/healthz", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)

        def loaded() -> float:
            text = httpx.get(url + "/metrics").text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith('kvpool_connector_tokens_total{direction="loaded"}'))

        print("| engine path | tokens identical to vLLM alone | tokens kvpool loaded |")
        print("|---|---|---|")
        for path in ENGINE_PATHS:
            before = loaded()
            child = [sys.executable, __file__, "--engine", path, "--socket", socket, "--model", str(model)]
            out = subprocess.run(child, capture_output=True, text=True, timeout=900)
            verdict = next((json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"path"')), None)
            if verdict is None:
                print(f"| {path} | failed to run (rc {out.returncode}): {out.stderr.strip().splitlines()[-1:]} | |")
                ok = False
                continue
            time.sleep(1.5)  # the connector reports at least once a second
            print(f"| {path} | {verdict['identical']} | {loaded() - before:.0f} |")
            ok = ok and verdict["identical"]
    finally:
        sidecar.terminate()
        sidecar.wait(30)
        release_instance(instance_name(port))  # an exit may leave the pool's segment for a restart: done with it
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
