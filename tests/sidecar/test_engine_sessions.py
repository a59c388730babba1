"""Several writers on one sidecar's engine channel (issue 51): a failed link invalidates at once and its
pages stay out of circulation, sequences belong to the connection that admitted them, every bound is
per operation, and nothing is decoded or held for a peer before it is authenticated."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from kvpool_sidecar import wire
from kvpool_sidecar.engines.link import OpFailed, Refused, SidecarLink, fetch_welcome
from kvpool_sidecar.engines.scheduler import SchedulerSide
from kvpool_sidecar.service.credentials import Credentials
from kvpool_sidecar.storage import KVStorage
from support import LongSteps, free_port, live_sidecar, socket_path
from test_engine_connector import CONFIG, PS, SHAPE, done, hashes, hello, save_whole, settle, wait_for

ENGINE, ADMIN = "e" * 24, "a" * 24
CREDS = Credentials.parse(f"engine {ENGINE}\nadmin {ADMIN}")


def until(check, what: str, timeout: float = 10.0) -> None:
    """Wait on a condition (never on a wall-time figure); fail naming it."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def sample(sidecar, name: str, labels: dict | None = None) -> float:
    return sidecar.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def channel(pages: int = 16, quarantine: float = 0.0, **kw):
    path = socket_path()
    storage = KVStorage(SHAPE, PS, pages=pages, shared=True)
    return path, live_sidecar(CONFIG, pages=pages, storage=storage, engine_socket=path, token=CREDS,
                              engine_quarantine=quarantine, **kw)


def engine(path: str, session: str, token: str = ENGINE) -> SchedulerSide:
    return LongSteps(SidecarLink(path, hello(session=session, token=token)), PS, session=session,
                         lookup_wait=1.0)


def test_a_failed_link_invalidates_at_once_and_its_pages_reach_no_other_writer():
    path, live = channel(pages=15, quarantine=60)
    with live as (_, sidecar):
        a, b = engine(path, "a"), engine(path, "b")
        # A: a 13-token prompt (3 full pages) in chunked prefill: step 1 saves 2 pages, step 2 would save 1.
        wait_for(a, "r", hashes(3, "a"), 13, 0, None)
        a.allocated("r", [1, 2, 3, 4], 0)
        step1 = a.plan([("r", [1, 2, 3, 4], True, 0, 8)])
        a_pages = set(sidecar.pool.sequences.live[a._requests["r"].seq_id].pages)
        assert [s.blocks for s in step1.saves] == [[1, 2]]
        # A's link fails a round trip (a protocol error, a stalled sidecar past timeout_s: the sidecar
        # and the engine each drop the connection). A socket merely shut down would read as one the
        # sidecar closed, which the link replaces before sending anything on it (issue 65).
        a.link._conn.sock.close()
        with pytest.raises(ConnectionError):
            a.link.admit(wire.Admit("probe", hashes(1, "z"), PS)).result(5)
        # At once, before any reconnect: nothing more is planned into the dead session's pages ...
        step2 = a.plan([("r", None, False, 8, 5)])
        assert step2.saves == []
        # ... and its step-1 save, reported late, is never committed.
        a.worker_done(done(step1.step))
        until(lambda: sample(sidecar, "kvpool_engine_lapsed_sequences_total") == 1, "A's sequence lapsed")
        assert sample(sidecar, "kvpool_engine_quarantined_pages") == len(a_pages)
        # B fills the pool meanwhile: none of the pages A's worker may still write is handed to B.
        b_pages: set[int] = set()
        for i in range(8):  # the pool turned over
            wait_for(b, f"q{i}", hashes(3, f"b{i}"), 13, 0, None)
            b.allocated(f"q{i}", [10, 11, 12, 13], 0)
            step = b.plan([(f"q{i}", [10, 11, 12, 13], True, 0, 13)])
            b_pages |= set(sidecar.pool.sequences.live[b._requests[f"q{i}"].seq_id].pages)
            b.worker_done(done(step.step))
            b.finished(f"q{i}")
            b.sent({f"q{i}"})
        assert len(b_pages) >= 6 and not b_pages & a_pages  # B never got a page A's worker may still write
        until(lambda: sidecar.pool.stats().sequences == 1, "B's requests committed and released")
        assert sidecar.pool.stats().cached_pages == len(b_pages)  # published
        assert sidecar.pool.stats().in_use_pages == len(a_pages)  # A's, still out of circulation
        sidecar.pool.check_invariants()
        a.link.close()
        b.link.close()


def test_quarantined_pages_return_once_the_quarantine_ends():
    path, live = channel(pages=16, quarantine=0.3)
    with live as (_, sidecar):
        a = engine(path, "a")
        wait_for(a, "r", hashes(3), 13, 0, None)
        a.allocated("r", [1, 2, 3, 4], 0)
        a.plan([("r", [1, 2, 3, 4], True, 0, 13)])  # its save's pages taken, not yet written
        a.link._conn.sock.close()  # the engine died
        until(lambda: sample(sidecar, "kvpool_engine_quarantined_pages") == 3, "A's pages quarantined")
        assert sidecar.pool.stats().sequences == 1
        until(lambda: sidecar.pool.stats().sequences == 0, "the quarantine ends")
        assert sample(sidecar, "kvpool_engine_quarantined_pages") == 0
        assert sidecar.pool.stats().free_pages == 16
        sidecar.pool.check_invariants()
        a.link.close()


def test_a_sequence_belongs_to_the_connection_that_admitted_it():
    path, live = channel(pages=32)
    with live as (url, sidecar):
        a, b = engine(path, "a"), engine(path, "b")
        wait_for(a, "r", hashes(3, "a"), 13, 0, None)
        seq = a._requests["r"].seq_id
        # Another session with the same engine token names A's sequence: each op fails alone.
        with pytest.raises(OpFailed, match="unknown_sequence"):
            b.link.commit(seq, 12, b.link.generation).result(5)
        b.link.release(seq, b.link.generation)
        until(lambda: b.link.round_trips >= 2, "B's release reached the sidecar")
        assert seq in sidecar.pool.sequences.live
        # HTTP callers, admin included, cannot commit, release or fork it.
        for token, status in ((ADMIN, 404), (ENGINE, 404)):
            auth = {"authorization": f"Bearer {token}"}
            assert httpx.post(f"{url}/v1/sequences/{seq}/commit", json={"num_computed_tokens": 12},
                              headers=auth).status_code == status
            assert httpx.post(f"{url}/v1/sequences/{seq}/fork", json={"new_seq_id": "mine"},
                              headers=auth).status_code == status
            assert httpx.delete(f"{url}/v1/sequences/{seq}", headers=auth).status_code == status
        assert seq in sidecar.pool.sequences.live and sidecar.pool.stats().cached_pages == 0
        # A is unaffected: its save commits and is found.
        a.allocated("r", [1, 2, 3, 4], 0)
        a.worker_done(done(a.plan([("r", [1, 2, 3, 4], True, 0, 13)]).step))
        a.finished("r")
        a.sent({"r"})
        until(lambda: sidecar.pool.stats().sequences == 0, "A's commit and release applied")
        assert wait_for(b, "again", hashes(3, "a"), 13, 0, None) == 3 * PS
        a.link.close()
        b.link.close()


def test_a_sidecar_restarted_while_the_link_was_idle_admits_the_next_lookups_at_once():
    """Issue 65: the sidecar went and came back on its socket while the engine was idle, the link still
    holding the old connection. The next lookups (a batch's, all in one step) are each admitted by the
    new sidecar: the closed connection is replaced before anything is sent on it, with no failed round
    trip and no backoff (a lookup failed, or skipped while backing off, serves its request without the
    pool and never saves it)."""
    path = socket_path()
    first, second = (KVStorage(SHAPE, PS, pages=16, shared=True) for _ in range(2))
    with live_sidecar(CONFIG, pages=16, storage=first, engine_socket=path, token=CREDS):
        side = engine(path, "a")
        wait_for(side, "r", hashes(2, "r"), 9, 0, None)
        assert side._requests["r"].epoch == first.epoch
        side.finished("r")
        settle(side.link, None, lambda _: not side.link._queue.qsize())
    with live_sidecar(CONFIG, pages=16, storage=second, engine_socket=path, token=CREDS) as (_, sidecar):
        for i in range(4):
            wait_for(side, f"b{i}", hashes(2, f"b{i}"), 9, 0, None)
            assert side._requests[f"b{i}"].epoch == second.epoch, f"lookup {i} was not admitted"
        assert side.link.generation == 1 and side.link.backoff.failures == 0
        assert sidecar.pool.stats().sequences == 4
        side.link.close()
    first.close()
    second.close()


def test_a_hello_cannot_take_over_a_connected_session_but_may_once_it_is_gone():
    path, live = channel()
    with live as (_, sidecar):
        a = engine(path, "same")
        wait_for(a, "r", hashes(3), 13, 0, None)
        with pytest.raises(Refused, match="session_in_use"):
            fetch_welcome(path, hello(session="same", token=ENGINE), 5)
        assert sidecar.pool.stats().sequences == 1 and sample(sidecar, "kvpool_engine_sessions") == 1
        a.link.close()
        until(lambda: sample(sidecar, "kvpool_engine_sessions") == 0, "A's connection ended")
        again = engine(path, "same")
        assert wait_for(again, "r", hashes(3, "n"), 13, 0, None) == 0
        assert sample(sidecar, "kvpool_engine_sessions") == 1
        again.link.close()


def test_a_prompt_longer_than_one_admission_admits_its_first_blocks_and_costs_no_other_request():
    pages = wire.MAX_BLOCKS * 3 // 2  # the to-C partition (70 %) holds MAX_BLOCKS and more
    path, live = channel(pages=pages)
    with live as (_, sidecar):
        side = engine(path, "a")
        link = side.link
        # An earlier request's save is in flight and another's hit is held.
        wait_for(side, "old", hashes(3, "o"), 13, 0, None)
        side.allocated("old", [1, 2, 3, 4], 0)
        side.worker_done(done(side.plan([("old", [1, 2, 3, 4], True, 0, 13)]).step))
        side.finished("old")
        side.sent({"old"})
        assert wait_for(side, "hit", hashes(3, "o"), 13, 0, None) == 3 * PS
        wait_for(side, "saving", hashes(2, "s"), 9, 0, None)
        side.allocated("saving", [5, 6, 7], 0)
        saving = side.plan([("saving", [5, 6, 7], True, 0, 9)])
        # 40,000 blocks: its first MAX_BLOCKS go through the tier.
        long = hashes(40_000, "L")
        assert wait_for(side, "long", long, 40_000 * PS + 1, 0, None) == 0
        assert side._requests["long"].num_pages == wire.MAX_BLOCKS
        assert len(sidecar.pool.sequences.live[side._requests["long"].seq_id].keys) == wire.MAX_BLOCKS
        # The other requests keep their saves and hits, on the same connection.
        side.worker_done(done(saving.step))
        side.finished("saving")
        side.sent({"saving"})
        assert wait_for(side, "saved", hashes(2, "s"), 9, 0, None) == 2 * PS
        assert link.generation == 0 and link.backoff.failures == 0
        # An admission over the bound sent as it is fails alone.
        with pytest.raises(OpFailed, match="too_large.*field hashes"):
            link.admit(wire.Admit("raw", long, len(long) * PS)).result(10)
        assert link.admit(wire.Admit("fine", hashes(1, "f"), PS)).result(5)[0] == 0
        assert link.generation == 0
        for req in ("hit", "long", "saved"):
            side.finished(req)
        link.close()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


def _refusal(s: socket.socket) -> wire.Message | None:
    """The sidecar's answer and that it hung up (None: it hung up without one)."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return wire.decode(data[4:]) if data else None


def test_unauthenticated_peers_are_refused_before_they_cost_memory(tmp_path):
    """A sidecar process: a 16 MiB first frame, a 1 MB sequence id, silent connections."""
    path = socket_path()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"engine {ENGINE}\n")
    serve = [str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", "--port", str(free_port()),
             "--pages", "64", "--kv-shape", "2,1,8,float32", "--engine-socket", path, "--token-file", str(tokens),
             "--log-level", "warning"]
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        until(lambda: os.path.exists(path) or proc.poll() is not None, "the sidecar's socket", 60)
        good = engine(path, "good")
        assert wait_for(good, "r0", hashes(2, "g0"), 9, 0, None) == 0
        before = _rss(proc.pid)
        # A first frame of 16 MiB: refused on its length, unread.
        with _connect(path) as s:
            s.sendall((16 << 20).to_bytes(4, "big"))
            answer = _refusal(s)
            assert isinstance(answer, wire.Refused) and "limit is 16384" in answer.detail
        # A first frame that is a step, not a hello: not decoded as one.
        with _connect(path) as s:
            s.sendall(wire.frame(wire.Step(admits=[wire.Admit("x", [b"h"], 4)])))
            assert isinstance(_refusal(s), wire.Refused)
        # Silent connections: 64 wait for their hello (then time out); more are closed unread.
        silent = [_connect(path) for _ in range(80)]
        closed = 0
        for s in silent[64:]:
            s.settimeout(10)
            closed += s.recv(1) == b""
        assert closed == 16
        # A 1 MB sequence id from an authenticated engine: that op fails, the session lives on.
        with pytest.raises(OpFailed, match="seq_id must be 1-128 characters"):
            good.link.admit(wire.Admit("x" * (1 << 20), hashes(1, "big"), PS)).result(10)
        assert wait_for(good, "r1", hashes(2, "g0"), 9, 0, None) == 0 and good.link.generation == 0
        for s in silent[:64]:  # the handshake timeout closes them
            s.settimeout(15)
            assert s.recv(1) == b""
            s.close()
        assert wait_for(good, "r2", hashes(2, "g2"), 9, 0, None) == 0 and good.link.generation == 0
        assert _rss(proc.pid) - before < 64 << 20
        good.link.close()
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_without_tokens_the_channel_serves_only_the_sidecars_own_user():
    path = socket_path()
    os.chmod(os.path.dirname(path), 0o777)
    with live_sidecar(CONFIG, pages=8, engine_socket=path):
        os.chmod(path, 0o666)  # even a socket anyone can reach
        assert fetch_welcome(path, hello(), 5).page_size == PS
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # another user's process: a raw hello, the answer back through the pipe
            try:
                os.setgid(65534)
                os.setuid(65534)
                with _connect(path) as s:
                    s.sendall(wire.frame(hello()))
                    os.write(write, s.recv(65536))
            finally:
                os._exit(0)
        os.close(write)
        answer = os.read(read, 65536)
        os.waitpid(child, 0)
        refused = wire.decode(answer[4:])
        assert isinstance(refused, wire.Refused) and "serves only its own user" in refused.detail


def test_a_socket_directory_another_user_owns_is_refused(tmp_path):
    from kvpool_sidecar.service.channel import check_socket_dir

    theirs = tmp_path / "kvpool"
    theirs.mkdir()
    if os.getuid() != 0:
        pytest.skip("needs root to give the directory away")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(OSError, match="belongs to uid 65534"):
        check_socket_dir(theirs / "engine.sock")
    mine = tmp_path / "fresh" / "engine.sock"
    check_socket_dir(mine)
    assert (mine.parent.stat().st_mode & 0o777) & ~0o770 == 0  # owner and group only


def test_a_hold_only_admission_holds_the_cached_prefix_and_allocates_nothing():
    """vLLM's tiering asks before it stores: a hold-only admission (KVPoolTier's lookup) holds the leading
    cached pages for its sequence, allocates no page for the rest and so evicts nothing, and makes no
    sequence at all when nothing is cached."""
    path, live = channel(pages=8)
    with live as (_, sidecar):
        side = engine(path, "s")
        for i in range(2):  # 8 cached pages: a full pool
            save_whole(side, f"p{i}", hashes(4, f"p{i}"), 17, [1, 2, 3, 4, 5])
        until(lambda: sidecar.pool.stats().cached_pages == 8, "the pool never filled")
        link = side.link
        held = link.admit(wire.Admit("look", hashes(4, "p0")[:3] + hashes(2, "new"), 5 * PS, None, hold_only=True))
        _, got = held.result(5)
        assert got.cached_tokens == 3 * PS and len(got.page_ids) == 3
        stats = sidecar.pool.stats()
        assert stats.sequences == 1 and stats.in_use_pages == 3 and stats.cached_pages == 5  # nothing evicted
        _, none = link.admit(wire.Admit("miss", hashes(3, "other"), 3 * PS, None, hold_only=True)).result(5)
        assert none.page_ids == [] and none.cached_tokens == 0 and sidecar.pool.stats().sequences == 1
        # The held pages cannot be evicted: a store wanting every page gets only others.
        _, store = link.admit(wire.Admit("store", hashes(8, "flood"), 8 * PS, None)).result(5)
        assert store.page_ids and not set(store.page_ids) & set(got.page_ids)
        # The connector's admission: its prefix held, a sequence made even with no hit, its pages grown
        # when saved; a pool with no page to give grows it by none (the save is skipped), never fails.
        _, later = link.admit(wire.Admit("later", hashes(2, "l"), 2 * PS, None, save_later=True)).result(5)
        assert later.page_ids == [] and "later" in sidecar.pool.sequences.live
        assert link.grow("later", 2 * PS, link.generation).result(5).page_ids == []  # all 8 pages in use
        with pytest.raises(OpFailed, match="unknown_sequence"):
            link.grow("nobody", PS, link.generation).result(5)
        with pytest.raises(OpFailed, match="field save_later"):
            link.admit(wire.Admit("both", hashes(1), PS, None, hold_only=True, save_later=True)).result(5)
        link.close()
