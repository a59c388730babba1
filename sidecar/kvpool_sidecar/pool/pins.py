"""Pins: prefixes protected from eviction, by request or automatically (long prompts, hot prefixes),
within a quota of the pool, with an optional TTL. Owns I6: pinned pages never exceed the quota, and a
pinned page's parent is pinned too (a pin covers a whole prefix).

Auto-pins are the pool's own and yield: a pin that does not fit the quota lapses the oldest auto-pins
first (never a pin a caller made). So no traffic, however many long prompts it sends, can fill the quota
and leave later prompts or callers without pins: the quota holds the most recent auto-pins, and every
displacement and refusal is counted (``kvpool_autopins_total{result}``).
"""

from __future__ import annotations

import heapq
import secrets
from array import array
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import replace

from kvpool_sidecar.errors import InvalidRequest, QuotaExceeded, UnknownPin
from kvpool_sidecar.keys import DEFAULT_META, WorkloadMeta
from kvpool_sidecar.policies import NO_PAGE
from kvpool_sidecar.pool.records import PARTITIONS, Pin, SeqState
from kvpool_sidecar.rates import PREFIX_RATE_WINDOW, DecayedCounter

_MAX_TRACKED_PREFIXES = 65_536  # prefix rates kept before the cold ones are pruned
# Pages of expired pins that one pool call lapses (the rest on later calls or the background task): about
# 0.1 ms with the default policy, so that a 4,000-page pin lapsing never stalls the admission that saw it.
LAPSE_PAGES_PER_CALL = 256


class Pinning:
    """Pin records, per-page pin counts, expiry and auto-pin; a part of :class:`~kvpool_sidecar.pool.PagePool`."""

    def _init_pins(self, n: int) -> None:
        self._pins = array("I", bytes(4 * n))  # pins per page (4 bytes a page, not a list's 8)
        self._pin_records: dict[str, Pin] = {}  # insertion order: oldest first
        self._pin_expiry: list[tuple[float, str]] = []  # a heap of (expiry, pin id)
        self._lapsing: deque[list] = deque()  # [record, pages of it still pinned]: expired or dropped pins
        self._pinned_pages = 0
        self.pin_quota = 0  # set by the pool's config
        self.autopins = 0
        self.autopins_refused = 0
        self.autopins_displaced = 0
        self._auto_ids: dict[str, None] = {}  # live auto-pins, oldest first
        self._auto_refs = array("I", bytes(4 * n))  # per page, how many of its pins are auto-pins
        self._auto_only = 0  # pinned pages every pin of which is an auto-pin
        # First-page key -> recent admissions: a prefix above autoPin.minPrefixQPS keeps its shared
        # pages pinned (the page-length rule's sibling).
        self._prefix_rate = DecayedCounter(PREFIX_RATE_WINDOW)
        self._prune_prefix_rates_at = _MAX_TRACKED_PREFIXES

    def pin(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[Hashable] | None = None,
        seq_id: str | None = None,
        meta: WorkloadMeta = DEFAULT_META,
        ttl: float | None = None,
        now: float | None = None,
    ) -> Pin:
        """Protect a cached prefix (or a sequence's published pages) from eviction; ``ttl`` makes it lapse."""
        now = self.clock() if now is None else now
        self._expire_pins(now)
        if ttl is not None and ttl <= 0:
            raise InvalidRequest("ttl must be above 0 seconds", "ttl")
        if seq_id is not None:
            if tokens is not None or block_hashes is not None:
                raise InvalidRequest("pin either a seq_id or a prefix, not both", "seq_id")
            seq = self._seq(seq_id)
            pages = seq.pages[: seq.published]
        else:
            keys, _ = self._keys(tokens, block_hashes, None, meta)
            pages = self._cached_prefix(keys)
        if not pages:
            raise InvalidRequest("nothing of that prefix is cached to pin", "tokens" if seq_id is None else "seq_id")
        return self._pin_pages(pages, ttl, now)

    def _pin_pages(self, pages: list[int], ttl: float | None, now: float, auto: bool = False) -> Pin:
        new = sum(1 for p in pages if self._pins[p] == 0)
        if self._lapsing and not auto and self._pinned_pages + new > self.pin_quota:
            self._lapse(now, None)  # a caller's pin waits for no slice: expired pins make room now
            new = sum(1 for p in pages if self._pins[p] == 0)
        if self._pinned_pages + new > self.pin_quota and self._auto_ids and self._fits_without_auto(pages):
            while self._pinned_pages + new > self.pin_quota:
                # Room from the oldest auto-pin (its pages may overlap ``pages``: count again).
                self.unpin(next(iter(self._auto_ids)), now)
                self.autopins_displaced += 1
                new = sum(1 for p in pages if self._pins[p] == 0)
        if self._pinned_pages + new > self.pin_quota:
            raise QuotaExceeded(
                f"pinning {new} more pages would exceed the pin quota "
                f"({self._pinned_pages} of {self.pin_quota} pages pinned)",
                "pinning.quotaPercent",
            )
        self._check_share(pages)
        self._add_pins(pages, auto, now)
        pin_id = f"pin-{secrets.token_hex(12)}"  # unguessable: a pin id is what lets its holder unpin
        expires = None if ttl is None else now + ttl
        record = Pin(pin_id, tuple(pages), expires, auto)
        self._pin_records[pin_id] = record
        if auto:
            self._auto_ids[pin_id] = None
        if expires is not None:
            heapq.heappush(self._pin_expiry, (expires, pin_id))
        return record

    def _add_pins(self, pages: list[int], auto: bool, now: float) -> None:
        pins, auto_refs = self._pins, self._auto_refs
        for page in pages:
            if pins[page] == 0:
                self._pinned_pages += 1
                if self._ref[page] == 0:
                    self._policies[self._part[page]].take(page, now, False)
            was_auto_only = pins[page] > 0 and pins[page] == auto_refs[page]
            pins[page] += 1
            auto_refs[page] += auto
            self._auto_only += (pins[page] == auto_refs[page]) - was_auto_only

    def _check_share(self, pages: list[int]) -> None:
        """A pin keeps a partition's pages in use or pinned within its share (the other partition's
        share stays one eviction away): pinning pages to-C borrowed from to-B's idle share is refused."""
        held = [0, 0]
        for page in pages:
            if self._pins[page] == 0 and self._ref[page] == 0:  # cached, evictable now: held once pinned
                held[self._part[page]] += 1
        for part, more in enumerate(held):
            if more and self._owned[part] - len(self._policies[part]) + more > self._caps[part]:
                raise QuotaExceeded(
                    f"pinning {more} cached pages would hold more than the {PARTITIONS[part]} partition's "
                    f"share of {self._caps[part]} pages", "workloads.toB.isolationPercent",
                )

    def _fits_without_auto(self, pages: list[int]) -> bool:
        """Whether ``pages`` would fit the quota once every auto-pin lapsed (else none is displaced: a
        refused pin changes nothing)."""
        pins, auto_refs = self._pins, self._auto_refs
        new = sum(1 for p in pages if pins[p] == auto_refs[p])
        return self._pinned_pages - self._auto_only + new <= self.pin_quota

    def unpin(self, pin_id: str, now: float | None = None) -> None:
        record = self._pin_records.pop(pin_id, None)
        if record is None:
            raise UnknownPin(f"no pin {pin_id!r}", "pin_id")
        self._auto_ids.pop(pin_id, None)
        self._unpin_pages(record, 0, len(record.pages), self.clock() if now is None else now)

    def _unpin_pages(self, record: Pin, start: int, end: int, now: float) -> None:
        """Drop ``record``'s pin on its pages ``[start, end)``, deepest first (a pinned page's parent
        stays pinned: I6). A pin covers a prefix from its root, so a page's depth is its index: O(pages)."""
        pins, auto_refs, ref = self._pins, self._auto_refs, self._ref
        pages = record.pages
        auto = record.auto
        for depth in range(end - 1, start - 1, -1):
            page = pages[depth]
            was_auto_only = pins[page] == auto_refs[page]
            pins[page] -= 1
            auto_refs[page] -= auto
            self._auto_only += (pins[page] > 0 and pins[page] == auto_refs[page]) - was_auto_only
            if pins[page] == 0:
                self._pinned_pages -= 1
                if ref[page] == 0:
                    self._policies[self._part[page]].insert([page], [depth], depth + 1, now, self._klass[page])

    def _expire_pins(self, now: float, budget: int | None = LAPSE_PAGES_PER_CALL) -> None:
        """Pins past their TTL leave the records at once and lapse ``budget`` pages per call (None: all),
        so that a long pin lapsing never stalls the admission that noticed it: the rest lapse on the
        next calls, or in the sidecar's background task."""
        expiry = self._pin_expiry
        while expiry and expiry[0][0] <= now:
            _, pin_id = heapq.heappop(expiry)
            record = self._pin_records.get(pin_id)
            if record is not None:
                self._retire(record)
        self._lapse(now, budget)

    def _retire(self, record: Pin) -> None:
        """The pin leaves the records now; its pages lapse a slice per call (:meth:`_lapse`)."""
        del self._pin_records[record.pin_id]
        self._auto_ids.pop(record.pin_id, None)
        self._lapsing.append([record, len(record.pages)])

    def _lapse(self, now: float, budget: int | None) -> None:
        lapsing = self._lapsing
        while lapsing and (budget is None or budget > 0):
            item = lapsing[0]
            record, left = item
            n = left if budget is None else min(left, budget)
            self._unpin_pages(record, left - n, left, now)
            item[1] = left - n
            if budget is not None:
                budget -= n
            if not item[1]:
                lapsing.popleft()

    @property
    def lapsing_pages(self) -> int:
        """Pages of expired or dropped pins still pinned, waiting for their slice of a later call."""
        return sum(left for _, left in self._lapsing)

    def _auto_pin(self, seq: SeqState, now: float) -> None:
        """A long prompt's published pages, pinned by one record per sequence that grows with its
        chunked commits."""
        pages = seq.pages[: seq.published]
        record = self._pin_records.get(seq.autopin) if seq.autopin is not None else None
        if record is None:
            if pages and not all(self._pins[p] for p in pages):
                pin = self._pin_auto(pages, seq.meta, now)
                seq.autopin = pin.pin_id if pin is not None else None
        elif len(pages) > len(record.pages):
            self._grow_auto_pin(record, pages[len(record.pages):], now)

    def _grow_auto_pin(self, record: Pin, tail: list[int], now: float) -> None:
        """Extend ``record`` (an auto-pin) by the pages after it: other auto-pins yield, oldest first;
        what still does not fit the quota stays unpinned (counted refused)."""
        pins = self._pins
        new = sum(1 for p in tail if pins[p] == 0)
        for pin_id in list(self._auto_ids):
            if self._pinned_pages + new <= self.pin_quota:
                break
            if pin_id != record.pin_id:
                self.unpin(pin_id, now)
                self.autopins_displaced += 1
                new = sum(1 for p in tail if pins[p] == 0)
        room = self.pin_quota - self._pinned_pages
        take: list[int] = []
        for page in tail:
            if pins[page] == 0:
                if room == 0:
                    self.autopins_refused += 1
                    break
                room -= 1
            take.append(page)
        if take:  # the sequence's own pages, in use: no partition's share changes
            self._add_pins(take, True, now)
            self._pin_records[record.pin_id] = replace(record, pages=record.pages + tuple(take))

    def _pin_hot_prefix(self, first_key: Hashable, hits: list[int], meta: WorkloadMeta, now: float) -> None:
        """A prefix admitted more than ``autoPin.minPrefixQPS`` times a second (by its first page) keeps
        the pages this request shared with earlier ones pinned for its class window: what is hot is
        exactly what was reused. A pin past the quota is refused quietly (counted)."""
        rates = self._prefix_rate
        rate = rates.add(first_key, now) / PREFIX_RATE_WINDOW
        if len(rates) > self._prune_prefix_rates_at:
            rates.prune(now, 1.0)  # prefixes seen less than about once a window
            self._prune_prefix_rates_at = max(_MAX_TRACKED_PREFIXES, 2 * len(rates))
        if rate <= self._autopin.minPrefixQPS or not hits or all(self._pins[p] for p in hits):
            return
        self._pin_auto(hits, meta, now)

    def _pin_auto(self, pages: list[int], meta: WorkloadMeta, now: float) -> Pin | None:
        """An auto-pin for the class's window; refused quietly (counted) when even every other auto-pin
        lapsing would not make room."""
        try:
            pin = self._pin_pages(pages, self._window_of(meta.workload_class), now, auto=True)
        except QuotaExceeded:
            self.autopins_refused += 1
            return None
        self.autopins += 1
        return pin

    def expire_pins(self, now: float | None = None, max_pages: int | None = None) -> None:
        """Lapse the pins past their TTL now, ``max_pages`` pages at most (None: all); they otherwise
        lapse a slice per pool call."""
        self._expire_pins(self.clock() if now is None else now, max_pages)

    @property
    def pins(self) -> dict[str, Pin]:
        return dict(self._pin_records)

    @property
    def pin_count(self) -> int:
        return len(self._pin_records)

    def pin_ids(self) -> set[str]:
        """The live pins' ids (those past their TTL are gone once any pin call has run)."""
        return set(self._pin_records)

    def _fit_pins_to_quota(self) -> list[Pin]:
        """A lower quota drops the oldest pins until the rest fit; their pages lapse a slice per call."""
        dropped: list[Pin] = []
        excess = self._pinned_pages - self.lapsing_pages - self.pin_quota
        dropping: dict[int, int] = {}  # page -> pins of it dropped here
        for record in list(self._pin_records.values()):  # insertion order: oldest first
            if excess <= 0:
                break
            self._retire(record)
            for page in record.pages:  # what it frees: a page another pin holds stays pinned
                dropping[page] = dropping.get(page, 0) + 1
                excess -= dropping[page] == self._pins[page]
            dropped.append(record)
        self._lapse(self.clock(), LAPSE_PAGES_PER_CALL)
        return dropped

    def _check_pins(self, free: set[int]) -> None:
        """I6 from scratch."""
        pin_counts = [0] * self.total_pages
        auto_counts = [0] * self.total_pages
        held = [(r, len(r.pages)) for r in self._pin_records.values()] + [(r, n) for r, n in self._lapsing]
        for record, n in held:
            for p in record.pages[:n]:
                pin_counts[p] += 1
                auto_counts[p] += record.auto
        assert pin_counts == list(self._pins), "I6: pin counts differ from the pin records"
        assert auto_counts == list(self._auto_refs), "I6: auto-pin counts differ from the pin records"
        assert self._auto_only == sum(1 for p, c in enumerate(pin_counts) if c and c == auto_counts[p])
        pinned = sum(1 for c in pin_counts if c)
        assert pinned == self._pinned_pages, "I6: pinned page count drifted"
        live = len({p for r in self._pin_records.values() for p in r.pages})  # lapsing pins are on their way out
        assert live <= self.pin_quota, f"I6: {live} pages pinned by live pins above the quota of {self.pin_quota}"
        for page in range(self.total_pages):
            if not self._pins[page]:
                continue
            assert page not in free, f"I6: free page {page} is pinned"
            parent = self._parent[page]
            if parent != NO_PAGE and self._key[page] is not None:
                assert self._pins[parent], f"I6: pinned page {page} has an unpinned parent"
