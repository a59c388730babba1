"""A sidecar's peer side as one piece: its NIXL agent over the pool, the server (``--peer-port``) and the client
that fetches from its members: a static list (``--peers HOST:PORT,...``), or a source polled every
``refresh_seconds`` (``--peers kubernetes``: the pods of the sidecar's policy); a failed poll keeps the last
members."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvpool_sidecar.peers.agent import PeerAgent
from kvpool_sidecar.peers.client import PeerClient
from kvpool_sidecar.peers.host import PoolHost
from kvpool_sidecar.peers.keys import TransferKeys
from kvpool_sidecar.peers.server import PeerServer

log = logging.getLogger("kvpool.peers")
REFRESH_SECONDS = 10.0
Members = frozenset[tuple[str, int]]


def parse_peers(text: str) -> frozenset[tuple[str, int]]:
    """``HOST:PORT,...`` (``--peers``) as (host, port) pairs; a bad item is refused naming it."""
    out = set()
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--peers: {item!r} is not HOST:PORT (a port of 1-65535)")
        out.add((host.strip("[]"), int(port)))
    return frozenset(out)


class Peers:
    """The agent (its pool's pages registered once at start), the server when ``port`` is given, the client."""

    def __init__(self, host: PoolHost, keys: TransferKeys, *, port: int | None = None, bind: str = "0.0.0.0",
                 members: Members = frozenset(), membership: Callable[[], Members] | None = None,
                 refresh_seconds: float = REFRESH_SECONDS) -> None:
        storage = host.storage
        if storage is None:
            raise ValueError("peers read and serve the pool's KV: start the sidecar with --kv-shape")
        self.agent = PeerAgent(storage.kv.data_ptr(), storage.kv.numel() * storage.kv.element_size())
        self.server = PeerServer(host, self.agent, keys, port, bind) if port is not None else None
        self.client = PeerClient(host, self.agent, keys, members)
        self.host = host
        self.membership = membership
        self.refresh_seconds = refresh_seconds
        host.metrics.peer_members.set(len(members))

    async def start(self) -> None:
        if self.server is not None:
            await self.server.start()
        await self.refresh_members()

    async def refresh_members(self) -> None:
        """Take the membership source's current members; a failure keeps the last ones (logged, counted)."""
        if self.membership is None:
            return
        try:
            members = await asyncio.to_thread(self.membership)
        except Exception as exc:  # the API unreachable, forbidden, a timeout: the last members stay
            self.host.metrics.peer_membership_errors.inc()
            log.warning("peer membership: the poll failed, %d members kept: %s", len(self.client.members), exc)
            return
        if members != self.client.members:
            log.info("peer membership: %d members (%s)", len(members),
                     ", ".join(f"{h}:{p}" for h, p in sorted(members)[:8]) or "none")
        self.client.members = members
        self.host.metrics.peer_members.set(len(members))

    async def _follow_membership(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self.refresh_members()

    async def serve_until_cancelled(self) -> None:
        populate = asyncio.create_task(asyncio.to_thread(self.agent.populate))  # reads fault as they go meanwhile
        follow = asyncio.create_task(self._follow_membership()) if self.membership is not None else None
        try:
            if self.server is not None:
                await self.server.serve_until_cancelled()
            else:
                await asyncio.Event().wait()
        finally:
            populate.cancel()
            if follow is not None:
                follow.cancel()
            await self.client.close()
            self.agent.close()
