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
from collections.abc import Hashable
from dataclasses import replace

from kvpool_sidecar.errors import QuotaExceeded, UnknownPin
from kvpool_sidecar.keys import WorkloadMeta
from kvpool_sidecar.policies import NO_PAGE
from kvpool_sidecar.pool.eviction import Eviction
from kvpool_sidecar.pool.pages import PageTable
from kvpool_sidecar.pool.records import PARTITIONS, Pin, PoolSettings, SeqState
from kvpool_sidecar.rates import PREFIX_RATE_WINDOW, DecayedCounter

_MAX_TRACKED_PREFIXES = 65_536  # prefix rates kept before the cold ones are pruned
# Pages of expired pins that one pool call lapses (the rest on later calls or the background task): about
# 0.1 ms with the default policy, so that a 4,000-page pin lapsing never stalls the admission that saw it.
LAPSE_PAGES_PER_CALL = 256


class Pinning:
    """Pin records, per-page pin counts (the table's ``pins``), expiry and auto-pin, over the pages of a
    :class:`~.pages.PageTable` and the policies of an :class:`~.eviction.Eviction` (a pinned page leaves
    its policy and comes back when its last pin goes)."""

    def __init__(self, table: PageTable, eviction: Eviction, settings: PoolSettings) -> None:
        self.table = table
        self.eviction = eviction
        n = table.total_pages
        self.records: dict[str, Pin] = {}  # insertion order: oldest first
        # A heap of (expiry, serial, pin id): pins that expire together lapse in the order they were
        # made, not in the order of their random ids (a replay would not repeat itself).
        self._pin_expiry: list[tuple[float, int, str]] = []
        self._pins_made = 0
        self.lapsing: deque[list] = deque()  # [record, pages of it still pinned]: expired or dropped pins
        self.pinned_pages = 0
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
        self.configure(settings)

    def configure(self, settings: PoolSettings) -> None:
        """A new quota takes effect on the next pin; :meth:`fit_to_quota` lapses what exceeds it."""
        self.quota = settings.pin_quota
        self.autopin = settings.autopin
        self.window_of = settings.window_of

    def due(self, now: float) -> bool:
        """Whether pins expired by ``now`` or pages of dropped pins wait to lapse."""
        return bool((self._pin_expiry and self._pin_expiry[0][0] <= now) or self.lapsing)

    def pin_pages(self, pages: list[int], ttl: float | None, now: float, auto: bool = False) -> Pin:
        new = sum(1 for p in pages if self.table.pins[p] == 0)
        if self.lapsing and not auto and self.pinned_pages + new > self.quota:
            self._lapse(now, None)  # a caller's pin waits for no slice: expired pins make room now
            new = sum(1 for p in pages if self.table.pins[p] == 0)
        if self.pinned_pages + new > self.quota and self._auto_ids and self._fits_without_auto(pages):
            while self.pinned_pages + new > self.quota:
                # Room from the oldest auto-pin (its pages may overlap ``pages``: count again).
                self.unpin(next(iter(self._auto_ids)), now)
                self.autopins_displaced += 1
                new = sum(1 for p in pages if self.table.pins[p] == 0)
        if self.pinned_pages + new > self.quota:
            raise QuotaExceeded(
                f"pinning {new} more pages would exceed the pin quota "
                f"({self.pinned_pages} of {self.quota} pages pinned)",
                "pinning.quotaPercent",
            )
        self._check_share(pages)
        self._add_pins(pages, auto, now)
        pin_id = f"pin-{secrets.token_hex(12)}"  # unguessable: a pin id is what lets its holder unpin
        expires = None if ttl is None else now + ttl
        record = Pin(pin_id, tuple(pages), expires, auto)
        self.records[pin_id] = record
        if auto:
            self._auto_ids[pin_id] = None
        if expires is not None:
            self._pins_made += 1
            heapq.heappush(self._pin_expiry, (expires, self._pins_made, pin_id))
        return record

    def _add_pins(self, pages: list[int], auto: bool, now: float) -> None:
        pins, auto_refs = self.table.pins, self._auto_refs
        for page in pages:
            if pins[page] == 0:
                self.pinned_pages += 1
                if self.table.ref[page] == 0:
                    self.eviction.policies[self.table.part[page]].take(page, now, False)
            was_auto_only = pins[page] > 0 and pins[page] == auto_refs[page]
            pins[page] += 1
            auto_refs[page] += auto
            self._auto_only += (pins[page] == auto_refs[page]) - was_auto_only

    def _check_share(self, pages: list[int]) -> None:
        """A pin keeps a partition's pages in use or pinned within its share (the other partition's
        share stays one eviction away): pinning pages to-C borrowed from to-B's idle share is refused."""
        held = [0, 0]
        for page in pages:
            if self.table.pins[page] == 0 and self.table.ref[page] == 0:  # cached, evictable now: held once pinned
                held[self.table.part[page]] += 1
        for part, more in enumerate(held):
            if more and self.eviction.owned[part] - len(self.eviction.policies[part]) + more > self.eviction.caps[part]:
                raise QuotaExceeded(
                    f"pinning {more} cached pages would hold more than the {PARTITIONS[part]} partition's "
                    f"share of {self.eviction.caps[part]} pages", "workloads.toB.isolationPercent",
                )

    def _fits_without_auto(self, pages: list[int]) -> bool:
        """Whether ``pages`` would fit the quota once every auto-pin lapsed (else none is displaced: a
        refused pin changes nothing)."""
        pins, auto_refs = self.table.pins, self._auto_refs
        new = sum(1 for p in pages if pins[p] == auto_refs[p])
        return self.pinned_pages - self._auto_only + new <= self.quota

    def unpin(self, pin_id: str, now: float) -> None:
        record = self.records.pop(pin_id, None)
        if record is None:
            raise UnknownPin(f"no pin {pin_id!r}", "pin_id")
        self._auto_ids.pop(pin_id, None)
        self._unpin_pages(record, 0, len(record.pages), now)

    def _unpin_pages(self, record: Pin, start: int, end: int, now: float) -> None:
        """Drop ``record``'s pin on its pages ``[start, end)``, deepest first (a pinned page's parent
        stays pinned: I6). A pin covers a prefix from its root, so a page's depth is its index: O(pages)."""
        t = self.table
        pins, auto_refs, ref = t.pins, self._auto_refs, t.ref
        pages = record.pages
        auto = record.auto
        for depth in range(end - 1, start - 1, -1):
            page = pages[depth]
            was_auto_only = pins[page] == auto_refs[page]
            pins[page] -= 1
            auto_refs[page] -= auto
            self._auto_only += (pins[page] > 0 and pins[page] == auto_refs[page]) - was_auto_only
            if pins[page] == 0:
                self.pinned_pages -= 1
                if ref[page] == 0:
                    self.eviction.policies[t.part[page]].insert([page], [depth], depth + 1, now, t.klass[page])

    def expire(self, now: float, budget: int | None = LAPSE_PAGES_PER_CALL) -> None:
        """Pins past their TTL leave the records at once and lapse ``budget`` pages per call (None: all),
        so that a long pin lapsing never stalls the admission that noticed it: the rest lapse on the
        next calls, or in the sidecar's background task."""
        expiry = self._pin_expiry
        while expiry and expiry[0][0] <= now:
            _, _, pin_id = heapq.heappop(expiry)
            record = self.records.get(pin_id)
            if record is not None:
                self._retire(record)
        self._lapse(now, budget)

    def _retire(self, record: Pin) -> None:
        """The pin leaves the records now; its pages lapse a slice per call (:meth:`_lapse`)."""
        del self.records[record.pin_id]
        self._auto_ids.pop(record.pin_id, None)
        self.lapsing.append([record, len(record.pages)])

    def _lapse(self, now: float, budget: int | None) -> None:
        lapsing = self.lapsing
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
        return sum(left for _, left in self.lapsing)

    def auto_pin(self, seq: SeqState, now: float) -> None:
        """A long prompt's published pages, pinned by one record per sequence that grows with its
        chunked commits; only prompts of at least ``autoPin.minPromptTokens``."""
        least = self.autopin.minPromptTokens
        if not (self.autopin.enabled and least is not None and seq.num_prompt_tokens >= least):
            return
        pages = seq.pages[: seq.published]
        record = self.records.get(seq.autopin) if seq.autopin is not None else None
        if record is None:
            if pages and not all(self.table.pins[p] for p in pages):
                pin = self._pin_auto(pages, seq.meta, now)
                seq.autopin = pin.pin_id if pin is not None else None
        elif len(pages) > len(record.pages):
            self._grow_auto_pin(record, pages[len(record.pages):], now)

    def _grow_auto_pin(self, record: Pin, tail: list[int], now: float) -> None:
        """Extend ``record`` (an auto-pin) by the pages after it: other auto-pins yield, oldest first;
        what still does not fit the quota stays unpinned (counted refused)."""
        pins = self.table.pins
        new = sum(1 for p in tail if pins[p] == 0)
        for pin_id in list(self._auto_ids):
            if self.pinned_pages + new <= self.quota:
                break
            if pin_id != record.pin_id:
                self.unpin(pin_id, now)
                self.autopins_displaced += 1
                new = sum(1 for p in tail if pins[p] == 0)
        room = self.quota - self.pinned_pages
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
            self.records[record.pin_id] = replace(record, pages=record.pages + tuple(take))

    def pin_hot_prefix(self, first_key: Hashable, hits: list[int], meta: WorkloadMeta, now: float) -> None:
        """A prefix admitted more than ``autoPin.minPrefixQPS`` times a second (by its first page) keeps
        the pages this request shared with earlier ones pinned for its class window: what is hot is
        exactly what was reused. A pin past the quota is refused quietly (counted)."""
        rates = self._prefix_rate
        rate = rates.add(first_key, now) / PREFIX_RATE_WINDOW
        if len(rates) > self._prune_prefix_rates_at:
            rates.prune(now, 1.0)  # prefixes seen less than about once a window
            self._prune_prefix_rates_at = max(_MAX_TRACKED_PREFIXES, 2 * len(rates))
        if rate <= self.autopin.minPrefixQPS or not hits or all(self.table.pins[p] for p in hits):
            return
        self._pin_auto(hits, meta, now)

    def _pin_auto(self, pages: list[int], meta: WorkloadMeta, now: float) -> Pin | None:
        """An auto-pin for the class's window; refused quietly (counted) when even every other auto-pin
        lapsing would not make room."""
        try:
            pin = self.pin_pages(pages, self.window_of(meta.workload_class), now, auto=True)
        except QuotaExceeded:
            self.autopins_refused += 1
            return None
        self.autopins += 1
        return pin

    def fit_to_quota(self, now: float) -> list[Pin]:
        """A lower quota drops the oldest pins until the rest fit; their pages lapse a slice per call."""
        dropped: list[Pin] = []
        excess = self.pinned_pages - self.lapsing_pages - self.quota
        dropping: dict[int, int] = {}  # page -> pins of it dropped here
        for record in list(self.records.values()):  # insertion order: oldest first
            if excess <= 0:
                break
            self._retire(record)
            for page in record.pages:  # what it frees: a page another pin holds stays pinned
                dropping[page] = dropping.get(page, 0) + 1
                excess -= dropping[page] == self.table.pins[page]
            dropped.append(record)
        self._lapse(now, LAPSE_PAGES_PER_CALL)
        return dropped

    def check(self, free: set[int]) -> None:
        """I6 from scratch."""
        pin_counts = [0] * self.table.total_pages
        auto_counts = [0] * self.table.total_pages
        held = [(r, len(r.pages)) for r in self.records.values()] + [(r, n) for r, n in self.lapsing]
        for record, n in held:
            for p in record.pages[:n]:
                pin_counts[p] += 1
                auto_counts[p] += record.auto
        assert pin_counts == list(self.table.pins), "I6: pin counts differ from the pin records"
        assert auto_counts == list(self._auto_refs), "I6: auto-pin counts differ from the pin records"
        assert self._auto_only == sum(1 for p, c in enumerate(pin_counts) if c and c == auto_counts[p])
        pinned = sum(1 for c in pin_counts if c)
        assert pinned == self.pinned_pages, "I6: pinned page count drifted"
        live = len({p for r in self.records.values() for p in r.pages})  # lapsing pins are on their way out
        assert live <= self.quota, f"I6: {live} pages pinned by live pins above the quota of {self.quota}"
        for page in range(self.table.total_pages):
            if not self.table.pins[page]:
                continue
            assert page not in free, f"I6: free page {page} is pinned"
            parent = self.table.parent[page]
            if parent != NO_PAGE and self.table.key[page] is not None:
                assert self.table.pins[parent], f"I6: pinned page {page} has an unpinned parent"
