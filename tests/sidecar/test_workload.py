"""The reuse model: priors at cold start, an unbiased fit, the never-reused mass, drift."""

from __future__ import annotations

import heapq
import math
import random

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.workload import PRIOR_REUSE_PROBABILITY, ReuseModel

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
    assert math.isclose(model.params(CHAT)[1] * 60, 0.15)
    assert math.isclose(model.params(API)[1] * 60, 6.0)
    assert model.params(CHAT)[0] == PRIOR_REUSE_PROBABILITY


def test_fit_recovers_rate_and_reuse_probability():
    model = ReuseModel(fit_spec())
    feed(model, CHAT, rate_per_s=1 / 120, p=0.3, pages=20_000, start=0.0, rng=random.Random(1))
    assert abs(model.params(CHAT)[1] * 120 - 1) < 0.1
    assert abs(model.params(CHAT)[0] - 0.3) < 0.03


def test_rare_class_borrows_its_workload_class_fit():
    model = ReuseModel(fit_spec())
    feed(model, CHAT, rate_per_s=1 / 60, p=0.2, pages=5000, start=0.0, rng=random.Random(2))
    rare = ("toC", "image", 3)
    model.observe_release(rare, 1, 5000.0)
    # Not the 0.5 prior: it shrinks towards to-C's fitted 0.2.
    assert abs(model.params(rare)[0] - 0.2) < 0.05


def test_a_class_leans_on_its_workload_class_and_new_priors_apply_at_once():
    model = ReuseModel(fit_spec())
    feed(model, CHAT, rate_per_s=1 / 60, p=0.2, pages=2000, start=0.0, rng=random.Random(3))
    model.observe_release(("toC", "file", 1), 3, 500.0)
    # a class with three releases and no reuse yet reads like its workload class, which learned from CHAT
    workload_p, fine_p = model.params(("toC",))[0], model.params(("toC", "file", 1))[0]
    assert workload_p < 0.3 and abs(fine_p - workload_p) < 0.01
    assert math.isclose(model.params(("toB", "api", 2))[1] * 60, 6.0)  # unseen: to-B's prior
    model.configure(KVCachePolicySpec.model_validate({"workloads": {"toB": {"decayPerMinute": 1}}}))
    assert math.isclose(model.params(("toB", "api", 2))[1] * 60, 1.0)


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
    fitted = model.params(CHAT)[0]
    model.configure(KVCachePolicySpec.model_validate({"workloads": {"toB": {"decayPerMinute": 12}}}))
    assert math.isclose(model.params(API)[1] * 60, 12)
    assert model.params(CHAT)[0] == fitted


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
