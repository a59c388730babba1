"""One NIXL agent per sidecar: its pool's pages registered once, peers' agents added as they are met, reads.

NIXL (the ``peers`` extra: ``pip install 'kvpool[peers]'``) with its UCX backend: between processes of one
machine a READ is a single kernel copy (cma), between nodes RDMA. No progress thread: it spins a core even
when idle (on a two-core node it halves every transfer); the reader progresses its own reads by polling them,
and the source calls :meth:`PeerAgent.progress` while it holds pages for a peer (transports that need the
target's help, such as TCP, advance then).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import secrets
import socket
from typing import Any

import numpy as np

log = logging.getLogger("kvpool.peers")
DONE, PROC, ERR = "DONE", "PROC", "ERR"
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range's pages into this process's page tables, writable


def nixl_api() -> Any:
    """NIXL's Python API (``nixl._api``; the CUDA 12 build's own module where the meta package is absent), or
    None where neither is installed. NIXL's own INFO lines (its handler writes them to stdout, outside the
    sidecar's log) are quieted unless ``NIXL_LOG_LEVEL`` asks for them."""
    for name in ("nixl._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    return None


def available() -> bool:
    return nixl_api() is not None


class NixlMissing(RuntimeError):
    """Peer fetching needs NIXL: the ``peers`` extra."""


class PeerAgent:
    """A NIXL agent over one memory region (the pool's pages): ``base`` and ``nbytes``."""

    def __init__(self, base: int, nbytes: int, name: str | None = None) -> None:
        api = nixl_api()
        if api is None:
            raise NixlMissing("serving or fetching peers needs NIXL: install kvpool's peers extra "
                              "(pip install 'kvpool[peers]', which `make venv` does)")
        self.name = name or f"kvpool-{socket.gethostname()}-{secrets.token_hex(6)}"
        self._agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        self.base = base
        self.nbytes = nbytes
        self._registered = self._agent.register_memory([(base, nbytes, 0, "")], "DRAM")

    def populate(self) -> None:
        """Fault the region's pages into this process's page tables (writable; their bytes are unchanged). The
        sidecar never touches its pool's pages itself (the engines write them through their own mappings), so
        a peer's single-copy read would otherwise fault every 4 KiB page of it on the way, in the kernel: a
        64 MiB read at about half speed. Blocking (seconds for a large pool; ctypes lets go of the GIL): run
        it off the event loop. Where the kernel lacks the call, reads fault as they go."""
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(self.base), ctypes.c_size_t(self.nbytes), MADV_POPULATE_WRITE) != 0:
            log.info("could not prefault the pool's pages (errno %d): peer reads fault them as they go",
                     ctypes.get_errno())

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def read(self, runs: list[tuple[int, int, int]], peer: str) -> Any:
        """Start a READ of ``runs`` ((local address, remote address, bytes)) from ``peer``; returns its handle
        (poll it with :meth:`state`). Raises where the peer is gone already."""
        local = np.array([(lo, n, 0) for lo, _, n in runs], dtype=np.uint64)
        remote = np.array([(ro, n, 0) for _, ro, n in runs], dtype=np.uint64)
        handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, "DRAM"),
                                             self._agent.get_xfer_descs(remote, "DRAM"), peer)
        try:
            state = self._agent.transfer(handle)
        except Exception:
            self.release(handle)
            raise
        return handle, state

    def state(self, handle: Any) -> str:
        """DONE, PROC or ERR (a failure of the peer, its connection or the transfer)."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception:
            return ERR

    def release(self, handle: Any) -> bool:
        """Release a transfer's handle (aborting it if it is still in progress); False where NIXL refused, so
        that the caller keeps what it reads into out of circulation until a later release succeeds."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def progress(self) -> None:
        """Advance the transports that need the target's help (no progress thread)."""
        self._agent.get_new_notifs()

    def close(self) -> None:
        try:
            self._agent.deregister_memory(self._registered)
        except Exception:  # the process is going: the agent goes with it
            pass
