"""One sidecar's state: the pool, the config in force, metrics, and the serialised access to both.

Pool operations are Python (two hot loops compiled) that take microseconds to a few hundred microseconds: they run
inline on the event loop under an asyncio lock, which serialises them without a thread hop (a
thread would make every call wait for the GIL behind the other). Work that can take milliseconds
(an admission that evicts thousands of pages, a policy switch that re-inserts every cached page)
runs on a worker thread while holding the same lock, so the loop keeps answering probes and scrapes
meanwhile; idle pre-eviction runs in small bounded steps.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from array import array
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from kvpool_sidecar.config import SidecarConfig, spec_hash
from kvpool_sidecar.keys import workload_class_of
from kvpool_sidecar.peers.keys import TransferKeys
from kvpool_sidecar.pool import PagePool, TooManyPins, UnknownPin, UnknownSequence, WorkloadMeta
from kvpool_sidecar.service.credentials import ADMIN, Principal
from kvpool_sidecar.service.metrics import SidecarMetrics
from kvpool_sidecar.service.prompts import EnginePins, PromptPins
from kvpool_sidecar.service.reloads import ConfigReloads, ConfigState
from kvpool_sidecar.service.removals import Removals
from kvpool_sidecar.storage import KVStorage
from kvpool_sidecar.workload import DriftEvent, StatsClass

log = logging.getLogger("kvpool.sidecar")
T = TypeVar("T")
DEFAULT_MAX_SEQUENCES = 16_384  # live sequences one sidecar holds (an engine runs a few hundred at most)
DEFAULT_MAX_SEQUENCE_TOKENS = 1 << 20  # the longest contexts served today are about a million tokens
DEFAULT_MAX_PINS_PER_OWNER = 4096  # pin records one credential holds (auto-pins are the pool's own)

HEAVY_PAGES = 2048  # an admission of this many pages may evict as many: ~10 ms, off the event loop


SHADOW_SLOTS_PER_PAGE = 8  # the unbounded cache's memory: 8 fingerprints of 4 bytes per pool page
MIN_SHADOW_SLOTS = 1 << 17  # a small pool's ideal still remembers a useful history (512 KiB)


class ShadowIndex:
    """The keys an unbounded cache would hold, approximately: a direct-mapped table of 32-bit key
    fingerprints. A key stays until a later key lands on its slot: a cache of ``slots`` keys with random
    replacement, eight times the pool, at 4 bytes a slot and no object per key (a false hit needs two
    keys of one slot to agree on 32 more bits of their hash).

    Its hit count is the ideal that ``kvpool_hit_tokens`` is measured against (eviction efficiency).
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._table = array("I", bytes(4 * slots))

    def admit(self, keys: list[Hashable]) -> int:
        """Pages of ``keys`` that an unbounded cache would hit; then remembers them all."""
        table = self._table
        n = self.slots
        hits = 0
        leading = True
        for key in keys:
            h = hash(key)
            slot = h % n
            fingerprint = (h >> 32) & 0xFFFFFFFF or 1  # never 0: an empty slot
            if leading:
                if table[slot] == fingerprint:
                    hits += 1
                else:
                    leading = False
            table[slot] = fingerprint
        return hits


class Sidecar(ConfigReloads, EnginePins):
    def __init__(
        self,
        config: SidecarConfig,
        pages: int,
        *,
        config_path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        shadow_capacity: int | None = None,
        storage: KVStorage | None = None,
        transfer_keys: TransferKeys | None = None,
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        max_sequence_tokens: int = DEFAULT_MAX_SEQUENCE_TOKENS,
        max_pins_per_owner: int = DEFAULT_MAX_PINS_PER_OWNER,
        wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.timezone.utc),
    ) -> None:
        self.transfer_keys = transfer_keys
        self._seq_owner: dict[str, str] = {}  # who admitted each live sequence (bounded by max_sequences)
        self._pin_owner: dict[str, str] = {}  # who pinned each pin record
        self._pins_by_owner: dict[str, set[str]] = {}  # each credential's pins (bounded by max_pins_per_owner)
        self._hashing_refused: set[str] = set()  # engine models whose hashing was refused (warned once)
        self.max_pins_per_owner = max_pins_per_owner
        self.wall = wall
        self.pool = PagePool(pages, config.spec().at(self.minute_of_day()), clock=clock, max_sequences=max_sequences,
                             max_sequence_tokens=max_sequence_tokens)
        self.prompts = PromptPins()
        self._prompt_key_memo: dict[str, tuple[Any, list[list[bytes]]]] = {}
        self.prompts.configure(config.spec(), self.unpin_own)
        self.clock = clock
        self.config_path = Path(config_path) if config_path else None
        self.state = ConfigState(config, spec_hash(config))
        self.metrics = SidecarMetrics()
        self.metrics.add_gauges(self.snapshot)
        self.shadow = ShadowIndex(shadow_capacity or max(SHADOW_SLOTS_PER_PAGE * pages, MIN_SHADOW_SLOTS))
        self.storage = storage
        self.storage_epoch = storage.epoch if storage is not None else None
        self.backend: dict[str, Any] = storage.describe() if storage else {"storage": "none", "kernels": "none"}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-pool")
        self._lock = asyncio.Lock()
        # Held by every pool call (on the loop or the worker thread) and by the metrics snapshot, which
        # prometheus_client's own thread may take (--metrics-port): a scrape never reads a pool mid-change.
        self._mutex = threading.RLock()
        self.last_activity = time.monotonic()
        self.engine_fed = False  # an engine's connector has fed the pool (keys: its block hashes)
        # Model identity -> (hash function, seed) of the engines that serve it, checked against their probe:
        # what names their pages from token ids (pins by tokens in the engine's key space).
        self.engine_hashing: dict[str, tuple[str, str]] = {}
        self.removals = Removals(self.pool)  # followed by engine sessions that publish KV events
        self.pool.model.on_drift = self._on_drift
        self.pool.model.on_reuse = self._on_reuse
        self._set_config_metrics()

    # ------------------------------------------------------------------------- serialised access
    async def run(self, fn: Callable[..., T], *args: Any, heavy: bool = False, **kwargs: Any) -> T:
        """Run a pool call for a request (it resets the idle timer); ``heavy`` ones go to the thread."""
        self.last_activity = time.monotonic()
        return await self.run_background(fn, *args, heavy=heavy, **kwargs)

    async def run_background(self, fn: Callable[..., T], *args: Any, heavy: bool = False, **kwargs: Any) -> T:
        """Run a pool call under the lock: inline, or on the worker thread when ``heavy``."""
        async with self._lock:
            if not heavy:
                with self._mutex:
                    return fn(*args, **kwargs)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, partial(self._locked, fn, *args, **kwargs))

    def _locked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._mutex:
            return fn(*args, **kwargs)

    def is_heavy(self, tokens: list | None, block_hashes: list | None, num_tokens: int | None) -> bool:
        """Whether an admission may evict enough pages to be worth a thread hop."""
        if tokens is not None:
            pages = len(tokens) // self.pool.page_size
        else:
            pages = len(block_hashes or ())
        return pages >= HEAVY_PAGES

    def close(self) -> None:
        """Stop the worker thread and free the KV storage (its shared segment is unlinked); idempotent."""
        self._executor.shutdown(wait=True)
        if self.storage is not None:
            self.storage.close()

    def fork(self, seq_id: str, new_seq_id: str, owner: Principal = ADMIN) -> Any:
        """Fork, and copy the partial last page's KV when this sidecar holds the KV storage."""
        result = self.with_evictions(self.pool.fork, seq_id, new_seq_id)
        self._seq_owner[new_seq_id] = owner.key
        if self.storage is not None and result.copy_src >= 0:
            self.storage.copy_pages([result.copy_src], [result.copy_dst])
        return result

    # ------------------------------------------------------------------------- pool operations
    # ------------------------------------------------------------------------------ ownership
    def check_owner(self, who: Principal, seq_id: str) -> None:
        """Who may act on a live sequence (to anyone else it answers as if absent):
        * one an engine channel connection admitted: that connection alone (no other session, whatever
          its token, and no HTTP caller, admin included: committing another's in-flight sequence would
          publish pages its worker has not written);
        * a tenant credential: only the sequences it admitted;
        * engine and admin credentials over HTTP: any other sequence."""
        owner = self._seq_owner.get(seq_id)
        if owner == who.key:
            return
        if who.session is not None or who.role == "tenant" or (owner or "").startswith("session:"):
            raise UnknownSequence(f"no sequence {seq_id!r}", "seq_id")

    def release(self, seq_id: str) -> None:
        self.pool.release(seq_id)
        self._seq_owner.pop(seq_id, None)

    def pin(self, *args: Any, owner: Principal = ADMIN, **kwargs: Any) -> Any:
        """Pin for ``owner``, who may hold at most ``max_pins_per_owner`` live pin records (each costs
        memory even on pages pinned already, so the page quota alone does not bound them)."""
        held = self._pins_by_owner.setdefault(owner.key, set())
        if len(held) >= self.max_pins_per_owner:
            held.intersection_update(self.pool.pinning.records)  # forget the ones that lapsed by TTL first
            if len(held) >= self.max_pins_per_owner:
                raise TooManyPins(
                    f"{owner.key} holds {len(held)} pins: the limit is {self.max_pins_per_owner} per credential "
                    "(--max-pins-per-owner); unpin some or pin with a ttl", "pin_id",
                )
        record = self.pool.pin(*args, **kwargs)
        self._pin_owner[record.pin_id] = owner.key
        held.add(record.pin_id)
        if len(self._pin_owner) > 2 * len(self.pool.pinning.records) + 1024:  # lapsed pins: forget their owners
            live = self.pool.pinning.records
            self._pin_owner = {pin_id: who for pin_id, who in self._pin_owner.items() if pin_id in live}
        return record

    def pins_of(self, who: Principal) -> list[Any]:
        """The live pins ``who`` may remove (an admin: all of them, auto-pins included)."""
        self.pool.expire_pins(max_pages=0)  # expired records leave now; their pages lapse in slices
        records = self.pool.pins.values()
        if who.role == "admin":
            return list(records)
        return [r for r in records if self._pin_owner.get(r.pin_id) == who.key]

    def unpin(self, pin_id: str, who: Principal) -> None:
        """Only the credential that pinned (or an admin) unpins; to the others the pin does not exist."""
        if who.role != "admin" and self._pin_owner.get(pin_id) != who.key:
            raise UnknownPin(f"no pin {pin_id!r}", "pin_id")
        self.pool.unpin(pin_id)
        self._forget_pin(pin_id)

    def _forget_pin(self, pin_id: str) -> None:
        """Drop a removed pin from its owner's records."""
        self._pins_by_owner.get(self._pin_owner.pop(pin_id, ""), set()).discard(pin_id)

    def admit(self, seq_id: str, tokens: list[int] | None, block_hashes: list | None, num_tokens: int | None,
              meta: WorkloadMeta, owner: Principal = ADMIN, allocate: bool = True) -> Any:
        before = dict(self.pool.eviction.evictions_by)
        start = time.perf_counter()
        adm = self.pool.admit(seq_id, tokens, block_hashes=block_hashes, num_tokens=num_tokens, meta=meta,
                              allocate=allocate)
        elapsed = time.perf_counter() - start
        self._seq_owner[seq_id] = owner.key
        length = len(tokens) if tokens is not None else (num_tokens or len(block_hashes or ()) * self.pool.page_size)
        m = self.metrics
        m.observe_admission(meta.workload_class, adm.num_cached_tokens, length, adm.cross_user_tokens)
        ideal = min(self.shadow.admit(adm.keys) * self.pool.page_size, length)
        m.shadow_hit_tokens.labels(meta.workload_class).inc(max(ideal, adm.num_cached_tokens))
        if adm.evicted_pages:
            m.eviction_seconds.observe(elapsed / adm.evicted_pages)
            self._count_evictions(before)
        return adm

    def _count_evictions(self, before: dict[tuple[str, str], int]) -> None:
        self.removals.flush()
        for (partition, reason), n in self.pool.eviction.evictions_by.items():
            delta = n - before.get((partition, reason), 0)
            if delta:
                self.metrics.evicted_pages.labels(partition, reason).inc(delta)

    def pre_evict(self, max_pages: int) -> int:
        before = dict(self.pool.eviction.evictions_by)
        freed = self.pool.pre_evict(max_pages=max_pages)
        if freed:
            self._count_evictions(before)
        return freed

    def with_evictions(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a pool call that may evict (append, fork) and count what it evicted."""
        before = dict(self.pool.eviction.evictions_by)
        result = fn(*args, **kwargs)
        self._count_evictions(before)
        return result

    def _on_reuse(self, klass: StatsClass, pages: int, gap_sum: float) -> None:
        self.metrics.reuse_gap.labels(workload_class_of(klass)).observe(gap_sum / pages)

    def _on_drift(self, event: DriftEvent) -> None:
        self.metrics.drift_events.labels(workload_class_of(event.klass)).inc()
        log.warning(
            "reuse-rate drift in class %s: %.3f/min against reference %.3f/min%s", event.klass,
            event.fitted_rate, event.reference_rate, " (adopted as the new reference)" if event.adopted else "",
        )

    # ------------------------------------------------------------------------------ reading
    def snapshot(self) -> dict[str, Any]:
        """The pool's gauges for a scrape, read under the pool's mutex (from any thread)."""
        with self._mutex:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        st = self.pool.stats()
        fits = {}
        for klass, (rate, p, _) in self.pool.model.classes().items():
            if isinstance(klass, tuple) and len(klass) == 1:
                fits[klass[0]] = (rate, p)
        return {
            "pages": {"free": st.free_pages, "in_use": st.in_use_pages, "cached": st.cached_pages,
                      "pinned": st.pinned_pages},
            "partitions": {
                name: {"capacity": p.capacity, "owned": p.owned, "evictable": p.evictable, "borrowed": p.borrowed}
                for name, p in st.partitions.items()
            },
            "pin_quota": st.pin_quota_pages,
            "prompts": self.prompts.pages_pinned(),
            "autopins": {"pinned": self.pool.pinning.autopins, "displaced": self.pool.pinning.autopins_displaced,
                         "refused": self.pool.pinning.autopins_refused},
            "fragmentation": st.fragmentation_tokens,
            "unwritten": st.unwritten_pages,
            "evidence_refused": self.pool.evidence_refused,
            "sequences": st.sequences,
            "observer_errors": self.pool.observer_errors,
            "fits": fits,
            "tuning": self.pool.tuning(),
        }

    def stats(self) -> dict[str, Any]:
        st = self.pool.stats()
        return {
            "total_pages": st.total_pages,
            "page_size": st.page_size,
            "free_pages": st.free_pages,
            "in_use_pages": st.in_use_pages,
            "cached_pages": st.cached_pages,
            "pinned_pages": st.pinned_pages,
            "pin_quota_pages": st.pin_quota_pages,
            "sequences": st.sequences,
            "pins": st.pins,
            "fragmentation_tokens": st.fragmentation_tokens,
            "unwritten_pages": st.unwritten_pages,
            "evidence_refused_pages": self.pool.evidence_refused,
            "evictions": st.evictions,
            "hit_tokens": st.hit_tokens,
            "lookup_tokens": st.lookup_tokens,
            "token_hit_ratio": st.hit_tokens / st.lookup_tokens if st.lookup_tokens else 0.0,
            "partitions": {name: asdict(p) for name, p in st.partitions.items()},
            "policy": self.state.config.eviction.policy,
            "reuse_fits": {
                "/".join(str(x) for x in k) if isinstance(k, tuple) else str(k): {
                    "decay_per_minute": rate, "reuse_probability": p, "reuses": n}
                for k, (rate, p, n) in self.pool.model.classes().items()
            },
            "tuning": {
                part: {**t, "shadow_hit_ratios": {f"{w:g}": r for w, r in t["shadow_hit_ratios"].items()}}
                for part, t in self.pool.tuning().items()
            },
            "backend": self.backend,
        }

    # ------------------------------------------------------------------------------- config
