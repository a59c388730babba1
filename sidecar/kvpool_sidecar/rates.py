"""Rates of named events that decay with time: a pod's load, a prefix's requests per second.
Plain Python: no I/O, no clock of its own."""

from __future__ import annotations

import math
from collections.abc import Hashable

PREFIX_RATE_WINDOW = 10.0  # seconds over which a prefix's QPS is measured (auto-pin, the replay's hot prefixes)


class DecayedCounter:
    """Rates of named events (a pod's load, a prefix's QPS): counts per name that decay by
    ``exp(-dt / window)``; each name decays lazily when touched."""

    def __init__(self, window: float) -> None:
        if not window > 0:
            raise ValueError("window must be above 0 seconds")
        self.window = window
        self._value: dict[Hashable, float] = {}
        self._at: dict[Hashable, float] = {}

    def get(self, name: Hashable, now: float) -> float:
        value = self._value.get(name)
        if value is None:
            return 0.0
        dt = now - self._at[name]
        return value * math.exp(-dt / self.window) if dt > 0 else value

    def add(self, name: Hashable, now: float, amount: float = 1.0) -> float:
        value = self.get(name, now) + amount
        self._value[name] = value
        self._at[name] = max(now, self._at.get(name, now))
        return value

    def rate(self, name: Hashable, now: float) -> float:
        """Events per second over the recent window."""
        return self.get(name, now) / self.window

    def drop(self, name: Hashable) -> None:
        self._value.pop(name, None)
        self._at.pop(name, None)

    def names(self) -> list[Hashable]:
        return list(self._value)

    def prune(self, now: float, below: float) -> None:
        """Forget names whose decayed count fell under ``below`` (bounds memory for per-key counts)."""
        for name in [n for n in self._value if self.get(n, now) < below]:
            self.drop(name)

    def __len__(self) -> int:
        return len(self._value)
