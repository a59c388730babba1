"""The scheduler's half of an engine connector, in the engine's terms but without the engine.

Per request: one admission to the sidecar by the engine's own block hashes (which holds the pool's
hit pages until the request is released, so nothing it promised can be evicted before it is loaded),
then, step by step, which pool pages to load into which engine blocks and which newly computed full
blocks to save into which pool pages. The worker copies and commits (:mod:`.worker`).

Rules the engine sets:
* only full blocks are cached, and the last prompt token is always computed (the engine needs its
  logits), so at most ``(prompt_len - 1) // block_size`` blocks are loaded;
* the engine reports its own local hit; the pool serves only what lies beyond it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from kvpool_sidecar.engines.link import OpFailed, SidecarDown, SidecarLink

log = logging.getLogger("kvpool.engine")


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    epoch: int
    pages: list[int]  # pool pages, in prompt order
    blocks: list[int]  # the engine blocks they go into


@dataclass(frozen=True)
class SaveJob:
    req_id: str
    seq_id: str
    epoch: int
    pages: list[int]  # pool pages the sidecar allocated for these blocks
    blocks: list[int]  # engine blocks whose KV is complete after this step
    commit_tokens: int  # commit the sequence up to here once the copy is done


@dataclass
class StepPlan:
    """What the worker does around one forward pass (the engine's connector metadata)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


def loadable_tokens(pool_pages: int, local_tokens: int, prompt_len: int, block_size: int) -> int:
    """Tokens the pool can add beyond the engine's local hit (whole blocks; the last token is computed)."""
    limit = (prompt_len - 1) // block_size
    return max(0, min(pool_pages, limit) * block_size - local_tokens)


@dataclass
class _Request:
    seq_id: str
    prompt_len: int
    num_pages: int  # full prompt pages admitted
    future: Future | None = None
    page_ids: list[int] = field(default_factory=list)
    epoch: int | None = None
    pool_pages: int = 0  # leading pages the pool held at admission
    local_tokens: int = 0
    allocated: bool = False  # the engine gave it blocks (a later lookup means it was preempted)
    blocks: list[int] = field(default_factory=list)
    load: tuple[int, int] | None = None  # (first block index, count) still to load
    saved: int = 0  # pages [0, saved) are in the pool or being saved this step

    @property
    def active(self) -> bool:
        return self.future is not None or self.epoch is not None


class SchedulerSide:
    def __init__(self, link: SidecarLink, block_size: int, *, lookup_wait: float = 0.001,
                 default_meta: dict[str, Any] | None = None) -> None:
        self.link = link
        self.block_size = block_size
        self.lookup_wait = lookup_wait
        self.default_meta = dict(default_meta or {})
        self._requests: dict[str, _Request] = {}
        self._wait_until: float | None = None  # the step's waiting budget: lookup_wait in all, not per request
        self._ids = itertools.count()
        self._prefix = f"vllm-{secrets.token_hex(4)}"

    # ------------------------------------------------------------------------------ lookups
    def matched_tokens(self, req_id: str, block_hashes: list[str], prompt_len: int, local_tokens: int,
                       params: dict[str, Any] | None) -> int | None:
        """Tokens past ``local_tokens`` to load from the pool; None: ask again next step."""
        req = self._requests.get(req_id)
        if req is not None and req.allocated:  # preempted and back: start over with a fresh admission
            self._release(req)
            req = None
        if req is None:
            req = self._admit(req_id, block_hashes, prompt_len, params)
        req.local_tokens = local_tokens
        if req.future is not None:
            now = time.monotonic()
            if self._wait_until is None:
                self._wait_until = now + self.lookup_wait
            try:
                # Waiting (not polling) also lets the link's thread take the GIL from a busy engine loop.
                result = req.future.result(timeout=max(0.0, self._wait_until - now))
            except FutureTimeout:
                return None
            except (SidecarDown, OpFailed) as exc:
                req.future = None
                if isinstance(exc, OpFailed):
                    log.warning("kvpool: request %s served without the pool: %s", req_id, exc)
                self.link.record(lambda r: r.fail("lookup"))
                return 0
            req.future = None
            req.page_ids = result["page_ids"]
            req.epoch = result["storage_epoch"]
            req.pool_pages = result["num_cached_tokens"] // self.block_size
            req.saved = req.pool_pages
            if req.epoch is None:
                log.warning("kvpool: the sidecar keeps no KV storage (start it with --kv-shape): nothing to load")
                self._release(req)
                return 0
        if req.epoch is None:
            return 0
        return loadable_tokens(req.pool_pages, local_tokens, prompt_len, self.block_size)

    def _admit(self, req_id: str, block_hashes: list[str], prompt_len: int,
               params: dict[str, Any] | None) -> _Request:
        req = _Request(f"{self._prefix}-{next(self._ids)}", prompt_len, len(block_hashes))
        self._requests[req_id] = req
        if block_hashes and self.link.available():
            meta = {**self.default_meta, **_meta_of(params)}
            op = {"op": "admit", "seq_id": req.seq_id, "block_hashes": block_hashes,
                  "num_tokens": len(block_hashes) * self.block_size}
            if meta:
                op["meta"] = meta
            req.future = self.link.submit(op)
        return req

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

    def plan(self, scheduled: list[tuple[str, list[int] | None, bool, int, int]]) -> StepPlan:
        """``scheduled``: (req_id, block ids: all when ``replace`` else the new ones or None, replace,
        tokens computed before this step, tokens scheduled in it), for every request in the step."""
        self._wait_until = None  # the engine builds the plan once per step, after every lookup of it
        plan = StepPlan()
        bs = self.block_size
        for req_id, block_ids, replace, computed, scheduled_tokens in scheduled:
            req = self._requests.get(req_id)
            if req is None or req.epoch is None:
                continue
            if block_ids is not None:
                req.blocks = list(block_ids) if replace else req.blocks + list(block_ids)
            if req.load is not None:
                first, count = req.load
                req.load = None
                plan.loads.append(LoadJob(req_id, req.epoch, req.page_ids[first : first + count],
                                          req.blocks[first : first + count]))
            upto = min((computed + scheduled_tokens) // bs, req.num_pages, len(req.blocks))
            if upto > req.saved:
                plan.saves.append(SaveJob(req_id, req.seq_id, req.epoch, req.page_ids[req.saved : upto],
                                          req.blocks[req.saved : upto], upto * bs))
                req.saved = upto
        return plan

    # ------------------------------------------------------------------------------ the end
    def finished(self, req_id: str) -> None:
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._release(req)

    def _release(self, req: _Request) -> None:
        # Queued behind its admission on the same link, so the sidecar sees them in order.
        if req.active:
            self.link.submit({"op": "release", "seq_id": req.seq_id})
        req.future = None
        req.epoch = None

    def tracked(self) -> int:
        return len(self._requests)


def _meta_of(params: dict[str, Any] | None) -> dict[str, Any]:
    """The workload metadata a request carries in its ``kv_transfer_params`` (the sidecar validates it)."""
    if not params:
        return {}
    return {k: params[k] for k in ("tenant", "workload_class", "request_type", "turn", "user") if k in params}
