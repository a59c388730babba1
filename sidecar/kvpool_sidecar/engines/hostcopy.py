"""The tier's host-to-host copies (:mod:`.tiering`): rows moved in runs, on lanes that own their mapping.

A job moves whole rows (a chunk of vLLM's primary tier, a page of the pool) between two host regions.
:func:`~kvpool_sidecar.storage.reference.copy_row_runs` (the connector's host copies' too) copies each run
of ids consecutive on both sides as one ``copy_``: memory speed, and no
temporary (``index_select`` + ``index_copy_`` gathers the whole job into a buffer of its size first, at
about a tenth of the speed). A :class:`Lane` is one copy thread with its own mapping of the pool, so
the load lane and the store lane never wait on each other, and one lane's remap (a restarted sidecar)
never closes a mapping the other is copying through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvpool_sidecar import wire
from kvpool_sidecar.storage import KVStorage
from kvpool_sidecar.storage.tensors import AttachedKV

log = logging.getLogger("kvpool.engine")


class Lane:
    """One copy thread, jobs in submission order, and the pool as that thread last mapped it."""

    def __init__(self, name: str, welcome: Callable[[], wire.Welcome], page_bytes: int) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._welcome = welcome
        self._page_bytes = page_bytes
        self._mapped: AttachedKV | None = None  # used on the lane's thread only

    def submit(self, job: Callable[..., Any], *args: Any) -> Future:
        return self._thread.submit(job, *args)

    def mapping(self, epoch: int) -> AttachedKV | None:
        """The pool of ``epoch``, mapped (on the lane: a remap blocks no scheduler step); None when the
        sidecar serves another pool by now, or one whose pages do not hold vLLM's chunks."""
        mapped = self._mapped
        if mapped is not None and mapped.epoch == epoch:
            return mapped
        try:
            welcome = self._welcome()
        except Exception as exc:
            log.warning("kvpool tier: the pool could not be mapped: %s", exc)
            return None
        if welcome.storage is None or welcome.storage.get("epoch") != epoch:
            return None
        fresh = KVStorage.attach(welcome.storage)
        if rows(fresh).shape[1] != self._page_bytes:
            log.error("kvpool tier: the sidecar's pages hold %d bytes, vLLM's chunks %d: not used",
                      rows(fresh).shape[1], self._page_bytes)
            fresh.close()
            return None
        self._mapped = fresh
        if mapped is not None:
            mapped.close()
        return fresh

    def close(self) -> None:
        """Run what was submitted, then unmap."""
        self._thread.shutdown(wait=True)
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None


def rows(mapped: AttachedKV) -> torch.Tensor:
    """The pool's pages as rows of bytes."""
    kv = mapped.kv
    return kv.view(kv.shape[0], -1).view(torch.uint8)
