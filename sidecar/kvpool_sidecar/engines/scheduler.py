"""The scheduler's half of an engine connector, in the engine's terms but without the engine.

Per request: one admission to the sidecar by the engine's own block hashes, which holds the pool's hit
pages until they are loaded and allocates nothing else (``save_later``: a request waiting for the engine
holds no page it has not written); then, step by step, which pool pages to load into which engine blocks
and which newly computed full blocks to save into which pool pages. The pages to save into are taken when
the blocks are computed: the plan of the step that completes them asks the sidecar for them (a *grow*)
and saves into them, if the answer comes within what the step's lookups left of its waiting budget
(below); else a later plan does, once the answer is in (the engine keeps the blocks meanwhile). A
grow that finds no page (a pool full of pages in use or pinned) ends the request's saves there: what it
could not get is not saved, and nothing waits. The worker copies (:mod:`.worker`); this side commits and
releases. The plans and the worker's reports are :mod:`.steps`; a request's record, :mod:`.requests`.
A request's admission is released as soon as its transfers are over (its loads read, its last save
committed or failed), not when the request finishes: a long decode holds no pool page, and what it
committed stays in the pool as cache, evictable like any other page.

Ordering, through the engine's own channel (never two links for one request):
* step ``k``'s saves are committed only once the worker has reported step ``k`` done (its saves are
  written: they run off the forward path, so the report may come some steps later), and never past a
  save that failed;
* a request that had saves is finished only through the engine's completion channel: ``finished``
  returns True (the engine keeps its blocks), the worker reports it in ``finished_sending`` once the
  engine has told it the request finished, and only then :meth:`SchedulerSide.sent` releases it, on the
  same link and after its commits. One that finishes with saves still to plan (its grow not answered
  yet, or answered after the last step that ran it) is *draining*: later plans save it and name it in
  :attr:`StepPlan.coming` until they have, so that the worker does not report it before.

Rules the engine sets:
* only full blocks are cached, and the last prompt token is always computed (the engine needs its
  logits), so at most ``(prompt_len - 1) // block_size`` blocks are loaded;
* the engine reports its own local hit; the pool serves only what lies beyond it.

A step's lookups and grows cost it at most ``lookup_wait`` in all, and a request waits for its lookup at
most ``lookup_wait`` from its first ask (then it is served without the pool): a sidecar that does not
answer costs the engine a millisecond a step, never a timeout. A step waits less when the engine is busy:
waiting stalls every request the step runs, while a lookup not yet answered costs only its own request
a step (it is asked again in the next one), so a step waits at most its recent duration divided by the
requests it runs (:meth:`SchedulerSide.step_budget`).

A request with a peer hint (:mod:`.hints`) may wait longer, ``fetch_wait`` from its first ask
(:data:`PEER_FETCH_WAIT`), while its sidecar fetches the prompt's missing leading pages from the hinted peer:
the sidecar answers "fetching" and the lookup answers "not yet" (None) step after step, so the engine keeps
scheduling its other requests, and no step waits for it longer than its step budget. Past ``fetch_wait`` it
is admitted without the hint (what the pool holds by then) and computes the rest; the fetch still lands
for the next request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvpool_sidecar import wire
from kvpool_sidecar.engines.hints import peer_source
from kvpool_sidecar.engines.link import OpFailed, SidecarDown, SidecarLink
from kvpool_sidecar.engines.requests import Request, loadable_tokens
from kvpool_sidecar.engines.steps import LoadJob, SaveJob, StepDone, StepPlan

log = logging.getLogger("kvpool.engine")
META_FIELDS = ("tenant", "workload_class", "request_type", "turn", "user")
# Steps whose worker report is awaited (an engine has a handful in flight). A full table plans no new
# saves and promises no new loads until reports come: it never forgets a step (a dropped step's failed
# save would let a later step's commit publish pages that were never written).
MAX_PENDING_STEPS = 1024
STEP_TIME_CAP = 1.0  # seconds: a gap between plans longer than this is an idle engine, not a step
LATE_WARNING_EVERY = 60.0  # seconds: lookups past their budget are logged at most this often, with their count
# Seconds a request with a peer hint waits for its sidecar's fetch (the connector's peer_fetch_wait_ms). Only
# that request waits (the engine schedules the others meanwhile), and recomputing the prefix costs it about
# as much: a 7B model prefills ~2k tokens in ~250 ms on one GPU, and at the fetch rates measured between two
# sidecars (docs/benchmarks.md) 250 ms moves hundreds of MB, that many tokens' KV several times over.
PEER_FETCH_WAIT = 0.25


class SchedulerSide:
    def __init__(self, link: SidecarLink, block_size: int, *, session: str, lookup_wait: float = 0.002,
                 world_size: int = 1, default_meta: dict[str, Any] | None = None,
                 trust_request_params: bool = False, clock: Any = time.monotonic,
                 fetch_wait: float = PEER_FETCH_WAIT) -> None:
        self.link = link
        self.events = link.events
        self.block_size = block_size
        self.lookup_wait = lookup_wait
        self.fetch_wait = fetch_wait
        self.world_size = world_size
        self.default_meta = dict(default_meta or {})
        self.trust_request_params = trust_request_params
        self.clock = clock
        self._requests: dict[str, Request] = {}
        self._finishing: dict[str, Request | None] = {}  # finished, waiting for finished_sending
        self._draining: dict[str, Request] = {}  # finished, saves still to plan
        self._wait_until: float | None = None  # the step's waiting budget: lookup_wait in all, not per request
        self._next_id = 0
        self._prefix = session
        self._step = 0
        # step -> [(req_id, request, pages saved up to, or None: a load only)] awaiting the worker's report
        self._pending: dict[int, list[tuple[str, Request, int | None]]] = {}
        # Requests that had a save job, as the worker saw them: they finish through finished_sending.
        self._saved: set[str] = set()
        self._released: set[str] = set()  # of those, finished with every save reported: for the next plan
        self._done: dict[int, int] = {}  # ranks that reported each pending step so far
        self._failed: set[tuple[int, str]] = set()
        self._order: deque[int] = deque()
        self._late = 0  # lookups past their budget since the last warning of them
        self._planned_at: float | None = None  # when the last step's plan was built
        self._step_time: float | None = None  # the recent time between plans (moving average)
        self._running = 0  # requests the last step ran
        self._late_warned_at: float | None = None

    # ------------------------------------------------------------------------------ lookups
    def matched_tokens(self, req_id: str, block_hashes: list[bytes], prompt_len: int, local_tokens: int,
                       params: dict[str, Any] | None, source: Any = None, adapter: str = "") -> int | None:
        """Tokens past ``local_tokens`` to load from the pool; None: ask again next step. ``source``: the
        engine's request, which the KV events read token ids from; ``adapter``: the LoRA adapter the
        engine serves it with (the sidecar's policy may map it to a tenant and class)."""
        req = self._requests.get(req_id)
        if req is not None and req.allocated:  # preempted and back: start over with a fresh admission
            self._forget(req_id, req)
            req = None
        if req is None:
            req = self._admit(req_id, block_hashes, prompt_len, params, adapter)
            if self.events is not None:
                req.source, req.hashes = source, block_hashes
        req.local_tokens = local_tokens
        if req.future is not None:
            now = self.clock()
            if self._wait_until is None:
                self._wait_until = now + self.step_budget()
            deadline = min(self._wait_until, req.asked_at + req.wait)
            try:
                # Waiting (not polling) also lets the link's thread take the GIL from a busy engine loop.
                gen, result = req.future.result(timeout=max(0.0, deadline - now))
            except FutureTimeout:
                if now < req.asked_at + req.wait:
                    return None
                # Its own budget is spent: served without the pool (released once the answer comes).
                self._give_up(req)
                self.link.record(lambda r: r.fail("lookup"))
                self._warn_late(now)
                return 0
            except (SidecarDown, OpFailed) as exc:
                req.future = None
                if isinstance(exc, OpFailed):
                    log.warning("kvpool: request %s served without the pool: %s", req_id, exc)
                self.link.record(lambda r: r.fail("lookup"))
                return 0
            req.future = None
            if result.fetching and req.op is not None:  # the sidecar fetches from the hinted peer: ask again
                self._ask_again(req)
                return None
            req.generation = gen
            req.page_ids = list(result.page_ids)  # its hits: the pages to save come with its grows
            req.epoch, req.fence = result.epoch, result.fence
            req.pool_pages = result.cached_tokens // self.block_size
            req.saved = req.published = req.granted = req.pool_pages
            if self.events is not None and req.pool_pages:
                self.events.held(req.hashes, req.pool_pages, req.source)
            if req.epoch is None:
                log.warning("kvpool: the sidecar keeps no KV storage (start it with --kv-shape): nothing to load")
                self._release(req)
                return 0
        if req.epoch is None or self.backlogged:  # a full table promises no load it could not track
            return 0
        return loadable_tokens(req.pool_pages, local_tokens, prompt_len, self.block_size)

    @property
    def backlogged(self) -> bool:
        """The worker has left :data:`MAX_PENDING_STEPS` steps unreported: nothing new is moved."""
        return len(self._order) >= MAX_PENDING_STEPS

    def _admit(self, req_id: str, block_hashes: list[bytes], prompt_len: int,
               params: dict[str, Any] | None, adapter: str = "") -> Request:
        self._next_id += 1
        # A prompt longer than one admission may name: its first blocks go through the tier, the rest
        # are computed (the sidecar would refuse the whole admission).
        block_hashes = block_hashes[: wire.MAX_BLOCKS]
        req = Request(f"{self._prefix}-{self._next_id}", prompt_len, len(block_hashes), asked_at=self.clock(),
                       wait=self.lookup_wait)
        self._requests[req_id] = req
        if block_hashes and self.link.available():
            meta = self.meta_of(params, adapter)
            source = peer_source(params)  # whether or not params are trusted: it only names a member to read
            op = wire.Admit(req.seq_id, block_hashes, len(block_hashes) * self.block_size,
                            wire.Meta(**meta) if meta else None, source=source, save_later=True)
            if source is not None:
                req.op, req.wait = op, max(self.lookup_wait, self.fetch_wait)
            req.future = self.link.admit(op)
        return req

    def _ask_again(self, req: Request) -> None:
        """The sidecar is fetching the request's pages: the same admission again (answered once the fetch
        ended), or, once the request has waited ``fetch_wait``, without its hint (what the pool holds now,
        with a lookup's own budget from here)."""
        op = req.op
        assert op is not None  # only an admission with a source is answered "fetching"
        now = self.clock()
        if now >= req.asked_at + req.wait:
            op = req.op = wire.Admit(op.seq_id, op.hashes, op.num_tokens, op.meta, save_later=op.save_later)
            req.asked_at, req.wait = now, self.lookup_wait
        req.future = self.link.admit(op)

    def meta_of(self, params: dict[str, Any] | None, adapter: str = "") -> dict[str, Any]:
        """A request's workload metadata: the configured defaults, and what its ``kv_transfer_params`` say
        only when the deployment trusts them (an OpenAI body is the client's: by default it chooses
        neither its tenant, its class nor anything else the pool keys or partitions by). The LoRA
        adapter is the engine's (one the admin loaded), passed on for the policy's mapping."""
        meta = dict(self.default_meta)
        if self.trust_request_params and params:
            meta.update({k: params[k] for k in META_FIELDS if k in params})
        if adapter:
            meta["adapter"] = adapter
        return meta

    def step_budget(self) -> float:
        """How long this step may wait for its lookups: ``lookup_wait``, and no more than the step's recent
        duration divided by the requests it runs (waiting stalls each of them; a deferred lookup costs
        only its own request a step). An idle engine stalls nobody: ``lookup_wait``."""
        if not self._running or self._step_time is None:
            return self.lookup_wait
        return min(self.lookup_wait, self._step_time / self._running)

    def _warn_late(self, now: float) -> None:
        """One warning a minute at most for lookups that passed their budget (each is counted as a
        failed lookup): the sidecar answers, but too slowly for this engine's ``lookup_wait_ms``."""
        self._late += 1
        if self._late_warned_at is None or now - self._late_warned_at >= LATE_WARNING_EVERY:
            log.warning("kvpool: %d lookup(s) not answered within lookup_wait_ms=%g ran without the pool "
                        "(the sidecar is slow: starved of CPU?)", self._late, self.lookup_wait * 1000)
            self._late, self._late_warned_at = 0, now

    def _give_up(self, req: Request) -> None:
        future, req.future = req.future, None
        assert future is not None
        self.link.release_when_answered(future, req.seq_id, made=True)

    # ------------------------------------------------------------------------------- blocks
    def allocated(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        req = self._requests.get(req_id)
        if req is None or not req.active:
            return
        req.allocated = True
        req.blocks = list(block_ids)
        if num_external_tokens > 0:
            first = req.local_tokens // self.block_size
            req.load = (first, num_external_tokens // self.block_size)

    def plan(self, scheduled: list[tuple[str, list[int] | None, bool, int, int]],
             preempted: set[str] | None = None) -> StepPlan:
        """``scheduled``: (req_id, block ids: all when ``replace`` else the new ones or None, replace,
        tokens computed before this step, tokens scheduled in it), for every request in the step;
        ``preempted``: the requests the engine preempted (their blocks may be reused in this step)."""
        # The step's waiting budget, what its lookups left of it: the grows sent below are waited for
        # until then, and those not answered by then are saved by a later plan.
        wait_until = self._start_step(len(scheduled))
        plan = StepPlan(self._step, preempted=set(preempted or ()), released=self._released)
        self._released = set()
        for req_id in plan.preempted:  # its blocks are freed and reused at once: no later plan may save them
            req = self._requests.get(req_id)
            if req is not None:
                req.save_failed, req.blocks = True, []
        pending: list[tuple[str, Request, int | None]] = []
        saving = not self.backlogged
        live = self.link.generation  # the connection this plan's admissions must live on
        running, grows = self._plan_loads(plan, scheduled, live, saving)
        if grows:
            wait(grows, timeout=max(0.0, wait_until - self.clock()))
        for req_id, req, loading in running:
            upto = self._plan_save(plan, req_id, req) if saving else None
            if upto is not None:
                pending.append((req_id, req, upto))
            elif loading:
                pending.append((req_id, req, None))
            elif req.transfers_over:
                self._release(req)
        drained = self._plan_draining(plan, pending, live, saving)
        if pending:
            for _, req, _ in pending:
                req.in_flight += 1
            self._pending[plan.step] = pending
            self._order.append(plan.step)
        for req in drained:  # after its last save is counted in flight: released once it is reported
            if req.transfers_over:
                self._release(req)
        return plan

    def _start_step(self, running: int) -> float:
        """A new step of ``running`` requests: its number, the engine's recent step time; returns when
        the step's waiting budget ends."""
        now = self.clock()
        wait_until = self._wait_until if self._wait_until is not None else now + self.step_budget()
        self._wait_until = None  # the engine builds the plan once per step, after every lookup of it
        self._step += 1
        if self._planned_at is not None:
            took = min(now - self._planned_at, STEP_TIME_CAP)
            self._step_time = took if self._step_time is None else 0.8 * self._step_time + 0.2 * took
        self._planned_at, self._running = now, running
        return wait_until

    def _plan_loads(self, plan: StepPlan, scheduled: list[tuple[str, list[int] | None, bool, int, int]],
                    live: int, saving: bool) -> tuple[list[tuple[str, Request, bool]], list[Future]]:
        """The step's loads, and a grow for each request whose computed blocks have no pages yet (not
        waited for here). Returns the requests running on the live connection (with whether they load
        in this step) and the grows sent."""
        bs = self.block_size
        running: list[tuple[str, Request, bool]] = []
        grows: list[Future] = []
        for req_id, block_ids, replace, computed, scheduled_tokens in scheduled:
            req = self._requests.get(req_id)
            if req is None or req.epoch is None:
                continue
            if block_ids is not None:
                req.blocks = list(block_ids) if replace else req.blocks + list(block_ids)
            valid = req.generation == live
            loading = False
            if req.load is not None:
                first, count = req.load
                req.load = None
                # A load promised on a connection that is gone must not read pages the sidecar freed:
                # the worker reports those blocks failed and the engine recomputes them.
                plan.loads.append(LoadJob(req_id, req.epoch, req.page_ids[first : first + count],
                                          req.blocks[first : first + count], valid, req.fence))
                loading = valid
            if not valid:
                continue
            req.computed = max(req.computed, min((computed + scheduled_tokens) // bs, req.num_pages,
                                                 len(req.blocks)))
            running.append((req_id, req, loading))
            req.take_grow()
            if saving and req.grow is None and not req.grow_short and not req.save_failed \
                    and req.granted < req.computed:
                req.grow_to = req.computed  # pages for the blocks this step completes
                req.grow = self.link.grow(req.seq_id, req.computed * bs, req.generation)
                grows.append(req.grow)
        return running, grows

    def _plan_draining(self, plan: StepPlan, pending: list[tuple[str, Request, int | None]], live: int,
                       saving: bool) -> list[Request]:
        """The saves of the finished requests still draining (added to ``pending``); returns those that
        have none left to plan (no longer draining)."""
        plan.coming = set(self._draining)
        drained: list[Request] = []
        for req_id, req in list(self._draining.items()):
            upto = None
            if req.generation != live or req.epoch is None:
                req.save_failed = True  # its connection went, and its pages with it
            elif saving:
                upto = self._plan_save(plan, req_id, req)
            if upto is not None:
                pending.append((req_id, req, upto))
            if not req.saves_coming:
                del self._draining[req_id]
                req.draining = False
                drained.append(req)
        return drained

    def _plan_save(self, plan: StepPlan, req_id: str, req: Request) -> int | None:
        """A save job for the request's computed blocks that have pages (its grow's answer taken in
        first); returns the pages it saves up to, or None when it plans none."""
        req.take_grow()
        upto = min(req.computed, req.granted)
        if upto <= req.saved or req.save_failed:
            return None
        plan.saves.append(SaveJob(req_id, req.epoch, req.page_ids[req.saved : upto],
                                  req.blocks[req.saved : upto], req.fence))
        req.saved = upto
        if not req.draining:  # a draining request finished already: _finishing has it
            self._saved.add(req_id)
        return upto

    def worker_done(self, done: StepDone) -> None:
        """The worker ran these steps: commit their saves (each rank's write is in), in step order."""
        for step, n in done.steps.items():
            if step in self._pending:
                self._done[step] = self._done.get(step, 0) + n
        self._failed |= done.failed_saves
        r = done.report
        if not r.empty():
            self.link.record(lambda rep: rep.merge(r))
        while self._order and self._done.get(self._order[0], 0) >= self.world_size:
            step = self._order.popleft()
            self._done.pop(step, None)
            for req_id, req, upto in self._pending.pop(step, ()):
                req.in_flight -= 1
                if (step, req_id) in self._failed:
                    req.save_failed = True
                if upto is not None and not req.save_failed and req.epoch is not None:
                    self.link.commit(req.seq_id, upto * self.block_size, req.generation,
                                     self._announcer(req) if self.events is not None else None)
                if req.transfers_over:
                    self._release(req)  # after its commits, on the same link
            self._failed = {(s, rid) for s, rid in self._failed if s > step}

    def _announcer(self, req: Request) -> Any:
        events = self.events
        assert events is not None

        def published(total: int) -> None:  # on the link's thread, in reply order
            if total > req.published:
                events.stored(req.hashes, req.published, total, req.source)
                req.published = total

        return published

    # ------------------------------------------------------------------------------ the end
    def finished(self, req_id: str) -> bool:
        """The engine is done with the request. True: it has saves whose copies may still read its
        blocks, so it finishes through the worker's ``finished_sending`` (and is released then, after its
        commits); False: the engine frees its blocks at once (a request whose saves were all written and
        reported, the common case, holds its blocks not a step longer than without the tier). Either
        way its pool pages go back only once no copy of it is unreported (:meth:`_end`): a load still in
        flight (an abort while its step runs, vLLM scheduling a step ahead) keeps reading its hit pages."""
        req = self._requests.pop(req_id, None)
        if req is not None and req.epoch is not None and req.saves_coming:
            # Blocks computed whose save is not planned yet: the engine keeps them until it is written.
            req.draining = req.ended = True
            self._draining[req_id] = req
            self._saved.discard(req_id)  # it finishes through finished_sending: _finishing has it
            self._finishing[req_id] = req
            return True
        if req_id in self._saved:
            self._saved.discard(req_id)
            if req is not None and req.in_flight == 0 and req.load is None:
                self._released.add(req_id)  # the worker forgets it with the next plan
                self._end(req)
                return False
            self._finishing[req_id] = req
            return True
        if req is not None:
            self._end(req)
        return False

    def sent(self, req_ids: set[str] | None) -> None:
        """The worker finished these requests' saves (every rank): release them, after their commits."""
        for req_id in req_ids or ():
            req = self._finishing.pop(req_id, None)
            if req is not None:
                self._end(req)

    def _forget(self, req_id: str, req: Request) -> None:
        """A preempted request starts over with a fresh admission: the old one ends (its saves still in
        flight are committed or failed as the worker reports them, and then it is released)."""
        del self._requests[req_id]
        self._end(req)

    def _end(self, req: Request) -> None:
        """No more copies are planned for this admission: released now, or by :meth:`worker_done` once
        the worker has reported the copies still in flight (the one rule for when its pages go back)."""
        req.ended = True
        if req.transfers_over:
            self._release(req)

    def _release(self, req: Request) -> None:
        if req.future is not None:
            self._give_up(req)
        elif req.epoch is not None:
            self.link.release(req.seq_id, req.generation)
        req.epoch = None
