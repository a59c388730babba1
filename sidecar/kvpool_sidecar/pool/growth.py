"""Growing a live sequence: the pages for its keys past those it holds, taken when their bytes are about
to be written (an engine's save: the connector's *grow*), and the admission rule by evidence
(``eviction.admitByEvidence``): a save of a class shown not to come back does not evict a page that holds
a claim (:mod:`.claims`). A part of
:class:`~kvpool_sidecar.pool.PagePool`.
"""

from __future__ import annotations

from kvpool_sidecar.errors import InvalidRequest
from kvpool_sidecar.pool.capacity import Capacity
from kvpool_sidecar.pool.eviction import Eviction
from kvpool_sidecar.pool.frequencies import PageFrequencies
from kvpool_sidecar.pool.pins import Pinning
from kvpool_sidecar.pool.records import SeqState
from kvpool_sidecar.pool.sequences import SequenceTable


class Growth:
    """A pool's sequences growing into pages of their partition, as many as it can get."""

    def __init__(self, eviction: Eviction, capacity: Capacity, pinning: Pinning,
                 sequences: SequenceTable, frequencies: PageFrequencies, page_size: int) -> None:
        self.eviction = eviction
        self.capacity = capacity
        self.pinning = pinning
        self.sequences = sequences
        self.frequencies = frequencies
        self.page_size = page_size
        self.evidence_refused = 0  # pages grows did not take: their class shown not to come back, the victim claimed

    def grow(self, seq_id: str, num_tokens: int, now: float) -> list[int]:
        """Pages for the sequence's keys up to ``num_tokens`` (whole pages) past those it holds, taken now
        (evicting as an admission does): as many as its partition can get, maybe none (never raises for
        want of room: a save that finds no page is skipped). Returns the pages added, in key order."""
        seq = self.sequences.get(seq_id)
        if num_tokens < 0:
            raise InvalidRequest("num_tokens must be at least 0", "num_tokens")
        need = min(num_tokens // self.page_size, len(seq.keys)) - len(seq.pages)
        if need <= 0:
            return []
        if self.pinning.due(now):
            self.pinning.expire(now)
        if not self.capacity.surely_obtainable(seq.partition, need, 0):
            need = min(need, self.capacity.obtainable(seq.partition, []))
            if need <= 0:
                return []
        start = len(seq.pages)
        pages = self._allocate_by_evidence(seq, need, now)
        if not pages:
            return []
        self.sequences.grow(seq, pages)
        if seq.counts is not None and self.frequencies.counting:
            self.frequencies.assign(pages, seq.counts[start : start + need])
        return pages

    def _allocate_by_evidence(self, seq: SeqState, need: int, now: float) -> list[int]:
        """Up to ``need`` pages for ``seq``. When its class is shown not to come back (:class:`.Claims`), one at
        a time, stopping before a victim that holds a claim: a page with evidence against its reuse does not
        evict one without it. Pages it stops short of are counted (``evidence_refused``)."""
        eviction = self.eviction
        part = seq.partition
        claims = eviction.claims
        if not claims.never_back(seq.klass, now):
            return eviction.allocate(part, need, now)
        pages: list[int] = []
        while len(pages) < need:
            victim = eviction.next_victim(part, now)
            if victim is not None and claims.claimed(victim, now):
                self.evidence_refused += need - len(pages)
                break
            pages += eviction.allocate(part, 1, now)
        return pages
