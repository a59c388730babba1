"""The self-tuned policy (workload_adaptive): its order, its counts, its tuner, and what operators see."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool_sidecar import frequency
from kvpool_sidecar._shadow import ShadowCore
from kvpool_sidecar._sketch import count as sketch_count
from kvpool_sidecar.config import ConfigError, KVCachePolicySpec, SidecarConfig, validate_config
from kvpool_sidecar.frequency import COUNT_CAP, LIFT_SHAPE, CountLift, FrequencySketch, ReuseByCount
from kvpool_sidecar.pool import PagePool, tuning
from kvpool_sidecar.pool.tuning import _DECIDE_EVERY, SampledPrompt, SelfTuner, ShadowCache
from kvpool_sidecar.replay import capacity_pages, parse_lines, replay_pool, trace_spec
from kvpool_sidecar.replay.synth import generate
from oracles import PythonShadowCore, count_python
from support import live_sidecar


def adaptive(weight: float | None = None, **tuning: object) -> KVCachePolicySpec:
    """workload_adaptive, self-tuned, or with the fixed reuse weight ``weight`` (no locality term)."""
    eviction: dict = {"policy": "workload_adaptive", "selfTuning": tuning}
    if weight is not None:
        eviction["weights"] = {"reuse": weight, "locality": 0, "timeWindow": 0.1}
        eviction["selfTuning"] = {**tuning, "enabled": False}
    return KVCachePolicySpec.model_validate({"eviction": eviction})


def trace(profile: str, requests: int = 3000, seed: int = 1):
    return parse_lines(generate(profile, requests, seed), f"{profile}:{seed}")


def test_with_no_reuse_weight_it_evicts_exactly_as_lru():
    """alpha = 0 is plain recency: the same hits and the same evictions as the LRU policy, page for page."""
    for profile in ("mixed", "scan"):
        t = trace(profile)
        lru = replay_pool(t, "lru", 0.01)
        flat = replay_pool(t, "workload_adaptive", 0.01, adaptive(0.0))
        assert (flat.token_hit_ratio, flat.evictions) == (lru.token_hit_ratio, lru.evictions)


def test_pages_prompts_keep_containing_outlive_one_off_pages():
    """A hot prefix seen in many prompts survives a stream of one-off prompts that LRU lets flush it."""
    def run(policy: str, spec: KVCachePolicySpec | None) -> int:
        pool = PagePool(28, spec or KVCachePolicySpec.model_validate({"eviction": {"policy": policy}}),
                        clock=lambda: 0.0)
        hot = list(range(10))
        hits = 0
        for i in range(200):
            now = float(i)
            ids = hot if i % 4 == 0 else [1000 + 10 * i + j for j in range(10)]  # 30 one-off pages between
            hits += pool.admit(f"r{i}", block_hashes=ids, num_tokens=16 * len(ids), now=now).num_cached_tokens
            pool.commit(f"r{i}", 16 * len(ids), now=now)
            pool.release(f"r{i}", now=now)
        pool.check_invariants()
        return hits
    assert run("lru", None) == 0  # 30 one-off pages flush the 10 hot ones every time
    assert run("workload_adaptive", adaptive(0.1)) >= 40 * 160  # nearly every hot prompt hits whole


def test_a_prefix_never_goes_before_its_continuation():
    """With a strong credit the victim is always a leaf: no eviction has to take cached descendants along."""
    pool = PagePool(60, adaptive(1.0), clock=lambda: 0.0)
    cascades = 0
    evict_descendants = pool.eviction._evict_descendants

    def counted(page: int) -> list[int]:
        nonlocal cascades
        cascades += 1
        return evict_descendants(page)

    pool.eviction._evict_descendants = counted
    rng = random.Random(3)
    for i in range(600):
        base = rng.randrange(6)
        ids = [base * 100 + j for j in range(rng.randrange(1, 6))]  # shared prefixes of varying depth
        ids += [10_000 + i * 10 + j for j in range(rng.randrange(0, 6))]  # a private tail
        pool.admit(f"r{i}", block_hashes=ids, num_tokens=16 * len(ids), now=float(i))
        pool.commit(f"r{i}", 16 * len(ids), now=float(i))
        pool.release(f"r{i}", now=float(i))
    pool.check_invariants()
    assert pool.evictions > 1000 and cascades == 0


def test_the_sketch_counts_prompts_keeps_counts_past_eviction_and_stays_bounded():
    pages = 20_000  # above the floors: sized by the pool
    sketch = FrequencySketch(pages)
    assert sketch.nbytes <= 2 * 2 * 32 * pages  # two rows of at most 64 bytes per page
    before, _ = sketch.add(["a", "b"])
    assert before == [0, 0]
    for _ in range(COUNT_CAP + 3):
        sketch.add(["a"])
    assert sketch.count("a") == COUNT_CAP and sketch.count("b") == 1
    # Fill it to its halving point with keys seen once: few fresh keys then look seen.
    sketch.add([("fill", i) for i in range(16 * pages - sketch._added - 1)])
    false = sum(sketch.count(("fresh", i)) > 0 for i in range(2000))
    assert false < 2000 * 0.2  # two rows at most 40 % full: about 15 %
    counts = [sketch.count(k) for k in ("a", "b", ("fill", 7))]
    sketch.add(["c"])  # the period's last increment: every count halves
    assert sketch.halvings == 1 and sketch.count("a") == COUNT_CAP // 2
    assert [sketch.count(k) for k in ("a", "b", ("fill", 7))] == [c // 2 for c in counts]


def test_a_small_pools_sketch_remembers_as_long_as_its_floors_say():
    """A pool of 1,000 pages gets the floors' cells and period, not 64 KiB halved every 16,000 keys."""
    sketch = FrequencySketch(1000)
    assert sketch.nbytes == frequency.MIN_CELLS
    sketch.add(["kept", "kept"])
    sketch.add([("once", i) for i in range(frequency.MIN_MEMORY - 3)])
    assert sketch.halvings == 0 and sketch.count("kept") == 2
    sketch.add(["last"])
    assert sketch.halvings == 1 and sketch.count("kept") == 1
    sketch.size_for(0)  # no counting: the memory goes
    assert sketch.nbytes == 64


def test_the_compiled_sketch_counts_exactly_as_the_python_loop():
    rng = random.Random(7)
    keys: list = [rng.randrange(-(2**70), 2**70) for _ in range(300)]
    keys += [-1, -2, 0, 2**63 - 1, -(2**63), 2**64 + 5, "a", b"\x00" * 16, ("toC", 3), 1.5]
    keys += [rng.randbytes(16) for _ in range(300)] + list(range(200))
    reference, compiled = bytearray(64 * 8), bytearray(64 * 8)  # small: cells collide and reach the cap
    for step in range(60):
        prompt = keys[:rng.randrange(0, 8)] + rng.sample(keys, rng.randrange(0, 40))  # a hot prefix and others
        drop = rng.choice([-1, 59, 60, 61, 62, 63, 64])
        cap = rng.choice([COUNT_CAP, 3])
        assert sketch_count(compiled, 7, prompt, cap, drop) == count_python(reference, 7, prompt, cap, drop), step
        assert compiled == reference, step
    assert max(compiled) == COUNT_CAP


def test_the_compiled_sketch_refuses_cells_it_would_write_past():
    cells = bytearray(64 * 4)
    with pytest.raises(ValueError, match="line_mask"):
        sketch_count(cells, 4, [1, 2, 3], COUNT_CAP, -1)  # five lines' reach over four lines
    with pytest.raises(TypeError, match="bytearray"):
        sketch_count(bytes(64 * 4), 3, [1], COUNT_CAP, -1)
    with pytest.raises(TypeError):
        sketch_count(cells, 3, [1, [2]], COUNT_CAP, -1)  # an unhashable key, as hash() says
    assert cells.count(0) == len(cells) - 2  # only the key before it was counted (two cells)


def replay_both(compiled: ShadowCore, reference: PythonShadowCore, prompts: list[SampledPrompt],
                curve: list[float], scores: tuple[float, float]) -> tuple[float, float]:
    """One batch into both cores: their scores, sizes and queues (key by key, touch by touch) agree."""
    got = compiled.replay(prompts, curve, *scores)
    assert got == reference.replay(prompts, curve, *scores)
    assert len(compiled) == len(reference)
    assert compiled.queues() == reference.queues()
    return got


@pytest.mark.parametrize("weight", [0.0, 0.03, 0.3])
def test_the_compiled_shadow_decides_exactly_as_the_python_one(weight):
    rng = random.Random(11)
    compiled, reference = ShadowCore(60, weight), PythonShadowCore(60, weight)
    hot: list = [rng.randbytes(8) for _ in range(30)]  # reused often: hits, moves between queues
    curve = list(ReuseByCount().p)
    now = 0.0
    scores = (0.0, 0.0)
    for batch in range(300):
        if batch % 40 == 39:  # a refitted curve: a new list, the heap rebuilt
            curve = sorted(min(1.0, c + rng.random() * 0.1) for c in curve)
        prompts = []
        for _ in range(rng.randrange(1, 4)):
            now += rng.choice([0.0, 0.5, 1.0, 7.0])  # equal touch times: ties go by the heap's serials
            keys = hot[: rng.randrange(0, 12)] + [rng.randrange(10**6) for _ in range(rng.randrange(0, 8))]
            if keys and rng.random() < 0.1:
                keys.append(keys[0])  # a key twice in one prompt
            counts = list(itertools.accumulate((rng.randrange(1, COUNT_CAP + 1) for _ in keys), min))
            prompts.append(SampledPrompt(keys, counts, rng.choice([600.0, 6000.0]), now, rng.choice([1.0, 0.99])))
        scores = replay_both(compiled, reference, prompts, curve, scores)
    assert scores[0] > 10 and len(reference) == 60


_prompts = st.lists(  # small keys, few counts, equal times: hits, moves between queues, ties
    st.tuples(st.lists(st.integers(0, 12), max_size=6), st.integers(1, COUNT_CAP), st.sampled_from([0.0, 1.0]),
              st.sampled_from([600.0, 60.0])),
    min_size=1, max_size=6)


@given(capacity=st.integers(1, 6), weight=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
       batches=st.lists(st.tuples(_prompts, st.integers(0, 6)), min_size=1, max_size=12))
@settings(max_examples=150, deadline=None)
def test_any_stream_leaves_the_compiled_and_python_shadows_alike(capacity, weight, batches):
    """Any prompts, and capacities that move between batches (a partition's holdings do)."""
    compiled, reference = ShadowCore(capacity, weight), PythonShadowCore(capacity, weight)
    curve = list(ReuseByCount().p)
    now = 0.0
    scores = (0.0, 0.0)
    for batch, resize in batches:
        if resize:
            compiled.capacity = reference.capacity = resize
            assert compiled.capacity == resize
        prompts = []
        for keys, top, step, scale in batch:
            now += step
            counts = [max(1, top - depth) for depth in range(len(keys))]  # capped by the page above
            prompts.append(SampledPrompt(keys, counts, scale, now, 0.9))
        scores = replay_both(compiled, reference, prompts, curve, scores)


def test_the_compiled_shadow_refuses_what_it_cannot_rank_and_stays_whole():
    shadow = ShadowCache(8, 0.3)
    curve = list(ReuseByCount().p)
    shadow.replay([SampledPrompt([1, 2, 3], [3, 2, 1], 600.0, 1.0, 1.0)], curve)
    kept = shadow.core.queues()
    with pytest.raises(ValueError, match="fewer counts"):
        shadow.replay([SampledPrompt([4, 5], [1], 600.0, 2.0, 1.0)], curve)
    with pytest.raises(ValueError, match="outside the curve"):
        shadow.replay([SampledPrompt([4], [COUNT_CAP + 1], 600.0, 2.0, 1.0)], curve)
    with pytest.raises(ValueError, match="empty"):
        shadow.replay([SampledPrompt([4], [1], 600.0, 2.0, 1.0)], [])
    with pytest.raises(TypeError):
        shadow.replay([SampledPrompt([[4]], [1], 600.0, 2.0, 1.0)], curve)  # an unhashable key

    class Reentrant:  # a key whose hash replays into the same shadow
        def __hash__(self) -> int:
            shadow.replay([], curve)
            return 1

    with pytest.raises(RuntimeError, match="inside a replay"):
        shadow.replay([SampledPrompt([Reentrant()], [1], 600.0, 2.0, 1.0)], curve)
    assert shadow.core.queues() == kept and len(shadow) == 3


def test_the_python_references_replay_a_trace_as_the_compiled_loops_do(monkeypatch):
    """The whole policy with the Python references in place of the compiled loops replays a trace to
    the same hits, evictions, switches and shadow hit ratios (the references are what the loops mean)."""
    t = trace("mixed", 3000, seed=3)

    def replayed() -> tuple:
        pages, _ = capacity_pages(t, 0.01)
        pool = PagePool(pages, trace_spec(t, "workload_adaptive"), clock=lambda: 0.0)
        result = replay_pool(t, "workload_adaptive", 0.01, pool=pool)
        return result.token_hit_ratio, result.evictions, pool.tuning()

    compiled = replayed()
    monkeypatch.setattr(frequency, "_count", count_python)
    monkeypatch.setattr(tuning, "ShadowCore", PythonShadowCore)
    python = replayed()
    assert python == compiled
    assert compiled[2]["toC"]["switches"] >= 1 and compiled[2]["toB"]["switches"] >= 1  # the tuners moved


def test_the_reuse_curve_is_learned_from_counts_and_never_falls():
    """1,000 keys are seen three times and 4,000 once: a key seen once comes back one time in five,
    one seen twice always; past that nothing comes back, and the curve stays at its high."""
    curve = ReuseByCount()
    sketch = FrequencySketch(10_000)
    stream = [("thrice", i % 1000) for i in range(3000)] + [("once", i) for i in range(4000)]
    random.Random(0).shuffle(stream)
    for key in stream:
        before, _ = sketch.add([key])
        curve.observe(before, sketch.halvings)
    curve.refit()
    assert 0.15 < curve.p[1] < 0.3 and curve.p[2] > 0.9
    assert all(a <= b for a, b in zip(curve.p[1:], curve.p[2:], strict=False))


def flows(lift: CountLift, visits: dict[int, int], rounds: int = 1, start: int = 0) -> None:
    """Feed ``lift`` exact counts: key k (numbered from ``start``) is contained in ``visits[k]``
    requests, each request one key, the keys' visits interleaved; ``rounds`` times over fresh keys."""
    for r in range(rounds):
        seen: dict[int, int] = {}
        order = [start + r * len(visits) + k for k, v in visits.items() for _ in range(v)]
        random.Random(r).shuffle(order)
        for key in order:
            lift.observe([seen.get(key, 0)])
            seen[key] = seen.get(key, 0) + 1


def geometric(keys: int) -> dict[int, int]:
    """Visits where half the keys at any count reach one more: the count predicts nothing."""
    return {k: 1 + (k & -k).bit_length() - 1 if k else 12 for k in range(keys)}


def test_where_the_count_predicts_nothing_its_credit_goes_but_the_templates_keep_theirs():
    """Half the keys at every count come back once more (a drain of long conversations): counts 2-8
    get no credit; counts 9 and up (a template every prompt sends) keep theirs; the curve never falls."""
    lift = CountLift()
    assert lift.p == [LIFT_SHAPE[0], *LIFT_SHAPE[1:]] and lift.lift == 1.0  # no flows yet: the full shape
    flows(lift, geometric(4096))
    lift.refit()
    assert lift.measured_lift() == 0.0 and lift.lift == 0.0
    assert lift.p[1:9] == [0.0] * 8 and lift.p[9:] == list(LIFT_SHAPE[9:]) and lift.p[9] == 0.5
    assert all(a <= b for a, b in zip(lift.p, lift.p[1:], strict=False))


def test_where_pages_seen_again_come_back_more_the_credit_is_full():
    """1,000 keys are seen four times and 4,000 once: a key seen once comes back one time in five,
    one seen twice or three times two in three: the full shape, log2 from count 2."""
    lift = CountLift()
    visits = {k: 4 if k < 1000 else 1 for k in range(5000)}
    flows(lift, visits)
    lift.refit()
    assert lift.measured_lift() == 1.0 and lift.p == list(LIFT_SHAPE)
    assert lift.p[1] == 0.0 and 0 < lift.p[2] < lift.p[4] < lift.p[8] == 0.5


def test_the_lift_follows_a_change_of_traffic_within_its_memory():
    """Chat-like flows, then a drain where the count says nothing: the credit of counts 2-8 goes
    within a few memories (a pool of 1,000 pages: 65,536 increments), and comes back with chat."""
    lift = CountLift(1000)
    assert lift.memory == 65_536
    chat = {k: 4 if k < 1000 else 1 for k in range(5000)}
    flows(lift, chat, rounds=20)
    assert lift.lift == 1.0
    flows(lift, geometric(4096), rounds=40, start=10**6)  # 40 x 8,192 increments: five memories
    assert lift.lift < 0.05  # chat's flows weigh 2**-5 of what they did
    flows(lift, geometric(4096), rounds=40, start=2 * 10**6)
    assert max(lift.p[1:9]) < frequency.REFIT_TOLERANCE  # no credit left but what a refit would not move
    flows(lift, chat, rounds=40, start=10**7)
    assert min(lift.p[2:9]) > 0 and max(abs(a - b) for a, b in zip(lift.p, LIFT_SHAPE, strict=True)) < 0.005


def test_a_lift_moved_by_less_than_the_tolerance_keeps_the_curve():
    """A new curve re-ranks every queue: one that moves the credit by under REFIT_TOLERANCE is not made."""
    lift = CountLift()
    flows(lift, geometric(4096))
    lift.refit()
    curve = lift.p
    lift.arrivals[3] += 4  # a flow or two more at count 2: the measured lift moves by a hair
    assert 0.0 < lift.measured_lift() * 0.5 < frequency.REFIT_TOLERANCE
    lift.refit()
    assert lift.p is curve and lift.lift == 0.0


def lru_and_credit() -> SelfTuner:
    """A tuner of two candidates, 0 (LRU, in force first) and 0.1, over 400 pages."""
    settings = SidecarConfig().eviction.selfTuning.model_copy(update={"reuseWeights": [0.0, 0.1]})
    return SelfTuner(pages=400, gamma=0.1, settings=settings)


def test_the_tuner_follows_the_candidate_that_hits_more_and_holds_on_a_tie():
    tuner = lru_and_credit()
    assert tuner.sample_one_in == 1 and tuner.weight == 0.0
    p = ReuseByCount().p
    sketch = FrequencySketch(400)
    hot = [("hot", j) for j in range(100)]
    for i in range(3000):  # a hot prompt between one-off ones: LRU lets 450 pages flush it, the credit keeps it
        keys = hot if i % 4 == 0 else [("once", i, j) for j in range(150)]
        before, _ = sketch.add(keys)
        tuner.observe(keys, before, list(range(len(keys))), p, 600.0, float(i))
    assert tuner.weight == 0.1 and tuner.switches == 1
    ratios = tuner.hit_ratios()
    assert ratios[0.1] > ratios[0.0] + 0.1
    tie = lru_and_credit()
    for i in range(3000):  # nothing is ever reused: every candidate hits nothing, the choice holds
        keys = [("only", i, j) for j in range(20)]
        before, _ = sketch.add(keys)
        tie.observe(keys, before, list(range(len(keys))), p, 600.0, float(i))
    assert tie.weight == 0.0 and tie.switches == 0


def test_a_lead_that_comes_and_goes_moves_nothing_and_a_steady_one_is_adopted():
    """The decision rule alone (interval by interval, no decay): a challenger ahead on average
    but by a lead that flips sign each interval is never adopted (a switch costs the live cache
    what the shadows do not see); a steady lead of 1 % of the score per interval is, once it
    passes the 2 % margin and twice the root of its squares."""
    tuner = lru_and_credit()
    lru, credit = tuner.shadows
    lru.score = 1000.0
    for interval in range(80):
        lru.interval_hits, credit.interval_hits = 100.0, (150.0 if interval % 2 else 60.0)
        assert not tuner._decide()
    credit.lead = credit.lead_squares = 0.0
    decided = []
    for _ in range(8):
        lru.interval_hits, credit.interval_hits = 100.0, 110.0
        decided.append(tuner._decide())
    assert decided.index(True) == 4 and tuner.weight == 0.1 and tuner.switches == 1  # 50 > 2 * sqrt(500)


def steady_small_lead_adopted_at(intervals: int) -> int | None:
    """The interval at which a challenger is adopted that hits 1 % more than the candidate in force
    in every interval (half the 2 % margin), decayed as a stream of 16 requests an interval is with
    the default horizon; None if it is not within ``intervals``."""
    tuner = lru_and_credit()
    lru, credit = tuner.shadows
    decay = math.exp(-_DECIDE_EVERY / SidecarConfig().eviction.selfTuning.horizonRequests)
    for interval in range(intervals):
        lru.interval_hits, credit.interval_hits = 100.0, 101.0
        lru.score = lru.score * decay + lru.interval_hits
        tuner._interval_decay = decay
        if tuner._decide():
            return interval
    return None


def test_a_steady_lead_under_the_margin_per_request_is_adopted_once_it_adds_up(monkeypatch):
    """The leads remember longer than the scores: a steady 1 % lead gains, in time, the 2 % of one
    horizon's hits that the margin asks for; with the scores' own memory it never could."""
    adopted = steady_small_lead_adopted_at(2000)
    assert adopted is not None and adopted < 300
    monkeypatch.setattr(tuning, "LEAD_MEMORY", 1.0)
    assert steady_small_lead_adopted_at(2000) is None


def adopted_after_a_losing_phase(intervals: int) -> int | None:
    """The interval at which a challenger is adopted that trailed the candidate in force by 10 % in
    each of 300 intervals and then leads it by 10 % in each; None if not within ``intervals``."""
    tuner = lru_and_credit()
    lru, credit = tuner.shadows
    lru.score = 1000.0
    decay = math.exp(-_DECIDE_EVERY / SidecarConfig().eviction.selfTuning.horizonRequests)
    for interval in range(-300, intervals):
        lru.interval_hits, credit.interval_hits = 100.0, (90.0 if interval < 0 else 110.0)
        tuner._interval_decay = decay
        if tuner._decide():
            assert interval >= 0, "adopted while it trailed"
            return interval
    return None


def test_a_candidate_worse_in_an_earlier_phase_is_adopted_soon_after_it_leads(monkeypatch):
    """A lead is floored at minus one margin: a candidate outgrown in one phase and right in the next
    is chosen within a few intervals of the change, not after repaying the phase it lost."""
    adopted = adopted_after_a_losing_phase(200)
    assert adopted is not None and adopted < 16
    monkeypatch.setattr(tuning, "LEAD_FLOOR", math.inf)  # no floor: the lost phase is repaid first
    assert adopted_after_a_losing_phase(100) is None  # (at interval 163)


@pytest.mark.parametrize(("profile", "capacity"), [("to-c", 0.02), ("scan", 0.0025), ("to-b-burst", 0.01)])
def test_self_tuned_never_loses_to_lru_on_what_it_was_not_built_for(profile, capacity):
    """The rule of issue 19 on three small traces (bench/policy_matrix.py runs the whole matrix)."""
    t = trace(profile, 6000, seed=2)
    lru = replay_pool(t, "lru", capacity)
    tuned = replay_pool(t, "workload_adaptive", capacity, adaptive())
    assert tuned.token_hit_ratio >= lru.token_hit_ratio - 0.002


def exact_block_hits(t, pages: int, weight: float) -> tuple[float, float]:
    """The block hit ratio of the key ``touched + scale * P(count)`` (prefix-closed) on ``t``,
    evaluated exactly with a heap of every touch, and that of a self-tuner's shadow of the same
    weight fed the same prompts in the tuner's batches (1/64 of its capacity)."""
    shadow = ShadowCache(pages, weight)
    sketch = FrequencySketch(pages)
    curve = CountLift(pages)  # learns as the shared partition's did, from the same counts
    scale = 600.0 / 0.1
    heap: list[tuple[float, int, int]] = []
    touch: dict[int, int] = {}  # cached key -> its live entry's (negated) serial
    serial = hit = looked = 0
    pending: list[SampledPrompt] = []
    for req in t.requests:
        keys = req.hash_ids[: req.input_length // t.block_size]
        before, _ = sketch.add(keys)
        curve.observe(before, sketch.halvings)
        counts = list(itertools.accumulate((min(c + 1, COUNT_CAP) for c in before), min))
        hit += len(list(itertools.takewhile(touch.__contains__, keys)))
        for key, count in zip(keys, counts, strict=True):
            serial -= 1
            touch[key] = serial
            heapq.heappush(heap, (req.timestamp + scale * weight * curve.p[count], serial, key))
        while len(touch) > pages:
            _, entry, key = heapq.heappop(heap)
            if touch.get(key) == entry:
                del touch[key]
        looked += len(req.hash_ids)
        pending.append(SampledPrompt(list(keys), counts, scale, req.timestamp, 1.0))
        if sum(len(prompt.keys) for prompt in pending) >= pages // 64:
            shadow.replay(pending, curve.p)
            pending = []
    return hit / looked, shadow.score / looked


def test_the_queues_decide_as_the_exact_rule_does():
    """Decision quality: the live policy's queues and a shadow's (batched as the tuner batches)
    against the exact rule (a heap of every touch) of the same key (same weight, same curve, every
    page sampled) on one trace: the live policy within 0.95 of it, the shadow within 0.98 (it ranks
    with the curve in force, the heap with the curve at each touch)."""
    t = trace("to-c", 4000)
    pages = int(t.distinct_blocks * 0.02)
    live = replay_pool(t, "workload_adaptive", 0.02, adaptive(0.1))
    exact, shadow = exact_block_hits(t, pages, 0.1)
    assert min(exact, live.block_hit_ratio) >= 0.95 * max(exact, live.block_hit_ratio)
    assert min(exact, shadow) >= 0.98 * max(exact, shadow)


def test_each_partition_has_its_own_candidates_unless_the_policy_names_them():
    """Unset, the shared partition's candidates weigh the count's lift (at most 0.5) and the to-B
    one's the learned P(reuse | count); a policy that names candidates gets them in both."""
    unset = validate_config({"eviction": {"selfTuning": {"reuseWeights": None}}}).eviction.selfTuning
    assert unset.candidates(to_b=False) == [0.0, 0.008, 0.03, 0.06, 0.12, 0.24]
    assert unset.candidates(to_b=True) == [0.0, 0.01, 0.03, 0.1, 0.2, 0.3]
    named = validate_config({"eviction": {"selfTuning": {"reuseWeights": [0.1, 0]}}}).eviction.selfTuning
    assert named.candidates(to_b=False) == named.candidates(to_b=True) == [0.0, 0.1]
    pool = PagePool(20_000, KVCachePolicySpec.model_validate({"eviction": {"selfTuning": {"reuseWeights": [0, 0.1]}}}))
    assert {part: [s.weight for s in t.shadows] for part, t in pool.tuners().items()} == {
        "toC": [0.0, 0.1], "toB": [0.0, 0.1]}
    def shares(pages: int) -> dict[str, int]:
        return {part: t.sample_one_in for part, t in PagePool(pages, KVCachePolicySpec()).tuners().items()}

    # Shared shadows: 1 in 4 at least (while 512 pages are left), more only down to 2,048; to-B down to 512.
    # to-C's shadows simulate the pages it may hold: the whole pool (it borrows to-B's idle share).
    assert shares(20_000) == {"toC": 8, "toB": 8}  # 20,000 / 6,000 pages: shadows of 2,500 / 750
    assert shares(5_000) == {"toC": 4, "toB": 2}  # 5,000 / 1,500: 1,250 / 750
    assert shares(1_000) == {"toC": 1, "toB": 1}  # 1,000 / 300: unsampled, a smaller shadow ranks badly


def test_to_c_shadows_simulate_the_pages_to_c_can_hold_now():
    """to-C borrows to-B's idle share, so its shadows are the whole pool while to-B holds nothing;
    once to-B holds pages, to-C can hold that many fewer, and its shadows shrink with it (a shadow of
    the whole pool would compare the weights at a cache size to-C no longer has)."""
    from kvpool_sidecar.keys import TO_B, WorkloadMeta

    pool = PagePool(1_000, KVCachePolicySpec(), clock=lambda: 0.0)  # 30 % to-B share, unsampled shadows
    tuner = pool.tuners()["toC"]

    def to_c(i: int) -> None:
        pool.admit(f"c{i}", block_hashes=[10_000 + 8 * i + j for j in range(8)], num_tokens=8 * 16)
        pool.release(f"c{i}")

    to_c(0)
    assert [s.capacity for s in tuner.shadows] == [1_000] * len(tuner.shadows)
    for i in range(25):  # to-B holds 200 pages (in use), within its 300-page share
        pool.admit(f"b{i}", block_hashes=[50_000 + 8 * i + j for j in range(8)], num_tokens=8 * 16,
                   meta=WorkloadMeta(workload_class=TO_B))
    to_c(1)
    assert [s.capacity for s in tuner.shadows] == [800] * len(tuner.shadows)
    for i in range(25):  # computed and released, its pages stay cached: to-C still cannot take them
        pool.commit(f"b{i}", 8 * 16)
        pool.release(f"b{i}")
    to_c(2)
    assert tuner.shadows[0].capacity == 800
    pool.check_invariants()


@pytest.mark.parametrize(("change", "field"), [
    ({"reuseWeights": [0.1, 0.1]}, "eviction.selfTuning.reuseWeights"),
    ({"reuseWeights": [2.0]}, "eviction.selfTuning.reuseWeights.0"),
    ({"reuseWeights": []}, "eviction.selfTuning.reuseWeights"),
    ({"sampleOneIn": 3}, "eviction.selfTuning.sampleOneIn"),
    ({"horizonRequests": 10}, "eviction.selfTuning.horizonRequests"),
])
def test_bad_self_tuning_settings_name_the_field(change, field):
    with pytest.raises(ConfigError) as err:
        validate_config({"eviction": {"policy": "workload_adaptive", "selfTuning": change}})
    assert field in str(err.value)


def test_operators_see_the_weight_the_shadows_and_the_switches():
    config = SidecarConfig.model_validate({"pageSize": 4, "eviction": {"policy": "workload_adaptive"}})
    with live_sidecar(config, pages=64) as (url, sidecar):
        for i in range(40):
            ids = list(range(8)) if i % 2 else [100 + 8 * i + j for j in range(8)]
            sidecar.pool.admit(f"r{i}", block_hashes=ids, now=float(i))
            sidecar.pool.release(f"r{i}", now=float(i))
        scrape = httpx.get(url + "/metrics").text
        stats = httpx.get(url + "/v1/stats").json()
    assert 'kvpool_tuning_reuse_weight{partition="toC"} 0.0' in scrape
    assert 'kvpool_tuning_shadow_hit_ratio{partition="toC",reuse_weight="0.24"}' in scrape
    assert 'kvpool_tuning_shadow_hit_ratio{partition="toB",reuse_weight="0.3"}' in scrape
    assert 'kvpool_tuning_switches_total{partition="toC"} 0.0' in scrape
    assert 'kvpool_tuning_count_lift{partition="toC"} 1.0' in scrape  # too few flows yet to measure it
    assert 'kvpool_tuning_count_lift{partition="toB"}' not in scrape  # it learns P(reuse | count) instead
    state = stats["tuning"]["toC"]
    assert state["self_tuned"] and state["reuse_weight"] == 0.0 and state["count_lift"] == 1.0
    assert set(state["shadow_hit_ratios"]) == {"0", "0.008", "0.03", "0.06", "0.12", "0.24"}
    assert set(stats["tuning"]["toB"]["shadow_hit_ratios"]) == {"0", "0.01", "0.03", "0.1", "0.2", "0.3"}


def test_tune_reports_each_candidate_and_what_self_tuning_chose(tmp_path, capsys):
    from kvpool_sidecar.cli import main

    path = tmp_path / "scan.jsonl"
    path.write_text("\n".join(generate("scan", 1500, 1)) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text("eviction:\n  policy: workload_adaptive\n  selfTuning:\n    reuseWeights: [0, 0.03]\n")
    assert main(["tune", str(path), "--capacity", "0.0025", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    fixed = {float(line.split()[0]): float(line.split()[1]) for line in out.splitlines()[1:3]}
    assert set(fixed) == {0.0, 0.03} and fixed[0.03] > fixed[0.0]  # a scan: the credit keeps the hot set
    assert "self-tuning (toC): ended on reuse=0.03 after 1 switches" in out
    assert "toB" not in out  # a single-class trace has no to-B partition to tune


def test_a_reload_turns_the_tuner_off_and_on_and_keeps_every_page():
    spec = adaptive()
    pool = PagePool(64, spec, clock=lambda: 0.0)
    for i in range(30):
        ids = [i % 5] + [100 + 8 * i + j for j in range(3)]
        pool.admit(f"r{i}", block_hashes=ids, num_tokens=64, now=float(i))
        pool.release(f"r{i}", now=float(i))
    cached = pool.stats().cached_pages
    (policy,) = [p for p in pool.policies if p.uses_frequency][:1]
    assert pool.tuning()["toC"]["self_tuned"] and policy.weights == (0.0, 0.0)
    pool.reconfigure(adaptive(0.1))  # an operator's fixed weight
    assert not pool.tuning()["toC"]["self_tuned"] and policy.weights == (0.1, 0.0)
    restricted = adaptive(reuseWeights=[0.01, 0.1])
    pool.reconfigure(restricted)  # back on, with only two candidates: it starts at the smaller
    assert pool.tuning()["toC"]["self_tuned"] and policy.weights == (0.01, 0.0)
    assert set(pool.tuning()["toC"]["shadow_hit_ratios"]) == {0.01, 0.1}
    assert pool.stats().cached_pages == cached
    pool.check_invariants()
