"""The worker's half of an engine connector: map the sidecar's pool, copy pages, commit what was saved.

Safety rules (a wrong KV page is a wrong answer):
* every job names the storage epoch its page ids came from; the worker copies only into and out of a
  mapping of that epoch (re-mapping when the sidecar restarted), else the job fails: a failed load is
  reported so the engine recomputes those blocks, a failed save is simply not committed;
* a save is committed (made visible to other requests) only after its copy is complete.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvpool_sidecar.client import SidecarClient, SidecarError
from kvpool_sidecar.engines.blocks import EngineLayer, LayoutError, PageCopier, check_compatible
from kvpool_sidecar.engines.link import Backoff, OpFailed, Report, SidecarDown, send_batch
from kvpool_sidecar.engines.scheduler import LoadJob, SaveJob
from kvpool_sidecar.storage import KVStorage, StaleHandle
from kvpool_sidecar.storage.tensors import AttachedKV

log = logging.getLogger("kvpool.engine")
REPORT_EVERY = 1.0  # seconds: a report with no commit to ride on is sent on its own at most this often


class WorkerSide:
    def __init__(self, client: SidecarClient, layers: list[EngineLayer], block_size: int, *,
                 backend: str | None = None, backoff: Backoff | None = None) -> None:
        self.client = client
        self.layers = layers
        self.block_size = block_size
        self.copier = PageCopier(layers, backend)
        self.backoff = backoff or Backoff("sidecar (worker)")
        self.report = Report()
        self._mapped: AttachedKV | None = None
        self._incompatible: str | None = None
        self._last_report = time.monotonic()

    # ----------------------------------------------------------------------------- mapping
    def attach(self, *, strict: bool) -> None:
        """Map the pool now. ``strict`` (start-up): a sidecar that answers but whose pool cannot be used
        (another page size or shape, no KV storage, a segment this process cannot map) raises
        :class:`LayoutError`; an unreachable one only warns (the engine serves without it until it answers)."""
        try:
            self._remap()
        except SidecarDown as exc:
            log.warning("kvpool: the sidecar is not reachable at start-up (%s); serving without it until it is", exc)
        except LayoutError:
            if strict:
                raise
        except (StaleHandle, SidecarError, OSError, ValueError) as exc:
            if strict:
                raise LayoutError(f"the sidecar's pool cannot be mapped here: {exc}") from None

    def _remap(self) -> None:
        if not self.backoff.available():
            raise SidecarDown("backing off")
        try:
            handle = self.client.storage_handle()
        except SidecarError as exc:
            self.backoff.failed(exc)
            raise
        except Exception as exc:  # httpx errors, OSError
            self.backoff.failed(exc)
            raise SidecarDown(str(exc)) from None
        self.backoff.succeeded()
        try:
            check_compatible(self.layers, self.block_size, handle)
        except LayoutError as exc:
            if self._incompatible != str(exc):
                log.error("kvpool: refusing the pool: %s", exc)
            self._incompatible = str(exc)
            raise
        self._incompatible = None
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        self._mapped = KVStorage.attach(handle)

    def _mapping(self, epoch: int) -> AttachedKV | None:
        """A live mapping of the pool of ``epoch``, or None (that pool is gone or unreachable)."""
        mapped = self._mapped
        if mapped is not None and mapped.epoch == epoch:
            try:
                mapped.check()
                return mapped
            except StaleHandle:
                pass
        try:
            self._remap()
        except (LayoutError, SidecarDown, StaleHandle, SidecarError, ValueError):
            return None
        mapped = self._mapped
        return mapped if mapped is not None and mapped.epoch == epoch else None

    # ------------------------------------------------------------------------------- moving
    def load(self, jobs: list[LoadJob]) -> set[int]:
        """Copy every job's pages into its blocks; returns the blocks that could not be loaded."""
        failed: set[int] = set()
        for job in jobs:
            mapped = self._mapping(job.epoch)
            if mapped is None:
                failed.update(job.blocks)
                self.report.fail("load")
                continue
            try:
                self.copier.load(mapped.kv, job.pages, job.blocks)
                mapped.check()  # the pool closed meanwhile: what was read may be gone
            except (StaleHandle, RuntimeError, IndexError) as exc:
                log.warning("kvpool: loading %d pages for %s failed (%s): recomputing", len(job.pages), job.req_id, exc)
                failed.update(job.blocks)
                self.report.fail("load")
                continue
            self.report.loaded_tokens += len(job.pages) * self.block_size
        return failed

    def save(self, jobs: list[SaveJob]) -> None:
        """Copy each job's blocks into its pages, then commit them in one round trip."""
        commits: list[dict[str, Any]] = []
        saved: list[int] = []
        for job in jobs:
            mapped = self._mapping(job.epoch)
            if mapped is None:
                self.report.fail("save")
                continue
            try:
                self.copier.save(mapped.kv, job.blocks, job.pages)
            except (RuntimeError, IndexError) as exc:
                log.warning("kvpool: saving %d pages of %s failed (%s)", len(job.pages), job.req_id, exc)
                self.report.fail("save")
                continue
            commits.append({"op": "commit", "seq_id": job.seq_id, "num_computed_tokens": job.commit_tokens})
            saved.append(len(job.pages) * self.block_size)
        self._flush(commits, saved)

    def _flush(self, commits: list[dict[str, Any]], saved: list[int]) -> None:
        due = time.monotonic() - self._last_report >= REPORT_EVERY and not self.report.empty()
        if not commits and not due:
            return
        if not self.backoff.available():
            if commits:
                self.report.fail("save", len(commits))
            return
        report = self.report.take()
        try:
            results = send_batch(self.client, commits, report)
        except (SidecarDown, SidecarError) as exc:
            self.backoff.failed(exc)
            if report is not None:
                self.report.merge(report)
            self.report.fail("save", len(commits))
            return
        self.backoff.succeeded()
        self._last_report = time.monotonic()
        for result, tokens in zip(results, saved, strict=True):
            if isinstance(result, OpFailed):
                self.report.fail("save")  # e.g. the request was released, or the sidecar restarted
            else:
                self.report.saved_tokens += tokens

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        self.client.close()
