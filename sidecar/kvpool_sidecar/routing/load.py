"""Per-pod load: requests routed, exponentially decayed over a window (a recent-rate estimate that
needs no completion signal from the engines). The counter itself lives with the other statistics."""

from kvpool_sidecar.workload import DecayedCounter

__all__ = ["DecayedCounter"]
