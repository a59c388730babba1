"""The protocol between the pool and an eviction policy.

The pool owns page state; a policy only orders the *evictable* pages of one partition (cached, refcount
0, not pinned) and names a victim. Every call is O(1) or amortised O(1) on the request path.
"""

from __future__ import annotations

from typing import Hashable, Protocol


class EvictionPolicy(Protocol):
    name: str

    def insert(self, page: int, now: float, depth: int, klass: Hashable) -> None:
        """``page`` became evictable at ``now``; ``depth`` is its index in the prompt, ``klass`` its class."""

    def remove(self, page: int, now: float, hit: bool) -> None:
        """``page`` is no longer evictable: reused by a request (``hit``) or pinned."""

    def victim(self, now: float) -> int:
        """Remove and return the page to evict next; only called when ``len(self) > 0``."""

    def __len__(self) -> int: ...

    def __contains__(self, page: int) -> bool: ...


class PolicyError(ValueError):
    """An unknown policy name or bad policy parameter."""
