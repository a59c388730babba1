"""kvpool as a secondary tier of vLLM's own KV offloading, without vLLM (the adapter is :mod:`.tier`).

On a GPU, vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` moves KV between the GPU and its
CPU primary tier (a host region vLLM owns: its DMA, its streams, tested on GPUs in vLLM's CI). kvpool sits
behind that tier: chunks *cascade* from the primary tier into pool pages and are *promoted* back. Nothing
here touches the GPU; every copy is between two host regions (vLLM's primary chunks and the pool's
shared segment), never on the scheduler's thread: promotions on a lane (a copy thread) of their own, so
they never wait behind cascades, which have theirs; rows move in runs at memory speed (:mod:`.hostcopy`).

A pool page holds one offloaded chunk's bytes exactly as vLLM lays them out in its primary tier (every
worker's share, one after the other, without the region's alignment padding), so the sidecar's
``pageSize`` is vLLM's offloaded ``block_size`` (tokens per chunk) and ``--kv-shape``'s page bytes are
the chunk's. The bytes are opaque here; the model identity (:func:`.identity.chunk_identity`) keeps them
apart from any other layout.

Through the scheduler's one link (a session, as the connector's: the connection owns what it admits,
its fence stops its copies the moment it ends, its lapsed pages are quarantined):

* lookups: the keys vLLM asks about in a step are sent at the step's end as one *hold-only* admission
  per request (its cached prefix held, nothing allocated, nothing evicted) and answered RETRY until the
  answer is in; an answer not in ``lookup_wait`` after it was sent is a MISS (the request is served
  without the tier, and the hold is released when the answer comes). The scheduler never waits on the
  sidecar: vLLM scans a request's keys past a RETRY, so a step's lookups cost one round trip in all.
  A request with a peer hint (:mod:`.hints`) names its source in its holds: while the sidecar fetches the
  missing pages from that peer it answers "fetching", the hold is asked again (RETRY meanwhile) for at
  most ``fetch_wait`` from when it was first sent, then once more without the hint.
  A hold goes once vLLM has scheduled its request (its lookups are over then) and no load reads it,
  or, for one a load reads, once that load is reported: a key held but never loaded pins nothing for
  the request's whole life.
* loads (promotions): the held pages are copied into the primary chunks vLLM allocated, the session's
  fence checked after the read; a key whose page is not held by this request's lookup (or whose hold
  lapsed) fails alone and vLLM recomputes it.
* stores (cascades): one admission per job (pages for what the pool lacks), the primary chunks copied
  into the fresh pages in slices of at most ``SLICE_BYTES``, each under the session's lock with the
  fence checked first (:meth:`AttachedKV.writing`), then committed and released on
  the link, in that order: a page is published only after its bytes are written. vLLM keeps the
  primary chunks pinned until the job is reported done.

Every job submitted is reported, once, whatever raises on the way (a copy's bug included: the job fails,
a store's admission is released), and :meth:`TierSide.drain` returns only once every submitted job's
result is queued for :meth:`TierSide.finished_jobs` (vLLM's ``reset_cache`` asserts no job is left).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool_sidecar import wire
from kvpool_sidecar.engines.hints import peer_source
from kvpool_sidecar.engines.hostcopy import Lane, rows
from kvpool_sidecar.engines.link import OpFailed, Report, SidecarDown, SidecarLink
from kvpool_sidecar.engines.scheduler import META_FIELDS, PEER_FETCH_WAIT
from kvpool_sidecar.storage import StaleHandle
from kvpool_sidecar.storage.reference import copy_row_runs
from kvpool_sidecar.storage.tensors import SLICE_BYTES

log = logging.getLogger("kvpool.engine")
HIT, MISS, RETRY = "hit", "miss", "retry"
EXPECTED = (StaleHandle, RuntimeError, IndexError, OSError)  # a pool gone or moved, a link down: no bug


@dataclass(eq=False)
class _Hold:
    """One hold-only admission of a request's lookups."""

    req_id: str
    seq_id: str
    keys: list[bytes]
    sent_at: float
    future: Future | None = None
    generation: int = 0
    epoch: int | None = None
    fence: tuple[int, int] | None = None
    pages: dict[bytes, int] = field(default_factory=dict)  # held key -> its page
    loading: int = 0  # load jobs reading its pages, not yet reported
    live: bool = True  # not released
    op: wire.Admit | None = None  # its admission (asked again while the sidecar fetches from a peer)
    wait: float = 0.0  # how long it may wait for its answer from sent_at


@dataclass(eq=False)
class _Request:
    meta: dict[str, Any]
    answers: dict[bytes, _Hold | None] = field(default_factory=dict)  # asked key -> its hold (None: a miss)
    batch: dict[bytes, None] = field(default_factory=dict)  # keys asked this step, in order, sent at its end
    holds: list[_Hold] = field(default_factory=list)  # not released
    source: wire.Source | None = None  # its peer hint


@dataclass
class Finished:
    """A job done: ``ok`` for each of its keys, in the job's order."""

    job_id: int
    ok: list[bool]


class TierSide:
    def __init__(self, link: SidecarLink, welcome: Callable[[], wire.Welcome], primary: torch.Tensor,
                 page_bytes: int, page_size: int, *, session: str, lookup_wait: float = 0.002,
                 default_meta: dict[str, Any] | None = None, trust_request_params: bool = False,
                 clock: Callable[[], float] = time.monotonic, fetch_wait: float = PEER_FETCH_WAIT) -> None:
        self.link = link
        self.fetch_wait = fetch_wait
        self.primary = primary.view(torch.uint8)[:, :page_bytes]  # vLLM's chunks without their padding
        self.page_bytes = page_bytes
        self.page_size = page_size
        self.lookup_wait = lookup_wait
        self.default_meta = dict(default_meta or {})
        self.trust_request_params = trust_request_params
        self.clock = clock
        self._prefix = session
        self._ids = itertools.count(1)
        self._requests: dict[str, _Request] = {}
        self._lane = Lane("kvpool-tier-store", welcome, page_bytes)  # cascades
        self._load_lane = Lane("kvpool-tier-load", welcome, page_bytes)  # promotions: never behind a cascade
        self._done: queue.SimpleQueue[tuple[Finished, list[_Hold]]] = queue.SimpleQueue()
        self._jobs: set[int] = set()  # submitted, not yet reported (the scheduler's thread)
        self._unfinished: set[int] = set()  # submitted, their result not yet queued (any thread)
        self._finishing = threading.Condition()  # guards _unfinished

    # ------------------------------------------------------------------------------ requests
    def new_request(self, req_id: str, params: dict[str, Any] | None) -> None:
        meta = dict(self.default_meta)
        if self.trust_request_params and params:
            meta.update({k: params[k] for k in META_FIELDS if k in params})
        self._requests[req_id] = _Request(meta, source=peer_source(params))

    def _request(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:  # a request vLLM did not announce (it always does): the defaults
            self.new_request(req_id, None)
            req = self._requests[req_id]
        return req

    def scheduled(self, req_ids: Iterable[str]) -> None:
        """vLLM scheduled these requests: their lookups are over (a request is scheduled only once every
        key it found is loaded, and asks again only after a preemption), and the loads they started were
        submitted before this call. Their holds that no load is reading go now (the rest once their loads
        are reported): a key held but never loaded (vLLM's primary tier had it by then, or could not take
        the promotion) does not pin the pool's page for the request's whole life."""
        for req_id in req_ids:
            req = self._requests.get(req_id)
            if req is None:
                continue
            req.batch = {}
            for hold in list(req.holds):
                if hold.loading == 0:
                    self._release(req, hold)

    def finished(self, req_id: str) -> None:
        """No call for this request follows; its holds go once no load of theirs is in flight."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        for hold in list(req.holds):
            if hold.loading == 0:
                self._release(req, hold)

    # ------------------------------------------------------------------------------- lookups
    def lookup(self, req_id: str, key: bytes) -> str:
        req = self._request(req_id)
        if key in req.answers:
            hold = req.answers[key]
            if hold is not None and hold.future is not None:
                if not self._settle(req, hold):
                    return RETRY
                hold = req.answers.get(key)
            if hold is None:
                return MISS
            return HIT if hold.live and key in hold.pages and hold.generation == self.link.generation else MISS
        req.batch[key] = None  # a dict: a long prompt's first scan stays linear
        return RETRY

    def _settle(self, req: _Request, hold: _Hold) -> bool:
        """The hold's verdict for each of its keys, once its answer is in or its budget spent; False:
        neither yet (RETRY)."""
        assert hold.future is not None
        if not hold.future.done():
            if self.clock() - hold.sent_at < hold.wait:
                return False
            self._release(req, hold)  # served without the tier; released when the answer comes
            self.link.record(lambda r: r.fail("lookup"))
            for key in hold.keys:
                req.answers[key] = None
            return True
        future, hold.future = hold.future, None
        try:
            gen, result = future.result()
        except (SidecarDown, OpFailed) as exc:
            if isinstance(exc, OpFailed):
                log.warning("kvpool tier: a lookup failed: %s", exc)
            self.link.record(lambda r: r.fail("lookup"))
            hold.live = False
            req.holds.remove(hold)
            for key in hold.keys:
                req.answers[key] = None
            return True
        if result.fetching and hold.op is not None:  # the sidecar fetches from the peer: asked again (without
            # the hint once it waited fetch_wait)
            if self.clock() - hold.sent_at >= hold.wait:
                hold.op = wire.Admit(hold.op.seq_id, hold.op.hashes, hold.op.num_tokens,
                                     hold.op.meta, hold_only=True)
                hold.sent_at, hold.wait = self.clock(), self.lookup_wait
            hold.future = self.link.admit(hold.op)
            return False
        hold.generation, hold.epoch, hold.fence = gen, result.epoch, result.fence
        hits = result.cached_tokens // self.page_size
        hold.pages = dict(zip(hold.keys[:hits], result.page_ids[:hits], strict=True))
        if not result.page_ids:  # nothing cached: no sequence was made
            hold.live = False
            req.holds.remove(hold)
        if self.link.events is not None and hits:
            self.link.events.held(hold.keys, hits, None)
        for key in hold.keys:
            req.answers[key] = hold if key in hold.pages else None
        return True

    def flush(self) -> None:
        """The step's end: one hold-only admission per request that asked about new keys."""
        for req_id, req in self._requests.items():
            if not req.batch:
                continue
            keys = list(itertools.islice(req.batch, wire.MAX_BLOCKS))
            req.batch = {}
            hold = _Hold(req_id, f"{self._prefix}-{next(self._ids)}", keys, self.clock(),
                         wait=self.lookup_wait if req.source is None else max(self.lookup_wait, self.fetch_wait))
            if self.link.available():
                meta = req.meta
                hold.op = wire.Admit(hold.seq_id, keys, len(keys) * self.page_size, wire.Meta(**meta) if meta else None,
                                     hold_only=True, source=req.source)
                hold.future = self.link.admit(hold.op)
                req.holds.append(hold)
                for key in keys:
                    req.answers[key] = hold
            else:
                for key in keys:
                    req.answers[key] = None

    def _release(self, req: _Request, hold: _Hold) -> None:
        """Let the hold go (once answered, when it is not yet) and forget its answers: a key asked again
        later is asked anew."""
        if hold.future is not None:
            future, hold.future = hold.future, None
            self.link.release_when_answered(future, hold.seq_id)
        elif hold.live:
            self.link.release(hold.seq_id, hold.generation)
        hold.live = False
        if hold in req.holds:
            req.holds.remove(hold)
        for key in hold.keys:
            if req.answers.get(key) is hold:
                del req.answers[key]

    # ---------------------------------------------------------------------------------- jobs
    def _begin(self, job_id: int) -> None:
        self._jobs.add(job_id)
        with self._finishing:
            self._unfinished.add(job_id)

    def _finish(self, job_id: int, ok: list[bool], holds: list[_Hold] | None = None) -> None:
        """Queue the job's result for :meth:`finished_jobs` (exactly once per job, from any thread)."""
        self._done.put((Finished(job_id, ok), holds or []))
        with self._finishing:
            self._unfinished.discard(job_id)
            self._finishing.notify_all()

    # --------------------------------------------------------------------------------- loads
    def submit_load(self, job_id: int, req_id: str, keys: list[bytes], chunks: list[int]) -> None:
        """Copy the held pages of ``keys`` into primary ``chunks``, off this thread."""
        self._begin(job_id)
        n = len(keys)
        try:
            req = self._request(req_id)
            plan: list[tuple[int, int, int]] = []  # (index in the job, page, chunk)
            holds: list[_Hold] = []
            hold_of: _Hold | None = None
            for i, (key, chunk) in enumerate(zip(keys, chunks, strict=True)):
                hold = req.answers.get(key)
                if hold is None or hold.future is not None or not hold.live or key not in hold.pages \
                        or hold.generation != self.link.generation:
                    continue
                if hold_of is not None and (hold.epoch, hold.fence) != (hold_of.epoch, hold_of.fence):
                    continue  # a second session's hold (a reconnect between lookups): recomputed
                hold_of = hold
                plan.append((i, hold.pages[key], chunk))
                if not any(h is hold for h in holds):
                    holds.append(hold)
            epoch, fence = (hold_of.epoch, hold_of.fence) if hold_of is not None else (None, None)
            self._load_lane.submit(self._load, job_id, n, plan, epoch, fence, holds)
        except Exception:
            log.exception("kvpool tier: a load of %d chunks could not start: vLLM recomputes them", n)
            self.link.record(lambda r: r.fail("load"))
            self._finish(job_id, [False] * n)
            return
        for hold in holds:
            hold.loading += 1

    def _load(self, job_id: int, n: int, plan: list[tuple[int, int, int]], epoch: int | None,
              fence: tuple[int, int] | None, holds: list[_Hold]) -> None:
        """On the load lane: the copy, then the fence checked (nothing read was handed on meanwhile)."""
        ok = [False] * n
        try:
            mapped = self._load_lane.mapping(epoch) if plan and epoch is not None else None
            if mapped is not None:
                copy_row_runs(rows(mapped), [p for _, p, _ in plan], self.primary, [c for _, _, c in plan])
                mapped.check(fence)
                for i, _, _ in plan:
                    ok[i] = True
                moved = Report(loaded_tokens=len(plan) * self.page_size)
                self.link.record(lambda r: r.merge(moved))
        except Exception as exc:  # whatever raised, the job is reported: vLLM recomputes what failed
            _failed(exc, "loading %d chunks failed: vLLM recomputes them", len(plan))
            ok = [False] * n
        finally:
            if not all(ok):
                self.link.record(lambda r: r.fail("load"))
            self._finish(job_id, ok, holds)

    # -------------------------------------------------------------------------------- stores
    def submit_store(self, job_id: int, req_id: str, keys: list[bytes], chunks: list[int]) -> None:
        """Admit ``keys``, copy primary ``chunks`` into the pages the pool lacks, then commit: off this
        thread (the admission's answer starts the copy on the store lane)."""
        self._begin(job_id)
        n = len(keys)
        try:
            req = self._requests.get(req_id)
            meta = req.meta if req is not None else self.default_meta
            keys, chunks = keys[: wire.MAX_BLOCKS], chunks[: wire.MAX_BLOCKS]
            if not keys or not self.link.available():
                self._finish(job_id, [False] * n)
                return
            seq_id = f"{self._prefix}-{next(self._ids)}"
            future = self.link.admit(wire.Admit(seq_id, keys, len(keys) * self.page_size,
                                                wire.Meta(**meta) if meta else None))
        except Exception:
            log.exception("kvpool tier: a store of %d chunks could not start", n)
            self.link.record(lambda r: r.fail("save"))
            self._finish(job_id, [False] * n)
            return
        future.add_done_callback(lambda f: self._admitted(f, job_id, n, seq_id, keys, chunks))

    def _admitted(self, future: Future, job_id: int, n: int, seq_id: str, keys: list[bytes],
                  chunks: list[int]) -> None:
        """On the link's thread: the store's admission answered; its copy goes to the store lane."""
        try:
            gen, result = future.result()
        except Exception as exc:
            if isinstance(exc, OpFailed):
                log.warning("kvpool tier: a store's admission failed: %s", exc)
            self.link.record(lambda r: r.fail("save"))
            self._finish(job_id, [False] * n)
            return
        try:
            self._lane.submit(self._store, job_id, n, seq_id, gen, result, keys, chunks)
        except Exception as exc:  # a lane shut down: the admission goes back, the job fails
            _failed(exc, "storing %d chunks could not start", len(keys))
            self.link.record(lambda r: r.fail("save"))
            self.link.release(seq_id, gen)
            self._finish(job_id, [False] * n)

    def _store(self, job_id: int, n: int, seq_id: str, gen: int, result: wire.Admitted, keys: list[bytes],
               chunks: list[int]) -> None:
        """On the store lane: the fresh pages written in slices of at most ``SLICE_BYTES``, each under the
        session's lock with the fence checked first, then committed (published) and released, in that
        order; whatever raises, the admission is released and the job reported."""
        ok = [False] * n
        try:
            hits = result.cached_tokens // self.page_size
            admitted = len(result.page_ids)  # fewer than asked under pressure: the rest is not stored
            fresh = result.page_ids[hits:]
            written = False
            try:
                mapped = self._lane.mapping(result.epoch) if result.epoch is not None else None
                if mapped is not None and gen == self.link.generation:
                    src, pages = chunks[hits:admitted], rows(mapped)
                    per = max(1, SLICE_BYTES // self.page_bytes)
                    for at in range(0, len(fresh), per):
                        with mapped.writing(result.fence):
                            copy_row_runs(self.primary, src[at : at + per], pages, fresh[at : at + per])
                    mapped.check(result.fence)
                    written = True
            except Exception as exc:
                _failed(exc, "storing %d chunks failed", len(fresh))
            if written:  # committed after the bytes, before the release; announced once published
                events = self.link.events
                announce = None if events is None else (lambda total: events.held(keys, total, None))
                self.link.commit(seq_id, admitted * self.page_size, gen, announce)
                moved = Report(saved_tokens=len(fresh) * self.page_size)
                self.link.record(lambda r: r.merge(moved))
                ok = [i < admitted for i in range(n)]
            else:
                self.link.record(lambda r: r.fail("save"))
        except Exception as exc:
            _failed(exc, "storing %d chunks failed", len(keys))
            ok = [False] * n
        finally:
            try:
                self.link.release(seq_id, gen)
            finally:
                self._finish(job_id, ok)

    # ------------------------------------------------------------------------------ reports
    def finished_jobs(self) -> list[Finished]:
        """Jobs done since the last call; the holds their loads read are released here."""
        out = []
        while True:
            try:
                done, holds = self._done.get_nowait()
            except queue.Empty:
                break
            self._jobs.discard(done.job_id)
            out.append(done)
            for hold in holds:
                hold.loading -= 1
                if hold.loading == 0:
                    self._release(self._requests.get(hold.req_id) or _Request({}), hold)
        return out

    def pending(self) -> bool:
        return bool(self._jobs)

    def drain(self, timeout: float | None = None) -> bool:
        """Until every submitted job's result is queued for :meth:`finished_jobs` (a store's admission
        answers or fails within the link's timeout, then its copy runs); False if ``timeout`` passed
        first."""
        with self._finishing:
            return self._finishing.wait_for(lambda: not self._unfinished, timeout)

    def close(self) -> None:
        if not self.drain(timeout=self.link.timeout + 1):
            log.warning("kvpool tier: closing with %d jobs unfinished", len(self._unfinished))
        self._lane.close()
        self._load_lane.close()
        self.primary = torch.empty((0, self.page_bytes), dtype=torch.uint8)  # vLLM unmaps its region next
        self.link.close()


def _failed(exc: BaseException, what: str, n: int) -> None:
    """Log a copy that failed: a warning when the pool moved or the link went (expected), with the
    traceback for anything else (a bug, still reported as a failed job)."""
    if isinstance(exc, EXPECTED):
        log.warning("kvpool tier: " + what + " (%s)", n, exc)
    else:
        log.exception("kvpool tier: " + what + " (unexpected)", n)
