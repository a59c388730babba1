"""Eviction policies: the shared protocol and each policy's own order."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies import (
    POLICIES,
    PolicyBase,
    PolicyContext,
    make_policy,
)
from kvpool_sidecar.pool import PagePool, WorkloadMeta

CHAT = ("toC", "text", 0)
API = ("toB", "api", 0)


def ctx(spec: KVCachePolicySpec | None = None) -> PolicyContext:
    return PolicyContext(spec or KVCachePolicySpec(), key_of=lambda p: ("key", p))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_protocol_against_a_set_model(name):
    """Random insert/take/evict/victim/peek: the policy holds exactly the evictable pages, and names the same
    next victim however often it is asked."""
    rng = random.Random(7)
    policy = make_policy(name, ctx())
    evictable: set[int] = set()
    cached: set[int] = set()  # evictable or taken (held)
    now = 0.0
    for _ in range(3000):
        now += rng.random()
        op = rng.random()
        if op < 0.35:
            batch = [p for p in rng.sample(range(200), 5) if p not in evictable]
            if batch:
                policy.insert(batch, list(range(len(batch))), len(batch), now, CHAT)
                evictable.update(batch)
                cached.update(batch)
        elif op < 0.55 and evictable:
            page = rng.choice(sorted(evictable))
            policy.take(page, now, hit=rng.random() < 0.8)
            evictable.discard(page)
        elif op < 0.65 and evictable:
            page = rng.choice(sorted(evictable))
            policy.evict(page)
            evictable.discard(page)
            cached.discard(page)
        elif evictable:
            peeked = policy.peek(now)
            assert policy.peek(now) == peeked  # asking again changes nothing (the pool's checks peek)
            page = policy.victim(now)
            assert page == peeked
            assert page in evictable, f"{name} evicted a page that is not evictable"
            evictable.discard(page)
            cached.discard(page)
        assert len(policy) == len(evictable)
        for page in range(200):
            assert (page in policy) == (page in evictable)


def drain(policy, now: float = 100.0) -> list[int]:
    order = []
    while len(policy):
        order.append(policy.victim(now))
    return order


def filled(name: str, seed: int) -> tuple[Any, float]:
    """A policy holding 300 pages of three classes released over a few minutes, some reused."""
    rng = random.Random(seed)
    policy = make_policy(name, ctx())
    now = 0.0
    held: list[int] = []
    for start in range(0, 300, 10):
        now += rng.random() * 10
        pages = list(range(start + 9, start - 1, -1))
        policy.insert(pages, list(range(9, -1, -1)), 10, now, rng.choice([CHAT, API, ("toC", "file", 1)]))
        if rng.random() < 0.3:
            page = rng.choice(pages)
            policy.take(page, now, True)
            held.append(page)
    for page in held:
        policy.insert([page], [0], 10, now, CHAT)
    return policy, now + 1.0


@pytest.mark.parametrize("name", [name for name in sorted(POLICIES) if POLICIES[name].bulk])
@pytest.mark.parametrize("seed", range(4))
def test_victims_named_in_bulk_are_the_victims_named_one_by_one(name: str, seed: int) -> None:
    no_links = ([-1] * 300, [-1] * 300)
    one_by_one, now = filled(name, seed)
    bulk, _ = filled(name, seed)
    for count in (1, 37, 100, 62):
        expected = [one_by_one.victim(now) for _ in range(count)]
        assert bulk.victims(now, count, no_links) == expected
        now += 3.0
    assert len(bulk) == len(one_by_one) == 100


@pytest.mark.parametrize("name", [n for n in sorted(POLICIES) if POLICIES[n].restore is not PolicyBase.restore])
def test_victims_put_back_come_out_again_in_the_same_order(name: str) -> None:
    policy, now = filled(name, 1)
    named = policy.victims(now, 50, ([-1] * 300, [-1] * 300))
    policy.restore(named[20:])
    assert len(policy) == 300 - 20
    assert all(page in policy for page in named[20:])
    assert policy.victims(now, 30, ([-1] * 300, [-1] * 300)) == named[20:]


def test_lru_reinserts_at_the_tail_and_fifo_does_not():
    lru = make_policy("lru", ctx())
    fifo = make_policy("fifo", ctx())
    for policy in (lru, fifo):
        policy.insert([1], [0], 1, 0.0, CHAT)
        policy.insert([2], [0], 1, 1.0, CHAT)
        policy.take(1, 2.0, hit=True)
        policy.insert([1], [0], 1, 3.0, CHAT)
    assert drain(lru) == [2, 1]
    assert drain(fifo) == [1, 2]


def test_lru_ring_check_finds_a_broken_link():
    policy = make_policy("lru", ctx())
    policy.insert([5, 3, 9, 1], [3, 2, 1, 0], 4, 0.0, CHAT)
    policy.take(3, 1.0, True)
    policy.check()  # type: ignore[attr-defined]
    assert policy.order() == [5, 9, 1]  # type: ignore[attr-defined]
    policy._next[5] = 1  # type: ignore[attr-defined]  # skips page 9
    with pytest.raises(AssertionError, match="links back"):
        policy.check()  # type: ignore[attr-defined]


def test_fifo_queues_a_prompt_head_first():
    fifo = make_policy("fifo", ctx())
    fifo.insert([12, 11, 10], [2, 1, 0], 3, 0.0, CHAT)  # the pool releases tails first
    assert drain(fifo) == [10, 11, 12]


def test_lfu_evicts_the_least_reused_then_the_oldest():
    lfu = make_policy("lfu", ctx())
    lfu.insert([1, 2, 3], [0, 0, 0], 1, 0.0, CHAT)
    for _ in range(2):
        lfu.take(1, 1.0, hit=True)
        lfu.insert([1], [0], 1, 1.0, CHAT)
    lfu.take(3, 1.0, hit=True)
    lfu.insert([3], [0], 1, 1.0, CHAT)
    assert drain(lfu) == [2, 3, 1]


def test_s3fifo_drops_one_hit_wonders_and_readmits_ghosts_to_main():
    s3 = make_policy("s3fifo", ctx())
    s3.insert(list(range(10)), [0] * 10, 1, 0.0, CHAT)
    s3.take(0, 1.0, hit=True)
    s3.insert([0], [0], 1, 1.0, CHAT)
    first = s3.victim(2.0)
    assert first == 1  # page 0 was reused: promoted to main instead of evicted
    # A page whose key is in the ghost goes straight to main when it comes back.
    s3.insert([1], [0], 1, 3.0, CHAT)
    assert 1 in s3._main


def test_pages_released_together_go_tail_first_by_their_locality_level() -> None:
    """One class, one release time, a locality weight and self-tuning off: the default policy orders
    pages by their locality level (the tail of each prompt first), oldest first within a level."""
    from kvpool_sidecar.policies.adaptive import locality_level

    spec = KVCachePolicySpec.model_validate({"eviction": {
        "selfTuning": {"enabled": False}, "weights": {"reuse": 0, "locality": 1, "timeWindow": 0.1}}})
    policy = make_policy("workload_adaptive", ctx(spec))
    rng = random.Random(3)
    order: list[tuple[int, int, int]] = []  # (level, insertion, page)
    page = 0
    for _ in range(30):
        length = rng.randint(1, 40)
        pages = list(range(page, page + length))
        depths = list(range(length))
        rng.shuffle(depths)
        policy.insert(pages, depths, length, 10.0, CHAT)
        order += [(locality_level(d, length), p, p) for p, d in zip(pages, depths, strict=True)]
        page += length
    assert drain(policy, now=11.0) == [p for _, _, p in sorted(order)]


def test_pool_switches_policy_live_keeping_cached_pages():
    spec = KVCachePolicySpec.model_validate(
        {"pageSize": 4, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}}}
    )
    pool = PagePool(40, spec, clock=lambda: 0.0)
    for i in range(5):
        pool.admit(str(i), [i] * 8, now=float(i))
        pool.commit(str(i), 8)
        pool.release(str(i), now=float(i))
    data = spec.model_dump()
    data["eviction"]["policy"] = "workload_adaptive"
    pool.reconfigure(KVCachePolicySpec.model_validate(data))
    pool.check_invariants()
    assert all(pool.lookup([i] * 8) == 8 for i in range(5))
    assert pool.policies[0].name == "workload_adaptive"


def test_pre_eviction_frees_only_expired_pages_down_to_the_watermark():
    spec = KVCachePolicySpec.model_validate(
        {"pageSize": 4, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}},
         "workloads": {"toB": {"isolationPercent": 0}}, "preEviction": {"lowWatermarkPercent": 50}}
    )
    pool = PagePool(10, spec, clock=lambda: 0.0)
    for i in range(4):  # 8 cached pages at t = 0..3
        pool.admit(str(i), [i] * 8, now=float(i))
        pool.commit(str(i), 8)
        pool.release(str(i), now=float(i))
    assert pool.pre_evict(now=100.0) == 0  # nothing older than the 10-minute window
    freed = pool.pre_evict(now=601.5)  # pages of t=0 and t=1 expired; the watermark asks for 5 free
    assert freed == 3 and pool.stats().free_pages == 5
    assert pool.lookup([3] * 8) == 8  # the fresh prefix stayed
    pool.check_invariants()


def test_a_page_expires_after_its_own_class_window_wherever_it_lives():
    """With no to-B share, to-B pages live in the shared partition; each page still expires after the
    window of its own class (to-B 10 s, to-C 10 min), for the eviction counters as for idle eviction."""
    spec = KVCachePolicySpec.model_validate(
        {"pageSize": 4, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}},
         "workloads": {"toB": {"isolationPercent": 0}}, "preEviction": {"enabled": False}}
    )
    pool = PagePool(4, spec, clock=lambda: 0.0)
    for seq, meta in (("b", WorkloadMeta(workload_class="toB")), ("c", WorkloadMeta())):
        pool.admit(seq, [ord(seq)] * 8, meta=meta, now=0.0)
        pool.commit(seq, 8)
        pool.release(seq, now=0.0)
    pool.admit("new", list(range(100, 116)), now=60.0)  # 4 pages: all cached ones go, at 60 s
    assert pool.eviction.evictions_by == {("toC", "expired"): 2, ("toC", "capacity"): 2}
    pool.release("new", now=60.0)  # never committed: its pages are freed, not cached
    data = spec.model_dump()
    data["workloads"]["toB"]["timeWindow"] = "2m"  # reloaded: pages released from now on keep it
    pool.reconfigure(KVCachePolicySpec.model_validate(data))
    pool.admit("b2", [7] * 16, meta=WorkloadMeta(workload_class="toB"), now=61.0)
    pool.commit("b2", 16)
    pool.release("b2", now=61.0)
    pool.admit("late", list(range(200, 216)), now=150.0)  # 89 s after: inside to-B's new window
    assert pool.eviction.evictions_by == {("toC", "expired"): 2, ("toC", "capacity"): 6}
    pool.check_invariants()
