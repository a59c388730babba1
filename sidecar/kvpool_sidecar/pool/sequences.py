"""Live sequences: their page tables, publishing committed pages, growing and forking them.

Owns I2's publishing rule (a full page enters the prefix index only once its KV is committed) and the
bounds on what a caller can make the pool hold (live sequences, tokens per sequence).
"""

from __future__ import annotations

from kvpool_sidecar.errors import (
    DuplicateSequence,
    InvalidRequest,
    PoolExhausted,
    TooLong,
    TooManySequences,
    UnknownSequence,
)
from kvpool_sidecar.policies import NO_PAGE
from kvpool_sidecar.pool.capacity import Capacity
from kvpool_sidecar.pool.eviction import Eviction
from kvpool_sidecar.pool.pages import PageTable
from kvpool_sidecar.pool.pins import Pinning
from kvpool_sidecar.pool.records import PARTITIONS, ForkResult, SeqState


class SequenceTable:
    """The live sequences of a :class:`~kvpool_sidecar.pool.PagePool`: they hold pages of the
    :class:`~.pages.PageTable` (its refcounts), which the :class:`~.eviction.Eviction` hands out."""

    def __init__(self, table: PageTable, eviction: Eviction, capacity: Capacity, pinning: Pinning, page_size: int,
                 max_sequences: int | None, max_sequence_tokens: int | None) -> None:
        self.table = table
        self.eviction = eviction
        self.capacity = capacity
        self.pinning = pinning
        self.page_size = page_size
        self.max_sequences = max_sequences
        self.max_sequence_tokens = max_sequence_tokens
        self.live: dict[str, SeqState] = {}
        self.alloc_slots = 0  # token slots of the live sequences' pages
        self.used_slots = 0  # of which hold a token

    def add(self, seq: SeqState) -> None:
        self.live[seq.seq_id] = seq
        self.alloc_slots += len(seq.pages) * self.page_size
        self.used_slots += seq.num_tokens

    def remove(self, seq_id: str) -> SeqState:
        seq = self.live.pop(seq_id, None)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}", "seq_id")
        self.alloc_slots -= len(seq.pages) * self.page_size
        self.used_slots -= seq.num_tokens
        return seq

    def room_for_one(self) -> None:
        if self.max_sequences is not None and len(self.live) >= self.max_sequences:
            raise TooManySequences(
                f"{len(self.live)} live sequences: the limit is {self.max_sequences} (--max-sequences); "
                "release finished ones", "seq_id",
            )

    def check_length(self, num_tokens: int, field: str) -> None:
        if self.max_sequence_tokens is not None and num_tokens > self.max_sequence_tokens:
            raise TooLong(
                f"{num_tokens} tokens: the limit is {self.max_sequence_tokens} per sequence "
                "(--max-sequence-tokens)", field,
            )

    def get(self, seq_id: str) -> SeqState:
        seq = self.live.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}", "seq_id")
        return seq

    def commit(self, seq_id: str, num_computed_tokens: int, now: float) -> int:
        """The KV of the first ``num_computed_tokens`` is written: publish the full pages (I2).

        Returns how many pages the sequence has published in all.
        """
        seq = self.get(seq_id)
        if not seq.num_computed <= num_computed_tokens <= seq.num_tokens:
            raise InvalidRequest(
                f"num_computed_tokens must be in [{seq.num_computed}, {seq.num_tokens}]",
                "num_computed_tokens",
            )
        seq.num_computed = num_computed_tokens
        upto = min(num_computed_tokens // self.page_size, len(seq.keys))
        if seq.publish_blocked or upto <= seq.published:
            return seq.published
        index = self.table.index
        start = seq.published
        new_keys = seq.keys[start:upto]
        if index.keys().isdisjoint(new_keys):
            self.table.publish_fresh(seq.pages, start, new_keys, seq.meta.user)
            seq.published = upto
        else:
            self.table.publish_contended(seq, upto)
        self.pinning.auto_pin(seq, now)
        return seq.published

    def append(self, seq_id: str, num_new_tokens: int, now: float) -> list[int]:
        """Decoding grew the sequence; returns the pages added when it crossed page boundaries."""
        seq = self.get(seq_id)
        if num_new_tokens < 0:
            raise InvalidRequest("num_new_tokens must be at least 0", "num_new_tokens")
        self.check_length(seq.num_tokens + num_new_tokens, "num_new_tokens")
        need = -(-(seq.num_tokens + num_new_tokens) // self.page_size) - len(seq.pages)
        if need > 0:
            obtainable = self.capacity.obtainable(seq.partition, [])
            if need > obtainable:
                raise PoolExhausted(need, obtainable, PARTITIONS[seq.partition])
            new = self.eviction.allocate(seq.partition, need, now)
            seq.pages.extend(new)
            self.alloc_slots += need * self.page_size
        else:
            new = []
        seq.num_tokens += num_new_tokens
        self.used_slots += num_new_tokens
        return new

    def grow(self, seq: SeqState, pages: list[int]) -> None:
        """Pages allocated for the sequence's next keys (:meth:`~kvpool_sidecar.pool.PagePool.grow`)."""
        seq.pages.extend(pages)
        tokens = len(pages) * self.page_size
        seq.num_tokens += tokens
        self.alloc_slots += tokens
        self.used_slots += tokens

    def fork(self, seq_id: str, new_seq_id: str, now: float) -> ForkResult:
        """Parallel sampling: share the full pages, copy the partial last page into a fresh one."""
        seq = self.get(seq_id)
        if new_seq_id in self.live:
            raise DuplicateSequence(f"sequence {new_seq_id!r} already exists", "new_seq_id")
        self.room_for_one()
        ps = self.page_size
        full = seq.num_tokens // ps
        partial = len(seq.pages) > full
        if partial:
            obtainable = self.capacity.obtainable(seq.partition, [])
            if obtainable < 1:
                raise PoolExhausted(1, obtainable, PARTITIONS[seq.partition])
        shared = seq.pages[:full]
        for page in shared:
            self.table.ref[page] += 1
        pages = list(shared)
        src = dst = NO_PAGE
        if partial:
            src = seq.pages[full]
            dst = self.eviction.allocate(seq.partition, 1, now)[0]
            pages.append(dst)
        child = SeqState(
            new_seq_id, seq.meta, seq.partition, pages, seq.keys, seq.num_tokens,
            seq.num_prompt_tokens, seq.num_computed, min(seq.published, full), seq.publish_blocked, seq.klass,
        )
        self.add(child)
        return ForkResult(new_seq_id, pages, src, dst)

    def check(self) -> None:
        """I1's refcounts and I2's publishing, from the live sequences' page tables."""
        refs = [0] * self.table.total_pages
        slots = used = 0
        for seq in self.live.values():
            for p in seq.pages:
                refs[p] += 1
            slots += len(seq.pages) * self.page_size
            used += seq.num_tokens
            assert len(seq.pages) == -(-seq.num_tokens // self.page_size), f"{seq.seq_id}: page table size"
            for i in range(seq.published):
                assert self.table.index.get(seq.keys[i]) == seq.pages[i], f"I2: {seq.seq_id} page {i} unpublished"
            assert seq.published * self.page_size <= seq.num_computed, f"I2: {seq.seq_id} published early"
        assert refs == self.table.ref, "I1: refcounts differ from the sequences' page tables"
        assert self.table.in_use == sum(1 for r in refs if r), "in-use page count drifted"
        assert (slots, used) == (self.alloc_slots, self.used_slots), "fragmentation accounting drifted"
