"""One request's transfers, as the scheduler half (:mod:`.scheduler`) tracks them: its admission (the pool's
hit pages it holds), its loads, the pages its grows added and its saves, and whether its pages can go back.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvpool_sidecar import wire
from kvpool_sidecar.engines.link import OpFailed, SidecarDown


def loadable_tokens(pool_pages: int, local_tokens: int, prompt_len: int, block_size: int) -> int:
    """Tokens the pool can add beyond the engine's local hit (whole blocks; the last token is computed)."""
    limit = (prompt_len - 1) // block_size
    return max(0, min(pool_pages, limit) * block_size - local_tokens)


@dataclass
class Request:
    """One request's admission and transfers (the scheduler half's record of it)."""

    seq_id: str
    prompt_len: int
    num_pages: int  # full prompt pages it may save
    asked_at: float = 0.0
    future: Future | None = None
    page_ids: list[int] = field(default_factory=list)
    epoch: int | None = None
    fence: tuple[int, int] | None = None
    generation: int = 0  # the link connection its admission lives on
    pool_pages: int = 0  # leading pages the pool held at admission
    local_tokens: int = 0
    allocated: bool = False  # the engine gave it blocks (a later lookup means it was preempted)
    blocks: list[int] = field(default_factory=list)
    load: tuple[int, int] | None = None  # (first block index, count) still to load
    saved: int = 0  # pages [0, saved) are in the pool or being saved
    save_failed: bool = False  # nothing past a failed save is committed
    computed: int = 0  # its full prompt blocks computed once the last step that ran it is done
    granted: int = 0  # leading pages its sequence holds: its hits, then what its grows added
    grow: Future | None = None  # a grow asked, not yet taken in
    grow_to: int = 0  # the pages that grow asked for
    grow_short: bool = False  # a grow found fewer pages than asked: nothing past ``granted`` is saved
    draining: bool = False  # finished by the engine with saves still to plan
    in_flight: int = 0  # steps with its loads or saves whose worker report is awaited
    ended: bool = False  # the engine is done with this admission (finished, or preempted and back): no more plans
    # With KV events: the engine's request and its block hashes, and how many of its pages the sidecar
    # says are published (written on the link's thread only, in reply order).
    source: Any = None
    hashes: list[bytes] = field(default_factory=list)
    published: int = 0
    op: wire.Admit | None = None  # its admission, asked again while the sidecar fetches (it has a peer hint)
    wait: float = 0.0  # how long it may wait for its answer from its first ask

    @property
    def active(self) -> bool:
        return self.future is not None or self.epoch is not None

    @property
    def saves_coming(self) -> bool:
        """Pages asked for or granted that a save has still to write (none failed)."""
        return not self.save_failed and (self.grow is not None or self.granted > self.saved)

    @property
    def transfers_over(self) -> bool:
        """Nothing of its admission is still to be read or written: its pages can go back. A copy the
        worker has not reported may still read a hit page or write a fresh one, whatever the engine did
        with the request meanwhile: until it is reported, the pages stay held."""
        if self.in_flight:
            return False
        if self.ended:
            return not self.draining
        saves_over = self.saved >= self.num_pages or self.save_failed or (
            self.grow_short and self.grow is None and self.saved >= self.granted)
        return self.load is None and saves_over

    def take_grow(self) -> None:
        """Take in the answer of the request's grow, if it is in (never waits)."""
        future = self.grow
        if future is None or not future.done():
            return
        self.grow = None
        try:
            pages = future.result().page_ids
        except (SidecarDown, OpFailed):
            pages = []
        self.page_ids.extend(pages)
        self.granted += len(pages)
        self.grow_short = self.granted < self.grow_to
