"""Reuse statistics per workload class: how often a released page is reused, and how soon.

A page released at time 0 is reused later with probability ``p`` (the rest are never reused: a
single-turn chat, a one-off API call) and, if it is, after a gap of mean ``1 / rate``. Both are
estimated per class from decayed counters (so they follow a drifting workload), shrunk towards the
configured priors until ``minSamples`` reuses have been seen, and a class's rate is watched for
drift against the rate it settled at. They feed metrics and drift events; no policy ranks by them
(the default ranks by page counts, :mod:`kvpool_sidecar.frequency`).
Plain Python: no I/O, no clock of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvpool_sidecar.config import KVCachePolicySpec, parse_duration
from kvpool_sidecar.keys import workload_class_of

StatsClass = Hashable  # a keys.StatsClass, or the 1-tuple of its workload class that pools it
PRIOR_REUSE_PROBABILITY = 0.5
_MIN_P, _MAX_P = 0.01, 0.99
_DRIFT_CHECK_EVERY = 64  # reuse observations between drift checks of a class
# A class's drift reference waits until it has been seen for this many of its windows (and at least
# DRIFT_WARMUP_MIN_SECONDS): until then the long gaps have not come in and the plain rate is high by
# construction (a steady chat class, gaps of minutes: 2.7x its rate after one window, 1.2x after four).
DRIFT_WARMUP_WINDOWS = 4
DRIFT_WARMUP_MIN_SECONDS = 300.0
FIT_HALF_LIFE_SECONDS = 1800.0  # the fit forgets half its evidence in this time


@dataclass(slots=True)
class ClassFit:
    """Decayed sufficient statistics of one class."""

    klass: StatsClass
    prior_rate: float  # reuses per second
    releases: float = 0.0  # page releases (each could be followed by a reuse)
    reuses: float = 0.0  # page reuses observed
    gap_sum: float = 0.0  # seconds between a page's release and its reuse, summed
    total_reuses: int = 0  # undecayed, for cold start and drift checks
    updated_at: float = 0.0
    reference_rate: float | None = None
    since_check: int = 0
    first_reuse_at: float | None = None
    first_release_at: float | None = None


@dataclass(frozen=True, slots=True)
class DriftEvent:
    klass: StatsClass
    reference_rate: float
    fitted_rate: float
    at: float
    adopted: bool


def _parent(klass: StatsClass) -> StatsClass:
    """The workload class a finer class belongs to; a workload class is its own parent."""
    if isinstance(klass, tuple) and len(klass) > 1:
        return (klass[0],)
    return klass


class ReuseModel:
    """Per-class fits plus drift detection; the pool feeds it, policies and metrics read it."""

    def __init__(self, spec: KVCachePolicySpec, *, half_life: float | None = None) -> None:
        self._fits: dict[StatsClass, ClassFit] = {}  # never dropped
        # Counters decay with time (the caller's clock), all three together, so that their ratios
        # stay unbiased however the observations are batched.
        self._decay_per_second = math.log(2.0) / (half_life or FIT_HALF_LIFE_SECONDS)
        self.drift_events: list[DriftEvent] = []
        self.on_drift: Callable[[DriftEvent], None] | None = None
        self.on_reuse: Callable[[StatsClass, int, float], None] | None = None  # (class, pages, summed gaps)
        self.configure(spec)

    def configure(self, spec: KVCachePolicySpec) -> None:
        """Swap priors, windows and drift settings live; fitted statistics are kept."""
        self._prior_rate = {
            "toC": spec.workloads.toC.decayPerMinute / 60.0,
            "toB": spec.workloads.toB.decayPerMinute / 60.0,
        }
        self._workloads = spec.workloads
        self.min_samples = spec.learning.minSamples
        self.cold_start_seconds = parse_duration(spec.learning.coldStartPeriod)
        self.drift_threshold = spec.learning.driftThresholdPercent / 100.0
        self.refit_on_drift = spec.learning.refitOnDrift
        for klass, fit in self._fits.items():
            fit.prior_rate = self._prior_for(klass)

    def _prior_for(self, klass: StatsClass) -> float:
        return self._prior_rate.get(workload_class_of(klass), self._prior_rate["toC"])

    def _fit_pair(self, klass: StatsClass) -> tuple[ClassFit, ...]:
        """The fits an observation of ``klass`` updates: its own and its workload class's."""
        parent = _parent(klass)
        return (self._fit(klass),) if parent == klass else (self._fit(klass), self._fit(parent))

    def _fit(self, klass: StatsClass) -> ClassFit:
        fit = self._fits.get(klass)
        if fit is None:
            fit = self._fits[klass] = ClassFit(klass, self._prior_for(klass))
        return fit

    # ---------------------------------------------------------------------------- observations
    def _age(self, fit: ClassFit, now: float) -> None:
        dt = now - fit.updated_at
        if dt > 0:
            d = math.exp(-self._decay_per_second * dt)
            fit.releases *= d
            fit.reuses *= d
            fit.gap_sum *= d
            fit.updated_at = now

    def observe_release(self, klass: StatsClass, pages: int, now: float) -> None:
        for fit in self._fit_pair(klass):
            if now > fit.updated_at:
                self._age(fit, now)
            if fit.first_release_at is None:
                fit.first_release_at = now
            fit.releases += pages

    def observe_reuse(self, klass: StatsClass, pages: int, gap_sum: float, now: float) -> None:
        """``pages`` cached pages were reused; ``gap_sum`` is their summed time since last release."""
        if pages <= 0:
            return
        if self.on_reuse is not None:
            self.on_reuse(klass, pages, gap_sum)
        gap = gap_sum if gap_sum > 0.0 else 0.0
        for fit in self._fit_pair(klass):
            if now > fit.updated_at:
                self._age(fit, now)
            fit.reuses += pages
            fit.gap_sum += gap
            fit.total_reuses += pages
            fit.since_check += pages
            if fit.first_reuse_at is None:
                fit.first_reuse_at = now
            if fit.since_check >= _DRIFT_CHECK_EVERY and (
                fit.total_reuses >= self.min_samples or now - fit.first_reuse_at >= self.cold_start_seconds
            ):
                fit.since_check = 0
                self._check_drift(fit, now)

    def evidence(self, klass: StatsClass, now: float) -> tuple[float, float]:
        """(page releases, page reuses) of ``klass`` as of ``now``, decayed as its fit decays them (half-life
        ``FIT_HALF_LIFE_SECONDS``): the class's own, not its workload class's, so that a stream of a class (a
        turn) whose pages never come back shows it. What a page's claim rests on (:mod:`.pool.claims`)."""
        fit = self._fits.get(klass)
        if fit is None:
            return 0.0, 0.0
        dt = now - fit.updated_at
        decay = math.exp(-self._decay_per_second * dt) if dt > 0 else 1.0
        return fit.releases * decay, fit.reuses * decay

    # --------------------------------------------------------------------------------- the fit
    def params(self, klass: StatsClass) -> tuple[float, float]:
        """(probability that a released page is ever reused, reuse rate per second) of a class: its
        decayed counts shrunk towards its workload class's estimate (a workload class: its priors)
        by ``minSamples`` pseudo-observations."""
        parent = _parent(klass)
        if parent == klass:
            prior_p, prior_rate = PRIOR_REUSE_PROBABILITY, self._prior_for(klass)
        else:
            prior_p, prior_rate = self.params(parent)
        fit = self._fits.get(klass)
        if fit is None:
            return prior_p, prior_rate
        k = float(self.min_samples)
        p = (fit.reuses + k * prior_p) / (fit.releases + k)
        return min(max(p, _MIN_P), _MAX_P), (fit.reuses + k) / (fit.gap_sum + k / prior_rate)

    def classes(self) -> dict[StatsClass, tuple[float, float, int]]:
        """Per class (and per workload class): fitted rate (per minute), reuse probability, reuses seen."""
        return {k: (rate * 60.0, p, f.total_reuses) for k, f in self._fits.items() for p, rate in [self.params(k)]}

    # ------------------------------------------------------------------------------- drift
    def _check_drift(self, fit: ClassFit, now: float) -> None:
        # Drift is about the workload, so it compares the data's own estimate, not the shrunk one
        # (which moves on its own as evidence outweighs the prior).
        seen_since = fit.first_release_at if fit.first_release_at is not None else fit.first_reuse_at
        window = self._workloads.window_of(workload_class_of(fit.klass))
        warmup = max(DRIFT_WARMUP_WINDOWS * window, DRIFT_WARMUP_MIN_SECONDS)
        if fit.gap_sum <= 0 or seen_since is None or now - seen_since < warmup:
            return
        rate = fit.reuses / fit.gap_sum
        if fit.reference_rate is None:
            fit.reference_rate = rate  # the end of this class's cold start
            return
        ref = fit.reference_rate
        if abs(rate - ref) > self.drift_threshold * ref:
            event = DriftEvent(fit.klass, ref * 60.0, rate * 60.0, now, self.refit_on_drift)
            if self.refit_on_drift:
                fit.reference_rate = rate
            self.drift_events.append(event)
            del self.drift_events[:-100]
            if self.on_drift is not None:
                self.on_drift(event)
