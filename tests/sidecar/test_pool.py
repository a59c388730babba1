"""The pool's invariants (ARCHITECTURE.md), one behaviour per test."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.keys import MAX_REQUEST_TYPES, OTHER_REQUEST_TYPES
from kvpool_sidecar.policies import LRUPolicy
from kvpool_sidecar.pool import (
    TO_B,
    TO_C,
    DuplicateSequence,
    InvalidRequest,
    PagePool,
    PoolExhausted,
    QuotaExceeded,
    UnknownPin,
    UnknownSequence,
    WorkloadMeta,
    first_page_digest,
)

PS = 4


def make_pool(pages: int = 40, **spec: object) -> PagePool:
    base: dict = {"pageSize": PS, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}}}
    for key, value in spec.items():
        base[key] = value
    return PagePool(pages, KVCachePolicySpec.model_validate(base), clock=lambda: 0.0)


def run(pool: PagePool, seq: str, tokens: list[int], meta: WorkloadMeta = WorkloadMeta()) -> int:
    """Admit, compute, commit and release one request; returns its cached tokens."""
    cached = pool.admit(seq, tokens, meta=meta).num_cached_tokens
    pool.commit(seq, len(tokens))
    pool.release(seq)
    pool.check_invariants()
    return cached


def snapshot(pool: PagePool) -> tuple:
    return (
        pool.stats(),
        list(pool.table.ref),
        dict(pool.table.index),
        list(pool.table.free),
        list(pool.table.pins),
        [p.order() for p in pool.policies],  # type: ignore[attr-defined]
        sorted(pool.pins),
    )


def test_prefix_reuse_counts_full_pages_only():
    pool = make_pool()
    assert run(pool, "a", list(range(10))) == 0
    # 10 tokens = 2 full pages + a partial page; the partial page is never shared.
    assert run(pool, "b", list(range(10))) == 8
    assert run(pool, "c", list(range(8)) + [77, 78]) == 8
    assert run(pool, "d", [1, *range(1, 10)]) == 0
    assert pool.lookup(list(range(12))) == 8


def test_nothing_is_shared_before_commit():
    pool = make_pool()
    pool.admit("a", list(range(12)))
    assert pool.lookup(list(range(12))) == 0
    assert pool.admit("b", list(range(12))).num_cached_tokens == 0
    pool.commit("a", 5)  # one full page written
    assert pool.lookup(list(range(12))) == 4
    pool.check_invariants()


def test_no_leak_after_everything_is_released():
    pool = make_pool()
    for i in range(30):
        run(pool, f"s{i}", [i % 3] * 6 + [i] * 7)
    st = pool.stats()
    assert st.sequences == 0 and st.in_use_pages == 0
    assert st.free_pages + st.cached_pages == st.total_pages


def test_tenants_never_hit_each_other_unless_the_prefix_is_shared():
    system_prompt = [9, 9, 9, 9, 1, 2, 3, 4]
    pool = make_pool()
    assert run(pool, "a", system_prompt + [5], WorkloadMeta(tenant="acme")) == 0
    assert run(pool, "b", system_prompt + [5], WorkloadMeta(tenant="globex")) == 0
    assert run(pool, "c", system_prompt + [5], WorkloadMeta(tenant="acme")) == 8
    shared = make_pool(tenancy={"sharedPrefixes": [first_page_digest(system_prompt, PS)]})
    assert run(shared, "a", system_prompt + [5], WorkloadMeta(tenant="acme")) == 0
    assert run(shared, "b", system_prompt + [6], WorkloadMeta(tenant="globex")) == 8


def test_block_hash_input_is_isolated_per_tenant_and_partial_block_not_cached():
    pool = make_pool()
    pool.admit("a", block_hashes=[10, 11, 12], num_tokens=10)  # last block is partial
    pool.commit("a", 10)
    pool.release("a")
    assert pool.lookup(block_hashes=[10, 11, 12], num_tokens=12) == 8
    assert pool.lookup(block_hashes=[10, 11], meta=WorkloadMeta(tenant="other")) == 0
    with pytest.raises(InvalidRequest, match="does not fit"):
        pool.lookup(block_hashes=[10, 11], num_tokens=9)


class RootFirst(LRUPolicy):
    """Evicts the most recently inserted page: release inserts tails first, so that is a root."""

    victims = None  # type: ignore[assignment]  # named one at a time

    def victim(self, now: float) -> int:
        page = self.order()[-1]
        self.take(page, now, False)
        return page


class RootsFirstInBulk(LRUPolicy):
    """The same order, named in bulk: the pool must hand back the victims after a cascade."""

    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        return [RootFirst.victim(self, now) for _ in range(count)]  # type: ignore[arg-type]

    def restore(self, pages: list[int]) -> None:
        self.insert(pages[::-1], [0] * len(pages), len(pages), 0.0, None)


def one_partition_pool(pages: int, policy: type[LRUPolicy]) -> PagePool:
    spec = KVCachePolicySpec.model_validate({"pageSize": PS, "workloads": {"toB": {"isolationPercent": 0}}})
    return PagePool(pages, spec, policy_factory=policy, clock=lambda: 0.0)


@pytest.mark.parametrize("policy", [RootFirst, RootsFirstInBulk])
def test_eviction_takes_descendants_with_their_parent(policy: type[LRUPolicy]) -> None:
    pool = one_partition_pool(6, policy)
    run(pool, "a", list(range(12)))  # a 3-page chain
    assert pool.stats().cached_pages == 3
    pool.admit("b", [7] * 16)  # needs 4 pages: 3 free, so one eviction, which must take the whole chain
    pool.check_invariants()
    assert pool.lookup(list(range(12))) == 0
    assert pool.stats().evictions == 3
    assert pool.eviction.evictions_by == {("toC", "capacity"): 3}  # the chain is counted whole (the metric reads this)


@pytest.mark.parametrize("policy", [RootFirst, RootsFirstInBulk])
def test_a_cascade_ends_the_evictions_and_victims_named_in_bulk_go_back(policy: type[LRUPolicy]) -> None:
    pool = one_partition_pool(8, policy)
    run(pool, "a", list(range(100, 104)))  # one page
    run(pool, "b", list(range(12)))  # a 3-page chain, released last: its root is the first victim
    assert pool.stats().free_pages == 4
    pool.admit("c", [7] * 24)  # 6 pages: 4 free, then the chain's root, which takes the chain along
    pool.check_invariants()
    assert pool.lookup(list(range(12))) == 0
    assert pool.lookup(list(range(100, 104))) == 4, "the other page was named but not needed"
    assert pool.stats().evictions == 3


def test_a_bulk_policy_that_names_no_victim_is_an_error_not_a_hang() -> None:
    class Mute(LRUPolicy):
        def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
            return []

    pool = one_partition_pool(4, Mute)
    run(pool, "a", list(range(16)))  # the pool is full of cached pages
    with pytest.raises(RuntimeError, match="named no victim"):
        pool.admit("b", [7] * 4)


def test_pages_in_use_are_never_evicted_and_exhaustion_changes_nothing():
    pool = make_pool(10, workloads={"toB": {"isolationPercent": 0}})
    pool.admit("a", list(range(24)))  # 6 pages in use
    run(pool, "b", [5] * 8)  # 2 cached pages
    before = snapshot(pool)
    with pytest.raises(PoolExhausted) as err:
        pool.admit("c", [6] * 28)
    assert (err.value.needed, err.value.evictable) == (7, 4)
    assert snapshot(pool) == before
    pool.check_invariants()
    pool.admit("c", [6] * 16)  # fits by evicting the 2 cached pages, never a page of "a"
    assert list(pool.sequences.get("a").pages) == list(range(6))
    pool.check_invariants()


def test_pin_protects_a_prefix_and_quota_is_enforced():
    pool = make_pool(10, workloads={"toB": {"isolationPercent": 0}}, pinning={"quotaPercent": 20})
    run(pool, "a", list(range(8)))
    pin = pool.pin(list(range(8)))
    assert len(pin.pages) == 2 and pool.stats().pinned_pages == 2
    again = pool.pin(list(range(4)))  # a second record on the same pages, under an unguessable id
    assert again.pin_id != pin.pin_id and len(again.pin_id) == len("pin-") + 24
    pool.unpin(again.pin_id)
    run(pool, "b", [1] * 8)
    before = snapshot(pool)
    with pytest.raises(QuotaExceeded, match="pin quota"):
        pool.pin([1] * 8)
    assert snapshot(pool) == before
    # Churn through the whole pool: the pinned prefix survives.
    for i in range(20):
        run(pool, f"x{i}", [100 + i] * 16)
    assert pool.lookup(list(range(8))) == 8
    pool.unpin(pin.pin_id)
    with pytest.raises(UnknownPin):
        pool.unpin(pin.pin_id)
    for i in range(20):
        run(pool, f"y{i}", [200 + i] * 16)
    assert pool.lookup(list(range(8))) == 0


def test_ttl_pin_lapses_on_its_own():
    now = [0.0]
    pool = PagePool(
        10,
        KVCachePolicySpec.model_validate({"pageSize": PS, "eviction": {"policy": "lru"}}),
        clock=lambda: now[0],
    )
    run(pool, "a", list(range(8)))
    pool.pin(list(range(8)), ttl=5.0)
    now[0] = 4.0
    pool.admit("b", [1] * 4)
    assert pool.stats().pins == 1
    now[0] = 6.0
    pool.admit("c", [2] * 4)
    assert pool.stats().pins == 0 and pool.stats().pinned_pages == 0
    pool.check_invariants()


def test_pins_that_expire_together_lapse_in_the_order_they_were_made():
    """A replay repeats itself: pins with one expiry give their pages back to the policy in the order
    they were pinned, not in the order of their random ids (under LRU that order is the eviction order)."""
    pool = make_pool(40, pinning={"quotaPercent": 50, "autoPin": {"enabled": False}})
    prompts = [[100 * i + j for j in range(2 * PS)] for i in range(8)]
    for i, prompt in enumerate(prompts):
        run(pool, f"s{i}", prompt)
    pages_of = [pool.pin(prompt, ttl=5.0, now=1.0).pages for prompt in prompts]
    pool.expire_pins(now=10.0)
    owner = {page: i for i, pages in enumerate(pages_of) for page in pages}
    order = [owner[page] for page in pool.policies[0].order()]  # type: ignore[attr-defined]
    assert order == sorted(order) and len(order) == 16
    pool.check_invariants()


def test_pin_by_sequence_and_errors():
    pool = make_pool()
    pool.admit("a", list(range(10)))
    with pytest.raises(InvalidRequest, match="nothing"):
        pool.pin(seq_id="a")  # nothing committed yet
    pool.commit("a", 10)
    assert len(pool.pin(seq_id="a").pages) == 2
    with pytest.raises(UnknownSequence):
        pool.pin(seq_id="zzz")
    pool.release("a")
    pool.check_invariants()


def test_auto_pin_long_prompts_for_their_class_window():
    now = [0.0]
    pool = PagePool(
        40,
        KVCachePolicySpec.model_validate(
            {"pageSize": PS, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"minPromptTokens": 12}}}
        ),
        clock=lambda: now[0],
    )
    run(pool, "short", [3] * 8)
    assert pool.stats().pins == 0
    run(pool, "long", list(range(12)), WorkloadMeta(workload_class=TO_B))
    assert pool.stats().pins == 1 and pool.pinning.autopins == 1
    now[0] = 11.0  # past the to-B window of 10 s
    pool.admit("z", [1] * 4)
    assert pool.stats().pins == 0


def test_auto_pin_hot_prefixes_by_qps():
    now = [0.0]
    spec = {"pageSize": PS, "eviction": {"policy": "lru"},
            "pinning": {"quotaPercent": 30, "autoPin": {"minPromptTokens": 10_000, "minPrefixQPS": 2}}}
    pool = PagePool(40, KVCachePolicySpec.model_validate(spec), clock=lambda: now[0])
    system = list(range(8))  # a shared 2-page system prompt
    for i in range(10):  # one request every 2 s: 0.5/s, below 2/s
        now[0] = 2.0 * i
        run(pool, f"slow{i}", system + [100 + i] * 4)
    assert pool.stats().pins == 0
    for i in range(30):  # ten a second: hot
        now[0] = 100.0 + 0.1 * i
        run(pool, f"hot{i}", system + [200 + i] * 4)
    pins = list(pool.pins.values())
    assert len(pins) == 1 and pool.pinning.autopins == 1  # pinned once, not once per request
    assert len(pins[0].pages) == 2 and pins[0].expires_at == pytest.approx(100.0 + 0.1 * 20 + 600, abs=1.0)
    assert pool.lookup(system) == 8
    # The pinned system prompt survives a flood that evicts everything else.
    for i in range(60):
        now[0] = 200.0 + i
        run(pool, f"flood{i}", [5000 + i] * 16)
    assert pool.lookup(system) == 8
    now[0] = 2000.0  # past the to-C window: the soft pin lapsed
    pool.admit("late", [1] * 4)
    assert pool.stats().pins == 0


def test_auto_pin_by_qps_respects_the_quota():
    now = [0.0]
    spec = {"pageSize": PS, "eviction": {"policy": "lru"},
            "pinning": {"quotaPercent": 5, "autoPin": {"minPromptTokens": 10_000, "minPrefixQPS": 1}}}
    pool = PagePool(40, KVCachePolicySpec.model_validate(spec), clock=lambda: now[0])  # quota: 2 pages
    prompt = list(range(12))  # 3 shared pages: more than the quota
    for i in range(30):
        now[0] = 0.05 * i
        run(pool, f"s{i}", prompt + [300 + i] * 4)
    assert pool.stats().pins == 0 and pool.pinning.autopins == 0 and pool.pinning.autopins_refused > 0


def test_to_b_churn_never_evicts_to_c_pages():
    pool = make_pool(20, workloads={"toB": {"isolationPercent": 30}})  # 6 to-B pages, 14 to-C
    run(pool, "chat", list(range(16)))  # 4 to-C pages
    for i in range(50):
        run(pool, f"api{i}", [1000 + i] * 12, WorkloadMeta(workload_class=TO_B))
    assert pool.lookup(list(range(16))) == 16
    st = pool.stats()
    assert st.partitions[TO_B].owned <= 6 and st.partitions[TO_C].owned == 4
    with pytest.raises(PoolExhausted, match="toB"):
        pool.admit("big", [5] * 28, meta=WorkloadMeta(workload_class=TO_B))
    # ...and to-C churn never evicts to-B pages.
    run(pool, "api-last", [7] * 8, WorkloadMeta(workload_class=TO_B))
    for i in range(30):
        run(pool, f"chat{i}", [2000 + i] * 16)
    assert pool.lookup([7] * 8, meta=WorkloadMeta(workload_class=TO_B)) == 8


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "workload_adaptive"])
def test_to_c_borrows_to_b_idle_share_and_gives_it_back_one_eviction_per_page(policy: str):
    """The shipped 30 % to-B share is a floor, not a fence: with to-C traffic only, to-C caches in
    the whole pool; a to-B burst gets every page of its share back at one eviction per page, and never
    more than its share; to-C's pages in use stay within its own share, so to-B's is always reclaimable."""
    pool = make_pool(100, eviction={"policy": policy})  # default isolationPercent: 30
    to_b = WorkloadMeta(workload_class=TO_B)
    for i in range(40):
        run(pool, f"c{i}", [1000 + i] * PS * 5)  # 200 pages of to-C prompts through a 100-page pool
    st = pool.stats()
    assert st.cached_pages == 100 and st.partitions[TO_C].borrowed == 30
    before = pool.evictions
    for i in range(6):
        pool.admit(f"b{i}", [2000 + i] * PS * 5, meta=to_b)  # 30 pages in use: to-B's whole share
    st = pool.stats()
    assert pool.evictions - before == 30
    assert st.partitions[TO_B].owned == 30 and st.partitions[TO_C].borrowed == 0
    with pytest.raises(PoolExhausted, match="toB"):
        pool.admit("b-more", [3000] * PS, meta=to_b)
    pool.check_invariants()
    for i in range(6):
        pool.release(f"b{i}")
    held = [pool.admit(f"long{i}", [4000 + i] * PS * 10) for i in range(7)]  # to-C's share in use
    assert sum(len(a.page_ids) for a in held) == 70
    with pytest.raises(PoolExhausted, match="toC"):
        pool.admit("c-more", [5000] * PS)  # to-B's 30 cached pages are its own: to-C may not evict them
    pool.check_invariants()


def test_fork_shares_full_pages_and_copies_the_partial_one():
    pool = make_pool()
    adm = pool.admit("a", list(range(10)))
    pool.commit("a", 10)
    forked = pool.fork("a", "b")
    assert forked.page_ids[:2] == adm.page_ids[:2]
    assert forked.copy_src == adm.page_ids[2] and forked.copy_dst not in adm.page_ids
    pool.check_invariants()
    new = pool.append("b", 3)  # 13 tokens: crosses into a 4th page
    assert len(new) == 1 and len(pool.sequences.get("b").pages) == 4
    assert pool.append("a", 2) == []
    pool.release("a")
    pool.release("b")
    pool.check_invariants()
    with pytest.raises(DuplicateSequence):
        pool.admit("c", [1]) and pool.fork("c", "c")


def test_fragmentation_accounting():
    pool = make_pool()
    pool.admit("a", list(range(10)))  # 3 pages = 12 slots for 10 tokens
    assert pool.stats().fragmentation_tokens == 2
    pool.append("a", 1)
    assert pool.stats().fragmentation_tokens == 1
    pool.release("a")
    assert pool.stats().fragmentation_tokens == 0


@pytest.mark.parametrize(
    ("call", "error", "field"),
    [
        (lambda p: p.admit("a", [1, 2]), DuplicateSequence, "seq_id"),
        (lambda p: p.admit("n", []), InvalidRequest, "tokens"),
        (lambda p: p.admit("n", [1, -1, "x"]), InvalidRequest, "tokens"),
        (lambda p: p.admit("n", [1], block_hashes=[1]), InvalidRequest, "tokens"),
        (lambda p: p.admit("n", block_hashes=[[1]]), InvalidRequest, "block_hashes"),
        (lambda p: p.commit("a", 99), InvalidRequest, "num_computed_tokens"),
        (lambda p: p.commit("zz", 1), UnknownSequence, "seq_id"),
        (lambda p: p.append("a", -1), InvalidRequest, "num_new_tokens"),
        (lambda p: p.release("zz"), UnknownSequence, "seq_id"),
        (lambda p: p.fork("a", "a"), DuplicateSequence, "new_seq_id"),
        (lambda p: p.pin([1, 2, 3, 4], ttl=-1), InvalidRequest, "ttl"),
        (lambda p: p.admit("n", list(range(4 * 41))), PoolExhausted, ""),
    ],
)
def test_bad_calls_raise_typed_errors_and_change_nothing(call, error, field):
    pool = make_pool()
    pool.admit("a", list(range(6)))
    pool.commit("a", 4)
    before = snapshot(pool)
    with pytest.raises(error) as err:
        call(pool)
    assert err.value.field == field
    assert snapshot(pool) == before
    pool.check_invariants()


def test_live_reconfigure_keeps_pages_and_refuses_page_size_change():
    pool = make_pool(20)
    run(pool, "a", list(range(16)))
    with pytest.raises(InvalidRequest, match="restart"):
        pool.reconfigure(KVCachePolicySpec(pageSize=8))
    pool.reconfigure(
        KVCachePolicySpec.model_validate({"pageSize": PS, "workloads": {"toB": {"isolationPercent": 90}},
                                          "pinning": {"quotaPercent": 5}})
    )
    assert pool.lookup(list(range(16))) == 16
    # to-C is now over its share of 2 pages: it keeps them while to-B leaves its share idle...
    run(pool, "b", [5] * 8)
    assert pool.stats().partitions[TO_C].borrowed == 4
    # ...and gives them back, one eviction each, when to-B needs its whole share of 18.
    before = pool.evictions
    pool.admit("to-b", [9] * 4 * 18, meta=WorkloadMeta(workload_class=TO_B))
    st = pool.stats()
    assert st.partitions[TO_B].owned == 18 and st.partitions[TO_C].borrowed == 0
    assert pool.evictions - before == 4
    pool.check_invariants()


def test_class_by_chooses_what_splits_the_reuse_statistics():
    def classes_after(class_by: list[str]) -> set:
        spec = KVCachePolicySpec.model_validate(
            {"pageSize": 4, "eviction": {"policy": "lru"}, "learning": {"classBy": class_by}}
        )
        pool = PagePool(32, spec, clock=lambda: 0.0)
        for i, (rtype, turn) in enumerate([("text", 0), ("file", 3), ("text", 1)]):
            meta = WorkloadMeta(request_type=rtype, turn=turn)
            pool.admit("s", block_hashes=[i, 100 + i], meta=meta, now=float(i))
            pool.commit("s", 8)
            pool.release("s", now=float(i))
            pool.admit("again", block_hashes=[i, 100 + i], meta=meta, now=i + 0.5)  # a reuse to fit
            pool.release("again", now=i + 0.5)
        return {k for k in pool.model.classes() if len(k) == 3}

    assert classes_after(["requestType", "turn"]) == {("toC", "text", 0), ("toC", "file", 3), ("toC", "text", 1)}
    assert classes_after(["turn"]) == {("toC", "", 0), ("toC", "", 3), ("toC", "", 1)}
    assert classes_after([]) == {("toC", "", 0)}


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "s3fifo", "workload_adaptive"])
def test_a_partition_under_its_new_share_takes_its_own_victims_when_the_other_has_none(policy: str):
    """Found by the stateful test's live reconfiguration: after to-B's share is cut below what it holds,
    a to-C request that finds no free page, and to-B's pages all in use, evicts its own pages; it used
    to ask to-B's empty policy for a victim (a crash, or a corrupt pool, depending on the policy)."""
    pool = make_pool(8, workloads={"toB": {"isolationPercent": 50}}, eviction={"policy": policy})
    to_b, to_c = WorkloadMeta(workload_class=TO_B), WorkloadMeta(workload_class=TO_C)
    pool.admit("b1", [1] * PS * 4, meta=to_b)  # to-B's 4 pages, in use throughout
    run(pool, "c1", [7] * PS * 4, to_c)  # to-C's 4 pages, cached
    pool.reconfigure(KVCachePolicySpec.model_validate(
        {"pageSize": PS, "eviction": {"policy": policy}, "pinning": {"autoPin": {"enabled": False}},
         "workloads": {"toB": {"isolationPercent": 10}}}))  # to-B's share: 0 pages; to-C's: 8
    adm = pool.admit("c2", [8] * PS * 2, meta=to_c)  # no free page; to-B has nothing evictable
    assert len(adm.page_ids) == 2 and adm.evicted_pages >= 2  # FIFO takes the whole chain from its head
    pool.check_invariants()
    assert pool.lookup([7] * PS * 4, meta=to_c) <= 2 * PS


def test_a_flood_of_long_prompts_cannot_starve_later_ones_of_auto_pins():
    """Auto-pins yield to newer ones, oldest first: the quota holds the most recent long prompts, never
    only the first client's; a caller's own pin displaces auto-pins too, and one that cannot fit even so
    changes nothing."""
    now = [0.0]
    spec = {"pageSize": PS, "eviction": {"policy": "lru"},
            "pinning": {"quotaPercent": 25, "autoPin": {"minPromptTokens": 12}}}
    pool = PagePool(80, KVCachePolicySpec.model_validate(spec), clock=lambda: now[0])  # quota: 20 pages
    for i in range(12):  # the flood: 12 long prompts of 4 pages each, 48 pages against a 20-page quota
        now[0] = float(i)
        run(pool, f"flood{i}", [1000 + i] * 16)
    assert pool.stats().pinned_pages <= pool.pinning.quota
    assert pool.pinning.autopins == 12 and pool.pinning.autopins_displaced >= 7 and pool.pinning.autopins_refused == 0
    victim = list(range(16))
    now[0] = 20.0
    run(pool, "victim", victim)
    assert any(r.auto and len(r.pages) == 4 and r.expires_at == 620.0 for r in pool.pins.values())  # pinned
    # A caller's pin (the first flood prompt's pages, cached but no longer pinned) makes room the same way ...
    record = pool.pin(tokens=[1000] * 16)
    assert not record.auto and pool.stats().pinned_pages <= pool.pinning.quota
    # ... but a pin too big even once every auto-pin lapsed is refused and lapses none of them.
    autos = {k for k, r in pool.pins.items() if r.auto}
    run(pool, "huge", list(range(500, 600)))  # 25 pages: its auto-pin cannot fit the 20-page quota
    assert pool.pinning.autopins_refused == 1
    with pytest.raises(QuotaExceeded):
        pool.pin(tokens=list(range(500, 600)))
    assert {k for k, r in pool.pins.items() if r.auto} == autos
    pool.check_invariants()


def test_a_failing_observer_never_fails_an_admission_nor_leaks_a_page():
    """The reuse model, the sketch and the self-tuner observe the pool; when one raises (a bug, a C
    extension's error), the admission it observed still succeeds, every page stays accounted for (I1-I9)
    and the failure is counted."""
    spec = KVCachePolicySpec.model_validate({"pageSize": PS})  # the default policy, self-tuned
    pool = PagePool(64, spec, clock=lambda: 0.0)
    assert pool.tuners(), "the default policy runs a self-tuner"

    def broken(*_: object) -> None:
        raise RuntimeError("observer bug")

    for tuner in pool.tuners().values():
        tuner.observe = broken
    pool.frequencies._sketch.add = broken
    pool.model.observe_reuse = broken
    pool.model.observe_release = broken
    for i in range(40):  # enough to fill the pool and evict: hits, reuses and evictions all observed
        prompt = list(range(8)) + [100 + i] * 8
        adm = pool.admit(f"s{i}", prompt)
        assert len(adm.page_ids) == 4
        pool.commit(f"s{i}", len(prompt))
        pool.release(f"s{i}")
    pool.check_invariants()
    st = pool.stats()
    assert st.free_pages + st.cached_pages == 64 and st.sequences == 0
    assert pool.lookup(list(range(8)) + [139] * 8) == 16
    assert pool.observer_errors >= 80  # each admission's count and release, at least


def test_a_chunked_long_prompt_has_one_auto_pin_and_a_long_pin_lapses_in_slices():
    """Auto-pin keeps one record per sequence, grown by its chunked commits; when a long pin expires,
    the admission that notices lapses one bounded slice of it, the rest lapse on later calls."""
    from kvpool_sidecar.pool.pins import LAPSE_PAGES_PER_CALL

    now = [0.0]
    spec = {"pageSize": PS, "eviction": {"policy": "lru"},
            "pinning": {"quotaPercent": 50, "autoPin": {"minPromptTokens": 16}}}
    pool = PagePool(2000, KVCachePolicySpec.model_validate(spec), clock=lambda: now[0])
    tokens = list(range(PS * 600))
    pool.admit("long", tokens)
    for done in range(PS * 100, PS * 600 + 1, PS * 100):  # six chunks
        pool.commit("long", done)
    assert pool.stats().pins == 1 and pool.stats().pinned_pages == 600
    pool.release("long")
    pool.check_invariants()
    now[0] = 1e6  # past every class window
    pool.admit("other", [7] * PS)
    assert pool.stats().pins == 0 and pool.pinning.lapsing_pages == 600 - LAPSE_PAGES_PER_CALL
    pool.check_invariants()
    pool.release("other")
    pool.expire_pins()
    assert pool.pinning.lapsing_pages == 0 and pool.stats().pinned_pages == 0
    assert pool.lookup(tokens) == len(tokens)  # lapsed, not dropped: still cached, evictable again
    pool.check_invariants()


@pytest.mark.parametrize(("before", "after"), [("lru", "s3fifo"), ("workload_adaptive", "lru"), ("fifo", "lfu")])
def test_a_policy_switch_hands_pages_over_in_slices_and_serves_meanwhile(before: str, after: str):
    """A live switch moves no page in the reconfigure call: the old policy keeps naming victims while a
    slice of its pages moves per call; nothing is lost, and the new policy ends up holding every page."""
    from kvpool_sidecar.pool.handover import Handover

    pool = make_pool(2000, eviction={"policy": before})
    for i in range(100):
        run(pool, f"c{i}", [1000 + i] * PS * 20)  # 2,000 cached pages
    pool.reconfigure(KVCachePolicySpec.model_validate({"pageSize": PS, "eviction": {"policy": after}}))
    assert all(isinstance(p, Handover) for p in pool.policies)  # nothing moved yet
    assert pool.stats().cached_pages == 2000
    hits = run(pool, "again", [1099] * PS * 20)  # served during the handover: a hit, then a release
    assert hits == PS * 20
    for i in range(3):
        run(pool, f"new{i}", [5000 + i] * PS * 20)  # evicts through the handover
    pool.check_invariants()
    while pool.settle(max_pages=100):
        pool.check_invariants()
    assert [p.name for p in pool.policies] == [after, after]
    assert pool.lookup([5002] * PS * 20) == PS * 20 and pool.lookup([1099] * PS * 20) == PS * 20
    pool.check_invariants()


def test_callers_cannot_make_the_pool_hold_a_class_per_request_type_they_invent():
    spec = KVCachePolicySpec.model_validate(
        {"pageSize": 4, "eviction": {"policy": "workload_adaptive"}, "learning": {"classBy": ["requestType"]}}
    )
    pool = PagePool(64, spec, clock=lambda: 0.0)
    for i in range(MAX_REQUEST_TYPES + 40):
        meta = WorkloadMeta(request_type=f"type-{i}")
        pool.admit("s", block_hashes=[i, 1000 + i], meta=meta, now=float(i))
        pool.commit("s", 8)
        pool.release("s", now=float(i))
        pool.admit("again", block_hashes=[i, 1000 + i], meta=meta, now=i + 0.5)
        pool.release("again", now=i + 0.5)
    types = {k[1] for k in pool.model.classes() if len(k) == 3}
    assert types == {f"type-{i}" for i in range(MAX_REQUEST_TYPES)} | {OTHER_REQUEST_TYPES}
    assert pool.class_of(WorkloadMeta(request_type="type-3")).request_type == "type-3"  # the known keep theirs
    pool.check_invariants()


def test_tenants_named_by_callers_hold_a_bounded_salt_cache_and_keep_their_own_keys():
    from kvpool_sidecar.pool.pool import MAX_CACHED_SALTS

    pool = make_pool(tenancy={"isolation": "perTenant"})
    run(pool, "t0", [1, 2, 3, 4, 5], WorkloadMeta(tenant="acme"))
    for i in range(MAX_CACHED_SALTS + 100):  # a trusted gateway naming a tenant per request
        pool.lookup([1, 2, 3, 4, 5], meta=WorkloadMeta(tenant=f"t{i}"))
    assert len(pool._salts) <= MAX_CACHED_SALTS  # the cache of salts is bounded
    assert pool.lookup([1, 2, 3, 4, 5], meta=WorkloadMeta(tenant="acme")) == 4  # acme's keys, recomputed alike
    assert pool.lookup([1, 2, 3, 4, 5], meta=WorkloadMeta(tenant="t1")) == 0


def saved_later(pool: PagePool, seq: str, hashes: list[str], meta: WorkloadMeta) -> list[int]:
    """The connector's way: admitted holding its hits only, grown when its blocks are saved, committed and
    released; returns the pages its grow took."""
    pool.admit(seq, block_hashes=hashes, meta=meta, allocate=False)
    grown = pool.grow(seq, len(hashes) * PS)
    pool.commit(seq, pool.sequences.get(seq).num_tokens)
    pool.release(seq)
    pool.check_invariants()
    return grown


@pytest.mark.parametrize("by_evidence", [True, False])
def test_a_save_of_a_class_shown_not_to_come_back_does_not_evict_a_page_that_holds_a_claim(by_evidence):
    """One shared LRU partition of 8 pages. to-B's prompts nobody sends again turn the pool over once (8
    pages released, none back: shown not to come back); to-C's prefix comes back. to-B's saves then evict
    to-B's own pages (no claim) until the next victim is the prefix's: there the save stops. Without the
    rule (admitByEvidence off) it evicts the prefix."""
    pool = make_pool(8, workloads={"toB": {"isolationPercent": 0}}, learning={"minSamples": 1},
                     eviction={"policy": "lru", "admitByEvidence": by_evidence})
    toc, tob = WorkloadMeta(workload_class="toC"), WorkloadMeta(workload_class="toB")
    for i in range(4):
        assert len(saved_later(pool, f"b{i}", [f"b{i}-0", f"b{i}-1"], tob)) == 2  # a new class: refused nothing
    prefix = [f"p{i}" for i in range(4)]
    assert len(saved_later(pool, "p", prefix, toc)) == 4
    for i in range(3):  # it comes back
        assert saved_later(pool, f"p-again{i}", prefix, toc) == []
    for i in (4, 5):  # the victims are to-B's old prompts: taken
        assert len(saved_later(pool, f"b{i}", [f"b{i}-0", f"b{i}-1"], tob)) == 2
    grown = saved_later(pool, "b6", ["b6-0", "b6-1"], tob)  # the next victim is the prefix's
    if by_evidence:
        assert grown == [] and pool.evidence_refused == 2
        assert pool.lookup(block_hashes=prefix, meta=toc) == 4 * PS  # the prefix stays whole
        assert len(saved_later(pool, "c", ["c-0"], toc)) == 1  # a to-C save evicts as the policy says
    else:
        assert len(grown) == 2 and pool.evidence_refused == 0
        assert pool.lookup(block_hashes=prefix, meta=toc) < 4 * PS


def flood_beside_a_prefix(tob_returns: bool, by_evidence: bool = True) -> tuple[PagePool, list[str]]:
    """A pool of 8 pages, to-B's share 4: to-C's 4-page prefix saved and come back, then to-B's share
    filled by two 2-page prompts that (``tob_returns``) one of which comes back, or never do."""
    pool = make_pool(8, workloads={"toB": {"isolationPercent": 50}}, learning={"minSamples": 1},
                     eviction={"policy": "lru", "admitByEvidence": by_evidence})
    toc, tob = WorkloadMeta(workload_class="toC"), WorkloadMeta(workload_class="toB")
    prefix = [f"p{i}" for i in range(4)]
    assert len(saved_later(pool, "p", prefix, toc)) == 4
    assert saved_later(pool, "p-again", prefix, toc) == []  # it comes back
    for i in range(2):
        assert len(saved_later(pool, f"b{i}", [f"b{i}-0", f"b{i}-1"], tob)) == 2
    if tob_returns:
        assert saved_later(pool, "b0-again", ["b0-0", "b0-1"], tob) == []
    assert pool.stats().free_pages == 0
    return pool, prefix


@pytest.mark.parametrize("by_evidence", [True, False])
def test_to_bs_share_protects_only_pages_of_a_class_that_comes_back(by_evidence):
    """to-B's share holds a flood nobody sends again; to-C needs two pages. With the rule the flood's
    pages (no claim) go before to-C's prefix, which came back; without it (admitByEvidence off) the
    share holds the flood and to-C evicts its own prefix."""
    pool, prefix = flood_beside_a_prefix(tob_returns=False, by_evidence=by_evidence)
    toc = WorkloadMeta(workload_class="toC")
    assert len(saved_later(pool, "c", ["c-0", "c-1"], toc)) == 2
    if by_evidence:
        assert pool.lookup(block_hashes=prefix, meta=toc) == 4 * PS
        assert pool.eviction.evictions_by == {("toB", "unclaimed"): 2}
    else:
        assert pool.lookup(block_hashes=prefix, meta=toc) < 4 * PS
        assert pool.eviction.evictions_by == {("toC", "capacity"): 2}


def test_to_bs_share_keeps_pages_of_a_class_that_comes_back():
    """The same, but to-B's prompts come back: its share holds, and to-C evicts its own prefix's tail."""
    pool, prefix = flood_beside_a_prefix(tob_returns=True)
    toc, tob = WorkloadMeta(workload_class="toC"), WorkloadMeta(workload_class="toB")
    assert len(saved_later(pool, "c", ["c-0", "c-1"], toc)) == 2
    assert pool.lookup(block_hashes=prefix, meta=toc) == 2 * PS
    assert pool.lookup(block_hashes=["b1-0", "b1-1"], meta=tob) == 2 * PS  # never came back itself


def test_a_flood_does_not_take_its_share_back_from_pages_that_come_back():
    """Once to-C holds the flood's share, a flood save does not evict to-C's pages to take its share
    back (they hold a claim, the flood none): it is refused; a to-B class that comes back gets its
    share back, one eviction of to-C's per page."""
    pool, prefix = flood_beside_a_prefix(tob_returns=False)
    toc, tob = WorkloadMeta(workload_class="toC"), WorkloadMeta(workload_class="toB")
    assert len(saved_later(pool, "c", ["c-0", "c-1"], toc)) == 2  # from the flood's share
    assert saved_later(pool, "b2", ["b2-0", "b2-1"], tob) == []
    assert pool.evidence_refused == 2
    assert pool.lookup(block_hashes=prefix, meta=toc) == 4 * PS
    assert saved_later(pool, "b1-again", ["b1-0", "b1-1"], tob) == []  # to-B's class comes back now
    assert len(saved_later(pool, "b3", ["b3-0", "b3-1"], tob)) == 2
    assert pool.eviction.evictions_by[("toC", "reclaimed")] == 2


def test_a_new_to_b_class_takes_its_share_back_from_pages_that_come_back():
    """to-C fills the whole pool, to-B's idle share included, with pages that come back; a to-B class the
    pool has no evidence about saves: it gets its share back (to-C's pages there are borrowed), never refused."""
    pool = make_pool(8, workloads={"toB": {"isolationPercent": 50}}, learning={"minSamples": 1},
                     eviction={"policy": "lru"})
    toc, tob = WorkloadMeta(workload_class="toC"), WorkloadMeta(workload_class="toB")
    for name in ("a", "b"):
        prefix = [f"{name}{i}" for i in range(4)]
        assert len(saved_later(pool, name, prefix, toc)) == 4
        assert saved_later(pool, f"{name}-again", prefix, toc) == []
    assert pool.stats().free_pages == 0
    for i in range(3):
        assert len(saved_later(pool, f"new{i}", [f"new{i}-0"], tob)) == 1
    assert pool.evidence_refused == 0
    assert pool.eviction.evictions_by[("toC", "reclaimed")] == 3


def test_a_page_past_its_window_holds_no_claim():
    """to-B's prompts come back, so their pages hold claims, but only for to-B's window (10 s): past it,
    to-C takes them before its own prefix, which came back within its own window (10 min)."""
    now = [0.0]
    pool = PagePool(8, KVCachePolicySpec.model_validate({
        "pageSize": PS, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}},
        "workloads": {"toB": {"isolationPercent": 50}}, "learning": {"minSamples": 1}}), clock=lambda: now[0])
    toc, tob = WorkloadMeta(workload_class="toC"), WorkloadMeta(workload_class="toB")
    prefix = [f"p{i}" for i in range(4)]
    assert len(saved_later(pool, "p", prefix, toc)) == 4
    assert saved_later(pool, "p-again", prefix, toc) == []
    for i in range(2):
        assert len(saved_later(pool, f"b{i}", [f"b{i}-0", f"b{i}-1"], tob)) == 2
        assert saved_later(pool, f"b{i}-again", [f"b{i}-0", f"b{i}-1"], tob) == []
    now[0] = 5.0  # within to-B's window: its share holds, to-C evicts its own prefix's tail
    assert len(saved_later(pool, "c", ["c-0"], toc)) == 1
    assert pool.lookup(block_hashes=prefix, meta=toc) == 3 * PS
    now[0] = 20.0  # past it: to-B's pages go first
    assert len(saved_later(pool, "d", ["d-0"], toc)) == 1
    assert pool.lookup(block_hashes=prefix, meta=toc) == 3 * PS
    assert pool.eviction.evictions_by[("toB", "unclaimed")] == 1
