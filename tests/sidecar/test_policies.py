"""Eviction policies: the shared protocol, each policy's own order, the workload-aware rules."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies import (
    NO_PAGE,
    POLICIES,
    PageTree,
    PolicyBase,
    PolicyContext,
    WorkloadAwareExactPolicy,
    WorkloadAwarePolicy,
    make_policy,
)
from kvpool_sidecar.pool import PagePool, WorkloadMeta
from kvpool_sidecar.workload import ReuseModel

CHAT = ("toC", "text", 0)
API = ("toB", "api", 0)


def ctx(spec: KVCachePolicySpec | None = None, model: ReuseModel | None = None) -> PolicyContext:
    spec = spec or KVCachePolicySpec()
    return PolicyContext(spec, model or ReuseModel(spec), key_of=lambda p: ("key", p))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_protocol_against_a_set_model(name):
    """Random insert/take/evict/victim/peek: the policy holds exactly the evictable pages."""
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


class _Tree:
    """A prefix forest over pages 0..299 that unlinks victims the way the pool does."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        n = 300
        self.tree = PageTree([NO_PAGE] * n, [NO_PAGE] * n, [NO_PAGE] * n)
        for page in range(n):
            if page % 10 and rng.random() < 0.8:
                self.link(page, page - 1)  # the chain of one prompt
            elif page >= 10 and rng.random() < 0.5:
                self.link(page, rng.randrange(page - page % 10))  # a prompt that continues an older one

    def link(self, page: int, parent: int) -> None:
        parent_of, first_child, next_sib = self.tree
        parent_of[page] = parent
        next_sib[page] = first_child[parent]
        first_child[parent] = page

    def children(self, page: int) -> list[int]:
        out, child = [], self.tree.first_child[page]
        while child != NO_PAGE:
            out.append(child)
            child = self.tree.next_sib[child]
        return out

    def unlink_if_leaf(self, page: int) -> bool:
        if self.tree.first_child[page] != NO_PAGE:
            return False
        self.unlink(page)
        return True

    def unlink(self, page: int) -> None:
        parent_of, first_child, next_sib = self.tree
        parent = parent_of[page]
        assert first_child[page] == NO_PAGE, f"page {page} was named before its child {first_child[page]}"
        if parent != NO_PAGE:
            siblings = [c for c in self.children(parent) if c != page]
            first_child[parent] = siblings[0] if siblings else NO_PAGE
            for a, b in zip(siblings, [*siblings[1:], NO_PAGE], strict=False):
                next_sib[a] = b
        parent_of[page] = NO_PAGE


def filled_in_tree(seed: int, with_tree: bool = True, name: str = "workload_aware") -> tuple[Any, _Tree, float]:
    tree = _Tree(seed)
    spec = KVCachePolicySpec()
    context = PolicyContext(spec, ReuseModel(spec), lambda p: ("key", p), "toC", tree.tree if with_tree else None)
    policy = make_policy(name, context)
    rng = random.Random(seed)
    now = 0.0
    for start in range(0, 300, 10):
        now += rng.random() * 10
        # Classes drawn at random, so a parent often ranks below its children (another class, older).
        policy.insert(list(range(start + 9, start - 1, -1)), list(range(9, -1, -1)), 10, now, rng.choice([CHAT, API]))
    return policy, tree, now + 1.0


def drain_in_tree(policy: Any, tree: _Tree, now: float) -> list[int]:
    """Every victim, one at a time, unlinked as the pool would: fails on a victim with a child."""
    order = []
    while len(policy):
        page = policy.victim(now)
        tree.unlink(page)
        order.append(page)
    assert sorted(order) == list(range(300))
    return order


@pytest.mark.parametrize("seed", range(4))
def test_workload_aware_names_a_page_only_after_its_descendants(seed: int) -> None:
    """A prefix is worth at least its continuations: a page with cached children is passed over until
    they are gone, so the pool never has to evict a subtree with it (one at a time and in bulk alike)."""
    one_by_one, tree_a, now = filled_in_tree(seed)
    order = drain_in_tree(one_by_one, tree_a, now)
    bulk, tree_b, now = filled_in_tree(seed)
    named: list[int] = []
    for count in (1, 37, 100, 62, 100):
        batch = bulk.victims(now, count, tree_b.tree[1:])
        assert len(batch) == count
        for page in batch:  # in order, as the pool does
            tree_b.unlink(page)
        named += batch
    assert named == order
    plain, tree_c, _ = filled_in_tree(seed, with_tree=False)  # the rank alone would cut subtrees
    assert any(tree_c.children(page) for page in drain(plain)[:150] if not tree_c.unlink_if_leaf(page))


@pytest.mark.parametrize("seed", range(2))
def test_the_exact_scan_also_names_a_page_only_after_its_descendants(seed: int) -> None:
    exact, tree, now = filled_in_tree(seed, name="workload_aware_exact")
    drain_in_tree(exact, tree, now)


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


def test_workload_aware_evicts_expired_pages_first():
    spec = KVCachePolicySpec()
    policy = WorkloadAwarePolicy(ctx(spec))
    policy.insert([1], [0], 1, 0.0, API)  # to-B window 10 s
    policy.insert([2], [5], 6, 5.0, CHAT)  # to-C window 10 min, a tail page
    assert policy.victim(20.0) == 1  # expired, although a head page
    policy.insert([3], [0], 1, 20.0, CHAT)
    assert policy.victim(21.0) == 2  # of two fresh chat pages, the tail goes first


def test_workload_aware_prefers_keeping_the_class_that_comes_back():
    spec = KVCachePolicySpec()
    model = ReuseModel(spec)
    # Follow-up turns come back, first turns mostly do not.
    first, follow = ("toC", "text", 0), ("toC", "text", 1)
    for t in range(500):
        model.observe_release(first, 10, float(t))
        model.observe_release(follow, 10, float(t))
        model.observe_reuse(first, 1, 30.0, float(t))
        model.observe_reuse(follow, 8, 8 * 30.0, float(t))
    assert model.reuse_probability(follow) > 2 * model.reuse_probability(first)
    policy = WorkloadAwarePolicy(ctx(spec, model))
    policy.insert([1], [0], 1, 500.0, follow)  # older
    policy.insert([2], [0], 1, 520.0, first)  # younger, but of a class that rarely returns
    assert policy.victim(530.0) == 2
    lru = make_policy("lru", ctx(spec, model))
    lru.insert([1], [0], 1, 500.0, follow)
    lru.insert([2], [0], 1, 520.0, first)
    assert lru.victim(530.0) == 1


def test_weights_swap_live_changes_decisions_without_rebuilding():
    spec = KVCachePolicySpec.model_validate({"eviction": {"weights": {"reuse": 1, "locality": 0, "timeWindow": 0}}})
    model = ReuseModel(spec)
    rare, frequent = ("toC", "text", 0), ("toC", "text", 5)
    for t in range(300):
        model.observe_release(rare, 10, float(t))
        model.observe_release(frequent, 10, float(t))
        model.observe_reuse(frequent, 9, 9 * 20.0, float(t))
    for cls in (WorkloadAwarePolicy, WorkloadAwareExactPolicy):
        policy = cls(ctx(spec, model))
        policy.insert([1], [0], 10, 300.0, rare)  # a head page of a class that rarely comes back
        policy.insert([2], [9], 10, 300.0, frequent)  # a tail page of a class that does
        assert policy.peek(301.0) == 1
        policy.configure(
            KVCachePolicySpec.model_validate({"eviction": {"weights": {"reuse": 0, "locality": 1, "timeWindow": 0}}})
        )
        assert policy.peek(302.0) == 2 and len(policy) == 2


def test_exact_policy_is_the_true_arg_min_of_the_rank():
    """Group heads are enough: compare with a brute-force scan of every page on random states."""
    rng = random.Random(3)
    spec = KVCachePolicySpec()
    model = ReuseModel(spec)
    for t in range(300):
        model.observe_release(CHAT, 5, float(t))
        model.observe_reuse(CHAT, 2, 2 * rng.uniform(10, 300), float(t))
    policy = WorkloadAwareExactPolicy(ctx(spec, model))
    meta: dict[int, tuple] = {}
    now = 0.0
    for page in range(300):
        now += rng.uniform(0, 20)
        klass = rng.choice([CHAT, API, ("toC", "file", 1)])
        length = rng.randint(1, 12)
        depth = rng.randrange(length)
        policy.insert([page], [depth], length, now, klass)
        meta[page] = (klass, depth, length, now)
    from kvpool_sidecar.policies.scoring import locality_level

    for _ in range(100):
        now += 5.0
        brute = min(
            meta,
            key=lambda p: (*policy.rank(meta[p][0], locality_level(meta[p][1], meta[p][2]), now - meta[p][3]),
                           meta[p][3]),
        )
        victim = policy.victim(now)
        assert victim == brute
        del meta[victim]


def test_pages_released_together_go_tail_first_by_their_locality_level() -> None:
    """One class, one release time, no protection: the bucketed policy orders pages by the same
    locality level as the score (the tail of each prompt first), oldest first within a level."""
    from kvpool_sidecar.policies.scoring import locality_level

    spec = KVCachePolicySpec.model_validate({"eviction": {"protectedPercent": 0}})
    policy = WorkloadAwarePolicy(ctx(spec))
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


def test_bucketed_and_exact_pick_alike_on_a_pool():
    """On a small replay both implementations agree on most victims (decision quality)."""
    rng = random.Random(5)
    hits = {}
    for name in ("workload_aware", "workload_aware_exact"):
        spec = KVCachePolicySpec.model_validate(
            {"pageSize": 4, "eviction": {"policy": name}, "pinning": {"autoPin": {"enabled": False}}}
        )
        pool = PagePool(60, spec, clock=lambda: 0.0)
        rng.seed(5)
        total = 0
        for i in range(600):
            conv = rng.randrange(40)
            tokens = [conv] * 8 + [rng.randrange(3) for _ in range(rng.randrange(4, 20))]
            meta = WorkloadMeta(turn=rng.randrange(3))
            total += pool.admit(str(i), tokens, meta=meta, now=float(i)).num_cached_tokens
            pool.commit(str(i), len(tokens), now=float(i))
            pool.release(str(i), now=float(i))
        pool.check_invariants()
        hits[name] = total
    assert hits["workload_aware"] >= 0.9 * hits["workload_aware_exact"]


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
    data["eviction"]["policy"] = "workload_aware"
    pool.reconfigure(KVCachePolicySpec.model_validate(data))
    pool.check_invariants()
    assert all(pool.lookup([i] * 8) == 8 for i in range(5))
    assert pool.policies[0].name == "workload_aware"


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


@pytest.mark.parametrize("seed", range(3))
def test_the_score_has_one_formula(seed: int) -> None:
    """The score lives in policies/scoring.py; its copies are pinned to it exactly: P_reuse inlined in
    ``Scoring.base_rank`` equals ``workload.p_reuse``, and the bucketed policy's cached ranks equal
    ``Scoring.rank`` (its bulk loop's inlined copy is pinned to those by the bulk-equals-one-by-one
    test above)."""
    from kvpool_sidecar.workload import p_reuse, reuse_within

    rng = random.Random(seed)
    policy, now = filled("workload_aware", seed)
    for _ in range(200):
        p, lam, window, age = rng.uniform(0.01, 0.99), rng.uniform(1e-4, 1.0), rng.uniform(1, 900), rng.uniform(0, 2000)
        fresh, base = policy.base_rank(p, lam, window, reuse_within(lam, window), age)
        assert fresh == (age <= window)
        assert base == policy.alpha * p_reuse(p, lam, age, reuse_within(lam, window)) + (policy.gamma if fresh else 0.0)
    entries = [e for e in policy._entry if e is not None]
    assert len(entries) > 100
    for entry in entries:
        klass, released, level = entry[2], entry[3], entry[4]
        assert policy._ranked(entry, now)[:2] == policy.rank(klass, level, now - released)
    exact = make_policy("workload_aware_exact", ctx())
    assert exact.rank(CHAT, 7, 30.0) == policy.rank(CHAT, 7, 30.0)  # the same function for both
