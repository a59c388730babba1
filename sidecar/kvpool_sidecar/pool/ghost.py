"""The ghost: keys of recently evicted pages, so that the reuse model sees reuses that come after
an eviction (a sample of them) and the pages that were never reused (censored observations).

Without it the model would only see the reuses that the current policy let survive, and learn its
own bias back. Kept only while a policy ranks by the model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

# The ghost remembers one evicted key in GHOST_SAMPLE (by the key's hash, so that a reuse is looked
# for on the keys that were remembered) and each stands for GHOST_SAMPLE pages. It keeps a key for as
# long as the longest class window (the model predicts reuse within a window, so it has to see gaps
# that long: at 1 % of the to-C trace a page lives 12 s in the pool, a chat's next turn comes after
# 400 s) and at most GHOST_KEYS_PER_PAGE keys per pool page (memory). A page evicted without its key
# remembered is never reported again: its sampled siblings stand for it, so in expectation eviction
# leaves the model's count of pages waiting for a reuse (at risk) unchanged.
GHOST_SAMPLE = 16
GHOST_MASK = GHOST_SAMPLE - 1  # a key is remembered when ``not hash(key) & GHOST_MASK``
GHOST_KEYS_PER_PAGE = 1  # a quarter of that lost to-C 1 % (0.1285 against 0.1315)
_GHOST_EXPIRE_PER_CALL = 256  # keys forgotten for age per eviction call (steady state: a few)


class GhostMemory:
    """The evicted keys and what they report to the model; a part of :class:`~kvpool_sidecar.pool.PagePool`."""

    def _init_ghost(self) -> None:
        # Evicted key -> (statistics class, last release).
        self._ghost: OrderedDict[Hashable, tuple[Hashable, float]] = OrderedDict()
        self._ghost_cap = 0  # set by _size_ghost: only policies that rank by the model need it
        self._ghost_horizon = 0.0
        self.ghost_hits = 0

    def _size_ghost(self, uses_model: bool, horizon: float) -> None:
        self._ghost_cap = max(1, self.total_pages * GHOST_KEYS_PER_PAGE) if uses_model else 0
        if not self._ghost_cap:
            self._ghost.clear()
        if self.model.track_at_risk and not uses_model:
            self.model.reset_at_risk()  # the ghost that would report them is gone
        self.model.track_at_risk = uses_model  # every page's way out is reported (see release)
        self._ghost_horizon = horizon

    def _observe_late_reuses(self, keys: list[Hashable], now: float) -> None:
        """The request's uncached pages whose keys the ghost remembers: reuses the pool missed."""
        ghost = self._ghost
        late_class: Hashable = None
        late = 0
        late_gaps = 0.0
        for key in keys:
            if hash(key) & GHOST_MASK:
                continue  # not one of the sampled keys: neither seen nor a reason to stop
            seen = ghost.pop(key, None)
            if seen is None:
                break
            if seen[0] != late_class:
                if late:
                    self.model.observe_reuse(late_class, late, late_gaps, now)
                late_class, late, late_gaps = seen[0], 0, 0.0
            late += GHOST_SAMPLE  # each remembered key stands for the unsampled ones
            late_gaps += GHOST_SAMPLE * (now - seen[1])
        if late:
            self.ghost_hits += late
            self.model.observe_reuse(late_class, late, late_gaps, now)

    def _trim_ghost(self, now: float) -> None:
        """Forget the evicted keys older than the horizon or over the cap, oldest first (mostly none):
        each is a page seen not reused for as long as it was remembered, which the reuse model needs
        as much as the reuses (censored observations)."""
        ghost = self._ghost
        pop = ghost.popitem
        censored: dict[Hashable, list[float]] = {}
        cap = self._ghost_cap
        oldest = now - self._ghost_horizon
        # Keys past the horizon go a bounded number per call: after a long idle spell (or a shorter
        # window) the backlog is spread over the next evictions instead of stalling one request.
        expire = _GHOST_EXPIRE_PER_CALL
        while ghost:
            if len(ghost) <= cap:
                if expire <= 0 or next(iter(ghost.values()))[1] >= oldest:
                    break
                expire -= 1
            klass, released = pop(last=False)[1]
            acc = censored.get(klass)
            if acc is None:
                censored[klass] = [1.0, now - released]
            else:
                acc[0] += 1.0
                acc[1] += now - released
        for klass, (pages, exposure) in censored.items():
            self.model.observe_censored(klass, GHOST_SAMPLE * pages, GHOST_SAMPLE * exposure, now)
