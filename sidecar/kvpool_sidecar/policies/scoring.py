"""The workload-aware score, in one place: Score = alpha*P_reuse + beta*S_locality + gamma*T_window.

* ``P_reuse`` comes from the per-class reuse model (:func:`kvpool_sidecar.workload.p_reuse`).
* ``S_locality`` decays with the page's index in its prompt: head pages (system prompts, chat history)
  serve every later turn, tail pages only the exact same continuation.
* ``T_window`` is 1 while the page is younger than its class's window, 0 after: expired pages go first.

Both workload-aware policies rank pages by (fresh, score) through :meth:`Scoring.rank`; the bucketed
one caches :meth:`Scoring.base_rank` (everything but the locality term) per release time and inlines
it in its bulk loop, which ``tests/sidecar/test_policies.py`` pins to this one.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies.base import PolicyBase, PolicyContext
from kvpool_sidecar.workload import ReuseModel, reuse_within

BUCKETS_PER_WINDOW = 8
LOCALITY_LEVELS = 16  # S_locality is quantised so that the exact variant has few (class, level) groups
_HIST_BINS = 64
_THRESHOLD_EVERY = 64  # sampled scores between threshold updates


def locality_level(depth: int, length: int) -> int:
    """How far from its prompt's tail a page is, in 1/16ths: the first page is 16, the last 1 or more.

    Relative rather than absolute: what is worth keeping of a prompt is its head, and the tails of
    all prompts compete on their reuse probability alone.
    """
    if depth >= length:
        return 1
    return LOCALITY_LEVELS - (depth * LOCALITY_LEVELS) // length


def locality(level: int) -> float:
    return level / LOCALITY_LEVELS


class Scoring(PolicyBase):
    """Weights and model shared by both implementations."""

    uses_model = True  # the pool keeps a ghost of evicted keys so the model sees late reuses too

    def __init__(self, ctx: PolicyContext) -> None:
        self.model: ReuseModel = ctx.model
        self.partition = ctx.partition
        self.configure(ctx.spec)

    def configure(self, spec: KVCachePolicySpec) -> None:
        w = spec.eviction.weights
        self.alpha, self.beta, self.gamma = w.reuse, w.locality, w.timeWindow
        self.beta_level = self.beta / LOCALITY_LEVELS  # beta * S_locality = beta_level * level
        self.protected_share = spec.eviction.protectedPercent / 100.0
        window = spec.workloads.toB.window_seconds if self.partition == "toB" else spec.workloads.toC.window_seconds
        self.bucket_width = window / BUCKETS_PER_WINDOW

    def base_rank(self, p: float, lam: float, window: float, within: float, age: float) -> tuple[bool, float]:
        """(fresh, alpha*P_reuse + gamma*T_window) of a page of age ``age`` in a class fitted (p, lam)
        with ``window`` (``within``: :func:`~kvpool_sidecar.workload.reuse_within` of them)."""
        survive = p * math.exp(-lam * age)  # p_reuse(p, lam, age, within), inlined (pinned by a test)
        score = self.alpha * (survive * within / (survive + 1.0 - p))
        fresh = age <= window
        if fresh:
            score += self.gamma
        return fresh, score

    def rank(self, klass: Hashable, level: int, age: float) -> tuple[bool, float]:
        """Eviction order: expired pages first (whatever their score), then the lowest score."""
        p, lam, window = self.model.params(klass)
        fresh, base = self.base_rank(p, lam, window, reuse_within(lam, window), age)
        return fresh, base + self.beta_level * level


class TopShare:
    """The score above which the top ``share`` of recent scores lie: a decayed histogram of sampled
    scores in [0, top], re-read every ``_THRESHOLD_EVERY`` samples (infinite until then)."""

    def __init__(self) -> None:
        self._hist = [0.0] * _HIST_BINS
        self.threshold = math.inf
        self._since = 0

    def note(self, score: float, top: float, share: float) -> None:
        hist = self._hist
        hist[min(int(score / top * _HIST_BINS), _HIST_BINS - 1)] += 1.0
        self._since += 1
        if self._since >= _THRESHOLD_EVERY:
            self._since = 0
            want = sum(hist) * share
            acc = 0.0
            self.threshold = math.inf
            for i in range(_HIST_BINS - 1, -1, -1):
                acc += hist[i]
                if acc > want:
                    self.threshold = (i + 1) * top / _HIST_BINS
                    break
            for i in range(_HIST_BINS):
                hist[i] *= 0.5  # forget old scores: the threshold follows the workload
