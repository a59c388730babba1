"""Random interleavings of every pool operation across two tenants and two classes, with live
reconfiguration (policy switch, partition resize, pin quota, auto-pin) and idle pre-eviction.

A reference model tracks, by content, which prefixes were published and by which physical page, so
that while nothing has been evicted the pool's hit counts must match the model exactly; once
evictions happen they can only be lower.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies import NO_PAGE, LRUPolicy, PolicyContext, PolicyFactory, has_unnamed_child
from kvpool_sidecar.pool import (
    TO_B,
    TO_C,
    PagePool,
    PoolExhausted,
    QuotaExceeded,
    WorkloadMeta,
    chain_token_keys,
    first_page_digest,
    tenant_salt,
)

PS = 2
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36]]
SHARED_FIRST = first_page_digest(BASES[2], PS)


REQUEST = {  # a prompt: a prefix of a base prompt, a suffix, a tenant, a workload class
    "base": st.sampled_from(BASES),
    "cut": st.integers(0, 10),
    "suffix": st.lists(st.integers(0, 3), max_size=5),
    "tenant": st.sampled_from(["acme", "globex"]),
    "klass": st.sampled_from([TO_C, TO_B]),
}


class ShuffledInBulk(LRUPolicy):
    """Names victims in a random order, in bulk, stopping after a page with a child it has not named:
    parents come before their children all the time, so the pool's cascades run on every path."""

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        super().__init__(ctx)
        self._rng = random.Random(0)

    def victim(self, now: float) -> int:
        page = self._rng.choice(self.order())
        self.take(page, now, False)
        return page

    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        named: dict[int, None] = {}
        for _ in range(count):
            page = self.victim(now)
            named[page] = None
            if has_unnamed_child(page, links, named):
                break
        return list(named)


class ShuffledInBulkRestored(ShuffledInBulk):
    """The same order, never stopping: the pool puts back the victims named after a cascade."""

    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        return [self.victim(now) for _ in range(count)]

    def restore(self, pages: list[int]) -> None:
        self.insert(pages, [0] * len(pages), len(pages), 0.0, None)


class PoolMachine(RuleBasedStateMachine):
    pages = 60
    policy = "lru"
    policy_factory: PolicyFactory | None = None

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        spec = self.spec(self.policy, to_b=30, quota=20, auto_pin=False)
        self.pool = PagePool(self.pages, spec, policy_factory=self.policy_factory, clock=lambda: self.now)
        self.ids = itertools.count()
        # model: content scope -> published prefix (tuple) -> page identity
        self.published: dict[tuple, object] = {}
        self.ever: set[tuple] = set()
        self.seqs: dict[str, dict] = {}
        self.pins: list[str] = []

    @initialize()
    def start(self) -> None:
        pass

    @staticmethod
    def spec(policy: str, to_b: int, quota: int, auto_pin: bool) -> KVCachePolicySpec:
        return KVCachePolicySpec.model_validate({
            "pageSize": PS,
            "eviction": {"policy": policy},
            "workloads": {"toB": {"isolationPercent": to_b, "timeWindow": "2s"}, "toC": {"timeWindow": "3s"}},
            # Auto-pin: prompts of 3+ pages, and prefixes admitted more than once in 10 s.
            "pinning": {"quotaPercent": quota, "autoPin": {"enabled": auto_pin, "minPromptTokens": 3 * PS,
                                                           "minPrefixQPS": 0.1}},
            "tenancy": {"sharedPrefixes": [SHARED_FIRST]},
            "preEviction": {"enabled": True, "lowWatermarkPercent": 30},
        })

    @rule(policy=st.sampled_from(["lru", "fifo", "lfu", "s3fifo", "workload_adaptive"]),
          to_b=st.integers(0, 50),
          quota=st.integers(0, 30), auto_pin=st.booleans())
    def reconfigure(self, policy: str, to_b: int, quota: int, auto_pin: bool) -> None:
        """A hot reload: no cached page is lost (what the model says is published stays so), over-full
        partitions shrink as they evict, a lowered quota unpins the oldest pins."""
        before = self.pool.stats()
        before_ids = list(self.pool.pins)
        dropped = self.pool.reconfigure(self.spec(policy, to_b, quota, auto_pin))
        after = self.pool.stats()
        assert after.cached_pages == before.cached_pages and after.evictions == before.evictions
        assert after.pins == before.pins - len(dropped)
        if dropped:  # only as many as it took, oldest first
            assert before.pinned_pages > after.pin_quota_pages
            assert [p.pin_id for p in dropped] == list(before_ids)[: len(dropped)]

    @rule(weight=st.sampled_from([None, 0.0, 0.01, 0.3, 1.0]))
    def retune(self, weight: float | None) -> None:
        """What the self-tuner does on a switch: the adaptive policy's order changes, no page moves."""
        before = self.pool.stats()
        for policy in self.pool.policies:
            if policy.uses_frequency:
                policy.set_reuse_weight(weight)
        assert self.pool.stats() == before

    @rule(budget=st.integers(1, 20))
    def pre_evict(self, budget: int) -> None:
        """Idle pre-eviction frees only pages past their class window, at most ``budget`` of them."""
        before = self.pool.stats()
        counted = sum(n for (_, reason), n in self.pool.eviction.evictions_by.items() if reason == "pre_eviction")
        freed = self.pool.pre_evict(max_pages=budget)
        assert self.pool.stats().free_pages - before.free_pages == freed
        now_counted = sum(n for (_, reason), n in self.pool.eviction.evictions_by.items() if reason == "pre_eviction")
        assert now_counted - counted == freed  # every page freed counted once, as pre-eviction

    def scope(self, tokens: list[int], tenant: str) -> str:
        return "shared" if first_page_digest(tokens, PS) == SHARED_FIRST else tenant

    def prefixes(self, tokens: list[int], tenant: str) -> list[tuple]:
        scope = self.scope(tokens, tenant)
        return [(scope, tuple(tokens[: PS * (i + 1)])) for i in range(len(tokens) // PS)]

    @rule(**REQUEST)
    @precondition(lambda self: len(self.seqs) < 8)
    def admit(self, base: list[int], cut: int, suffix: list[int], tenant: str, klass: str) -> None:
        tokens = base[:cut] + suffix or [0]
        seq_id = f"s{next(self.ids)}"
        prefixes = self.prefixes(tokens, tenant)
        try:
            adm = self.pool.admit(seq_id, tokens, meta=WorkloadMeta(workload_class=klass, tenant=tenant))
        except PoolExhausted:
            return
        hits = 0
        for p in prefixes:
            if p not in self.published:
                break
            hits += 1
        if self.pool.evictions == 0:
            assert adm.num_cached_tokens == hits * PS
        else:
            upper = 0
            for p in prefixes:
                if p not in self.ever:
                    break
                upper += 1
            assert adm.num_cached_tokens <= upper * PS
        idents = [self.published.get(p) for p in prefixes[: adm.num_cached_tokens // PS]]
        idents += [object() for _ in range(len(adm.page_ids) - len(idents))]
        self.seqs[seq_id] = {"tokens": tokens, "prefixes": prefixes, "idents": idents, "done": 0,
                             "computed": adm.num_cached_tokens, "blocked": False, "len": len(tokens)}

    @rule(**REQUEST)
    @precondition(lambda self: len(self.seqs) < 8)
    def serve(self, base: list[int], cut: int, suffix: list[int], tenant: str, klass: str) -> None:
        """A whole request (admit, compute the prompt, release): what fills a pool with cached pages."""
        before = set(self.seqs)
        self.admit(base, cut, suffix, tenant, klass)
        for seq_id in set(self.seqs) - before:
            self.commit_to(seq_id, self.seqs[seq_id]["len"])
            self.pool.release(seq_id)
            del self.seqs[seq_id]

    @rule(**REQUEST, saved=st.integers(0, 12))
    @precondition(lambda self: len(self.seqs) < 8)
    def save_later(self, base: list[int], cut: int, suffix: list[int], tenant: str, klass: str, saved: int) -> None:
        """The connector's way: admitted holding its cached prefix only, its other pages taken when its blocks
        are saved (as many as its partition gives, maybe none: claims and the admission rule by evidence
        decide), committed and released. What it published is what the pool then serves of its prompt."""
        tokens = base[:cut] + suffix or [0]
        seq_id = f"s{next(self.ids)}"
        meta = WorkloadMeta(workload_class=klass, tenant=tenant)
        hits = len(self.pool.admit(seq_id, tokens, meta=meta, allocate=False).page_ids)
        grown = self.pool.grow(seq_id, min(saved, len(tokens) // PS) * PS)
        held = hits + len(grown)
        assert held <= len(tokens) // PS
        self.pool.commit(seq_id, held * PS)
        self.pool.release(seq_id)
        for p in self.prefixes(tokens, tenant)[: self.pool.lookup(tokens, meta=meta) // PS]:
            self.published.setdefault(p, object())
            self.ever.add(p)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.seqs))
    def commit(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[seq_id]
        self.commit_to(seq_id, data.draw(st.integers(s["computed"], s["len"])))

    def commit_to(self, seq_id: str, upto: int) -> None:
        s = self.seqs[seq_id]
        self.pool.commit(seq_id, upto)
        s["computed"] = upto
        # An upper bound of what can ever be cached: a prefix the model sees blocked by another
        # sequence's page is published after all when that page was evicted first.
        self.ever.update(s["prefixes"][: upto // PS])
        for i in range(s["done"], min(upto // PS, len(s["prefixes"]))):
            if s["blocked"]:
                break
            p = s["prefixes"][i]
            if p in self.published and self.published[p] is not s["idents"][i]:
                s["blocked"] = True
                break
            self.published[p] = s["idents"][i]
            self.ever.add(p)
            s["done"] = i + 1

    @rule(data=st.data(), n=st.integers(0, 5))
    @precondition(lambda self: bool(self.seqs))
    def append(self, data: st.DataObject, n: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        try:
            new = self.pool.append(seq_id, n)
        except PoolExhausted:
            return
        s = self.seqs[seq_id]
        s["len"] += n
        s["idents"] += [object() for _ in new]

    @rule(data=st.data())
    @precondition(lambda self: bool(self.seqs) and len(self.seqs) < 8)
    def fork(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        child = f"s{next(self.ids)}"
        try:
            res = self.pool.fork(seq_id, child)
        except PoolExhausted:
            return
        s = self.seqs[seq_id]
        full = s["len"] // PS
        idents = s["idents"][:full] + ([object()] if len(res.page_ids) > full else [])
        self.seqs[child] = {**s, "idents": idents, "done": min(s["done"], full)}

    @rule(data=st.data())
    @precondition(lambda self: bool(self.seqs))
    def release(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.pool.release(seq_id)
        del self.seqs[seq_id]

    @rule(base=st.sampled_from(BASES), cut=st.integers(2, 10), tenant=st.sampled_from(["acme", "globex"]),
          ttl=st.none() | st.floats(0.5, 5))
    def pin(self, base: list[int], cut: int, tenant: str, ttl: float | None) -> None:
        try:
            pin = self.pool.pin(base[:cut], meta=WorkloadMeta(tenant=tenant), ttl=ttl)
        except QuotaExceeded as err:
            stats = self.pool.stats()
            cached = self.pool.lookup(base[:cut], meta=WorkloadMeta(tenant=tenant)) // PS
            if err.field == "workloads.toB.isolationPercent":  # the pin would hold pages past a share
                assert any(p.owned - p.evictable + cached > p.capacity for p in stats.partitions.values())
            else:
                assert stats.pinned_pages + cached > stats.pin_quota_pages
            return
        except Exception as exc:  # nothing cached is a clean InvalidRequest
            assert "nothing" in str(exc)
            return
        self.pins.append(pin.pin_id)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.pins))
    def unpin(self, data: st.DataObject) -> None:
        pin_id = data.draw(st.sampled_from(self.pins))
        self.pins.remove(pin_id)
        if pin_id in self.pool.pins:
            self.pool.unpin(pin_id)

    @rule(dt=st.floats(0.1, 3))
    def tick(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def invariants_hold(self) -> None:
        self.pool.check_invariants()  # I1-I9, I6 (pins within the quota) included

    @invariant()
    def keys_are_chained(self) -> None:
        """I3: a cached page's key is the chained key of its whole prefix (the first page salted by its
        tenant unless the prefix is shared), and its parent is the page of the prefix one page shorter."""
        pool = self.pool
        for scope, tokens in self.ever:
            salt = None if scope == "shared" else tenant_salt(scope)
            keys = chain_token_keys(list(tokens), PS, salt, frozenset([SHARED_FIRST]))
            page = pool.table.index.get(keys[-1])
            if page is None:
                continue
            assert pool.table.key[page] == keys[-1]
            parent = pool.table.parent[page]
            if len(keys) == 1:
                assert parent == NO_PAGE, f"I3: first page {page} has a parent"
            else:
                assert parent != NO_PAGE and pool.table.key[parent] == keys[-2], f"I3: page {page}'s parent is wrong"


class RoomyPool(PoolMachine):
    pages = 2000


class TightAdaptivePool(PoolMachine):
    """The self-tuned policy: queues by count, prefix-closed, named in bulk."""

    pages = 20  # full most of the time: the three base prompts alone publish more than that
    policy = "workload_adaptive"


class TightShuffledPool(PoolMachine):
    pages = 20
    policy_factory = ShuffledInBulk


class TightShuffledRestoredPool(PoolMachine):
    pages = 20
    policy_factory = ShuffledInBulkRestored


TestTightPool = PoolMachine.TestCase
TestTightPool.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)
TestRoomyPool = RoomyPool.TestCase
TestRoomyPool.settings = settings(
    max_examples=20, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)
for machine in (TightShuffledPool, TightShuffledRestoredPool, TightAdaptivePool):
    machine.TestCase.settings = settings(
        max_examples=25, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
    )
TestTightShuffledPool = TightShuffledPool.TestCase
TestTightShuffledRestoredPool = TightShuffledRestoredPool.TestCase
TestTightAdaptivePool = TightAdaptivePool.TestCase
