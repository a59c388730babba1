"""A production trace through a real vLLM engine, side by side: vLLM alone / LMCache (LRU, ARC) / kvpool
(LRU, its default policy), every second tier holding the same KV bytes.

    .venv/bin/python bench/engine.py                     # 800 requests of the conversation trace, ~8 min
    .venv/bin/python bench/engine.py --requests 200 --systems vllm,kvpool

The trace's hash ids become tokens deterministically (32 tokens per id, the engine's block size, from
a generator seeded by the id), so requests sharing ids share tokens exactly; prompts are capped at
``--max-blocks`` blocks (the tiny model's context). Requests are issued one at a time on the trace's
timestamps sped up ``--speedup`` times; kvpool's time windows are divided by the same factor so that
its policy sees the trace's own time scale. vLLM's own prefix cache is on and small (``--gpu-blocks``):
the first tier. Each request generates one token: its latency is the TTFT.

Figures per system: prefill tokens computed, tokens served by the second tier (vLLM's own
``external_prefix_cache_hits``), TTFT p50/p99, first tokens identical to vLLM alone, and each
connector's cost per request against the prefill time it saved. The cost is measured the same way for
every connector, from the outside: vLLM alone's TTFT is fitted as ``a + b * computed_tokens``; a
connector's cost per request is the mean of ``TTFT - (a + b * computed_tokens)`` (lookup, copies and
saves together) and the prefill it saved is ``b * served_tokens``.

LMCache (optional, not a test dependency) runs in its multiprocess-server mode:
``.venv/bin/pip install --no-deps lmcache==0.5.6 sortedcontainers aiofile caio aiofiles nvtx redis
opentelemetry-exporter-prometheus==0.66b2``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool_sidecar.service.server import instance_name, parse_shape
from kvpool_sidecar.storage.segment import release_instance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))  # what tests, benchmarks and the demo share
from tiny_model import KV_SHAPE as TINY_KV_SHAPE
from tiny_model import VOCAB as TINY_VOCAB

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "mooncake_conversation.jsonl.gz"
BLOCK = 32
BYTES_PER_PAGE = parse_shape(TINY_KV_SHAPE).bytes_per_page(BLOCK)
SYSTEMS = ("vllm", "lmcache-lru", "lmcache-arc", "kvpool-lru", "kvpool")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, deadline: float = 60) -> None:
    import httpx

    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer")


def wait_port(port: int, deadline: float = 60) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"port {port} did not open")


def kvpool_config(policy: str, speedup: float, extra: dict, reference: bool = False) -> dict:
    """The shipped defaults (its 30 % to-B share, which to-C borrows while idle, and auto-pins), with the
    windows and decay rates on the replay's faster clock; ``reference`` (``--setup reference``) turns
    auto-pins and the to-B share off."""
    config: dict = {
        "pageSize": BLOCK, "eviction": {"policy": policy},
        "workloads": {"toC": {"timeWindow": f"{int(600_000 / speedup)}ms", "decayPerMinute": 0.15 * speedup},
                      "toB": {"timeWindow": f"{int(10_000 / speedup)}ms", "decayPerMinute": 6.0 * speedup}},
    }
    if reference:
        config["pinning"] = {"autoPin": {"enabled": False}}
        config["workloads"]["toB"]["isolationPercent"] = 0
    return {**config, **extra}


def metric_total(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def run_one(system: str, args: argparse.Namespace) -> dict:
    """One system in this process: its services, a fresh engine, the trace slice."""
    import yaml

    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from tiny_model import build_tiny_model
    from vllm import LLM, SamplingParams

    work = Path(tempfile.mkdtemp(prefix=f"kvpool-bench-{system}-"))
    model = build_tiny_model(Path(args.model_dir))
    from engine_prompts import engine_prompts
    from kvpool_sidecar.replay import read_trace

    prompts = engine_prompts(read_trace(args.trace), args.start, args.requests, block_size=BLOCK,
                             max_blocks=args.max_blocks, vocab=TINY_VOCAB)
    services: list[subprocess.Popen] = []
    kv_transfer = None
    sidecar_url = None
    bindir = Path(sys.executable).parent
    if system.startswith("kvpool"):
        policy = "lru" if system == "kvpool-lru" else "workload_adaptive"
        (work / "config.yaml").write_text(yaml.safe_dump(kvpool_config(
            policy, args.speedup, json.loads(args.kvpool_config), args.setup == "reference")))
        port = free_port()
        services.append(subprocess.Popen(
            [bindir / "kvpool-sidecar", "serve", "--port", str(port), "--pages", str(args.pool_pages),
             "--kv-shape", TINY_KV_SHAPE, "--config", str(work / "config.yaml"), "--log-level", "error",
             "--engine-socket", str(work / "engine.sock")]))
        sidecar_url = f"http://127.0.0.1:{port}"
        wait_http(sidecar_url + "/healthz")
        kv_transfer = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_sidecar.engines.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"socket": str(work / "engine.sock")}}
    elif system.startswith("lmcache"):
        port = free_port()
        gib = args.pool_pages * BYTES_PER_PAGE / 2**30
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
        services.append(subprocess.Popen(
            [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost", "--port", str(port),
             "--chunk-size", str(args.lmcache_chunk), "--l1-size-gb", f"{gib:.6f}",
             "--eviction-policy", system.split("-")[1].upper(), "--supported-transfer-mode", "auto"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(port)
        kv_transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"lmcache.mp.port": port}}
    try:
        llm = LLM(model=str(model), dtype="float32", block_size=BLOCK, max_model_len=2048, seed=0, enforce_eager=True,
                  num_gpu_blocks_override=args.gpu_blocks, enable_prefix_caching=True, gpu_memory_utilization=0.3,
                  disable_log_stats=False, kv_transfer_config=kv_transfer)
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([{"prompt_token_ids": [5] * 100}], sp, use_tqdm=False)  # warm-up, not counted
        base_metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        rows = []
        start = time.monotonic()
        for item in prompts:
            due, tokens = item.timestamp, item.tokens
            wait = due / args.speedup - (time.monotonic() - start)
            if wait > 0:
                time.sleep(wait)
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
            rows.append({"ttft": time.perf_counter() - t, "prompt": len(tokens),
                         "cached": int(out.num_cached_tokens or 0), "token": out.outputs[0].token_ids[0]})
        metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        result = {
            "system": system, "rows": rows,
            "external_hits": metrics.get("vllm:external_prefix_cache_hits", 0)
            - base_metrics.get("vllm:external_prefix_cache_hits", 0),
            "local_hits": metrics.get("vllm:prefix_cache_hits", 0) - base_metrics.get("vllm:prefix_cache_hits", 0),
        }
        if sidecar_url:
            import httpx

            text = httpx.get(sidecar_url + "/metrics").text
            result["lookup_mean_s"] = (metric_total(text, "kvpool_connector_lookup_seconds_sum")
                                       / max(1.0, metric_total(text, "kvpool_connector_lookup_seconds_count")))
            result["kvpool_loaded"] = metric_total(text, 'kvpool_connector_tokens_total{direction="loaded"}')
            stats = httpx.get(sidecar_url + "/v1/stats").json()
            result["kvpool_stats"] = {k: stats[k] for k in ("pinned_pages", "free_pages", "cached_pages", "evictions",
                                                            "token_hit_ratio")}
            result["kvpool_evicted"] = {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                                        for line in text.splitlines()
                                        if line.startswith("kvpool_evicted_pages_total{") and not line.endswith(" 0.0")}
        llm.llm_engine.engine_core.shutdown()
        return result
    finally:
        for proc in services:
            proc.terminate()
            proc.wait(timeout=30)
        if sidecar_url is not None:  # an exit may leave the pool's segment for a restart: done with it
            release_instance(instance_name(int(sidecar_url.rsplit(":", 1)[1])))


def fit(rows: list[dict]) -> tuple[float, float]:
    xs = [r["prompt"] - r["cached"] for r in rows]
    ys = [r["ttft"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(results: list[dict], args: argparse.Namespace) -> None:
    by = {r["system"]: r for r in results}
    a, b = fit(by["vllm"]["rows"]) if "vllm" in by else (0.0, 0.0)
    reference = [r["token"] for r in by["vllm"]["rows"]] if "vllm" in by else None
    n = len(results[0]["rows"])
    prompt_tokens = sum(r["prompt"] for r in results[0]["rows"])
    print(f"{n} requests of {Path(args.trace).name} from #{args.start}, {prompt_tokens} prompt tokens; second tier "
          f"{args.pool_pages} pages x {BYTES_PER_PAGE} B = {args.pool_pages * BYTES_PER_PAGE / 2**20:.1f} MiB; "
          f"vLLM's own cache {args.gpu_blocks} blocks; trace time / {args.speedup}; kvpool setup {args.setup}")
    print(f"vLLM alone: TTFT = {a * 1e3:.2f} ms + {b * 1e6:.2f} us x computed tokens (least squares)")
    head = (f"{'system':<12}{'computed':>10}{'2nd tier':>10}{'local':>8}{'TTFT p50':>10}{'p99':>8}"
            f"{'same tok':>10}{'cost/req':>10}{'saved/req':>11}")
    print(head)
    for system in SYSTEMS:
        if system not in by:
            continue
        r = by[system]
        rows = r["rows"]
        computed = sum(x["prompt"] - x["cached"] for x in rows)
        ttfts = [x["ttft"] for x in rows]
        same = sum(x["token"] == y for x, y in zip(rows, reference, strict=True)) if reference else n
        cost = statistics.fmean(x["ttft"] - (a + b * (x["prompt"] - x["cached"])) for x in rows)
        saved = b * r["external_hits"] / n
        print(f"{system:<12}{computed:>10}{int(r['external_hits']):>10}{int(r['local_hits']):>8}"
              f"{statistics.median(ttfts) * 1e3:>8.1f}ms{pct(ttfts, 0.99) * 1e3:>6.1f}ms"
              f"{same:>6}/{n:<3}{cost * 1e3:>8.2f}ms{saved * 1e3:>9.2f}ms")
        if "lookup_mean_s" in r:
            print(f"{'':<12}kvpool's own figures: lookup round trip {r['lookup_mean_s'] * 1e3:.2f} ms mean, "
                  f"{int(r['kvpool_loaded'])} tokens copied in;")
            print(f"{'':<12}pool at the end {r['kvpool_stats']}; evicted {r['kvpool_evicted']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--max-blocks", type=int, default=60)
    parser.add_argument("--pool-pages", type=int, default=1500, help="second-tier capacity (LMCache: the same bytes)")
    parser.add_argument("--gpu-blocks", type=int, default=80, help="vLLM's own cache (more than 2048/32)")
    parser.add_argument("--speedup", type=float, default=4.0)
    parser.add_argument("--lmcache-chunk", type=int, default=BLOCK)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--kvpool-config", default="{}", help="JSON merged into kvpool's config (top-level keys)")
    parser.add_argument("--setup", choices=("shipped", "reference"), default="shipped",
                        help="kvpool's spec: the shipped defaults, or auto-pins and the to-B share off")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "kvpool-tiny-model"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        Path(args.out).write_text(json.dumps(run_one(args.one, args)))
        return 0
    results = []
    for system in args.systems.split(","):
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", system, "--out", str(out)]
        print(f"running {system} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            print(f"{system} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        print(f"  {system}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        results.append(json.loads(out.read_text()))
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
