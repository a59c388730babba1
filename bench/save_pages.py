"""Pages kvpool holds for bytes not yet written, through vLLM's OpenAI server on issue 67's class mix: to-C
prompts over shared prefixes beside a to-B flood of prompts never sent again (served with the LoRA adapter
``tob``, which the admin's mapping puts in the to-B class), ``--clients`` clients each, a tier smaller than
to-C's prefixes. One run per seed of the kvpool importable here (run it again with another checkout first on
``PYTHONPATH`` to compare two versions on the same traffic). ``--systems kvpool,lmcache`` runs LMCache's MP
server (LRU, as ``bench/serve.py`` starts it, on the same bytes) beside it on the same prompts, one after the
other in each seed (the order alternates over seeds), and prints each seed's tier tokens of kvpool over
LMCache's.

    VLLM_CPU_OMP_THREADS_BIND=0 .venv/bin/python bench/save_pages.py --seeds 7,8
    VLLM_CPU_OMP_THREADS_BIND=0 .venv/bin/python bench/save_pages.py --policy lru --isolation 0 --evidence off

``--policy``, ``--isolation`` (to-B's share, percent) and ``--evidence`` (``eviction.admitByEvidence``;
left out of the config when not given, so that an older sidecar reads it) set the sidecar's policy; the
admin's adapter mapping is there in every case.

The sidecar's ``/v1/stats`` is sampled every ``--every`` seconds: ``unwritten_pages`` (pages live
sequences hold that are not published: bytes not yet written, or written and not yet committed), its peak
and its mean over the run. Figures per seed: those, the tokens the tier served (vLLM's
``external_prefix_cache_hits``), and to-C's cached prompt tokens (vLLM's own cache and the tier, from
``--enable-prompt-tokens-details``) against what to-C could reuse (every prompt's prefix after its first), and
to-C's TTFT p50 (requests stream). Token counts are steadier than times on a shared machine; wall times are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "dev"))
from classes import build_adapter, one  # noqa: E402
from serve import BLOCK, Stack, metric  # noqa: E402
from tiny_model import KV_SHAPE as TINY_KV_SHAPE  # noqa: E402
from tiny_model import VOCAB, build_tiny_model  # noqa: E402


def prompts(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """to-C's prompts (a shared prefix each, then a fresh suffix), to-B's (random, never sent again) and
    each to-C prompt's prefix."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.prefixes)]
    ids: list[int] = []
    toc: list[list[int]] = []
    for _ in range(args.prompts):  # the draws of rng.choice(prefixes), then the suffix: seeds keep their traffic
        ids.append(rng.randrange(len(prefixes)))
        toc.append(prefixes[ids[-1]] + tokens(args.suffix_len))
    tob = [tokens(args.tob_len) for _ in range(args.prompts)]
    return toc, tob, ids


def clairvoyant(ids: list[int], pages_per_prefix: int, capacity: int) -> int:
    """Prefix pages a tier of ``capacity`` pages would serve to-C's prompts (prefix ``ids``, one at a time, in
    the order sent) holding to-C's prefixes only (no flood, no suffix) and evicting by Belady: the leading
    pages of the prefix used again soonest stay, a prefix's tail goes first. The bound a tier of that
    size could reach on this traffic with a perfect policy (vLLM's own cache apart)."""
    following = [len(ids)] * len(ids)  # for each request, the next one with its prefix
    seen: dict[int, int] = {}
    for i in range(len(ids) - 1, -1, -1):
        following[i] = seen.get(ids[i], len(ids))
        seen[ids[i]] = i
    held: dict[int, int] = {}  # prefix -> leading pages held
    next_use: dict[int, int] = {}
    hits = 0
    for i, p in enumerate(ids):
        hits += held.get(p, 0)
        next_use[p] = following[i]
        need = pages_per_prefix - held.get(p, 0)
        room = capacity - sum(held.values())
        take = min(room, need)
        held[p] = held.get(p, 0) + take
        need -= take
        while need > 0:  # take the tails of prefixes used later than p's next use
            q = max((q for q in held if q != p and held[q]), key=next_use.__getitem__, default=None)
            if q is None or next_use[q] <= next_use[p]:
                break
            give = min(held[q], need)
            held[q] -= give
            held[p] += give
            need -= give
    return hits


class Sampler:
    """``unwritten_pages`` of the sidecar's stats, every ``every`` seconds, on a thread."""

    def __init__(self, url: str, every: float) -> None:
        self.url, self.every = url, every
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.every):
                try:
                    self.samples.append(client.get(self.url + "/v1/stats").json()["unwritten_pages"])
                except (httpx.HTTPError, KeyError, ValueError):
                    continue

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.samples


async def drive(url: str, args: argparse.Namespace, toc: list[list[int]], tob: list[list[int]]) -> dict:
    cached: list[tuple[float, int]] = []  # to-C's (TTFT ms, cached tokens)

    async def clients(model: str, queue: list[list[int]], out: list[tuple[float, int]] | None) -> None:
        async def worker() -> None:
            while queue:
                got = await one(client, url, model, queue.pop(0), args.output_len)
                if out is not None:
                    out.append(got)

        await asyncio.gather(*(worker() for _ in range(args.clients)))

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(clients("base", list(toc), cached), clients("tob", list(tob), None))
        wall = time.perf_counter() - start
    return {"toc_cached": sum(c for _, c in cached), "ttft_p50": statistics.median(t for t, _ in cached), "wall": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="7,8")
    ap.add_argument("--prompts", type=int, default=120, help="prompts of each class")
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--tob-len", type=int, default=576)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--clients", type=int, default=4, help="clients of each class")
    ap.add_argument("--gpu-blocks", type=int, default=60, help="vLLM's own cache (blocks of 32 tokens)")
    ap.add_argument("--pool-pages", type=int, default=200, help="the tier (pages of 32 tokens)")
    ap.add_argument("--max-model-len", type=int, default=1024, help="below vLLM's own cache: a request must fit it")
    ap.add_argument("--policy", default="", help="eviction.policy (default: the shipped one)")
    ap.add_argument("--isolation", type=float, default=None, help="workloads.toB.isolationPercent")
    ap.add_argument("--evidence", choices=("on", "off"), default="", help="eviction.admitByEvidence")
    ap.add_argument("--systems", default="kvpool", help="kvpool, lmcache or both, comma-separated, in that order")
    ap.add_argument("--every", type=float, default=0.02, help="seconds between two samples of the stats")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvpool-save-pages-"))
    model = build_tiny_model(work / "tiny")
    adapter = build_adapter(model, work / "adapter")
    args.vllm_extra = ["--enable-lora", "--lora-modules", f"tob={adapter}", "--max-lora-rank", "8",
                       "--served-model-name", "base", "--enable-prompt-tokens-details",
                       "--max-model-len", str(args.max_model_len)]  # vLLM's last --max-model-len wins
    args.tensor_parallel_size = 1
    config: dict = {"pageSize": BLOCK, "workloads": {"adapters": [{"adapter": "tob", "workloadClass": "toB"}]}}
    if args.policy:
        config["eviction"] = {"policy": args.policy}
    if args.evidence:
        config.setdefault("eviction", {})["admitByEvidence"] = args.evidence == "on"
    if args.isolation is not None:
        config["workloads"]["toB"] = {"isolationPercent": args.isolation}
    args.kvpool_config = json.dumps(config)
    import kvpool_sidecar

    print(f"kvpool from {Path(kvpool_sidecar.__file__).parent}")
    print(f"config {args.kvpool_config}; vLLM's cache {args.gpu_blocks} blocks, tier "
          f"{args.pool_pages} pages of {BLOCK}; to-C {args.prompts} prompts over {args.prefixes} prefixes of "
          f"{args.prefix_len} (+{args.suffix_len}), to-B {args.prompts} x {args.tob_len} never sent again, "
          f"{args.clients} clients each, {args.output_len} tokens out")
    reusable = (args.prompts - args.prefixes) * args.prefix_len  # an upper bound: every prefix seen before
    systems = args.systems.split(",")
    if not systems or any(system not in ("kvpool", "lmcache") for system in systems):
        ap.error("--systems: kvpool, lmcache or both, comma-separated")
    print("| seed | system | unwritten pages peak | mean | tier tokens | to-C cached tokens | share of to-C's reusable "
          "| to-C TTFT p50 ms | tokens saved | evictions | connector failures | pages refused by evidence | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rnd, seed in enumerate(int(s) for s in args.seeds.split(",")):
        toc, tob, ids = prompts(args, seed)
        bound = clairvoyant(ids, args.prefix_len // BLOCK, args.pool_pages) * BLOCK / reusable
        print(f"seed {seed}: a clairvoyant tier of {args.pool_pages} pages holding to-C's prefixes only would serve "
              f"{bound:.2f} of to-C's reusable tokens (vLLM's own cache apart)", flush=True)
        tiers = {}
        for system in (systems if rnd % 2 == 0 else systems[::-1]):  # the order alternates over seeds
            sys_work = work / f"seed-{seed}-{system}"
            sys_work.mkdir()
            row = run_one(system, args, model, sys_work, toc, tob)
            tiers[system] = row["tier"]
            print(f"| {seed} | {system} | {row['peak']} | {row['mean']} | {int(row['tier']):,} | {row['toc_cached']:,} "
                  f"| {row['toc_cached'] / reusable:.2f} | {row['ttft_p50']:.0f} | {row['saved']} | {row['evictions']} "
                  f"| {row['failures']} | "
                  f"{row['refused']} | {row['wall']:.0f} |", flush=True)
        if len(tiers) == 2 and tiers["lmcache"]:
            print(f"seed {seed}: kvpool's tier tokens {tiers['kvpool'] / tiers['lmcache']:.2f}x LMCache's", flush=True)
    return 0


def run_one(system: str, args: argparse.Namespace, model: Path, work: Path, toc: list[list[int]],
            tob: list[list[int]]) -> dict:
    """One system's run of the seed's prompts: its figures (kvpool's own columns are "-" for LMCache)."""
    stack = Stack(system, args, model, TINY_KV_SHAPE, work)
    out: dict = {"peak": "-", "mean": "-", "saved": "-", "evictions": "-", "failures": "-", "refused": "-"}
    try:
        before = httpx.get(stack.url + "/metrics", timeout=10).text
        sampler = Sampler(stack.sidecar_url, args.every) if stack.sidecar_url else None
        out.update(asyncio.run(drive(stack.url, args, toc, tob)))
        samples = sampler.stop() if sampler else []
        after = httpx.get(stack.url + "/metrics", timeout=10).text
        name = "vllm:external_prefix_cache_hits_total"
        out["tier"] = metric(after, name) - metric(before, name)
        if stack.sidecar_url:
            time.sleep(1.5)  # the connector's last report
            stats = httpx.get(stack.sidecar_url + "/v1/stats", timeout=10).json()
            side = httpx.get(stack.sidecar_url + "/metrics", timeout=10).text
            saved = int(metric(side, 'kvpool_connector_tokens_total{direction="saved"}'))
            out.update(peak=max(samples, default=0), mean=f"{statistics.fmean(samples) if samples else 0:.1f}",
                       saved=f"{saved:,}",
                       evictions=f"{stats['evictions']:,}", refused=stats.get("evidence_refused_pages", "-"),
                       failures=int(metric(side, "kvpool_connector_failures_total")))
    finally:
        stack.close()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
