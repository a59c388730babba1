"""An engine's connection to its sidecar: one keep-alive HTTP connection, ops batched, faults absorbed.

The scheduler must never wait on the sidecar for more than about a millisecond, and must keep serving
when the sidecar is gone. :class:`SidecarLink` owns one thread and one ``httpx`` connection: callers
:meth:`~SidecarLink.submit` an op and get a :class:`~concurrent.futures.Future`; the thread sends
whatever has queued up as one ``POST /v1/batch`` (so ten lookups arriving together cost one round
trip). A transport failure marks the link down for a backoff that doubles up to a ceiling; while down
:meth:`~SidecarLink.available` is False (callers skip the sidecar), and once the backoff has passed
the next op is the probe. One warning when it goes down, one when it is back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool_sidecar.client import SidecarClient, SidecarError

log = logging.getLogger("kvpool.engine")
MAX_BATCH = 4096  # the API's limit on ops per batch
MAX_LEFTOVER_RELEASES = 65_536  # sequences a failed round trip may have left admitted, to release later
REPORT_EVERY = 1.0  # seconds idle after which a pending report is sent on its own


class SidecarDown(ConnectionError):
    """The sidecar could not be reached (or the link is backing off)."""


class OpFailed(RuntimeError):
    """The sidecar refused one op: ``error`` is its error name, ``field`` the field at fault."""

    def __init__(self, error: str, detail: str, field: str = "") -> None:
        super().__init__(f"{error}: {detail}" + (f" (field {field})" if field else ""))
        self.error, self.detail, self.field = error, detail, field


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
    """Connector measurements not yet sent (the API's ``EngineReport``)."""

    loaded_tokens: int = 0
    saved_tokens: int = 0
    lookup_seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, operation: str, n: int = 1) -> None:
        self.failures[operation] = self.failures.get(operation, 0) + n

    def empty(self) -> bool:
        return not (self.loaded_tokens or self.saved_tokens or self.lookup_seconds or self.failures)

    def take(self) -> dict[str, Any] | None:
        """The report as JSON, or None when empty; resets what it returns."""
        if self.empty():
            return None
        out = {"loaded_tokens": self.loaded_tokens, "saved_tokens": self.saved_tokens,
               "lookup_seconds": self.lookup_seconds[-4096:], "failures": dict(self.failures)}
        self.loaded_tokens = self.saved_tokens = 0
        self.lookup_seconds = []
        self.failures = {}
        return out

    def merge(self, sent: dict[str, Any]) -> None:
        """Put back a report whose round trip failed (it is sent with the next one)."""
        self.loaded_tokens += sent["loaded_tokens"]
        self.saved_tokens += sent["saved_tokens"]
        self.lookup_seconds = (sent["lookup_seconds"] + self.lookup_seconds)[-4096:]
        for op, n in sent["failures"].items():
            self.fail(op, n)


def send_batch(client: SidecarClient, ops: list[dict[str, Any]], report: dict[str, Any] | None) -> list[Any]:
    """One ``/v1/batch`` round trip: each op's result dict, or an :class:`OpFailed` in its place."""
    try:
        results = client.batch(ops, report)
    except SidecarError as exc:
        if exc.status >= 500 or exc.status == 401:
            raise SidecarDown(str(exc)) from None
        raise
    except (httpx.HTTPError, OSError, ValueError) as exc:  # ValueError: a body that is not JSON
        raise SidecarDown(f"{type(exc).__name__}: {exc}") from None
    return [r["result"] if r["ok"] else OpFailed(r["error"]["error"], r["error"]["detail"], r["error"]["field"])
            for r in results]


class SidecarLink:
    """Batched, asynchronous ops against one sidecar (see the module doc)."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 2.0,
                 backoff: Backoff | None = None, name: str = "kvpool-link") -> None:
        self._client = SidecarClient(url, token=token, timeout=timeout)
        self.backoff = backoff or Backoff(f"sidecar {url}")
        self.report = Report()
        self._lock = threading.Lock()  # guards report and the leftover releases
        self._queue: queue.SimpleQueue[tuple[dict[str, Any], Future] | None] = queue.SimpleQueue()
        self._leftover: list[str] = []
        self.round_trips = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def available(self) -> bool:
        return self.backoff.available()

    def submit(self, op: dict[str, Any]) -> Future:
        future: Future = Future()
        if self._closed:
            future.set_exception(SidecarDown("the link is closed"))
        else:
            self._queue.put((op, future))
        return future

    def record(self, update: Callable[[Report], None]) -> None:
        """Change the pending report (thread-safe); it travels with the next batch."""
        with self._lock:
            update(self.report)

    def close(self, timeout: float = 2.0) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        self._client.close()

    # ----------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=REPORT_EVERY)
            except queue.Empty:
                # Idle: a pending report goes on its own (nothing else would carry it).
                with self._lock:
                    due = not self.report.empty() or bool(self._leftover)
                if due and self.backoff.available():
                    self._send([], [])
                continue
            if item is None:
                return
            batch = [item]
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            self._send([op for op, _ in batch], [f for _, f in batch])

    def _send(self, ops: list[dict[str, Any]], futures: list[Future]) -> None:
        if not self.backoff.available():
            self._keep_releases(ops)
            for f in futures:
                f.set_exception(SidecarDown("backing off after a failed round trip"))
            return
        with self._lock:
            leftover, self._leftover = self._leftover[:MAX_BATCH - len(ops)], self._leftover[MAX_BATCH - len(ops):]
            report = self.report.take()
        cleanup = [{"op": "release", "seq_id": s} for s in leftover]
        start = time.perf_counter()
        try:
            try:
                results = send_batch(self._client, cleanup + ops, report) if cleanup or ops or report else []
            except SidecarError:
                if not cleanup + ops:
                    raise
                # The batch as a whole was refused (one op's body is invalid): send each op on its own,
                # so that only the bad one fails (its error names the field).
                results = [self._one(op, report if i == 0 else None) for i, op in enumerate(cleanup + ops)]
        except Exception as exc:
            self.backoff.failed(exc)
            with self._lock:
                self._leftover = leftover + self._leftover
                if report is not None:
                    self.report.merge(report)
            # An admission may have been applied before the answer was lost: release it later.
            self._keep_releases(ops, admits_too=True)
            error = exc if isinstance(exc, SidecarDown) else SidecarDown(str(exc))
            for f in futures:
                f.set_exception(error)
            return
        elapsed = time.perf_counter() - start
        self.round_trips += 1
        self.backoff.succeeded()
        admits = sum(op["op"] == "admit" for op in ops)
        if admits:
            with self._lock:
                self.report.lookup_seconds.extend([elapsed] * admits)
        for f, result in zip(futures, results[len(cleanup):], strict=True):
            if isinstance(result, OpFailed):
                f.set_exception(result)
            else:
                f.set_result(result)

    def _one(self, op: dict[str, Any], report: dict[str, Any] | None) -> Any:
        try:
            return send_batch(self._client, [op], report)[0]
        except SidecarError as exc:
            return OpFailed(exc.error, exc.detail, exc.field.removeprefix("ops.0."))

    def _keep_releases(self, ops: list[dict[str, Any]], admits_too: bool = False) -> None:
        kinds = ("release", "admit") if admits_too else ("release",)
        seqs = [op["seq_id"] for op in ops if op["op"] in kinds]
        with self._lock:
            self._leftover = (self._leftover + seqs)[-MAX_LEFTOVER_RELEASES:]
