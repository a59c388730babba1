"""kvpool's tier as the engine's own KV events: which pages this engine announced as held, and what to publish.

A router that indexes an engine's KV events (llm-d's precise prefix-cache scorer, Dynamo's KV router)
learns from them what each pod holds. kvpool's pages are announced in the engine's own terms, block by
block, by the engine's block hashes:

* stored: when a commit of this engine made pages visible in the pool (the sidecar's reply says how
  many of the sequence's pages are published), and when an admission hit pages this engine has not
  announced (stored by an earlier incarnation of it, or before a reconnect);
* removed: when the sidecar reports that a page left the pool (eviction), for pages this engine
  announced; and every announced page at once when the connection to the sidecar is lost or the
  sidecar lost removals (a restarted sidecar holds nothing; a router must not count a tier it cannot
  reach), never an all-cleared event, which would clear the engine's own tier as well.

Pure bookkeeping, thread-safe (the link's thread records, the scheduler takes); the engine's adapter
turns :class:`Stored` and :class:`Removed` into its event types.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stored:
    hashes: list[bytes]  # engine block hashes, in prompt order
    parent: bytes | None  # the hash of the block before the first (None: the first is the prompt's first)
    first_block: int  # the index of hashes[0] in its request's blocks
    source: Any  # the engine's request: token ids, LoRA and salt are read from it when published


@dataclass(frozen=True)
class Removed:
    hashes: list[bytes]


class EventLog:
    """What this engine announced as held in kvpool, and the events not yet published."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._announced: dict[bytes, None] = {}  # at most the pool's pages: each leaves with a removal
        self._pending: list[Stored | Removed] = []

    def __len__(self) -> int:
        return len(self._announced)

    def stored(self, hashes: Sequence[bytes], start: int, end: int, source: Any) -> None:
        """Blocks ``[start, end)`` of a request whose block hashes are ``hashes`` became visible in the pool."""
        if end <= start:
            return
        new = list(hashes[start:end])
        with self._lock:
            self._announced.update(dict.fromkeys(new))
            self._pending.append(Stored(new, hashes[start - 1] if start else None, start, source))

    def held(self, hashes: Sequence[bytes], count: int, source: Any) -> None:
        """An admission found the first ``count`` blocks in the pool: announce those not announced yet
        (from the first of them on, so the announcement stays one chain)."""
        announced = self._announced
        with self._lock:
            first = next((i for i in range(count) if hashes[i] not in announced), count)
        self.stored(hashes, first, count, source)

    def removed(self, hashes: Sequence[bytes]) -> None:
        """These blocks left the pool: a removal for each one this engine announced."""
        if not hashes:
            return
        with self._lock:
            pop = self._announced.pop
            gone = [h for h in hashes if pop(h, 0) is None]
            if gone:
                self._pending.append(Removed(gone))

    def forget_all(self) -> None:
        """Nothing announced can be counted on any more (connection lost, removals lost)."""
        with self._lock:
            if self._announced:
                self._pending.append(Removed(list(self._announced)))
                self._announced = {}

    def take(self) -> list[Stored | Removed]:
        """The events in the order they happened; resets."""
        with self._lock:
            out, self._pending = self._pending, []
        return out
