"""Which engine pages left the pool, for each engine session that publishes KV events.

The pool keeps the keys it drops while anyone follows them (``PagePool.removed_keys``); the sidecar hands
them out, under the pool's lock, to every following session whose model namespace they carry (a pool key
of an engine's page is the namespace's 16 bytes and the engine's block hash). A session takes its
removals with each step's reply; what piles up between two of its steps is bounded, and past the bound the
session is told its removals were lost (its connector then stops counting anything it announced as held).
"""

from __future__ import annotations

from collections.abc import Hashable

from kvpool_sidecar.pool import PagePool


class RemovalFeed:
    """The block hashes of one model namespace removed since the session last took them."""

    def __init__(self, prefix: bytes, limit: int) -> None:
        self.prefix = prefix
        self.limit = limit
        self.hashes: list[bytes] = []
        self.lost = False

    def add(self, keys: list[Hashable]) -> None:
        if self.lost:
            return
        prefix, n = self.prefix, len(self.prefix)
        self.hashes.extend(k[n:] for k in keys if isinstance(k, bytes) and k[:n] == prefix)
        if len(self.hashes) > self.limit:
            self.hashes = []
            self.lost = True

    def take(self) -> tuple[list[bytes], bool]:
        """The removals so far and whether some were lost; both reset."""
        hashes, lost = self.hashes, self.lost
        self.hashes, self.lost = [], False
        return hashes, lost


class Removals:
    """The feeds that follow one pool's removals (the pool keeps no removed key while there are none)."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.feeds: list[RemovalFeed] = []

    def follow(self, prefix: bytes) -> RemovalFeed:
        self.flush()  # what left before the session came is none of its business
        # Between two steps of an engine, its pages can leave at most once each (plus the pages that were
        # stored meanwhile): twice the pool with room is a bound a live session never reaches.
        feed = RemovalFeed(prefix, 2 * self.pool.total_pages + 1024)
        self.feeds.append(feed)
        if self.pool.removed_keys is None:
            self.pool.removed_keys = []
        return feed

    def unfollow(self, feed: RemovalFeed) -> None:
        if feed in self.feeds:
            self.feeds.remove(feed)
        if not self.feeds:
            self.pool.removed_keys = None

    def flush(self) -> None:
        """Hand the pool's removed keys to every feed (under the pool's lock)."""
        removed = self.pool.removed_keys
        if not removed:
            return
        for feed in self.feeds:
            feed.add(removed)
        removed.clear()
