"""The engine channel: a Unix-domain socket on which connectors talk to the pool (:mod:`kvpool_sidecar.wire`).

An engine's per-step traffic (admissions, commits, releases and its measurements) bypasses HTTP, JSON and
pydantic: one msgpack frame in, one out, per scheduler step, each op applied under the pool's lock and
answered on its own (a bad op fails alone). Who the peer is comes from the token in its
:class:`~kvpool_sidecar.wire.Hello` (the same credentials as the HTTP API), never from a message body.

Authentication first: the first frame is read with a small cap (:data:`~kvpool_sidecar.wire.MAX_HELLO`)
and decoded as a Hello only, within :data:`HELLO_TIMEOUT`, by at most :data:`MAX_HANDSHAKES` connections at
once. Without a token file the channel serves only processes of the sidecar's own user (or root), by the
peer's credentials from the kernel, and grants them the engine role, never admin.

Sessions: a connection is its session's lease, and the sequences it admits are its own: commits and
releases naming another connection's sequence fail (per op, as if it did not exist), whatever the
token; no HTTP caller can commit, release or fork them either. A Hello naming a session whose
connection is still open is refused (it waits :data:`TAKEOVER_WAIT` for the old one to end). When a
connection ends (the engine exited, crashed or was killed, or its link failed a round trip) its
sequences lapse (``kvpool_engine_lapsed_sequences_total``), but are released only after the quarantine
(``quarantine`` seconds, ``kvpool_engine_quarantined_pages``): its engine's worker may still be copying
into their fresh pages or out of their hit pages for a step or two, and until the quarantine ends no
other writer can be handed those pages, nor can they be evicted. What bounds "a step or two" is the
session's fence (:meth:`~kvpool_sidecar.storage.KVStorage.open_fence`), cleared the moment the
connection ends: the worker checks it before each layer it writes, so however many saves it still has
queued, at most the one layer copy under way when the session ended writes after that; and a load
checked after its read read nothing the sidecar had handed on.

Keys: block hashes are namespaced by the session's model identity (model, revision, dtype, KV layout:
the connector's ``model``), so an engine serving other weights never loads another model's pages.

Peer fetches: an admission naming a source (the request's ``remote_kv_source`` hint) whose pages are not all
cached here may be answered "fetching" while the sidecar fetches them from that peer (:mod:`.lookups`).

KV events: a session whose Hello asks for them follows the pool's removals of its model's pages
(:mod:`.removals`); each reply carries the block hashes that left before the step's commits and during
its admissions, so that the connector publishes stores and removals in the order they happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

import msgspec
from pydantic import ValidationError

from kvpool_sidecar import wire
from kvpool_sidecar.config import AdapterClass
from kvpool_sidecar.keys import DEFAULT_META, WorkloadMeta, namespace, namespaced
from kvpool_sidecar.pool import PoolError, PoolExhausted, UnknownSequence
from kvpool_sidecar.service import models
from kvpool_sidecar.service.credentials import Credentials, Principal
from kvpool_sidecar.service.http import ApiError, error_name, workload_meta
from kvpool_sidecar.service.lookups import LookupFetches
from kvpool_sidecar.service.removals import RemovalFeed
from kvpool_sidecar.service.state import HEAVY_PAGES, Sidecar
from kvpool_sidecar.storage import NoFenceSlot

log = logging.getLogger("kvpool.sidecar")
HELLO_TIMEOUT = 5.0  # seconds a new connection has to say who it is
MAX_HANDSHAKES = 64  # connections not yet authenticated at once; more are closed unread
TAKEOVER_WAIT = 1.0  # seconds a hello naming a connected session waits for the old connection to end
WRITER_POLL = 0.02  # seconds between two looks at an ended session's writers (a slice takes milliseconds)
DEFAULT_QUARANTINE = wire.QUARANTINE_SECONDS
ENGINE = Principal("engine")


class Session:
    """One connection's engine: its principal (owner of what it admits, this connection alone), model
    namespace and the sequences it holds."""

    def __init__(self, session_id: str, who: Principal, model: str, serial: int) -> None:
        self.id = session_id
        self.who = dataclasses.replace(who, session=f"{session_id}#{serial}")
        self.ns = namespace(model)
        self.model = model
        self.live: set[str] = set()
        self.feed: RemovalFeed | None = None
        self.fence: tuple[int, int] | None = None  # its copies' fence word in the pool (a scheduler's)
        self.ended = asyncio.Event()


class EngineChannel:
    """Serves :mod:`kvpool_sidecar.wire` on ``path`` for one :class:`Sidecar`."""

    def __init__(self, sidecar: Sidecar, path: str | Path, credentials: Credentials | None,
                 quarantine: float = DEFAULT_QUARANTINE, peers: Any = None) -> None:
        self.sidecar = sidecar
        self.path = Path(path)
        self.credentials = credentials
        self.quarantine = quarantine
        self.sessions: dict[str, Session] = {}
        self._server: asyncio.AbstractServer | None = None
        self._serial = itertools.count(1)
        self._handshakes = 0
        self._releases: set[asyncio.Task] = set()  # quarantined sequences waiting for their release
        # Lookups that fetch from a peer (peers: the sidecar's kvpool_sidecar.peers.node.Peers, or None).
        self.fetches = LookupFetches(sidecar.pool, sidecar.metrics, peers.client if peers is not None else None)

    async def start(self) -> None:
        self.fetches.loop = asyncio.get_running_loop()
        check_socket_dir(self.path)
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
            for task in list(self._releases):  # the pool goes with the sidecar
                task.cancel()
            self.fetches.cancel()
            await self.close()

    # --------------------------------------------------------------------------- a connection
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session: Session | None = None
        if self._handshakes >= MAX_HANDSHAKES:
            log.warning("engine channel: %d connections have not said hello yet: closing a new one unread",
                        self._handshakes)
            writer.close()
            return
        try:
            self._handshakes += 1
            try:
                hello = await asyncio.wait_for(_read_hello(reader), HELLO_TIMEOUT)
            finally:
                self._handshakes -= 1
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

    async def _greet(self, msg: wire.Hello, writer: asyncio.StreamWriter) -> Session | None:
        def refuse(error: str, detail: str, field: str = "") -> None:
            writer.write(wire.frame(wire.Refused(error, detail, field)))

        try:
            wire.check_hello(msg)
        except wire.WireError as exc:
            refuse("protocol", str(exc))
            return None
        who, why = self._who(msg.token, writer)
        if who is None:
            refuse("unauthorized", why, "token")
            return None
        session = Session(msg.session, who, msg.model, next(self._serial))
        if msg.role == "scheduler":
            old = self.sessions.get(msg.session)
            if old is not None:
                # An engine whose link failed reconnects under its id: its old connection is closing.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(old.ended.wait(), TAKEOVER_WAIT)
                if not old.ended.is_set():
                    refuse("session_in_use", f"session {msg.session!r} is connected: a connection takes a session "
                           "id only once the connection that holds it has ended", "session")
                    return None
            if self.sidecar.storage is not None:
                try:
                    session.fence = self.sidecar.storage.open_fence()
                except NoFenceSlot as exc:
                    refuse("too_many_sessions", str(exc), "session")
                    return None
            if msg.events:
                session.feed = self.sidecar.removals.follow(session.ns)
            if msg.hashing is not None:
                h = msg.hashing
                self.sidecar.learn_engine_hashing(msg.model, h.algo, h.seed, h.probe)
            self.sessions[msg.session] = session
            self.sidecar.engine_fed = True
            self.sidecar.metrics.engine_sessions.set(len(self.sessions))
        sc = self.sidecar
        handle = sc.storage.handle() if sc.storage is not None else None
        try:
            writer.write(wire.frame(wire.Welcome(msg.session, handle, sc.pool.page_size)))
            await writer.drain()
        except BaseException:  # the engine left before its welcome (its connect timed out): nothing of it stays
            if msg.role == "scheduler":
                await self._lapse(session)
            raise
        return session

    def _who(self, token: str | None, writer: asyncio.StreamWriter) -> tuple[Principal | None, str]:
        """The peer's principal, or None and why not."""
        if self.credentials is None:
            # No token file: the kernel's word for who the peer is; the engine role, never admin.
            uid = peer_uid(writer)
            if uid is not None and uid in (os.getuid(), 0):
                return ENGINE, ""
            return None, (f"without a token file this sidecar serves only its own user (uid {os.getuid()}) on "
                          f"the engine channel; the peer is uid {uid} (start the sidecar with --token-file)")
        who = self.credentials.who(token) if token else None
        if who is None or who.role not in ("admin", "engine"):
            return None, "a valid engine or admin token is required"
        return who, ""

    async def _lapse(self, session: Session) -> None:
        """The session's connection is gone: what it held lapses, into quarantine."""
        session.ended.set()
        self.fetches.forget(session.who.session)
        sc = self.sidecar
        slot = session.fence[0] if session.fence is not None else None
        if sc.storage is not None:  # first: its engine's queued copies stop at their next check
            sc.storage.close_fence(session.fence)
            session.fence = None
        if session.feed is not None:
            sc.removals.unfollow(session.feed)
            session.feed = None
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
            sc.metrics.engine_sessions.set(len(self.sessions))
        if not session.live:
            return
        seqs, session.live = list(session.live), set()
        pages = await sc.run_background(_pages_held, sc, seqs)
        sc.metrics.lapsed_sequences.inc(len(seqs))
        sc.metrics.quarantined_pages.inc(pages)
        if self.quarantine > 0:
            log.warning("engine session %s ended holding %d sequences: their %d pages stay out of circulation for "
                        "%g s (its engine may still be copying them), then are released", session.id, len(seqs),
                        pages, self.quarantine)
        task = asyncio.create_task(self._release(seqs, pages, self.quarantine, slot))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, seqs: list[str], pages: int, delay: float, slot: int | None) -> None:
        """After the quarantine, and once no writer of the session is in the middle of a slice (whatever
        stalled it between its check and its write: its lock is held until the slice is written), the
        session's sequences are released and their pages may go to another writer."""
        if delay > 0:
            await asyncio.sleep(delay)
        sc = self.sidecar
        waited = 0.0
        while slot is not None and sc.storage is not None and sc.storage.ended_writers_on(slot):
            if waited == 0.0:
                log.warning("an ended engine session's writer is still in the middle of a copy: its pages stay out "
                            "of circulation until that copy ends or its process exits")
            await asyncio.sleep(WRITER_POLL)
            waited += WRITER_POLL

        def release_all() -> None:
            for seq in seqs:
                with contextlib.suppress(UnknownSequence):
                    sc.release(seq)

        await sc.run_background(release_all, heavy=len(seqs) > 64)
        sc.metrics.quarantined_pages.dec(pages)

    # -------------------------------------------------------------------------------- a step
    async def _step(self, session: Session, msg: wire.Step) -> wire.StepReply:
        sc = self.sidecar
        if msg.report is not None and (r := _report(msg.report)) is not None:
            sc.metrics.observe_engine_report(r.loaded_tokens, r.saved_tokens, r.lookup_seconds, r.failures,
                                          r.events)
        if not (msg.admits or msg.commits or msg.releases or msg.grows or session.feed):
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
        # Commits, then releases, then grows, then admissions: a request's last commit precedes its
        # release, and a grow or an admission sees every page published and freed in the same step.
        commits: list[int | wire.Failed] = []
        for c in msg.commits:
            def commit(c: wire.Commit = c) -> int:
                sc.check_owner(who, _seq_id(c.seq_id))
                return pool.commit(c.seq_id, c.num_tokens)
            commits.append(_op(commit))
        releases: list[wire.Failed | None] = []
        for seq in msg.releases:
            def release(seq: str = seq) -> None:
                sc.check_owner(who, _seq_id(seq))
                sc.release(seq)
                session.live.discard(seq)
            releases.append(_op(release))
        grows: list[wire.Grown | wire.Failed] = []
        for g in msg.grows:
            def grow(g: wire.Grow = g) -> wire.Grown:
                sc.check_owner(who, _seq_id(g.seq_id))
                return wire.Grown(sc.with_evictions(pool.grow, g.seq_id, g.num_tokens))
            grows.append(_op(grow))
        admits: list[wire.Admitted | wire.Failed] = []
        for adm in msg.admits:
            admits.append(_op(lambda adm=adm: self._admit(session, adm)))
        if feed is None:
            return wire.StepReply(admits, commits, releases, grows=grows)
        sc.removals.flush()
        removed_after, lost_after = feed.take()
        return wire.StepReply(admits, commits, releases, removed_before, removed_after, lost or lost_after, grows)

    def _admit(self, session: Session, adm: wire.Admit) -> wire.Admitted:
        _seq_id(adm.seq_id)
        if not adm.hashes:
            raise ApiError(400, "invalid_request", "hashes must not be empty", "hashes")
        if len(adm.hashes) > wire.MAX_BLOCKS:
            raise ApiError(413, "too_large", f"{len(adm.hashes)} block hashes: at most {wire.MAX_BLOCKS} in one "
                           "admission (the connector admits a longer prompt's first blocks)", "hashes")
        if any(not 0 < len(h) <= wire.MAX_HASH_BYTES for h in adm.hashes):
            raise ApiError(400, "invalid_request", f"each hash must be 1-{wire.MAX_HASH_BYTES} bytes", "hashes")
        sc = self.sidecar
        meta = DEFAULT_META if adm.meta is None else _meta(adm.meta)
        if adm.meta is not None and adm.meta.adapter:
            meta = _mapped(meta, sc.state.config.workloads.adapter_rule(adm.meta.adapter))
        keys = namespaced(session.ns, adm.hashes)
        if adm.hold_only and adm.save_later:
            raise ApiError(400, "invalid_request", "hold_only makes no sequence to grow: give at most one of "
                           "hold_only and save_later", "save_later")
        if self.fetches.pending(session.who.session, session.model, adm, keys, meta):
            return wire.Admitted([], 0, sc.storage_epoch, session.fence, fetching=True)
        if adm.hold_only:  # a lookup: the cached prefix, held, and no page allocated (none evicted)
            keys = keys[: sc.pool.cached_pages(keys, meta)]
            if not keys:
                return wire.Admitted([], 0, sc.storage_epoch, session.fence)
            adm = msgspec.structs.replace(adm, num_tokens=len(keys) * sc.pool.page_size)
        # The channel admits only engine and admin credentials, which act for any tenant; the sequence is
        # this connection's alone.
        if adm.save_later:  # the cached prefix held, the pages to save taken by its grows
            result = sc.admit(adm.seq_id, None, keys, adm.num_tokens, meta, owner=session.who, allocate=False)
            session.live.add(adm.seq_id)
            return wire.Admitted(result.page_ids, result.num_cached_tokens, sc.storage_epoch, session.fence)
        try:
            result = sc.admit(adm.seq_id, None, keys, adm.num_tokens, meta, owner=session.who)
        except PoolExhausted as exc:
            # Under pressure the request keeps what the pool can give: its hits to load, and as many of
            # its leading blocks to save as there are pages (fewer answered pages tell the connector).
            fits = len(keys) - exc.needed + exc.evictable
            if fits < 1:
                raise
            ps = sc.pool.page_size
            result = sc.admit(adm.seq_id, None, keys[:fits], min(adm.num_tokens, fits * ps), meta,
                              owner=session.who)
        session.live.add(adm.seq_id)
        return wire.Admitted(result.page_ids, result.num_cached_tokens, sc.storage_epoch, session.fence)


@functools.lru_cache(maxsize=1024)
def _meta(m: wire.Meta) -> WorkloadMeta:
    """A request's metadata checked by the HTTP API's own model (one owner of its rules); an engine sends
    few distinct ones, so each is validated once."""
    if len(m.adapter) > 128:
        raise ApiError(400, "invalid_request", "at most 128 characters", "meta.adapter")
    try:
        meta = models.Meta(workload_class=m.workload_class, request_type=m.request_type, turn=m.turn,
                           tenant=m.tenant, user=m.user)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "meta." + ".".join(str(p) for p in first["loc"])
        raise ApiError(400, "invalid_request", first["msg"], field) from None
    return workload_meta(meta)


def _mapped(meta: WorkloadMeta, rule: AdapterClass | None) -> WorkloadMeta:
    """``meta`` with the tenant and class the policy gives the request's LoRA adapter, if it names it."""
    if rule is None:
        return meta
    return dataclasses.replace(meta, tenant=rule.tenant or meta.tenant,
                               workload_class=rule.workloadClass or meta.workload_class)


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


def _seq_id(seq_id: str) -> str:
    if not 0 < len(seq_id) <= wire.MAX_SEQ_ID:
        raise ApiError(400, "invalid_request", f"seq_id must be 1-{wire.MAX_SEQ_ID} characters", "seq_id")
    return seq_id


def _pages_held(sc: Sidecar, seqs: list[str]) -> int:
    live = sc.pool.sequences.live
    return sum(len(live[s].pages) for s in seqs if s in live)


def peer_uid(writer: asyncio.StreamWriter) -> int | None:
    """The connecting process's user id, from the kernel (SO_PEERCRED); None where unknown."""
    sock = writer.get_extra_info("socket")
    try:
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (AttributeError, OSError):
        return None
    return uid


def check_socket_dir(path: Path) -> None:
    """Create the socket's directory (owner and group only), or refuse one that another user owns: its
    owner could put a socket of their own in ours' place and receive the engines' tokens."""
    parent = path.parent
    parent.mkdir(mode=0o770, parents=True, exist_ok=True)
    owner = parent.stat().st_uid
    if owner not in (os.getuid(), 0):
        raise OSError(f"--engine-socket {path}: its directory {parent} belongs to uid {owner}, neither this "
                      f"sidecar's user (uid {os.getuid()}) nor root: whoever owns it could serve engines a socket "
                      "of their own. Remove the directory or choose one this sidecar's user owns")


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
    body = await wire.read_frame(reader, wire.MAX_FRAME)
    return None if body is None else wire.decode(body)


async def _read_hello(reader: asyncio.StreamReader) -> wire.Hello | None:
    """The first message, which must be a hello: read with the small cap, decoded as nothing else."""
    body = await wire.read_frame(reader, wire.MAX_HELLO)
    return None if body is None else wire.decode_hello(body)
