"""An engine's connection to its sidecar: the engine channel (a Unix socket, :mod:`kvpool_sidecar.wire`).

The scheduler must never wait on the sidecar for more than its lookup budget, and must keep serving when
the sidecar is gone. :class:`SidecarLink` owns one thread and one connection: callers
:meth:`~SidecarLink.admit`, :meth:`~SidecarLink.grow`, :meth:`~SidecarLink.commit` and
:meth:`~SidecarLink.release`; the thread sends whatever has queued up as one step message (so a scheduler
step's lookups, grows, commits and releases cost one round trip, in the order they were queued). An
admission and a grow return a :class:`~concurrent.futures.Future`.

The connection is the session's lease: when it breaks, the sidecar lets every sequence the session
held lapse, so nothing admitted before is valid any more. :attr:`SidecarLink.generation` counts lost
connections, and moves in the failure path itself, before any caller can plan another copy: callers keep
the generation their admission was answered on and drop what belongs to an older one (the sidecar keeps
the lapsed pages out of circulation for the copies planned before the failure). A step is kept under
:data:`~kvpool_sidecar.wire.STEP_BYTES` (what does not fit goes in the next one). A
failed connection marks the link down for a backoff that doubles up to a ceiling; while down
:meth:`~SidecarLink.available` is False (callers skip the sidecar), and once the backoff has passed the
next op reconnects. One warning when it goes down, one when it is back. A connection the sidecar has
closed since its last round trip (it restarted while the link was idle) is dropped before anything is
sent on it, as a failed one is, and the step goes on a new connection at once: the lookups of the first
requests after a restart (a whole batch, in one step) are not failed, nor is the link made to back off.
With KV events the link steps when idle too, but opens no connection just for that while its owner has
not made the hello final (``hello_ready``: the tier's, until vLLM's engine core has seeded its block
hashes).
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvpool_sidecar import wire
from kvpool_sidecar.routing.kv_events import EventLog

log = logging.getLogger("kvpool.engine")
REPORT_EVERY = 1.0  # seconds idle after which a pending report is sent on its own


class SidecarDown(ConnectionError):
    """The sidecar could not be reached (or the link is backing off)."""


class OpFailed(RuntimeError):
    """The sidecar refused one op: ``error`` is its error name, ``field`` the field at fault."""

    def __init__(self, error: str, detail: str, field: str = "") -> None:
        super().__init__(f"{error}: {detail}" + (f" (field {field})" if field else ""))
        self.error, self.detail, self.field = error, detail, field


class Refused(ConnectionError):
    """The sidecar refused the connection itself (a bad token, another protocol)."""


class Backoff:
    """Up, or down until ``retry_at``; each failure in a row doubles the wait (``base`` .. ``ceiling``)."""

    def __init__(self, what: str, base: float = 0.5, ceiling: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.base, self.ceiling, self.clock = what, base, ceiling, clock
        self.failures = 0
        self.retry_at = 0.0

    def available(self) -> bool:
        return self.failures == 0 or self.clock() >= self.retry_at

    def failed(self, exc: BaseException) -> None:
        if self.failures == 0:
            log.warning("kvpool: %s unreachable (%s); serving without it, retrying with backoff", self.what, exc)
        self.failures += 1
        self.retry_at = self.clock() + min(self.ceiling, self.base * 2 ** (self.failures - 1))

    def succeeded(self) -> None:
        if self.failures:
            log.warning("kvpool: %s reachable again after %d failed attempts", self.what, self.failures)
        self.failures = 0


@dataclass
class Report:
    """Connector measurements not yet sent (exported by the sidecar as ``kvpool_connector_*``)."""

    loaded_tokens: int = 0
    saved_tokens: int = 0
    lookup_seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)  # KV events published, by type (blocks)

    def fail(self, operation: str, n: int = 1) -> None:
        self.failures[operation] = self.failures.get(operation, 0) + n

    def published(self, kind: str, n: int) -> None:
        self.events[kind] = self.events.get(kind, 0) + n

    def empty(self) -> bool:
        return not (self.loaded_tokens or self.saved_tokens or self.lookup_seconds or self.failures or self.events)

    def take(self) -> wire.Report | None:
        """The report to send, or None when empty; resets what it returns."""
        if self.empty():
            return None
        out = wire.Report(self.loaded_tokens, self.saved_tokens, self.lookup_seconds[-4096:], dict(self.failures),
                          dict(self.events))
        self.loaded_tokens = self.saved_tokens = 0
        self.lookup_seconds = []
        self.failures = {}
        self.events = {}
        return out

    def merge(self, sent: Report | wire.Report) -> None:
        """Add another report: one whose round trip failed (sent with the next one), or a worker's."""
        self.loaded_tokens += sent.loaded_tokens
        self.saved_tokens += sent.saved_tokens
        self.lookup_seconds = (sent.lookup_seconds + self.lookup_seconds)[-4096:]
        for op, n in sent.failures.items():
            self.fail(op, n)
        for kind, n in sent.events.items():
            self.published(kind, n)


class Connection:
    """One blocking channel connection (connect, hello, then steps)."""

    def __init__(self, path: str, hello: wire.Hello, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
            self.sock.sendall(wire.frame(hello))
            welcome = self.read()
        except BaseException:
            self.sock.close()
            raise
        if isinstance(welcome, wire.Refused):
            self.sock.close()
            raise Refused(f"the sidecar refused the connection: {welcome.error}: {welcome.detail}")
        if not isinstance(welcome, wire.Welcome):
            self.sock.close()
            raise Refused(f"the sidecar answered hello with {type(welcome).__name__}")
        self.welcome = welcome

    def read(self) -> wire.Message:
        n = wire.frame_length(self._exactly(4))
        return wire.decode(self._exactly(n))

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the sidecar closed the connection")
            buf += chunk
        return bytes(buf)

    def step(self, msg: wire.Step) -> wire.StepReply:
        self.sock.sendall(wire.frame(msg))
        reply = self.read()
        if isinstance(reply, wire.Refused):
            raise Refused(f"{reply.error}: {reply.detail}")
        if not isinstance(reply, wire.StepReply):
            raise wire.WireError(f"expected a reply, got {type(reply).__name__}")
        return reply

    def closed_by_peer(self) -> bool:
        """The sidecar has closed this connection (between round trips it sends nothing, so anything to
        read is its end of the stream): nothing sent on it would be answered."""
        try:
            poll = select.poll()
            poll.register(self.sock, select.POLLIN)
            if not poll.poll(0):
                return False
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return False  # not readable as a socket: the round trip fails and says why

    def close(self) -> None:
        self.sock.close()


def fetch_welcome(path: str, hello: wire.Hello, timeout: float) -> wire.Welcome:
    """Connect, say hello, hang up: the sidecar's storage handle and page size (the worker's need)."""
    try:
        conn = Connection(path, hello, timeout)
    except Refused:
        raise
    except (OSError, wire.WireError) as exc:
        raise SidecarDown(f"{type(exc).__name__}: {exc}") from None
    conn.close()
    return conn.welcome


_Item = tuple[str, Any, "Future | None"]


def _size(item: _Item) -> int:
    """An item's share of a step's bytes (an upper estimate)."""
    return wire.admit_bytes(item[1]) if item[0] == "admit" else 64 + wire.MAX_SEQ_ID


class SidecarLink:
    """Batched, asynchronous ops of one engine session against one sidecar (see the module doc)."""

    def __init__(self, path: str, hello: wire.Hello, *, timeout: float = 2.0, backoff: Backoff | None = None,
                 name: str = "kvpool-link", events: EventLog | None = None,
                 hello_ready: Callable[[SidecarLink], bool] | None = None) -> None:
        self.path = path
        self.hello = hello
        # Asked on the link's thread before it opens a connection: may bring ``hello`` up to date, and says
        # whether it is final. An idle step opens no connection before it is; an op opens one regardless.
        self.hello_ready = hello_ready or (lambda link: True)
        self.events = events  # with hello.events: stores and removals recorded in the order of the replies
        self.timeout = timeout
        self.backoff = backoff or Backoff(f"sidecar {path}")
        self.report = Report()
        self.generation = 0  # connections lost so far; a sequence lives only as long as its connection
        self.round_trips = 0
        self._lock = threading.Lock()  # guards report
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._conn: Connection | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def available(self) -> bool:
        return self.backoff.available()

    def admit(self, op: wire.Admit) -> Future:
        """Answers ``(generation, Admitted)`` or fails with :class:`OpFailed` / :class:`SidecarDown`."""
        future: Future = Future()
        self._put(("admit", op, future), future)
        return future

    def commit(self, seq_id: str, num_tokens: int, generation: int,
               published: Callable[[int], None] | None = None) -> Future:
        """Answers the pages published; dropped (SidecarDown) when its sequence's connection is gone.
        ``published`` is called with that count on the link's thread, in the order of the replies (after
        the removals that came before the step, before those that came during it)."""
        future: Future = Future()
        self._put(("commit", (wire.Commit(seq_id, num_tokens), generation, published), future), future)
        return future

    def grow(self, seq_id: str, num_tokens: int, generation: int) -> Future:
        """Answers the pages the sequence (admitted with ``save_later``) grew by, maybe none; dropped
        (SidecarDown) when its sequence's connection is gone."""
        future: Future = Future()
        self._put(("grow", (wire.Grow(seq_id, num_tokens), generation, None), future), future)
        return future

    def release(self, seq_id: str, generation: int) -> None:
        self._put(("release", (seq_id, generation, None), None), None)

    def release_when_answered(self, admission: Future, seq_id: str, made: bool = False) -> None:
        """The caller no longer waits for ``admission``: release its sequence once it is answered (if it
        made one: ``made``, an admission that always does; a hold-only one that found nothing makes none)."""

        def release_late(f: Future) -> None:
            try:
                gen, result = f.result()
            except Exception:
                return
            if made or result.page_ids:
                self.release(seq_id, gen)

        admission.add_done_callback(release_late)

    def _put(self, item: _Item, future: Future | None) -> None:
        if self._closed:
            if future is not None:
                future.set_exception(SidecarDown("the link is closed"))
            return
        self._queue.put(item)

    def record(self, update: Callable[[Report], None]) -> None:
        """Change the pending report (thread-safe); it travels with the next step."""
        with self._lock:
            update(self.report)

    def close(self, timeout: float = 2.0) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._conn is not None:
            self._conn.close()

    # ----------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=REPORT_EVERY)
            except queue.Empty:
                with self._lock:
                    reporting = not self.report.empty()
                # With KV events, an idle link still steps: removals reach the engine and a lost sidecar is
                # noticed (its pages leave the stream) within a second; it opens no session for that with a
                # hello that is not final yet.
                watching = self.events is not None and (self._conn is not None or self.hello_ready(self))
                if (reporting or watching) and self.backoff.available():
                    self._send([])
                continue
            if item is None:
                return
            next_item: _Item | None = item
            while next_item is not None:
                next_item, stop = self._send_from(next_item)
                if stop:
                    return

    def _send_from(self, item: _Item) -> tuple[_Item | None, bool]:
        """Send ``item`` and what has queued behind it, up to a step's bounds (ops and bytes); returns the
        first item left over for the next step, and whether the link is closing."""
        batch = [item]
        size = _size(item)
        left: _Item | None = None
        stop = False
        while len(batch) < wire.MAX_OPS:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                stop = True
                break
            size += _size(nxt)
            if size > wire.STEP_BYTES:
                left = nxt
                break
            batch.append(nxt)
        self._send(batch)
        return left, stop

    def _connect(self) -> Connection:
        if self._conn is not None and self._conn.closed_by_peer():
            # The sidecar went (and may be back) since the last round trip: its session, and every
            # admission of it, ended with the connection; a new one is made now, nothing failed.
            log.warning("kvpool: the sidecar closed the connection of %s; reconnecting", self.path)
            self._lost()
        if self._conn is None:
            self.hello_ready(self)  # the hello as complete as it can be now (an op does not wait for more)
            self._conn = Connection(self.path, self.hello, self.timeout)
        return self._conn

    def _send(self, batch: list[_Item]) -> None:
        if not self.backoff.available():
            for _, _, f in batch:
                if f is not None:
                    f.set_exception(SidecarDown("backing off after a failed round trip"))
            return
        try:
            conn = self._connect()
        except Refused as exc:
            self._failed(exc, batch, None)
            return
        except (OSError, wire.WireError) as exc:
            self._failed(SidecarDown(f"{type(exc).__name__}: {exc}"), batch, None)
            return
        gen = self.generation
        step = wire.Step()
        sent: list[tuple[str, Future | None, Callable[[int], None] | None]] = []
        for kind, op, f in batch:
            then = None
            if kind == "admit":
                step.admits.append(op)
            else:
                payload, op_gen, then = op
                if op_gen != gen:  # its sequence went with an older connection: nothing to do
                    if f is not None:
                        f.set_exception(SidecarDown("the sequence's session ended"))
                    continue
                if kind == "commit":
                    step.commits.append(payload)
                elif kind == "grow":
                    step.grows.append(payload)
                else:
                    step.releases.append(payload)
            sent.append((kind, f, then))
        with self._lock:
            step.report = self.report.take()
        if not (step.admits or step.commits or step.releases or step.grows or step.report
                or self.events is not None):
            return
        start = time.perf_counter()
        try:
            reply = conn.step(step)
        except (OSError, wire.WireError, Refused) as exc:
            self._lost()
            self._failed(SidecarDown(f"{type(exc).__name__}: {exc}"), batch, step.report)
            return
        elapsed = time.perf_counter() - start
        self.round_trips += 1
        self.backoff.succeeded()
        if step.admits:
            with self._lock:
                self.report.lookup_seconds.extend([elapsed] * len(step.admits))
        self._deliver(reply, sent, gen)

    def _lost(self) -> None:
        """The connection is gone: every admission of it is dead from here on (callers see it at their
        next plan)."""
        assert self._conn is not None
        self.generation += 1
        self._conn.close()
        self._conn = None
        if self.events is not None:  # what this engine announced is out of reach (maybe gone)
            self.events.forget_all()

    def _deliver(self, reply: wire.StepReply, sent: list[tuple[str, Future | None, Callable[[int], None] | None]],
                 gen: int) -> None:
        """Answer each op's future from the reply; record the KV events in the order the pool saw them."""
        events = self.events
        if events is not None:
            events.removed(reply.removed_before)
        results = {"admit": iter(reply.admits), "commit": iter(reply.commits), "release": iter(reply.releases),
                   "grow": iter(reply.grows)}
        for kind, f, then in sent:
            result = next(results[kind], None)
            if then is not None and isinstance(result, int):
                then(result)
            if f is None:
                continue
            if isinstance(result, wire.Failed):
                f.set_exception(OpFailed(result.error, result.detail, result.field))
            elif kind == "admit":
                f.set_result((gen, result))
            else:
                f.set_result(result)
        if events is not None:
            events.removed(reply.removed_after)
            if reply.removals_lost:
                events.forget_all()

    def _failed(self, exc: Exception, batch: list[_Item], report: wire.Report | None) -> None:
        self.backoff.failed(exc)
        if report is not None:
            with self._lock:
                self.report.merge(report)
        error = exc if isinstance(exc, SidecarDown) else SidecarDown(str(exc))
        for _, _, f in batch:
            if f is not None and not f.done():  # an op of an older connection was answered already
                f.set_exception(error)
