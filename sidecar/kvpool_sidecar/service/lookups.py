"""Engine lookups that fetch from a peer (issue 66): an admission naming a source (``wire.Admit.source``, the
request's ``remote_kv_source`` hint) whose leading pages are not all cached here.

The channel asks :meth:`LookupFetches.pending` for each such admission, under the pool's lock. When the source
is a member of this sidecar's peers (``--peers``) and the pool lacks some of the prompt's pages, a fetch of
them (:meth:`~kvpool_sidecar.peers.client.PeerClient.fetch`, within :data:`PEER_FETCH_BUDGET`) starts on the
sidecar's loop and the admission is answered "fetching" (nothing admitted, nothing held); the connector asks
the same admission again a step later, and once the fetch has ended it is admitted as any other, finding the
fetched pages cached (the fetch publishes them only once their bytes are written, in the request's tenant and
class). Requests with the same prompt, source, tenant and class share one fetch. A hint naming no member is
ignored (the admission goes on at once) and counted as ``kvpool_peer_fetches_total{result="not_member"}``; an
admission asked again without its hint (its engine stopped waiting) is counted as
``kvpool_peer_fetch_late_total`` and goes on at once, its fetch still landing for the next request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
from concurrent.futures import Future
from typing import Any

from kvpool_sidecar import wire
from kvpool_sidecar.keys import WorkloadMeta

# Seconds a fetch started by a lookup may take in all (connecting, the peer's offer, the read). Longer than
# any engine waits for it (the connector's peer_fetch_wait_ms, 250 ms by default): a slower fetch still lands
# for the next request with the prompt; bounded so that a stalled peer holds nothing here for long.
PEER_FETCH_BUDGET = 2.0
FORGET_AFTER = 60.0  # seconds a finished fetch stays known to the admission that started it (then it is gone)


class LookupFetches:
    """The fetches the engine channel's lookups started (``client``: the sidecar's peer client, or None)."""

    def __init__(self, pool: Any, metrics: Any, client: Any | None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.client = client
        self.loop: asyncio.AbstractEventLoop | None = None  # the sidecar's (set when the channel starts)
        self._lock = threading.Lock()  # admissions may run on the pool's worker thread
        self._by_prompt: dict[tuple, Future] = {}  # fetches under way
        self._by_seq: dict[tuple[str, str], Future] = {}  # (connection, sequence) -> the fetch it waits for

    def pending(self, connection: str, model: str, adm: wire.Admit, keys: list[Hashable],
                meta: WorkloadMeta) -> bool:
        """Whether the admission is answered "fetching" (a fetch of its pages is under way, started now or
        before); False: admit it now. Under the pool's lock."""
        seq = (connection, adm.seq_id)
        with self._lock:
            fetch = self._by_seq.pop(seq, None)
        if adm.source is None:
            if fetch is not None and not fetch.done():
                self.metrics.peer_fetch_late.inc()
            return False
        if fetch is not None:  # asked again: answered once its fetch ended
            if fetch.done():
                return False
            with self._lock:
                self._by_seq[seq] = fetch
            return True
        peer = (adm.source.host, adm.source.port)
        if self.client is None or self.loop is None or peer not in self.client.members:
            self.metrics.peer_fetches.labels("not_member").inc()
            return False
        if self.pool.cached_pages(keys, meta) >= len(keys):
            return False
        prompt = (peer, model, meta.tenant, meta.workload_class, tuple(adm.hashes))
        with self._lock:
            fetch = self._by_prompt.get(prompt)
            if fetch is None:
                fetch = asyncio.run_coroutine_threadsafe(
                    self.client.fetch(peer, model, list(adm.hashes), meta, PEER_FETCH_BUDGET), self.loop)
                self._by_prompt[prompt] = fetch
                fetch.add_done_callback(lambda f: self._ended(prompt, f))
            self._by_seq[seq] = fetch
        fetch.add_done_callback(lambda f: self._forget_later(seq, f))
        return True

    def _ended(self, prompt: tuple, fetch: Future) -> None:
        with self._lock:
            if self._by_prompt.get(prompt) is fetch:
                del self._by_prompt[prompt]

    def _forget_later(self, seq: tuple[str, str], fetch: Future) -> None:
        """An admission that never asks again (its request aborted) does not keep its fetch known forever."""
        def forget() -> None:
            with self._lock:
                if self._by_seq.get(seq) is fetch:
                    del self._by_seq[seq]

        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.call_later, FORGET_AFTER, forget)

    def forget(self, connection: str) -> None:
        """The connection ended: its admissions ask nothing again."""
        with self._lock:
            for seq in [s for s in self._by_seq if s[0] == connection]:
                del self._by_seq[seq]

    def cancel(self) -> None:
        """The sidecar stops: fetches under way end (each publishes nothing and leaves nothing)."""
        with self._lock:
            fetches = list(self._by_prompt.values())
        for fetch in fetches:
            fetch.cancel()
