"""Offline tuning on a trace: each of the self-tuner's candidate reuse weights held fixed, against
what the self-tuner chose on the same replay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.replay.run import capacity_pages, replay_pool, trace_spec
from kvpool_sidecar.replay.trace import Trace


@dataclass(frozen=True, slots=True)
class TuneRow:
    reuse: float
    locality: float
    timeWindow: float
    token_hit_ratio: float


@dataclass(frozen=True, slots=True)
class SelfTuningReport:
    """What the self-tuner did on a replay, by partition: the weight it ended on, its switches and the
    share of requests each weight was in force for; and the token hit ratio it reached."""

    token_hit_ratio: float
    final: dict[str, float]
    switches: dict[str, int]
    time_at: dict[str, dict[float, float]]


def adaptive_spec(spec: KVCachePolicySpec, weight: float | None) -> KVCachePolicySpec:
    """``workload_adaptive``, self-tuned (``weight`` None) or held at the reuse weight ``weight``."""
    data = spec.model_dump()
    data["eviction"]["policy"] = "workload_adaptive"
    if weight is not None:
        data["eviction"]["selfTuning"]["enabled"] = False
        data["eviction"]["weights"] = {**data["eviction"]["weights"], "reuse": weight, "locality": 0.0}
    return KVCachePolicySpec.model_validate(data)


def fixed_weights(trace: Trace, capacity: float, spec: KVCachePolicySpec | None = None,
                  on_row: Callable[[TuneRow], None] | None = None) -> list[TuneRow]:
    """Each of the self-tuner's candidate reuse weights (of either partition) held fixed in both
    partitions for the whole replay; best first."""
    spec = spec or KVCachePolicySpec()
    tuning = spec.eviction.selfTuning
    rows = []
    for weight in sorted(set(tuning.candidates(to_b=False)) | set(tuning.candidates(to_b=True))):
        fixed = adaptive_spec(spec, weight)
        result = replay_pool(trace, "workload_adaptive", capacity, fixed)
        row = TuneRow(weight, 0.0, fixed.eviction.weights.timeWindow, result.token_hit_ratio)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    rows.sort(key=lambda r: -r.token_hit_ratio)
    return rows


def self_tuned(trace: Trace, capacity: float, spec: KVCachePolicySpec | None = None) -> SelfTuningReport:
    """Replay with the self-tuner on, reading its choice every 256 requests."""
    tuned = adaptive_spec(spec or KVCachePolicySpec(), None)
    pages, _ = capacity_pages(trace, capacity)
    pool = PagePool(pages, trace_spec(trace, "workload_adaptive", tuned), clock=lambda: 0.0)
    ticks: dict[str, dict[float, int]] = {}

    def tick(_: int) -> None:
        for part, state in pool.tuning().items():
            at = ticks.setdefault(part, {})
            at[state["reuse_weight"]] = at.get(state["reuse_weight"], 0) + 1

    result = replay_pool(trace, "workload_adaptive", capacity, tuned, progress=tick, pool=pool)
    served = {r.meta.workload_class for r in trace.requests}  # a partition no request used tuned nothing
    tuning = {part: state for part, state in pool.tuning().items() if part in served}
    ticks = {part: at for part, at in ticks.items() if part in served}
    return SelfTuningReport(
        result.token_hit_ratio,
        {part: state["reuse_weight"] for part, state in tuning.items()},
        {part: state["switches"] for part, state in tuning.items()},
        {part: {w: n / sum(at.values()) for w, n in sorted(at.items())} for part, at in ticks.items()},
    )
