"""A sidecar's peer side as one piece: its NIXL agent over the pool, the server (``--peer-port``) and the client
that fetches from the static members (``--peers``)."""

from __future__ import annotations

import asyncio

from kvpool_sidecar.peers.agent import PeerAgent
from kvpool_sidecar.peers.client import PeerClient
from kvpool_sidecar.peers.host import PoolHost
from kvpool_sidecar.peers.keys import TransferKeys
from kvpool_sidecar.peers.server import PeerServer


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
                 members: frozenset[tuple[str, int]] = frozenset()) -> None:
        storage = host.storage
        if storage is None:
            raise ValueError("peers read and serve the pool's KV: start the sidecar with --kv-shape")
        self.agent = PeerAgent(storage.kv.data_ptr(), storage.kv.numel() * storage.kv.element_size())
        self.server = PeerServer(host, self.agent, keys, port, bind) if port is not None else None
        self.client = PeerClient(host, self.agent, keys, members)

    async def start(self) -> None:
        if self.server is not None:
            await self.server.start()

    async def serve_until_cancelled(self) -> None:
        populate = asyncio.create_task(asyncio.to_thread(self.agent.populate))  # reads fault as they go meanwhile
        try:
            if self.server is not None:
                await self.server.serve_until_cancelled()
            else:
                await asyncio.Event().wait()
        finally:
            populate.cancel()
            await self.client.close()
            self.agent.close()
