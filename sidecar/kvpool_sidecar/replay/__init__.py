"""Trace replay: production traces through the real pool, the project's performance record."""

from kvpool_sidecar.replay.run import (
    REFERENCE_POLICIES,
    SETUPS,
    ReplayResult,
    Setup,
    capacity_pages,
    replay_pool,
    replay_reference,
    replay_spec,
    run_matrix,
    trace_spec,
)
from kvpool_sidecar.replay.trace import Request, Trace, TraceError, open_trace, parse_lines, read_trace

__all__ = [
    "REFERENCE_POLICIES",
    "ReplayResult",
    "Request",
    "SETUPS",
    "Setup",
    "Trace",
    "TraceError",
    "capacity_pages",
    "parse_lines",
    "open_trace",
    "read_trace",
    "replay_pool",
    "replay_reference",
    "replay_spec",
    "run_matrix",
    "trace_spec",
]
