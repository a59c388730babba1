"""The worker's half of an engine connector: map the sidecar's pool, copy pages, report what it wrote.

Safety rules (a wrong KV page is a wrong answer):
* every job names the storage epoch its page ids came from; the worker copies only into and out of a
  mapping of that epoch (re-mapping when the sidecar restarted), else the job fails: a failed load is
  reported so the engine recomputes those blocks, a failed save is reported so that the scheduler never
  commits it (nor anything of that request after it);
* every job names its session's fence word in the pool's header, which the sidecar clears the moment the
  session's connection ends: a save writes each layer as one slice under :meth:`AttachedKV.writing` (the
  session's slot locked, then the fence checked: the sidecar hands the session's pages on only once no
  slice holds the lock) and a load checks it after it has read, so once the sidecar may hand the
  session's pages on nothing of this engine writes them, and nothing read from them is used;
* the worker never commits: it reports each step whose saves are written (:class:`~.steps.StepDone`,
  through the engine's own worker-to-scheduler metadata, which vLLM aggregates over its ranks) and the
  scheduler commits a step's saves once every rank has reported it, none of them failed (a
  tensor-parallel rank writes its share of each page: a page is whole only when every rank's share is
  in). Requests that had saves are reported in ``finished_sending`` once the engine says they finished
  and their last save is written, in the same output as that save's report, so their release follows
  their commits and the engine keeps their blocks until the copy has read them.

Saves are asynchronous: ``save`` queues the step's copies (:mod:`.copies`: a thread here, a copy stream
on CUDA) and returns, so the engine's next step runs while they are written. The lane is bounded in
time: while its oldest queued save has waited longer than ``max_save_backlog`` a step's saves are
skipped, reported failed (``save_skipped``). A block being read by a queued save is the engine's until
the save completes: a finished request's blocks are held through ``finished_sending`` (above); a
preempted request's are freed at once, so ``preempted`` cancels its queued saves (reported failed, never
committed: a copy under way may read blocks the next step rewrites) and returns without waiting.

Loads feed the step's own forward: ``start_loads`` queues them layer by layer on a lane of their own
(never behind the saves) and returns; each attention layer waits for its own layer's rows
(``wait_layer``), so the copy of layer ``i + 1`` runs while layer ``i`` computes; ``finish_loads``
waits for the rest and names the blocks that could not be loaded (the engine recomputes them).

The worker talks to the sidecar only to fetch the pool's storage handle: at start, and after a restart
on a thread of its own, never in the forward path (a load for a pool it has not mapped yet fails at
once, as above, and the new mapping is taken up by a later step's jobs). A save for such a pool waits
for that handle on the save lane, off the forward path (at most ``max_save_backlog``), and is written
through a mapping of its own: the first requests after a restart, which name the new pool in the same
step as their saves, are saved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from kvpool_sidecar import wire
from kvpool_sidecar.engines.blocks import EngineLayer, LayoutError, PageCopier, check_compatible
from kvpool_sidecar.engines.copies import CopyQueue
from kvpool_sidecar.engines.link import Backoff, Refused, SidecarDown
from kvpool_sidecar.engines.steps import LoadJob, SaveJob, StepDone, StepPlan
from kvpool_sidecar.storage import KVStorage, StaleHandle
from kvpool_sidecar.storage.tensors import AttachedKV

log = logging.getLogger("kvpool.engine")
_Job = TypeVar("_Job", LoadJob, SaveJob)


@dataclass
class _Loading:
    """One step's loads from one pool and session, queued layer by layer."""

    mapped: AttachedKV
    fence: tuple[int, int] | None
    jobs: int
    pages: int
    blocks: list[int]
    layers: list[Future[None]]


@dataclass
class _Flight:
    """One step's saves of one pool and session, queued: done when ``written`` is (the requests whose
    save failed). ``cancelled``: requests preempted meanwhile, whose blocks the engine may rewrite."""

    step: int
    req_ids: list[str]
    tokens: dict[str, int]  # tokens each request's save moves
    queued_at: float = 0.0
    written: Future[set[str]] = field(default_factory=Future)
    cancelled: set[str] = field(default_factory=set)
    skipped: bool = False  # never queued: the lane was behind


class WorkerSide:
    def __init__(self, welcome: Callable[[], wire.Welcome], layers: list[EngineLayer], block_size: int, *,
                 backend: str | None = None, backoff: Backoff | None = None, rank: int = 0, ranks: int = 1,
                 max_save_backlog: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.welcome = welcome  # the sidecar's storage handle, fetched on the channel
        self.layers = layers
        self.block_size = block_size
        self.ranks = ranks  # tensor-parallel workers: each copies its share of every page
        self.counts_tokens = rank == 0  # tokens moved are counted once, by the first rank (failures by each)
        self.copier = PageCopier(layers, backend, rank, ranks)
        self.backoff = backoff or Backoff("sidecar (worker)")
        self.max_save_backlog = max_save_backlog  # seconds the oldest queued save may wait before saves are skipped
        self.clock = clock
        self.done = StepDone()  # what the next worker metadata carries
        self.copies = CopyQueue(layers[0].rows.device, "kvpool-save")
        self.loads = CopyQueue(layers[0].rows.device, "kvpool-load")
        self._layer_index = {layer.name: li for li, layer in enumerate(layers)}
        self._loading: list[_Loading] = []  # the step's loads, queued
        self._load_failed: set[int] = set()  # the step's blocks known failed before any copy
        self._load_failures = 0  # ... and their jobs
        self._flights: deque[_Flight] = deque()  # saves queued, oldest first
        self._saved: set[str] = set()  # requests that had a save job (they finish through finished_sending)
        self._finishing: set[str] = set()  # of those, finished by the engine, a save still in flight
        self._coming: set[str] = set()  # finished requests whose saves the scheduler has still to plan
        self._mapped: AttachedKV | None = None  # used and replaced by the forward path's thread only
        self._fresh: AttachedKV | None = None  # a new pool's mapping, made by the background remap
        self._remapping: threading.Thread | None = None
        self._handoff = threading.Lock()  # guards _fresh between the two threads
        self._incompatible: str | None = None
        self._handle: dict | None = None  # the storage handle last fetched

    # ----------------------------------------------------------------------------- mapping
    def attach(self, *, strict: bool) -> None:
        """Map the pool now. ``strict`` (start-up): a sidecar that answers but whose pool cannot be used
        (another page size or shape, no KV storage, a segment this process cannot map) raises
        :class:`LayoutError`; an unreachable one only warns (the engine serves without it until it answers)."""
        try:
            self._mapped = self._attach_new()
        except SidecarDown as exc:
            log.warning("kvpool: the sidecar is not reachable at start-up (%s); serving without it until it is", exc)
        except LayoutError:
            if strict:
                raise
        except (StaleHandle, Refused, OSError, ValueError) as exc:
            if strict:
                raise LayoutError(f"the sidecar's pool cannot be mapped here: {exc}") from None

    def _attach_new(self) -> AttachedKV:
        """The sidecar's current pool, mapped (the old mapping is left to the forward path to close)."""
        if not self.backoff.available():
            raise SidecarDown("backing off")
        try:
            welcome = self.welcome()
        except Refused as exc:
            self.backoff.failed(exc)
            raise
        except Exception as exc:
            self.backoff.failed(exc)
            raise SidecarDown(str(exc)) from None
        self.backoff.succeeded()
        if welcome.storage is None:
            raise LayoutError("the sidecar keeps no KV storage: start it with --kv-shape")
        try:
            check_compatible(self.layers, self.block_size, welcome.storage, self.ranks)
        except LayoutError as exc:
            if self._incompatible != str(exc):
                log.error("kvpool: refusing the pool: %s", exc)
            self._incompatible = str(exc)
            raise
        self._incompatible = None
        self._handle = welcome.storage
        return KVStorage.attach(welcome.storage)

    def _close(self, mapped: AttachedKV) -> None:
        """Unmap a pool (after every copy that used it)."""
        mapped.close()

    def _mapping(self, epoch: int) -> AttachedKV | None:
        """A live mapping of the pool of ``epoch``, or None at once (that pool is gone, or not mapped yet:
        a remap starts in the background)."""
        with self._handoff:
            fresh, self._fresh = self._fresh, None
        if fresh is not None:  # swapped here, on the forward path's thread; queued saves may still use
            old, self._mapped = self._mapped, fresh  # the old one: it is closed after them, in the queue
            if old is not None:
                self._wait_loads(None)  # the queued loads read it too
                self.copies.submit(lambda: self._close(old))
        mapped = self._live_mapping()
        if mapped is not None and mapped.epoch == epoch:
            return mapped
        self._remap_soon()
        return None

    def _live_mapping(self) -> AttachedKV | None:
        """The current mapping, unless its pool is gone (its header's epoch moved: the sidecar stopped or
        restarted): then it is unmapped, after the copies queued on it, so that the shm volume never holds
        a dead pool's pages for this engine, and None is returned."""
        mapped = self._mapped
        if mapped is None:
            return None
        try:
            mapped.check()
        except StaleHandle:
            self._mapped = None
            self._wait_loads(None)
            self.copies.submit(lambda: self._close(mapped))
            return None
        return mapped

    def _remap_soon(self) -> None:
        if (self._remapping is not None and self._remapping.is_alive()) or not self.backoff.available():
            return
        self._remapping = threading.Thread(target=self._remap_in_background, name="kvpool-remap", daemon=True)
        self._remapping.start()

    def _remap_in_background(self) -> None:
        try:
            fresh = self._attach_new()
        except (LayoutError, SidecarDown, StaleHandle, Refused, ValueError, OSError):
            return
        with self._handoff:
            stale, self._fresh = self._fresh, fresh
        if stale is not None:  # never handed to the forward path
            self._close(stale)

    # ------------------------------------------------------------------------------- moving
    def start_loads(self, jobs: list[LoadJob]) -> None:
        """Queue the step's loads on the load lane, layer by layer (one gather and scatter per layer for
        all the step's jobs of a pool), and return."""
        if self._loading or self._load_failed:  # a step whose loads nobody collected yet: kept for them
            carried = self.finish_loads()
            self._load_failed |= carried
        for job in jobs:
            if not job.valid:
                self._load_failed.update(job.blocks)
                self._load_failures += 1
        for (epoch, fence), group in _by_pool([job for job in jobs if job.valid]).items():
            mapped = self._mapping(epoch)
            pages = [p for job in group for p in job.pages]
            blocks = [b for job in group for b in job.blocks]
            if mapped is None:
                self._load_failed.update(blocks)
                self._load_failures += len(group)
                continue
            copy = self.copier.load_layer
            layers = [self.loads.submit(lambda li=li, kv=mapped.kv, pg=pages, bl=blocks, c=copy: c(kv, li, pg, bl))
                      for li in range(len(self.layers))]
            self._loading.append(_Loading(mapped, fence, len(group), len(pages), blocks, layers))

    def wait_layer(self, name: str) -> None:
        """Return once layer ``name``'s rows of the step's loads are in place (every layer's, for a name
        the engine did not register)."""
        self._wait_loads(self._layer_index.get(name))

    def _wait_loads(self, li: int | None) -> None:
        """Until the queued loads of layer ``li`` (of every layer: None) are done; failures are reported
        by :meth:`finish_loads`."""
        for loading in self._loading:
            for future in loading.layers if li is None else loading.layers[li : li + 1]:
                future.exception()

    def finish_loads(self) -> set[int]:
        """Wait for the step's loads; returns the blocks that could not be loaded (and reports them)."""
        failed, self._load_failed = self._load_failed, set()
        failures, self._load_failures = self._load_failures, 0
        loaded = 0
        for loading in self._loading:
            errors = [exc for exc in (f.exception() for f in loading.layers) if exc is not None]
            if not errors:
                try:  # the pool closed or the session ended meanwhile: what was read may be another's
                    loading.mapped.check(loading.fence)
                except StaleHandle as exc:
                    errors.append(exc)
            if errors:
                log.warning("kvpool: loading %d pages for %d requests failed (%s): recomputing", loading.pages,
                            loading.jobs, errors[0])
                failed.update(loading.blocks)
                failures += loading.jobs
            else:
                loaded += loading.pages * self.block_size
        self._loading = []
        if self.counts_tokens:
            self.done.report.loaded_tokens += loaded
        if failures:
            self.done.report.fail("load", failures)
        return failed

    def save(self, plan: StepPlan) -> None:
        """Queue the step's save jobs: one gather and scatter per layer for all of them (per pool and
        session), run off the forward path; the step is reported done once they are written (or failed).
        Skipped, reported failed, while the lane is more than ``max_save_backlog`` behind."""
        for job in plan.saves:
            self._saved.add(job.req_id)
        if not plan.saves:  # every step: a pool that went (no job names it any more) is unmapped at once
            self._live_mapping()
        now = self.clock()
        skip = self._behind(now)
        for (epoch, fence), group in _by_pool(plan.saves).items():
            req_ids = [job.req_id for job in group]
            tokens = {job.req_id: len(job.pages) * self.block_size for job in group}
            flight = _Flight(plan.step, req_ids, tokens, now, skipped=skip)
            if skip:
                self.done.report.fail("save_skipped", len(group))
                flight.written.set_result(set(req_ids))
            elif (mapped := self._mapping(epoch)) is None:  # not mapped yet: the lane waits for the remap
                flight.written = self.copies.submit(partial(self._write_remapped, self._remapping, epoch, group,
                                                            fence, flight))
            else:
                flight.written = self.copies.submit(partial(self._write, mapped, group, fence, flight))
            self._flights.append(flight)
        self._flights.append(_Flight(plan.step, [], {}, now, _DONE))  # the step's report, after its saves

    def _behind(self, now: float) -> bool:
        """The oldest save still queued has waited longer than ``max_save_backlog``."""
        self._harvest()
        oldest = next((f for f in self._flights if f.req_ids and not f.written.done()), None)
        return oldest is not None and now - oldest.queued_at > self.max_save_backlog

    def _write(self, mapped: AttachedKV, group: list[SaveJob], fence: tuple[int, int] | None,
               flight: _Flight) -> set[str]:
        """On the copy queue: the group's blocks into their pages, every layer after a check that the pool
        is live and the session's fence stands; returns the requests whose save failed (all of them when
        a copy failed, those preempted before or while it ran)."""
        live = [job for job in group if job.req_id not in flight.cancelled]
        pages = [p for job in live for p in job.pages]
        failed: set[str] = set()
        if live:
            try:
                self.copier.save(mapped.kv, [b for job in live for b in job.blocks], pages,
                                 lambda: mapped.writing(fence))
                mapped.check(fence)
            except (StaleHandle, RuntimeError, IndexError) as exc:
                log.warning("kvpool: saving %d pages of %d requests failed (%s)", len(pages), len(live), exc)
                failed.update(job.req_id for job in live)
        # Read after the copy returned (its device reads done): a request preempted before that point may
        # have had its blocks rewritten under the copy.
        return failed | flight.cancelled

    def _write_remapped(self, remap: threading.Thread | None, epoch: int, group: list[SaveJob],
                        fence: tuple[int, int] | None, flight: _Flight) -> set[str]:
        """On the copy queue: :meth:`_write` for a pool the forward path had not mapped (the sidecar
        restarted), once the background remap has fetched its handle (waiting ``max_save_backlog`` at
        most), through a mapping of this call's own; every request failed if that pool is not the one
        the sidecar serves."""
        if remap is not None:
            remap.join(self.max_save_backlog)
        handle = self._handle
        if handle is None or handle.get("epoch") != epoch:
            return {job.req_id for job in group}
        try:
            mapped = KVStorage.attach(handle)
        except (StaleHandle, OSError, ValueError) as exc:
            log.warning("kvpool: saving %d requests failed (%s)", len(group), exc)
            return {job.req_id for job in group}
        try:
            return self._write(mapped, group, fence, flight)
        finally:
            self._close(mapped)

    def _harvest(self) -> None:
        """Move the saves written since the last call (oldest first, as the queue runs them) into the
        report; a step is reported once all of its saves are."""
        while self._flights and self._flights[0].written.done():
            flight = self._flights.popleft()
            if not flight.req_ids:  # the step's marker: every save of the step before it is in
                self.done.steps[flight.step] = self.done.steps.get(flight.step, 0) + 1
                continue
            try:
                failed = flight.written.result()
            except Exception as exc:  # a copy that raised what _write does not expect: a failed save
                log.warning("kvpool: a save failed (%s)", exc)
                failed = set(flight.req_ids)
            for req_id in failed:
                self.done.failed_saves.add((flight.step, req_id))
            if failed and not flight.skipped:  # skipped ones were counted as such when skipped
                self.done.report.fail("save", len(failed))
            if self.counts_tokens:
                self.done.report.saved_tokens += sum(n for req_id, n in flight.tokens.items() if req_id not in failed)

    def preempted(self, req_ids: set[str]) -> None:
        """The engine freed these requests' blocks (preemption) and may reuse them in this step: their
        queued saves are cancelled (reported failed, never committed), and a copy of them under way is
        reported failed too, whatever it read. Returns at once: the forward path never waits for the lane."""
        for flight in self._flights:
            hit = req_ids.intersection(flight.req_ids)
            if hit:
                flight.cancelled |= hit

    def take_done(self) -> StepDone | None:
        """The steps whose saves are written since the last call (for the engine's worker metadata), or
        None."""
        self._harvest()
        if not self.done.steps and not self.done.failed_saves and self.done.report.empty():
            return None
        done, self.done = self.done, StepDone()
        return done

    def finished(self, finished_req_ids: set[str], released: set[str] | frozenset[str] = frozenset(),
                 coming: set[str] | None = None) -> set[str]:
        """Of the requests the engine says finished (now or before), those that had saves and whose saves
        are all written: they may be released (their saves are reported in the same output, by
        :meth:`take_done`, which the engine calls after this). ``released``: requests the scheduler let
        the engine free at once (every save reported before they finished), never named here;
        ``coming``: the step plan's finished requests whose saves are still to come (None: no plan
        this step, the last one's stand), never named here either."""
        if coming is not None:
            self._coming = coming
        self._saved |= self._coming - self._finishing
        self._saved -= released
        self._finishing -= released
        self._finishing |= self._saved & finished_req_ids
        self._saved -= finished_req_ids
        if not self._finishing:
            return set()
        self._harvest()
        busy = {req_id for flight in self._flights for req_id in flight.req_ids}
        out = self._finishing - busy - self._coming
        self._finishing -= out
        return out

    def close(self) -> None:
        self.loads.close()  # the queued copies first: they use the mappings
        self.copies.close()
        for mapped in (self._mapped, self._fresh):
            if mapped is not None:
                self._close(mapped)
        self._mapped = self._fresh = None


_DONE: Future[set[str]] = Future()
_DONE.set_result(set())


def _by_pool(jobs: list[_Job]) -> dict[tuple[int, tuple[int, int] | None], list[_Job]]:
    """Jobs grouped by the pool and session fence they name (a step's jobs name one, but for a sidecar
    restart or a reconnected link), in order."""
    out: dict[tuple[int, tuple[int, int] | None], list[_Job]] = {}
    for job in jobs:
        out.setdefault((job.epoch, job.fence), []).append(job)
    return out
