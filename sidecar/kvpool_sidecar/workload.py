"""Reuse statistics per workload class: an online exponential reuse-time model with a never-reused mass.

A page released at time 0 is reused at some later time with probability ``p`` (the rest are never
reused: a single-turn chat, a one-off API call) and, if it is, after an exponential gap of rate
``lam``. A pure exponential model says every page is reused eventually; the mass ``1 - p`` is what
makes an old page worthless rather than merely "due". Given that a page has waited ``age`` seconds
without reuse, the probability that it is reused within the next ``window`` seconds is

    P = p * exp(-lam * age) * (1 - exp(-lam * window)) / (p * exp(-lam * age) + 1 - p)

Both parameters are fitted online per class from decayed counters (so the fit follows a drifting
workload) and shrunk towards the configured priors until ``minSamples`` reuses have been seen.
The pool reports reuses (with their gaps) and, where it keeps a ghost of evicted keys, the pages it
forgot unreused after so many seconds: censored observations, taken in by EM (:func:`_em_step`).
Without them a small cache, which sees only the short gaps, would fit a fast decay to every class.
A pool that reports every page's way out (reused, or forgotten by its ghost) also lets the model count
the pages still waiting (``track_at_risk``): censored at their current age, so that a ghost that
watches pages for a whole window does not make every class look always reused meanwhile.
Plain Python: no I/O, no clock of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvpool_sidecar.config import KVCachePolicySpec, parse_duration
from kvpool_sidecar.keys import workload_class_of

StatsClass = Hashable  # a keys.StatsClass, or the 1-tuple of its workload class that pools it
PREFIX_RATE_WINDOW = 10.0  # seconds over which a prefix's QPS is measured (auto-pin, the router's hot prefixes)
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
    censored: float = 0.0  # pages forgotten unreused (their ghost key dropped): censored observations
    exposure: float = 0.0  # seconds those pages were watched for a reuse, summed
    em: tuple[float, float] | None = None  # the last (p, rate) of the censored fit: its next start
    # The pages released and not yet resolved (neither reused nor forgotten): cached or remembered by
    # the ghost. Not decayed: the set as it is now. Censored at their current age in the fit.
    at_risk: float = 0.0
    at_risk_released: float = 0.0  # their release times, summed
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
        self._fits: dict[StatsClass, ClassFit] = {}
        self._pairs: dict[StatsClass, tuple[ClassFit, ClassFit]] = {}  # fits are never dropped
        # Counters decay with time (the caller's clock), all three together, so that their ratios
        # stay unbiased however the observations are batched.
        self._decay_per_second = math.log(2.0) / (half_life or FIT_HALF_LIFE_SECONDS)
        self.drift_events: list[DriftEvent] = []
        self.on_drift: Callable[[DriftEvent], None] | None = None
        self.on_reuse: Callable[[StatsClass, int, float], None] | None = None  # (class, pages, summed gaps)
        # Set by a pool that reports every page's way out (reused, or forgotten by its ghost): the
        # fit then counts the pages still waiting as censored at their age (see _em_step).
        self.track_at_risk = False
        self.configure(spec)

    def configure(self, spec: KVCachePolicySpec) -> None:
        """Swap priors, windows and drift settings live; fitted statistics are kept."""
        self._prior_rate = {
            "toC": spec.workloads.toC.decayPerMinute / 60.0,
            "toB": spec.workloads.toB.decayPerMinute / 60.0,
        }
        self.windows = {"toC": spec.workloads.toC.window_seconds, "toB": spec.workloads.toB.window_seconds}
        self.min_samples = spec.learning.minSamples
        self.cold_start_seconds = parse_duration(spec.learning.coldStartPeriod)
        self.drift_threshold = spec.learning.driftThresholdPercent / 100.0
        self.refit_on_drift = spec.learning.refitOnDrift
        self._shape: dict[StatsClass, tuple[StatsClass | None, float, float]] = {}
        for klass, fit in self._fits.items():
            fit.prior_rate = self._prior_for(klass)

    def _prior_for(self, klass: StatsClass) -> float:
        return self._prior_rate.get(workload_class_of(klass), self._prior_rate["toC"])

    def window_of(self, klass: StatsClass) -> float:
        return self.windows.get(workload_class_of(klass), self.windows["toC"])

    def _fit_pair(self, klass: StatsClass) -> tuple[ClassFit, ClassFit]:
        """The fits an observation of ``klass`` updates, its own and its workload class's (first time)."""
        pair = self._pairs[klass] = (self._fit(klass), self._fit(_parent(klass)))
        return pair

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
            fit.censored *= d
            fit.exposure *= d
            fit.updated_at = now

    def observe_release(self, klass: StatsClass, pages: int, now: float) -> None:
        for fit in self._pairs.get(klass) or self._fit_pair(klass):
            if now > fit.updated_at:
                self._age(fit, now)
            if fit.first_release_at is None:
                fit.first_release_at = now
            fit.releases += pages
            if self.track_at_risk:
                fit.at_risk += pages
                fit.at_risk_released += pages * now

    def reset_at_risk(self) -> None:
        """Forget the pages waiting: whoever would have reported their outcome no longer will."""
        for fit in self._fits.values():
            fit.at_risk = fit.at_risk_released = 0.0

    @staticmethod
    def _leave_risk(fit: ClassFit, pages: float, released_sum: float) -> None:
        fit.at_risk -= pages
        fit.at_risk_released -= released_sum
        if fit.at_risk <= 0.0:  # sampled reports overshoot a little: the set is empty, not negative
            fit.at_risk = fit.at_risk_released = 0.0

    def observe_censored(self, klass: StatsClass, pages: float, exposure: float, now: float) -> None:
        """``pages`` released pages were watched for ``exposure`` seconds in all and not reused.

        Moves the censored fit one EM step (the workload class's first: a class shrinks towards it),
        so that the fit depends on the observations alone, not on how often it is read.
        """
        own, parent = self._pairs.get(klass) or self._fit_pair(klass)
        fits = _em_order(own, parent)
        for fit in fits:
            if now > fit.updated_at:
                self._age(fit, now)
            fit.censored += pages
            fit.exposure += exposure
            if self.track_at_risk:
                self._leave_risk(fit, pages, pages * now - exposure)
        self._em(fits, parent, now)

    def _em(self, fits: tuple[ClassFit, ...], parent: ClassFit, now: float) -> None:
        k = float(self.min_samples)
        for fit in fits:
            if fit is parent:
                prior_p, prior_rate = PRIOR_REUSE_PROBABILITY, self._prior_for(fit.klass)
            else:
                prior_p, prior_rate, _ = self.params(parent.klass)
            if fit.censored + fit.at_risk <= 0.0:
                continue  # nothing seen unreused yet: the plain estimate stands
            fit.em = _em_step(fit, k, prior_p, prior_rate, now)

    def observe_reuse(self, klass: StatsClass, pages: int, gap_sum: float, now: float) -> None:
        """``pages`` cached pages were reused; ``gap_sum`` is their summed time since last release."""
        if pages <= 0:
            return
        if self.on_reuse is not None:
            self.on_reuse(klass, pages, gap_sum)
        gap = gap_sum if gap_sum > 0.0 else 0.0
        pair = self._pairs.get(klass) or self._fit_pair(klass)
        for fit in pair:
            if now > fit.updated_at:
                self._age(fit, now)
            fit.reuses += pages
            fit.gap_sum += gap
            if self.track_at_risk:
                self._leave_risk(fit, pages, pages * now - gap)
            fit.total_reuses += pages
            fit.since_check += pages
            if fit.first_reuse_at is None:
                fit.first_reuse_at = now
            if fit.since_check >= _DRIFT_CHECK_EVERY and (
                fit.total_reuses >= self.min_samples or now - fit.first_reuse_at >= self.cold_start_seconds
            ):
                fit.since_check = 0
                self._check_drift(fit, now)
        if self.track_at_risk:  # every report moves the fit one step (the pages waiting are known)
            own, parent = pair
            self._em(_em_order(own, parent), parent, now)

    # --------------------------------------------------------------------------------- the fit
    def rate(self, klass: StatsClass) -> float:
        """Fitted reuse rate (per second), shrunk towards its parent's (see :meth:`params`)."""
        return self.params(klass)[1]

    def reuse_probability(self, klass: StatsClass) -> float:
        """Probability that a released page is ever reused (1 - the never-reused mass)."""
        return self.params(klass)[0]

    def params(self, klass: StatsClass) -> tuple[float, float, float]:
        """(:meth:`reuse_probability`, :meth:`rate`, :meth:`window_of`) of a class in one pass."""
        shape = self._shape.get(klass)
        if shape is None:  # what depends on the configuration only, kept until the next configure()
            parent = _parent(klass)
            shape = self._shape[klass] = (
                None if parent == klass else parent, self._prior_for(klass), self.window_of(klass)
            )
        parent, prior_rate, window = shape
        if parent is None:
            prior_p = PRIOR_REUSE_PROBABILITY
        else:
            prior_p, prior_rate, _ = self.params(parent)
        fit = self._fits.get(klass)
        if fit is None:
            return prior_p, prior_rate, window
        if fit.em is not None:
            p, lam = fit.em
            return p, lam, window
        k = float(self.min_samples)
        p = (fit.reuses + k * prior_p) / (fit.releases + k)
        return min(max(p, _MIN_P), _MAX_P), (fit.reuses + k) / (fit.gap_sum + k / prior_rate), window

    def p_reuse(self, klass: StatsClass, age: float, window: float | None = None) -> float:
        """P(reused within the next ``window`` | not reused for ``age`` seconds)."""
        p, lam, w = self.params(klass)
        if window is not None:
            w = window
        return p_reuse(p, lam, age, reuse_within(lam, w))

    def classes(self) -> dict[StatsClass, tuple[float, float, int]]:
        """Per class (and per workload class): fitted rate (per minute), reuse probability, reuses seen."""
        return {
            k: (self.rate(k) * 60.0, self.reuse_probability(k), f.total_reuses) for k, f in self._fits.items()
        }

    # ------------------------------------------------------------------------------- drift
    def _check_drift(self, fit: ClassFit, now: float) -> None:
        # Drift is about the workload, so it compares the data's own estimate, not the shrunk one
        # (which moves on its own as evidence outweighs the prior).
        seen_since = fit.first_release_at if fit.first_release_at is not None else fit.first_reuse_at
        warmup = max(DRIFT_WARMUP_WINDOWS * self.window_of(fit.klass), DRIFT_WARMUP_MIN_SECONDS)
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


def _em_order(own: ClassFit, parent: ClassFit) -> tuple[ClassFit, ...]:
    """The fits one observation moves, the workload class's first: a class shrinks towards it."""
    return (parent, own) if own is not parent else (own,)


def reuse_within(lam: float, window: float) -> float:
    """P(a gap shorter than ``window``) at rate ``lam``: the age-free factor of :func:`p_reuse`."""
    return 1.0 - math.exp(-lam * window)


def p_reuse(p: float, lam: float, age: float, within: float) -> float:
    """The conditional reuse probability of the module docstring, for one page (``within``:
    :func:`reuse_within` of its class's rate and window, computed once per class)."""
    survive = p * math.exp(-lam * age)
    return survive * within / (survive + 1.0 - p)


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


def _em_step(fit: ClassFit, k: float, prior_p: float, prior_rate: float, now: float) -> tuple[float, float]:
    """One EM step of the (p, rate) fit with censored observations, shrunk by ``k`` pseudo-reuses.

    A page forgotten after ``c`` seconds unreused is either never reused or reused later than ``c``;
    the E step splits those two (expected share ``w`` of the late ones), the M step counts the
    watched time of the late ones as exposure. Where the cache forgets pages long before their reuses
    come (to-C chats at 1 %: pages are watched for tens of seconds, turns come minutes apart), the
    gaps seen cannot show a decay, and the fit moves towards "likely reused, at the rate observed per
    watched second" instead of a fast decay fitted to truncated gaps (the plain estimate, reuses over
    summed gaps, takes every gap it sees for a whole gap).

    The pages released and not resolved yet (``fit.at_risk``: cached unreused, or still in the
    ghost) are censored at their age at ``now`` too. Without them a ghost that watches pages for a
    whole window reports its reuses minutes before it reports a single page forgotten, and the fit
    takes every class for one that is always reused.
    """
    reuses, gaps = fit.reuses, fit.gap_sum
    censored = fit.censored + fit.at_risk
    waited = max(fit.at_risk * now - fit.at_risk_released, 0.0)
    watched = (fit.exposure + waited) / censored
    if fit.em is None:  # start from the plain estimate
        p = (reuses + k * prior_p) / (reuses + censored + k)
        lam = (reuses + k) / (gaps + k / prior_rate)
    else:
        p, lam = fit.em
    late = p * math.exp(-lam * watched)
    w = late / (1.0 - p + late)
    p = min(max((reuses + censored * w + k * prior_p) / (reuses + censored + k), _MIN_P), _MAX_P)
    lam = (reuses + k) / (gaps + censored * w * watched + k / prior_rate)
    return p, lam
