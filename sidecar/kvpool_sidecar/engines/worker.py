"""The worker's half of an engine connector: map the sidecar's pool, copy pages, commit what was saved.

Safety rules (a wrong KV page is a wrong answer):
* every job names the storage epoch its page ids came from; the worker copies only into and out of a
  mapping of that epoch (re-mapping when the sidecar restarted), else the job fails: a failed load is
  reported so the engine recomputes those blocks, a failed save is simply not committed;
* a save is committed (made visible to other requests) only after its copy is complete. The commit
  itself travels asynchronously (a :class:`~.link.SidecarLink`): a commit that arrives after its
  request was released, or at a restarted sidecar, is refused by the sidecar, which is harmless.
"""

from __future__ import annotations

import logging

from kvpool_sidecar.client import SidecarClient, SidecarError
from kvpool_sidecar.engines.blocks import EngineLayer, LayoutError, PageCopier, check_compatible
from kvpool_sidecar.engines.link import Backoff, Report, SidecarDown, SidecarLink
from kvpool_sidecar.engines.scheduler import LoadJob, SaveJob
from kvpool_sidecar.storage import KVStorage, StaleHandle
from kvpool_sidecar.storage.tensors import AttachedKV

log = logging.getLogger("kvpool.engine")


class WorkerSide:
    def __init__(self, client: SidecarClient, layers: list[EngineLayer], block_size: int, *,
                 backend: str | None = None, backoff: Backoff | None = None, link: SidecarLink | None = None) -> None:
        self.client = client
        self.layers = layers
        self.block_size = block_size
        self.copier = PageCopier(layers, backend)
        self.backoff = backoff or Backoff("sidecar (worker)")
        # Commits and reports: batched, off the forward path. Shares the backoff with the mapping.
        self.link = link or SidecarLink(str(client.base_url), token=client.token, timeout=client.timeout,
                                        backoff=self.backoff, name="kvpool-worker-link")
        self._mapped: AttachedKV | None = None
        self._incompatible: str | None = None

    @property
    def report(self) -> Report:
        return self.link.report

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
        loaded = 0
        for job in jobs:
            mapped = self._mapping(job.epoch)
            if mapped is None:
                failed.update(job.blocks)
                continue
            try:
                self.copier.load(mapped.kv, job.pages, job.blocks)
                mapped.check()  # the pool closed meanwhile: what was read may be gone
            except (StaleHandle, RuntimeError, IndexError) as exc:
                log.warning("kvpool: loading %d pages for %s failed (%s): recomputing", len(job.pages), job.req_id, exc)
                failed.update(job.blocks)
                continue
            loaded += len(job.pages) * self.block_size
        failures = sum(1 for job in jobs if failed.intersection(job.blocks))

        def count(report: Report) -> None:
            report.loaded_tokens += loaded
            if failures:
                report.fail("load", failures)

        self.link.record(count)
        return failed

    def save(self, jobs: list[SaveJob]) -> None:
        """Copy each job's blocks into its pages, then commit them (asynchronously, one batch)."""
        for job in jobs:
            mapped = self._mapping(job.epoch)
            if mapped is None:
                self.link.record(lambda r: r.fail("save"))
                continue
            try:
                self.copier.save(mapped.kv, job.blocks, job.pages)
            except (RuntimeError, IndexError) as exc:
                log.warning("kvpool: saving %d pages of %s failed (%s)", len(job.pages), job.req_id, exc)
                self.link.record(lambda r: r.fail("save"))
                continue
            future = self.link.submit({"op": "commit", "seq_id": job.seq_id, "num_computed_tokens": job.commit_tokens})
            tokens = len(job.pages) * self.block_size
            future.add_done_callback(lambda f, n=tokens: self.link.record(
                (lambda r: r.fail("save")) if f.exception() is not None else (lambda r: _add_saved(r, n))))

    def close(self) -> None:
        self.link.close()
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        self.client.close()


def _add_saved(report: Report, tokens: int) -> None:
    report.saved_tokens += tokens
