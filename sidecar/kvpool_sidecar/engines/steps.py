"""What crosses between the connector's two halves each step: the scheduler's plan (which pool pages to load
into which engine blocks, which blocks to save into which pages) and the worker's report of the steps it ran.
Plain data, no engine and no tensors: the scheduler half (:mod:`.scheduler`) builds the plans, the worker
(:mod:`.worker`) runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool_sidecar.engines.link import Report


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    epoch: int
    pages: list[int]  # pool pages, in prompt order
    blocks: list[int]  # the engine blocks they go into
    valid: bool = True  # False: the admission's session ended; the worker reports the blocks failed
    fence: tuple[int, int] | None = None  # the admission's session fence (the worker checks it)


@dataclass(frozen=True)
class SaveJob:
    req_id: str
    epoch: int
    pages: list[int]  # pool pages the sidecar allocated for these blocks (its grows)
    blocks: list[int]  # engine blocks whose KV is complete after this step
    fence: tuple[int, int] | None = None  # the admission's session fence: no page is written once it moved


@dataclass
class StepPlan:
    """What the worker does around one forward pass (the engine's connector metadata)."""

    step: int = 0
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # requests whose blocks the engine freed this step
    # Requests that had saves, all written and reported before they finished: the engine freed their
    # blocks at once, so the worker does not name them in finished_sending.
    released: set[str] = field(default_factory=set)
    # Finished requests with saves still to plan (this plan's included): the engine keeps their blocks,
    # and the worker names none of them in finished_sending yet.
    coming: set[str] = field(default_factory=set)


@dataclass
class StepDone:
    """What the worker reports of the steps it ran (summed over its ranks)."""

    steps: dict[int, int] = field(default_factory=dict)  # step -> ranks that ran it
    failed_saves: set[tuple[int, str]] = field(default_factory=set)  # (step, req_id)
    report: Report = field(default_factory=Report)

    def merge(self, other: StepDone) -> StepDone:
        for step, n in other.steps.items():
            self.steps[step] = self.steps.get(step, 0) + n
        self.failed_saves |= other.failed_saves
        self.report.merge(other.report)
        return self
