"""Fetch a prompt's leading pages from a peer sidecar into this one's pool (:mod:`.protocol`).

:meth:`PeerClient.fetch` asks the peer for the pages past those cached here, admits them here (the pool's
own admission: fresh pages, nothing published), READs the peer's held pages into them with NIXL and commits
them (publishes, in the request's class) only once the read completed; then tells the peer it is done. Every
step runs within the caller's budget, and the read must also end well inside the peer's hold
(:data:`HOLD_SHARE` of it, counted from before the fetch was sent, so before the peer's own clock started):
a read that ends later is discarded, never published, as one that failed. Whatever fails (the peer refused,
died or stalled, the pool here had no room) costs a miss: the fresh pages go back unpublished; a read NIXL
could not abort keeps its pages out of circulation until it ends. The connection (and the peer's agent) is
dropped after any failure and made again by the next fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvpool_sidecar.keys import WorkloadMeta
from kvpool_sidecar.peers import protocol as p
from kvpool_sidecar.peers.agent import DONE, PROC, PeerAgent
from kvpool_sidecar.peers.host import PoolHost, pool_keys, wire_meta
from kvpool_sidecar.peers.keys import TransferKeys
from kvpool_sidecar.peers.runs import page_runs
from kvpool_sidecar.peers.server import _read, layout_of
from kvpool_sidecar.pool import PoolError, PoolExhausted, UnknownSequence

log = logging.getLogger("kvpool.peers")
HOLD_SHARE = 0.8  # of the peer's hold, the most a read may take (counted from before the fetch was sent)
POLL = 0.0002  # seconds between two looks at a read in progress
RESULTS = ("hit", "partial", "miss", "timeout", "refused", "error", "not_member")


@dataclass(frozen=True)
class FetchResult:
    """``result``: ``hit`` (every page asked for is cached here now), ``partial`` (some), ``miss`` (the peer had
    none past those cached here), ``timeout``, ``refused`` (by the peer, or no room here), ``error`` (the peer
    or the read failed), ``not_member`` (the peer is none of this sidecar's members: nothing was sent);
    ``pages``/``nbytes``: what was written here; ``cached_pages``: the prompt's leading pages cached here after
    the fetch."""

    result: str
    pages: int = 0
    nbytes: int = 0
    cached_pages: int = 0


class PeerRefused(Exception):
    """The peer refused the connection or the fetch (``reason`` as it said)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str,
                 layout: p.Layout) -> None:
        self.reader, self.writer, self.peer, self.layout = reader, writer, peer, layout
        self.lock = asyncio.Lock()


class PeerClient:
    """Fetches for one sidecar (``host``) with its agent, proving the cluster key ``keys`` to each peer."""

    def __init__(self, host: PoolHost, agent: PeerAgent, keys: TransferKeys,
                 members: frozenset[tuple[str, int]] = frozenset()) -> None:
        if host.storage is None:
            raise ValueError("fetching from peers needs the pool's KV (--kv-shape)")
        self.host = host
        self.agent = agent
        self.keys = keys
        self.members = members  # the peers this sidecar fetches from (--peers); any other is refused unasked
        self.layout = layout_of(host)
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._connecting = asyncio.Lock()  # one handshake at a time: two fetches never make two connections
        self._parked: set[asyncio.Task] = set()  # what a fetch left to end: a read NIXL could not abort, a release

    async def fetch(self, peer: tuple[str, int], model: str, hashes: list[bytes], meta: WorkloadMeta,
                    budget: float) -> FetchResult:
        """The prompt's leading pages (``hashes``: its leading block hashes as the engine computed them)
        fetched from ``peer`` (host, peer port) within ``budget`` seconds."""
        start = time.monotonic()
        result = await self._fetch(peer, model, hashes, meta, start + budget)
        m = self.host.metrics
        m.peer_fetches.labels(result.result).inc()
        m.peer_fetch_pages.inc(result.pages)
        m.peer_fetch_bytes.inc(result.nbytes)
        m.peer_fetch_seconds.observe(time.monotonic() - start)
        return result

    async def schemes(self, peer: tuple[str, int], model: str, budget: float) -> list[p.Scheme]:
        """How the engines of ``model`` at ``peer`` hash their blocks (none: the peer knows of none, is no member,
        or failed within ``budget`` seconds)."""
        if peer not in self.members:
            return []
        deadline = time.monotonic() + budget
        try:
            conn = await asyncio.wait_for(self._connection(peer), _left(deadline))
            async with conn.lock:
                conn.writer.write(p.frame(p.Schemes(model)))
                await conn.writer.drain()
                known = await asyncio.wait_for(_read(conn.reader, p.MAX_FRAME), _left(deadline))
            if not isinstance(known, p.Known):
                raise p.PeerProtocolError(f"expected the known schemes, got {type(known).__name__.lower()}")
            p.check_known(known)
            return known.schemes
        except (PeerRefused, TimeoutError, OSError, asyncio.IncompleteReadError, p.PeerProtocolError) as exc:
            log.info("peer %s:%d: no hashing schemes: %s", *peer, exc or type(exc).__name__)
            self._drop(peer)
            return []

    async def _fetch(self, peer: tuple[str, int], model: str, hashes: list[bytes], meta: WorkloadMeta,
                     deadline: float) -> FetchResult:
        pool = self.host.pool
        if peer not in self.members:
            return FetchResult("not_member")
        keys = pool_keys(model, hashes)
        local = await self.host.run_background(pool.cached_pages, keys, meta)
        if local >= len(hashes):
            return FetchResult("hit", cached_pages=local)
        conn: _Connection | None = None
        try:
            conn = await asyncio.wait_for(self._connection(peer), _left(deadline))
            async with conn.lock:
                result = await self._fetch_on(conn, model, hashes, keys, meta, local, deadline)
            if result.result in ("timeout", "error"):
                self._drop(peer)  # the peer may be gone or stalled: the next fetch connects again
            return result
        except PeerRefused as exc:
            log.info("peer %s:%d refused: %s", *peer, exc)
            self._drop(peer)
            return FetchResult("refused", cached_pages=local)
        except TimeoutError:
            self._drop(peer)
            return FetchResult("timeout", cached_pages=local)
        except (OSError, asyncio.IncompleteReadError, p.PeerProtocolError) as exc:
            log.info("fetch from peer %s:%d failed: %s", *peer, exc)
            self._drop(peer)
            return FetchResult("error", cached_pages=local)

    async def _fetch_on(self, conn: _Connection, model: str, hashes: list[bytes], keys: list, meta: WorkloadMeta,
                        local: int, deadline: float) -> FetchResult:
        sent = time.monotonic()
        conn.writer.write(p.frame(p.Fetch(model, hashes, wire_meta(meta), local)))
        await conn.writer.drain()
        offer = await asyncio.wait_for(_read(conn.reader, p.MAX_FRAME), _left(deadline))
        if isinstance(offer, p.Refused):
            raise PeerRefused(offer.error, offer.detail)
        if not isinstance(offer, p.Offer):
            raise p.PeerProtocolError(f"expected an offer, got {type(offer).__name__.lower()}")
        if offer.first != local or len(offer.pages) > len(hashes) - local or any(
                not 0 <= page < conn.layout.pages for page in offer.pages):
            raise p.PeerProtocolError("the offer does not answer the fetch (field pages)")
        if not offer.pages:
            return FetchResult("miss", cached_pages=local)
        read_by = min(deadline, sent + HOLD_SHARE * offer.hold_seconds)
        try:
            written = await self._read_into_pool(conn, keys, meta, local, offer, read_by)
        finally:
            with contextlib.suppress(Exception):  # the peer's hold ends with this, or with the connection
                conn.writer.write(p.frame(p.Done()))
        if written is None:
            return FetchResult("timeout" if time.monotonic() >= read_by else "error", cached_pages=local)
        fresh, cached = written
        return FetchResult("hit" if cached == len(hashes) else "partial", fresh, fresh * self.layout.page_bytes,
                           cached)

    async def _read_into_pool(self, conn: _Connection, keys: list, meta: WorkloadMeta, first: int, offer: p.Offer,
                              read_by: float) -> tuple[int, int] | None:
        """Admit the offered pages here, read them, publish them: the pages written and the prompt's leading
        pages cached here now, or None (nothing published)."""
        host, pool = self.host, self.host.pool
        ps = pool.page_size
        n = first + len(offer.pages)
        seq = f"peer-fetch:{secrets.token_hex(8)}"

        def admit() -> tuple[list[int], int] | None:
            take = n
            try:
                adm = pool.admit(seq, block_hashes=keys[:take], num_tokens=take * ps, meta=meta)
            except PoolExhausted as exc:
                take = n - exc.needed + exc.evictable
                if take <= first:
                    return None
                adm = pool.admit(seq, block_hashes=keys[:take], num_tokens=take * ps, meta=meta)
            return adm.page_ids, adm.num_cached_tokens // ps

        try:
            admitted = await host.run_background(admit)
        except PoolError:
            admitted = None
        if admitted is None:
            raise PeerRefused("no_room", "this pool has no room for the offered pages")
        pages, hits = admitted
        if hits < first:  # pages cached here a moment ago were evicted: their keys would go unwritten
            await host.run_background(_release, host, seq)
            return None
        fresh = pages[hits:]
        if not fresh:
            await host.run_background(_finish, host, seq, len(pages) * ps)
            return 0, len(pages)
        runs = page_runs(fresh, offer.pages[hits - first: hits - first + len(fresh)], self.layout.page_bytes,
                         self.layout.base, conn.layout.base)
        try:
            handle, state = self.agent.read(runs, conn.peer)
        except Exception as exc:
            log.info("peer read failed to start: %s", exc)
            await host.run_background(_release, host, seq)
            return None
        try:
            while state == PROC and time.monotonic() < read_by:
                await asyncio.sleep(POLL)
                state = self.agent.state(handle)
        except asyncio.CancelledError:  # the caller gave up: nothing is published, the pages wait for the read
            self._keep(self.host.run_background(_release, host, seq) if self.agent.release(handle)
                       else self._park(handle, seq))
            raise
        if state == DONE and time.monotonic() <= read_by:
            self.agent.release(handle)
            await host.run_background(_finish, host, seq, len(pages) * ps)
            return len(fresh), len(pages)
        if self.agent.release(handle):  # done, failed, or aborted: its fresh pages go back unpublished
            await host.run_background(_release, host, seq)
        else:  # NIXL could not abort it: its pages stay out of circulation until it ends
            self._keep(self._park(handle, seq))
        return None

    def _keep(self, job: Any) -> None:
        task = asyncio.ensure_future(job)
        self._parked.add(task)
        task.add_done_callback(self._parked.discard)

    async def _park(self, handle: Any, seq: str) -> None:
        log.warning("a peer read could not be aborted: its pages stay out of circulation until it ends")
        while self.agent.state(handle) == PROC:
            await asyncio.sleep(0.01)
        while not self.agent.release(handle):
            await asyncio.sleep(0.1)
        await self.host.run_background(_release, self.host, seq)

    async def _connection(self, peer: tuple[str, int]) -> _Connection:
        async with self._connecting:
            conn = self._connections.get(peer)
            return conn if conn is not None else await self._connect(peer)

    async def _connect(self, peer: tuple[str, int]) -> _Connection:
        reader, writer = await asyncio.open_connection(*peer, limit=p.MAX_FRAME)
        try:
            challenge = await _read(reader, p.MAX_HANDSHAKE_FRAME)
            if isinstance(challenge, p.Refused):
                raise PeerRefused(challenge.error, challenge.detail)
            if not isinstance(challenge, p.Challenge) or challenge.protocol != p.PROTOCOL:
                raise PeerRefused("protocol", f"the peer does not speak peer protocol {p.PROTOCOL}")
            key_id, secret = self.keys.signing
            mine = p.nonce()
            writer.write(p.frame(p.Proof(p.PROTOCOL, key_id, mine, p.proof(secret, b"client", challenge.nonce,
                                                                                mine))))
            await writer.drain()
            accept = await _read(reader, p.MAX_METADATA)
            if isinstance(accept, p.Refused):
                raise PeerRefused(accept.error, accept.detail)
            if not isinstance(accept, p.Accept) or not p.proved(secret, b"server", challenge.nonce, mine, accept.tag):
                raise PeerRefused("unauthorized", "the peer did not prove the cluster key")
            if (accept.layout.shape, accept.layout.page_size, accept.layout.page_bytes) != (
                    self.layout.shape, self.layout.page_size, self.layout.page_bytes):
                raise PeerRefused("layout", f"the peer's pages are {accept.layout.shape} x {accept.layout.page_size} "
                                  f"tokens, this pool's {self.layout.shape} x {self.layout.page_size}")
            name = self.agent.add_peer(accept.metadata)
        except BaseException:
            writer.close()
            raise
        conn = self._connections[peer] = _Connection(reader, writer, name, accept.layout)
        return conn

    def _drop(self, peer: tuple[str, int]) -> None:
        conn = self._connections.pop(peer, None)
        if conn is None:
            return
        conn.writer.close()
        with contextlib.suppress(Exception):
            self.agent.remove_peer(conn.peer)

    async def close(self) -> None:
        for peer in list(self._connections):
            self._drop(peer)
        for task in list(self._parked):
            task.cancel()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _finish(host: PoolHost, seq: str, num_tokens: int) -> None:
    """Publish the sequence's pages (their bytes are written), then let them go to the cache."""
    host.pool.commit(seq, num_tokens)
    host.pool.release(seq)


def _release(host: PoolHost, seq: str) -> None:
    with contextlib.suppress(UnknownSequence):
        host.pool.release(seq)
