"""Serve this sidecar's pool to peers: ``kvpool-sidecar serve --peer-port PORT`` (:mod:`.protocol`).

A peer proves the cluster key before anything else is sent; a connection that does not (a wrong or unknown
key, a broken handshake, none within :data:`HANDSHAKE_TIMEOUT`) is refused and counted
(``kvpool_peer_refused_total``). A fetch's pages are *held* (an admission of its cached leading pages, as the
engine channel's lookups hold theirs: they are in use, never evicted nor handed to a writer) from the offer
until the reader's :class:`~.protocol.Done`, the end of its connection, or ``hold_seconds`` (a reader that
stalls), whichever comes first; the reader's own deadline for its read ends earlier (:mod:`.client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

from kvpool_sidecar import wire
from kvpool_sidecar.peers import protocol as p
from kvpool_sidecar.peers.agent import PeerAgent
from kvpool_sidecar.peers.host import PoolHost, meta_of, pool_keys
from kvpool_sidecar.peers.keys import TransferKeys
from kvpool_sidecar.pool import PoolError, UnknownSequence

log = logging.getLogger("kvpool.peers")
HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to prove the cluster key
HOLD_SECONDS = 2.0  # the longest a fetch's pages stay held for its reader (a 64 MiB read takes about 10 ms)
MAX_CONNECTIONS = 64  # peer connections at once (each holds at most one fetch's pages); more are refused
PROGRESS_INTERVAL = 0.001  # seconds between two progress calls of the agent while pages are held


def layout_of(host: PoolHost) -> p.Layout:
    storage = host.storage
    assert storage is not None
    s = storage.shape
    return p.Layout((s.layers, s.kv_heads, s.head_dim, s.dtype), storage.page_size,
                    s.bytes_per_page(storage.page_size), storage.num_pages, storage.kv.data_ptr())


class PeerServer:
    """Serves :mod:`.protocol` on ``bind:port`` for one sidecar."""

    def __init__(self, host: PoolHost, agent: PeerAgent, keys: TransferKeys, port: int, bind: str = "0.0.0.0",
                 hold_seconds: float = HOLD_SECONDS) -> None:
        if host.storage is None:
            raise ValueError("serving peers needs the pool's KV (--kv-shape)")
        self.host = host
        self.agent = agent
        self.keys = keys
        self.port = port
        self.bind = bind
        self.hold_seconds = hold_seconds
        self.layout = layout_of(host)
        self.connections = 0
        self.holds = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.bind, self.port, limit=p.MAX_FRAME)
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]
        log.info("serving peers on %s:%d (NIXL agent %s)", self.bind, self.port, self.agent.name)

    async def serve_until_cancelled(self) -> None:
        try:
            while True:  # no progress thread: the held pages' reads advance here
                await asyncio.sleep(PROGRESS_INTERVAL if self.holds else 0.05)
                if self.holds:
                    self.agent.progress()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            self._server = None

    def _refuse(self, writer: asyncio.StreamWriter, reason: str, detail: str) -> None:
        self.host.metrics.peer_refused.labels(reason).inc()
        with contextlib.suppress(Exception):
            writer.write(p.frame(p.Refused(reason, detail)))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= MAX_CONNECTIONS:
            self._refuse(writer, "too_many", f"{MAX_CONNECTIONS} peers are connected")
            writer.close()
            return
        self.connections += 1
        self._writers.add(writer)
        try:
            if await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_TIMEOUT):
                while (msg := await _read(reader, p.MAX_FRAME)) is not None:
                    if isinstance(msg, p.Schemes):
                        p.check_schemes(msg)
                        schemes = [p.Scheme(*s) for s in self.host.engine_schemes(msg.model)][:p.MAX_SCHEMES]
                        writer.write(p.frame(p.Known(schemes)))
                        await writer.drain()
                        continue
                    if not isinstance(msg, p.Fetch):
                        raise p.PeerProtocolError(f"expected a fetch, got {type(msg).__name__.lower()}")
                    p.check_fetch(msg)
                    if not await self._fetch(msg, reader, writer):
                        break
        except TimeoutError:
            self._refuse(writer, "timeout", f"no proof of the cluster key within {HANDSHAKE_TIMEOUT:g} s")
        except p.PeerProtocolError as exc:
            self._refuse(writer, "protocol", str(exc))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.connections -= 1
            self._writers.discard(writer)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Challenge, check the peer's proof, prove back and send the agent's metadata; False: refused."""
        server_nonce = p.nonce()
        writer.write(p.frame(p.Challenge(p.PROTOCOL, server_nonce)))
        await writer.drain()
        msg = await _read(reader, p.MAX_HANDSHAKE_FRAME)
        if msg is None:
            return False
        if not isinstance(msg, p.Proof) or msg.protocol != p.PROTOCOL:
            self._refuse(writer, "protocol", f"expected a proof of protocol {p.PROTOCOL}")
            return False
        secret = self.keys.secret(msg.key_id)
        if len(msg.nonce) != p.NONCE_BYTES or not p.proved(secret, b"client", server_nonce, msg.nonce, msg.tag):
            self._refuse(writer, "unauthorized", "the proof does not verify under any cluster key of this sidecar")
            return False
        tag = p.proof(secret, b"server", server_nonce, msg.nonce)  # type: ignore[arg-type]
        writer.write(p.frame(p.Accept(tag, self.agent.name, self.agent.metadata(), self.layout)))
        await writer.drain()
        return True

    async def _fetch(self, msg: p.Fetch, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Offer the held pages, wait for the reader's done; False: the connection is to close."""
        try:
            offer, seq = await self.host.run_background(self._hold, msg)
        except PoolError as exc:
            self.host.metrics.peer_refused.labels("busy").inc()
            writer.write(p.frame(p.Refused("busy", str(exc))))
            await writer.drain()
            return True
        if seq is None:
            writer.write(p.frame(offer))
            await writer.drain()
            return True
        self.holds += 1
        try:
            writer.write(p.frame(offer))
            await writer.drain()
            self.host.metrics.peer_served_pages.inc(len(offer.pages))
            try:
                done = await asyncio.wait_for(_read(reader, p.MAX_FRAME), self.hold_seconds)
            except TimeoutError:
                log.warning("a peer did not finish reading %d held pages within %g s: released, connection closed",
                            len(offer.pages), self.hold_seconds)
                return False
            return isinstance(done, p.Done)
        finally:
            self.holds -= 1
            await self.host.run_background(_release, self.host, seq)

    def _hold(self, msg: p.Fetch) -> tuple[p.Offer, str | None]:
        pool = self.host.pool
        keys = pool_keys(msg.model, msg.hashes)
        meta = meta_of(msg.meta)
        n = pool.cached_pages(keys, meta)
        if n <= msg.first:
            return p.Offer(msg.first, [], self.hold_seconds), None
        seq = f"peer-hold:{secrets.token_hex(8)}"
        adm = pool.admit(seq, block_hashes=keys[:n], num_tokens=n * pool.page_size, meta=meta)
        return p.Offer(msg.first, adm.page_ids[msg.first:n], self.hold_seconds), seq


def _release(host: PoolHost, seq: str) -> None:
    with contextlib.suppress(UnknownSequence):
        host.pool.release(seq)


async def _read(reader: asyncio.StreamReader, limit: int) -> Any:
    """The next message, or None at a clean end of the stream (framed as the engine channel's frames)."""
    body = await wire.read_frame(reader, limit, p.frame_length)
    return None if body is None else p.decode(body)
