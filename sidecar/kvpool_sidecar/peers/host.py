"""What the peer server and client need of the sidecar that runs them, and the keys they share.

A fetch names the model identity, the prompt's leading engine block hashes and its tenant: both sides key the
pages exactly as the engine channel does (:func:`pool_keys`, then the pool's own tenant salt in
:meth:`~kvpool_sidecar.pool.PagePool.admit`), so a fetch can reach only the pages its tenant's own requests
would hit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar

from kvpool_sidecar.keys import TO_B, TO_C, WorkloadMeta, namespace, namespaced
from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.storage import KVStorage
from kvpool_sidecar.wire import Meta

T = TypeVar("T")


class PoolHost(Protocol):
    """The sidecar (:class:`kvpool_sidecar.service.state.Sidecar`): its pool, storage, metrics, and the
    serialised access every pool call goes through."""

    pool: PagePool
    storage: KVStorage | None
    metrics: Any

    async def run_background(self, fn: Callable[..., T], *args: Any, heavy: bool = False, **kwargs: Any) -> T: ...

    def engine_schemes(self, model: str) -> list[tuple[str, str, str]]:
        """(identity, algo, seed) of each engine model identity of ``model`` whose hashing is known here."""
        ...


def pool_keys(model: str, hashes: list[bytes]) -> list[Hashable]:
    """The engine block hashes of ``model`` as the pool's keys (before the tenant salt the pool adds)."""
    return namespaced(namespace(model), hashes)


def meta_of(meta: Meta) -> WorkloadMeta:
    """What a fetch's metadata may choose: the tenant (its keys' salt) and the class the pages are held in."""
    return WorkloadMeta(workload_class=TO_B if meta.workload_class == TO_B else TO_C, tenant=meta.tenant)


def wire_meta(meta: WorkloadMeta) -> Meta:
    return Meta(workload_class=meta.workload_class, tenant=meta.tenant)
