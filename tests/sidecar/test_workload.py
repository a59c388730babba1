"""The reuse model: priors at cold start, an unbiased fit, the never-reused mass, drift."""

from __future__ import annotations

import heapq
import math
import random

import pytest
from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.workload import PRIOR_REUSE_PROBABILITY, ReuseModel, p_reuse, reuse_within

CHAT = ("toC", "text", 0)
API = ("toB", "api", 0)
# The default prior weighs 5000 reuses (what the replays measured best); these tests fit a class from a
# few thousand, so they weigh the prior as 200.
FIT = {"learning": {"minSamples": 200}}


def fit_spec() -> KVCachePolicySpec:
    return KVCachePolicySpec.model_validate(FIT)


def feed(model: ReuseModel, klass, rate_per_s: float, p: float, pages: int, start: float, rng: random.Random) -> float:
    """Release ``pages`` pages one per second; each is reused with prob ``p`` after Exp(rate)."""
    now = start
    for _ in range(pages):
        now += 1.0
        model.observe_release(klass, 1, now)
        if rng.random() < p:
            model.observe_reuse(klass, 1, rng.expovariate(rate_per_s), now)
    return now


def test_cold_start_uses_the_configured_priors():
    model = ReuseModel(KVCachePolicySpec())
    assert math.isclose(model.rate(CHAT) * 60, 0.15)
    assert math.isclose(model.rate(API) * 60, 6.0)
    assert model.reuse_probability(CHAT) == PRIOR_REUSE_PROBABILITY
    assert model.window_of(API) == 10 and model.window_of(CHAT) == 600


def test_fit_recovers_rate_and_reuse_probability():
    model = ReuseModel(fit_spec())
    feed(model, CHAT, rate_per_s=1 / 120, p=0.3, pages=20_000, start=0.0, rng=random.Random(1))
    assert abs(model.rate(CHAT) * 120 - 1) < 0.1
    assert abs(model.reuse_probability(CHAT) - 0.3) < 0.03


def watch(model: ReuseModel, klass, rate_per_s: float, p: float, horizon: float, pages: int, seed: int) -> None:
    """Like :func:`feed`, but a reuse is seen only within ``horizon`` seconds of the release (the time
    a page stays cached or remembered by the ghost); the others are reported as censored."""
    rng = random.Random(seed)
    now = 0.0
    for _ in range(pages):
        now += 1.0
        model.observe_release(klass, 1, now)
        gap = rng.expovariate(rate_per_s) if rng.random() < p else math.inf
        if gap < horizon:
            model.observe_reuse(klass, 1, gap, now)
        else:
            model.observe_censored(klass, 1, horizon, now)


def test_censored_fit_recovers_rate_and_reuse_probability_when_pages_are_watched_long():
    model = ReuseModel(fit_spec())
    watch(model, CHAT, rate_per_s=1 / 120, p=0.3, horizon=3000, pages=20_000, seed=1)
    assert abs(model.rate(CHAT) * 120 - 1) < 0.1
    assert abs(model.reuse_probability(CHAT) - 0.3) < 0.03


def test_pages_forgotten_before_their_reuse_do_not_make_a_slow_class_look_fast_or_worthless():
    """Chats reused after minutes in a cache that remembers a page for 20 s: the gaps seen are all
    short. Taken as whole gaps they fit a fast decay and a tiny reuse probability; with the forgotten
    pages counted as censored, the reuses per watched second (what eviction weighs) stay close to the
    truth, and so does the order of two classes that differ in how often they come back."""
    truth = {CHAT: 0.8, ("toC", "text", 1): 0.2}
    censored, plain = ReuseModel(fit_spec()), ReuseModel(fit_spec())
    for seed, (klass, p) in enumerate(truth.items()):
        watch(censored, klass, rate_per_s=1 / 400, p=p, horizon=20, pages=20_000, seed=seed)
        feed_seen = random.Random(seed)  # the same pages, without the censored reports
        now = 0.0
        for _ in range(20_000):
            now += 1.0
            plain.observe_release(klass, 1, now)
            gap = feed_seen.expovariate(1 / 400) if feed_seen.random() < p else math.inf
            if gap < 20:
                plain.observe_reuse(klass, 1, gap, now)
    for klass, p in truth.items():
        hazard = p / 400  # reuses per second of a page just released
        fitted_p, fitted_rate, _ = censored.params(klass)
        assert 0.5 < fitted_p * fitted_rate / hazard < 2
        plain_p, plain_rate, _ = plain.params(klass)
        assert plain_p * plain_rate / hazard < 0.3
    high, low = (censored.p_reuse(klass, 10.0) for klass in truth)
    assert high > 1.8 * low  # the truth: 4x; the window-wide probability saturates


def replay_events(model: ReuseModel, p: float, rate_per_s: float, horizon: float, until: float) -> None:
    """Pages released one per second until ``until``, reported as a pool with a ghost that watches them
    for ``horizon`` seconds reports them: a reuse when it happens, a forgotten page ``horizon`` after
    its release; pages still waiting at ``until`` are not reported yet."""
    rng = random.Random(7)
    events: list[tuple[float, int, float]] = []  # (when, 0 release / 1 reuse / 2 forgotten, release time)
    t = 0.0
    while t < until:
        events.append((t, 0, t))
        gap = rng.expovariate(rate_per_s) if rng.random() < p else math.inf
        events.append((t + gap, 1, t) if gap < horizon else (t + horizon, 2, t))
        t += 1.0
    for when, kind, released in sorted(events):
        if when > until:
            break
        if kind == 0:
            model.observe_release(CHAT, 1, when)
        elif kind == 1:
            model.observe_reuse(CHAT, 1, when - released, when)
        else:
            model.observe_censored(CHAT, 1, horizon, when)


def test_pages_still_waiting_are_censored_at_their_age_so_a_long_watch_does_not_inflate_reuse():
    """A ghost that watches pages for 10 minutes reports a reuse seconds after it happens but a page
    that is never reused only 10 minutes after its release. Fitted from what was reported, the class
    looks always reused; with the pages still waiting counted (censored at their age), it does not."""
    reported, at_risk = ReuseModel(fit_spec()), ReuseModel(fit_spec())
    at_risk.track_at_risk = True
    for model in (reported, at_risk):
        replay_events(model, p=0.3, rate_per_s=1 / 120, horizon=600, until=1500)
    assert abs(at_risk.reuse_probability(CHAT) - 0.3) < 0.05
    assert reported.reuse_probability(CHAT) > 0.4  # the bias the waiting pages correct
    # Waiting: the last 600 s of releases less those reused so far, 600 - 0.3 * (600 - 120) pages.
    assert at_risk._fits[CHAT].at_risk == pytest.approx(456, rel=0.1)


def test_never_reused_mass_makes_old_pages_worthless():
    # With p = 1 an exponential is memoryless: age changes nothing. With p < 1, waiting is evidence
    # that the page belongs to the never-reused mass.
    assert math.isclose(p_reuse(1.0, 0.01, 0, reuse_within(0.01, 60)), p_reuse(1.0, 0.01, 500, reuse_within(0.01, 60)))
    young, old = p_reuse(0.3, 0.01, 0, reuse_within(0.01, 60)), p_reuse(0.3, 0.01, 500, reuse_within(0.01, 60))
    assert old < young / 5


def test_rare_class_borrows_its_workload_class_fit():
    model = ReuseModel(fit_spec())
    feed(model, CHAT, rate_per_s=1 / 60, p=0.2, pages=5000, start=0.0, rng=random.Random(2))
    rare = ("toC", "image", 3)
    model.observe_release(rare, 1, 5000.0)
    # Not the 0.5 prior: it shrinks towards to-C's fitted 0.2.
    assert abs(model.reuse_probability(rare) - 0.2) < 0.05


def test_params_are_reuse_probability_rate_and_window_in_one_pass():
    model = ReuseModel(KVCachePolicySpec())
    feed(model, CHAT, rate_per_s=1 / 60, p=0.2, pages=500, start=0.0, rng=random.Random(3))
    model.observe_release(("toC", "file", 1), 3, 500.0)
    classes = (CHAT, ("toC",), ("toC", "file", 1), API, ("toB", "api", 2))
    for klass in classes:
        assert model.params(klass) == (model.reuse_probability(klass), model.rate(klass), model.window_of(klass))
    model.configure(KVCachePolicySpec.model_validate({"workloads": {"toC": {"timeWindow": "2m", "decayPerMinute": 1}}}))
    for klass in classes:  # new priors and windows are seen at once
        assert model.params(klass) == (model.reuse_probability(klass), model.rate(klass), model.window_of(klass))
    assert model.params(CHAT)[2] == 120


def test_drift_is_reported_and_adopted_when_refit_is_on():
    spec = KVCachePolicySpec.model_validate({"learning": {"minSamples": 100, "driftThresholdPercent": 20}})
    model = ReuseModel(spec, half_life=300.0)
    events = []
    model.on_drift = events.append
    rng = random.Random(3)
    now = feed(model, CHAT, rate_per_s=1 / 60, p=0.5, pages=3000, start=0.0, rng=rng)
    assert events == []  # a stable workload reports nothing
    feed(model, CHAT, rate_per_s=1 / 10, p=0.5, pages=3000, start=now, rng=rng)  # reuse 6x faster
    assert events, "a 6x faster reuse must be reported as drift"
    assert events[0].klass in (CHAT, ("toC",)) and events[0].adopted
    assert events[-1].fitted_rate > 1.2 * events[0].reference_rate


def test_drift_without_refit_keeps_the_reference():
    spec = KVCachePolicySpec.model_validate(
        {"learning": {"minSamples": 100, "driftThresholdPercent": 20, "refitOnDrift": False}}
    )
    model = ReuseModel(spec, half_life=300.0)
    rng = random.Random(4)
    now = feed(model, CHAT, rate_per_s=1 / 60, p=0.5, pages=3000, start=0.0, rng=rng)
    feed(model, CHAT, rate_per_s=1 / 10, p=0.5, pages=3000, start=now, rng=rng)
    refs = {round(e.reference_rate, 6) for e in model.drift_events if e.klass == CHAT}
    assert len(refs) == 1 and not any(e.adopted for e in model.drift_events)


def test_live_reconfigure_changes_priors_but_keeps_the_fit():
    model = ReuseModel(KVCachePolicySpec())
    feed(model, CHAT, rate_per_s=1 / 60, p=0.4, pages=3000, start=0.0, rng=random.Random(5))
    fitted = model.reuse_probability(CHAT)
    model.configure(KVCachePolicySpec.model_validate({"workloads": {"toB": {"decayPerMinute": 12}}}))
    assert math.isclose(model.rate(API) * 60, 12)
    assert model.reuse_probability(CHAT) == fitted


def feed_as_it_happens(
    model: ReuseModel, klass, rate_per_s: float, p: float, seconds: int, start: float, rng: random.Random
) -> float:
    """Release a page a second for ``seconds``; each is reused with prob ``p`` after Exp(rate), and the
    reuse is reported when it happens (so the long gaps show up late, as in a running pool)."""
    due: list[tuple[float, float]] = []  # (reuse time, gap)
    now = start
    for _ in range(seconds):
        now += 1.0
        while due and due[0][0] <= now:
            at, gap = heapq.heappop(due)
            model.observe_reuse(klass, 1, gap, at)
        model.observe_release(klass, 1, now)
        if rng.random() < p:
            gap = rng.expovariate(rate_per_s)
            heapq.heappush(due, (now + gap, gap))
    return now


def test_a_steady_api_workload_reported_as_it_happens_is_not_drift_and_a_slower_one_is():
    # Reuses reported when they happen, as a running pool does: the short gaps come in first.
    spec = KVCachePolicySpec.model_validate({"learning": {"minSamples": 50, "driftThresholdPercent": 20}})
    model = ReuseModel(spec, half_life=600.0)
    now = feed_as_it_happens(model, API, rate_per_s=0.1, p=0.6, seconds=3000, start=0.0, rng=random.Random(8))
    assert model.drift_events == []
    feed_as_it_happens(model, API, rate_per_s=0.02, p=0.6, seconds=3000, start=now, rng=random.Random(9))  # 5x slower
    assert any(e.klass == API and e.fitted_rate < 0.8 * e.reference_rate for e in model.drift_events)


def test_a_steady_chat_workload_reported_as_it_happens_is_not_drift_until_it_changes():
    # Gaps of minutes: in the first window only the short ones have come in (the plain rate is 2.7x
    # the true one after ten minutes, 1.2x after forty), so the reference waits for four windows.
    spec = KVCachePolicySpec.model_validate({"learning": {"minSamples": 100, "driftThresholdPercent": 20}})
    model = ReuseModel(spec)
    now = feed_as_it_happens(model, CHAT, rate_per_s=1 / 400, p=0.5, seconds=7200, start=0.0, rng=random.Random(1))
    assert model.drift_events == []
    # Then reuse 4x faster
    feed_as_it_happens(model, CHAT, rate_per_s=1 / 100, p=0.5, seconds=3600, start=now, rng=random.Random(2))
    assert any(e.klass == CHAT and e.fitted_rate > 1.2 * e.reference_rate for e in model.drift_events)
