"""A pool of a million pages with the shipped defaults: memory per cached page, and how long the calls
that touch many pages (a long pin lapsing, a policy switch, a partition resize) hold up admissions.

    .venv/bin/python bench/measurements/million.py [--pages 1000000] [--pin-pages 4000]

Prints:
* bytes per cached page (tracemalloc) of the pool with the default policy, its self-tuner and sketch,
  plus the sidecar's ideal-cache index (``ShadowIndex``): every structure a page costs;
* admission latency (p50 / max over 2,000 admissions of 16-page prompts) with nothing lapsing, then
  while a pin of ``--pin-pages`` pages expires: the max is what the lapse adds to one admission;
* the longest single pool call during a live policy switch and during a to-B share resize, and the
  admissions' max latency around them (a switch may be split over the calls that follow it).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.service.state import SHADOW_SLOTS_PER_PAGE, ShadowIndex

NAMESPACE = bytes(16)
PROMPT_PAGES = 64
PAGE = 16


def key(prompt: int, page: int) -> bytes:
    """A pool key as the engine channel makes one: a 16-byte model namespace and a 32-byte block hash."""
    return NAMESPACE + hashlib.sha256(b"%d/%d" % (prompt, page)).digest()


def fill(pool: PagePool, shadow: ShadowIndex, pages: int, now: list[float]) -> int:
    """Cache ``pages`` pages as prompts of PROMPT_PAGES pages sharing nothing; returns the prompts."""
    n = 0
    for n in range(pages // PROMPT_PAGES):
        hashes = [key(n, j) for j in range(PROMPT_PAGES)]
        now[0] += 0.001
        adm = pool.admit(f"fill{n}", block_hashes=hashes, num_tokens=PROMPT_PAGES * PAGE)
        shadow.admit(adm.keys)
        pool.commit(f"fill{n}", PROMPT_PAGES * PAGE)
        pool.release(f"fill{n}")
    return n + 1


def admissions(pool: PagePool, count: int, base: int, now: list[float]) -> list[float]:
    """Seconds per admission of fresh 16-page prompts (each evicts 16 pages of a full pool)."""
    out = []
    for i in range(count):
        hashes = [key(base + i, j) for j in range(16)]
        now[0] += 0.001
        start = time.perf_counter()
        pool.admit(f"a{base + i}", block_hashes=hashes, num_tokens=16 * PAGE)
        out.append(time.perf_counter() - start)
        pool.commit(f"a{base + i}", 16 * PAGE)
        pool.release(f"a{base + i}")
    return out


def show(label: str, seconds: list[float]) -> None:
    print(f"{label:<44} p50 {statistics.median(seconds) * 1e3:7.3f} ms   max {max(seconds) * 1e3:7.3f} ms")


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=1_000_000)
    parser.add_argument("--pin-pages", type=int, default=4000)
    parser.add_argument("--breakdown", action="store_true", help="the allocations that cost most, by line")
    args = parser.parse_args()
    now = [0.0]
    spec = KVCachePolicySpec.model_validate({"pageSize": PAGE})  # the shipped defaults
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = PagePool(args.pages, spec, clock=lambda: now[0])
    shadow = ShadowIndex(SHADOW_SLOTS_PER_PAGE * args.pages)
    fill(pool, shadow, args.pages, now)
    used = tracemalloc.get_traced_memory()[0] - base
    if args.breakdown:
        for stat in tracemalloc.take_snapshot().statistics("lineno")[:12]:
            print(f"  {stat.size / args.pages:7.1f} B/page  {stat.traceback[0]}")
    tracemalloc.stop()
    cached = pool.stats().cached_pages
    print(f"{args.pages:,} pages, policy {spec.eviction.policy}, {cached:,} cached "
          f"({cached / args.pages:.1%} of the pool, to-C only)")
    print(f"memory: {used / cached:.0f} bytes per cached page (pool, policy, tuner, sketch, ideal index)")

    show("admissions, nothing lapsing", admissions(pool, 2000, 1 << 20, now))
    pin_hashes = [key(1 << 40, j) for j in range(args.pin_pages)]
    pool.admit("long", block_hashes=pin_hashes, num_tokens=args.pin_pages * PAGE)
    pool.commit("long", args.pin_pages * PAGE)
    pool.release("long")
    pin = pool.pin(block_hashes=pin_hashes, ttl=1.0)
    assert len(pin.pages) == args.pin_pages
    now[0] += 2.0  # the pin is past its TTL: the next admissions lapse it
    show(f"admissions while a {args.pin_pages:,}-page pin lapses", admissions(pool, 2000, 2 << 20, now))
    assert pin.pin_id not in pool.pins and not pool.pinning.lapsing_pages, "the pin did not lapse"

    for label, change in (
        ("policy switch to lru", {"pageSize": PAGE, "eviction": {"policy": "lru"}}),
        ("to-B share 30 % -> 10 %", {"pageSize": PAGE, "eviction": {"policy": "lru"},
                                     "workloads": {"toB": {"isolationPercent": 10}}}),
    ):
        call = timed(pool.reconfigure, KVCachePolicySpec.model_validate(change))
        after = admissions(pool, 200, (3 << 20) + len(label), now)
        print(f"{label:<44} the call {call * 1e3:9.1f} ms; admissions after: p50 "
              f"{statistics.median(after) * 1e3:.3f} ms, max {max(after) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
