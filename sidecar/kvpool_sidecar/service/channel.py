"""The engine channel: a Unix-domain socket on which connectors talk to the pool (:mod:`kvpool_sidecar.wire`).

An engine's per-step traffic (admissions, commits, releases and its measurements) bypasses HTTP, JSON and
pydantic: one msgpack frame in, one out, per scheduler step, each op applied under the pool's lock and
answered on its own (a bad op fails alone). Who the peer is comes from the token in its
:class:`~kvpool_sidecar.wire.Hello` (the same credentials as the HTTP API), never from a message body.

Sessions: a connection is its session's lease. The sidecar remembers every sequence a connection
admitted and still holds; when the connection ends (the engine exited, crashed or was killed: the kernel
closes its socket) those sequences are released at once and counted
(``kvpool_engine_lapsed_sequences_total``). A new Hello for a live session id replaces the old
connection (an engine restarted under the same id) and releases its sequences first.

Keys: block hashes are namespaced by the session's model identity (model, revision, dtype, KV layout:
the connector's ``model``), so an engine serving other weights never loads another model's pages.

KV events: a session whose Hello asks for them follows the pool's removals of its model's pages
(:mod:`.removals`); each reply carries the block hashes that left before the step's commits and during
its admissions, so that the connector publishes stores and removals in the order they happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvpool_sidecar import wire
from kvpool_sidecar.keys import DEFAULT_META, WorkloadMeta
from kvpool_sidecar.pool import PoolError, UnknownSequence
from kvpool_sidecar.service import models
from kvpool_sidecar.service.credentials import ADMIN, Credentials, Principal
from kvpool_sidecar.service.http import ApiError, error_name, workload_meta
from kvpool_sidecar.service.removals import RemovalFeed
from kvpool_sidecar.service.state import HEAVY_PAGES, Sidecar

log = logging.getLogger("kvpool.sidecar")
HELLO_TIMEOUT = 5.0  # seconds a new connection has to say who it is


def namespace(model: str) -> bytes:
    """The key namespace of a model identity (16 bytes)."""
    return hashlib.blake2b(model.encode(), digest_size=16, person=b"kvpool-model").digest()


def namespaced(ns: bytes, hashes: list[bytes]) -> list[bytes]:
    """Each engine block hash made a pool key of model ``ns``: the namespace's 16 bytes and the hash (the
    chain stays the engine's; a concatenation, not a second hash: it is on every admission's path)."""
    return list(map(ns.__add__, hashes))


class Session:
    """One connection's engine: its principal, model namespace and the sequences it holds."""

    def __init__(self, session_id: str, who: Principal, model: str) -> None:
        self.id = session_id
        self.who = who
        self.ns = namespace(model)
        self.live: set[str] = set()
        self.feed: RemovalFeed | None = None


class EngineChannel:
    """Serves :mod:`kvpool_sidecar.wire` on ``path`` for one :class:`Sidecar`."""

    def __init__(self, sidecar: Sidecar, path: str | Path, credentials: Credentials | None) -> None:
        self.sidecar = sidecar
        self.path = Path(path)
        self.credentials = credentials
        self.sessions: dict[str, tuple[Session, asyncio.StreamWriter]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                if socket_in_use(self.path):
                    raise OSError(f"--engine-socket {self.path}: another process serves it (a second sidecar "
                                  "needs its own socket path)")
                self.path.unlink()  # a predecessor's socket (a killed sidecar leaves it behind)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=wire.MAX_FRAME)
        # Owner and group only: the engine's container shares the sidecar's group (fsGroup) in a pod.
        os.chmod(self.path, 0o660)
        log.info("engine channel on %s", self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def serve_until_cancelled(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    # --------------------------------------------------------------------------- a connection
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session: Session | None = None
        try:
            hello = await asyncio.wait_for(_read(reader), HELLO_TIMEOUT)
            if hello is None:
                return
            session = await self._greet(hello, writer)
            if session is None:
                return
            while (msg := await _read(reader)) is not None:
                if not isinstance(msg, wire.Step):
                    raise wire.WireError(f"expected a step, got {type(msg).__name__.lower()}")
                wire.check_step(msg)
                reply = await self._step(session, msg)
                writer.write(wire.frame(reply))
                await writer.drain()
        except wire.WireError as exc:
            log.warning("engine channel: closing a connection that broke the protocol: %s", exc)
            with contextlib.suppress(Exception):
                writer.write(wire.frame(wire.Refused("protocol", str(exc))))
                await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # the sidecar is shutting down: its pool goes with it
            session = None
        finally:
            if session is not None:
                await self._lapse(session)
            writer.close()

    async def _greet(self, msg: wire.Message, writer: asyncio.StreamWriter) -> Session | None:
        def refuse(error: str, detail: str, field: str = "") -> None:
            writer.write(wire.frame(wire.Refused(error, detail, field)))

        if not isinstance(msg, wire.Hello):
            refuse("protocol", "the first message must be a hello")
            return None
        try:
            wire.check_hello(msg)
        except wire.WireError as exc:
            refuse("protocol", str(exc))
            return None
        who = self._who(msg.token)
        if who is None:
            refuse("unauthorized", "a valid engine or admin token is required", "token")
            return None
        session = Session(msg.session, who, msg.model)
        if msg.role == "scheduler":
            if msg.events:
                session.feed = self.sidecar.removals.follow(session.ns)
            old = self.sessions.get(msg.session)
            if old is not None:
                log.warning("engine session %s connected again: releasing what its old connection held", msg.session)
                await self._lapse(old[0])
                old[1].close()
            self.sessions[msg.session] = (session, writer)
            self.sidecar.engine_fed = True
            self.sidecar.metrics.engine_sessions.set(len(self.sessions))
        sc = self.sidecar
        handle = sc.storage.handle() if sc.storage is not None else None
        writer.write(wire.frame(wire.Welcome(msg.session, handle, sc.pool.page_size)))
        await writer.drain()
        return session

    def _who(self, token: str | None) -> Principal | None:
        if self.credentials is None:
            return ADMIN  # no token file: the socket's permissions are the only gate, as for loopback HTTP
        who = self.credentials.who(token) if token else None
        if who is None or who.role not in ("admin", "engine"):
            return None
        return who

    async def _lapse(self, session: Session) -> None:
        """Release what a session still holds (its connection is gone or replaced)."""
        if session.feed is not None:
            self.sidecar.removals.unfollow(session.feed)
            session.feed = None
        current = self.sessions.get(session.id)
        if current is not None and current[0] is session:
            del self.sessions[session.id]
            self.sidecar.metrics.engine_sessions.set(len(self.sessions))
        if not session.live:
            return
        seqs, session.live = list(session.live), set()

        def release_all() -> int:
            n = 0
            for seq in seqs:
                with contextlib.suppress(UnknownSequence):
                    self.sidecar.release(seq)
                    n += 1
            return n

        n = await self.sidecar.run_background(release_all, heavy=len(seqs) > 64)
        self.sidecar.metrics.lapsed_sequences.inc(n)
        log.warning("engine session %s ended holding %d sequences: released them", session.id, n)

    # -------------------------------------------------------------------------------- a step
    async def _step(self, session: Session, msg: wire.Step) -> wire.StepReply:
        sc = self.sidecar
        if msg.report is not None and (r := _report(msg.report)) is not None:
            sc.metrics.observe_engine_report(r.loaded_tokens, r.saved_tokens, r.lookup_seconds, r.failures,
                                          r.events)
        if not (msg.admits or msg.commits or msg.releases or session.feed):
            return wire.StepReply([], [], [])
        heavy = sum(len(a.hashes) for a in msg.admits) >= HEAVY_PAGES
        return await sc.run(self._apply, session, msg, heavy=heavy)

    def _apply(self, session: Session, msg: wire.Step) -> wire.StepReply:
        sc = self.sidecar
        pool = sc.pool
        who = session.who
        feed = session.feed
        if feed is not None:
            sc.removals.flush()
            removed_before, lost = feed.take()
        # Commits, then releases, then admissions: a request's last commit precedes its release, and an
        # admission sees every page published and freed in the same step.
        commits: list[int | wire.Failed] = []
        for c in msg.commits:
            def commit(c: wire.Commit = c) -> int:
                sc.check_owner(who, c.seq_id)
                return pool.commit(c.seq_id, c.num_tokens)
            commits.append(_op(commit))
        releases: list[wire.Failed | None] = []
        for seq in msg.releases:
            def release(seq: str = seq) -> None:
                sc.check_owner(who, seq)
                sc.release(seq)
                session.live.discard(seq)
            releases.append(_op(release))
        admits: list[wire.Admitted | wire.Failed] = []
        for adm in msg.admits:
            admits.append(_op(lambda adm=adm: self._admit(session, adm)))
        if feed is None:
            return wire.StepReply(admits, commits, releases)
        sc.removals.flush()
        removed_after, lost_after = feed.take()
        return wire.StepReply(admits, commits, releases, removed_before, removed_after, lost or lost_after)

    def _admit(self, session: Session, adm: wire.Admit) -> wire.Admitted:
        if not adm.hashes:
            raise ApiError(400, "invalid_request", "hashes must not be empty", "hashes")
        if any(not 0 < len(h) <= wire.MAX_HASH_BYTES for h in adm.hashes):
            raise ApiError(400, "invalid_request", f"each hash must be 1-{wire.MAX_HASH_BYTES} bytes", "hashes")
        meta = DEFAULT_META if adm.meta is None else _meta(adm.meta)
        sc = self.sidecar
        keys = namespaced(session.ns, adm.hashes)
        # The channel admits only engine and admin credentials, which act for any tenant.
        result = sc.admit(adm.seq_id, None, keys, adm.num_tokens, meta, owner=session.who)
        session.live.add(adm.seq_id)
        return wire.Admitted(result.page_ids, result.num_cached_tokens, sc.storage_epoch)


@functools.lru_cache(maxsize=1024)
def _meta(m: wire.Meta) -> WorkloadMeta:
    """A request's metadata checked by the HTTP API's own model (one owner of its rules); an engine sends
    few distinct ones, so each is validated once."""
    try:
        meta = models.Meta(workload_class=m.workload_class, request_type=m.request_type, turn=m.turn,
                           tenant=m.tenant, user=m.user)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "meta." + ".".join(str(p) for p in first["loc"])
        raise ApiError(400, "invalid_request", first["msg"], field) from None
    return workload_meta(meta)


def _report(r: wire.Report) -> models.EngineReport | None:
    """A connector's report checked by the HTTP API's model; a bad one is dropped (its ops still apply)."""
    try:
        return models.EngineReport(loaded_tokens=r.loaded_tokens, saved_tokens=r.saved_tokens,
                                   lookup_seconds=r.lookup_seconds, failures=r.failures, events=r.events)
    except ValidationError as exc:
        log.warning("engine channel: dropping an invalid connector report: %s", exc.errors()[0]["msg"])
        return None


def _op(fn: Any) -> Any:
    try:
        return fn()
    except PoolError as exc:
        return wire.Failed(error_name(exc), str(exc), exc.field)
    except ApiError as exc:
        return wire.Failed(exc.error, exc.detail, exc.field)


def socket_in_use(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


async def _read(reader: asyncio.StreamReader) -> wire.Message | None:
    """The next message, or None at a clean end of the stream."""
    try:
        header = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    n = wire.frame_length(header)
    return wire.decode(await reader.readexactly(n))
