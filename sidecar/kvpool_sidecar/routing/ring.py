"""A consistent-hash ring with virtual nodes: keys map to pods so that a membership change moves ~1/N.

Each pod owns ``virtual_nodes`` points on a 64-bit ring (blake2b of ``pod#i``); a key belongs to the
first point clockwise of its own position. Walking on from there lists the other pods in a fixed,
key-specific order: the overflow and replica order of bounded-load routing.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Hashable, Iterable, Iterator


def ring_position(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def key_position(key: Hashable) -> int:
    """A key's place on the ring: its bytes when it is bytes (a chained page hash), else its repr."""
    return ring_position(key if isinstance(key, bytes) else repr(key).encode())


class HashRing:
    def __init__(self, virtual_nodes: int = 160, pods: Iterable[str] = ()) -> None:
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be at least 1")
        self.virtual_nodes = virtual_nodes
        self._points: list[int] = []  # sorted
        self._owner: list[str] = []  # pod of each point, parallel to _points
        self._pods: set[str] = set()
        for pod in pods:
            self.add(pod)

    @property
    def pods(self) -> frozenset[str]:
        return frozenset(self._pods)

    def __len__(self) -> int:
        return len(self._pods)

    def __contains__(self, pod: object) -> bool:
        return pod in self._pods

    def add(self, pod: str) -> None:
        if pod in self._pods:
            return
        self._pods.add(pod)
        for i in range(self.virtual_nodes):
            point = ring_position(f"{pod}#{i}".encode())
            at = bisect.bisect_left(self._points, point)
            self._points.insert(at, point)
            self._owner.insert(at, pod)

    def remove(self, pod: str) -> None:
        if pod not in self._pods:
            return
        self._pods.discard(pod)
        keep = [(p, o) for p, o in zip(self._points, self._owner, strict=True) if o != pod]
        self._points = [p for p, _ in keep]
        self._owner = [o for _, o in keep]

    def walk(self, position: int) -> Iterator[str]:
        """Every pod once, in ring order from the owner of ``position``."""
        n = len(self._points)
        if not n:
            return
        start = bisect.bisect_right(self._points, position) % n
        seen: set[str] = set()
        total = len(self._pods)
        for i in range(n):
            pod = self._owner[(start + i) % n]
            if pod not in seen:
                seen.add(pod)
                yield pod
                if len(seen) == total:
                    return

    def owner(self, position: int) -> str:
        for pod in self.walk(position):
            return pod
        raise LookupError("the ring has no pods")


def key_movement(positions: Iterable[int], before: HashRing, after: HashRing) -> float:
    """The share of keys whose owner differs between two rings (a membership change moves ~1/N)."""
    total = moved = 0
    for position in positions:
        total += 1
        moved += before.owner(position) != after.owner(position)
    return moved / total if total else 0.0
