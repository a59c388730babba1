"""Grid search of the workload-aware weights (alpha, beta, gamma) on a trace."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.replay.run import replay_pool
from kvpool_sidecar.replay.trace import Trace

DEFAULT_GRID = {
    "reuse": (0.4, 0.6, 0.8, 1.0),
    "locality": (0.0, 0.15, 0.3),
    "timeWindow": (0.0, 0.1),
}


@dataclass(frozen=True, slots=True)
class TuneRow:
    reuse: float
    locality: float
    timeWindow: float
    token_hit_ratio: float


def with_weights(spec: KVCachePolicySpec, reuse: float, locality: float, time_window: float) -> KVCachePolicySpec:
    data = spec.model_dump()
    data["eviction"]["weights"] = {"reuse": reuse, "locality": locality, "timeWindow": time_window}
    return KVCachePolicySpec.model_validate(data)


def grid_search(
    trace: Trace,
    capacity: float,
    spec: KVCachePolicySpec | None = None,
    grid: dict[str, tuple[float, ...]] | None = None,
    policy: str = "workload_aware",
    on_row: Callable[[TuneRow], None] | None = None,
) -> list[TuneRow]:
    """Replay every weight combination (all-zero skipped); rows sorted best first."""
    spec = spec or KVCachePolicySpec()
    grid = grid or DEFAULT_GRID
    rows = []
    for a, b, g in itertools.product(grid["reuse"], grid["locality"], grid["timeWindow"]):
        if a + b + g <= 0:
            continue
        result = replay_pool(trace, policy, capacity, with_weights(spec, a, b, g))
        row = TuneRow(a, b, g, result.token_hit_ratio)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    rows.sort(key=lambda r: -r.token_hit_ratio)
    return rows
