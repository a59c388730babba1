"""No write of an ended session lands in a page handed on, however long its writer stalls between its
check and its write; a restart takes over its predecessor's segment only once that pool's writers are
done; a changed layout or protocol is refused by name; an abandoned hello leaves nothing (issue 65).
Real sidecars on their engine channel, the connector's two halves without an engine."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

import pytest
import torch
from kvpool_sidecar import wire
from kvpool_sidecar.engines.blocks import engine_layers
from kvpool_sidecar.engines.link import Refused, SidecarLink, fetch_welcome
from kvpool_sidecar.engines.scheduler import LoadJob, SchedulerSide, StepDone, StepPlan
from kvpool_sidecar.engines.worker import WorkerSide
from kvpool_sidecar.storage import KVStorage, StaleHandle
from kvpool_sidecar.storage import tensors as tensors_module
from kvpool_sidecar.storage.segment import release_instance
from kvpool_sidecar.storage.tensors import HEADER, LayoutMismatch, WritersStillActive
from support import LongSteps, live_sidecar, socket_path
from test_engine_connector import CONFIG, PS, SHAPE, engine_kv, hashes, hello, settle, wait_for, welcome_of
from test_engine_sessions import until


class Stall:
    """Holds the first write made inside a slice (after the writer's lock and check) until opened."""

    def __init__(self, move) -> None:
        self.move, self.started, self.gate, self.calls = move, threading.Event(), threading.Event(), 0

    def __call__(self, *args) -> None:
        self.calls += 1
        if self.calls == 1:
            self.started.set()
            assert self.gate.wait(30), "the test never let the stalled writer go"
        self.move(*args)


def stalled_worker(path: str, kv: dict[str, torch.Tensor]) -> tuple[WorkerSide, Stall]:
    worker = WorkerSide(welcome_of(path), engine_layers(kv, next(iter(kv.values())).shape[0]), PS)
    worker.attach(strict=True)
    worker.copier._move = stall = Stall(worker.copier._move)  # type: ignore[method-assign]
    return worker, stall


def mapped_worker(path: str) -> WorkerSide:
    """An engine's worker (6 blocks of random KV) mapping the pool of the sidecar at ``path``."""
    worker = WorkerSide(welcome_of(path), engine_layers(engine_kv(6, "cpu"), 6), PS)
    worker.attach(strict=True)
    return worker


def save_and_commit(side: SchedulerSide, worker: WorkerSide, req: str, tag: str) -> list[int]:
    """One 3-page prompt saved by ``worker`` and committed; returns its pages."""
    wait_for(side, req, hashes(3, tag), 13, 0, None)
    if side._requests[req].epoch is None:
        return []
    side.allocated(req, [1, 2, 3, 4], 0)
    plan = side.plan([(req, [1, 2, 3, 4], True, 0, 13)])
    pages = [p for job in plan.saves for p in job.pages]
    worker.save(plan)
    worker.copies.submit(lambda: None).result()
    side.worker_done(worker.take_done() or StepDone())
    side.finished(req)
    return pages


def test_a_save_stalled_between_its_check_and_its_write_never_lands_in_a_page_another_session_committed():
    """Engine A's save passed its check and stalls before its write (descheduled, swapped, stopped); its
    link fails and its quarantine ends. Its pages stay out of circulation while the writer holds its slot;
    engine B is served other pages. When A's write lands, it lands in A's own pages; A's next layer is
    refused; only then do A's pages go to B, whose committed bytes are B's."""
    storage = KVStorage(SHAPE, PS, pages=6, shared=True)
    path = socket_path()
    with live_sidecar(CONFIG, pages=6, storage=storage, engine_socket=path, engine_quarantine=0.2) as (_, sidecar):
        worker_a, stall = stalled_worker(path, {n: torch.full_like(t, 1.0) for n, t in engine_kv(6, "cpu").items()})
        a = LongSteps(SidecarLink(path, hello(session="a")), PS, session="a", lookup_wait=1.0)
        wait_for(a, "r", hashes(3, "a"), 13, 0, None)
        a.allocated("r", [1, 2, 3, 4], 0)
        plan = a.plan([("r", [1, 2, 3, 4], True, 0, 13)])
        a_pages = set(plan.saves[0].pages)
        worker_a.save(plan)
        assert stall.started.wait(5)  # layer 0: locked, checked, not yet written
        a.link._conn.sock.close()  # A's link fails: the fence is cleared, the quarantine runs out
        until(lambda: sidecar.metrics.registry.get_sample_value("kvpool_engine_lapsed_sequences_total") == 1,
              "A's session lapsed")
        time.sleep(0.6)  # three quarantines
        assert sidecar.pool.stats().sequences == 1, "A's pages were released while its writer could still write"

        worker_b = WorkerSide(welcome_of(path), engine_layers(
            {n: torch.full_like(t, 2.0) for n, t in engine_kv(6, "cpu").items()}, 6), PS)
        worker_b.attach(strict=True)
        b = LongSteps(SidecarLink(path, hello(session="b")), PS, session="b", lookup_wait=1.0)
        b_pages = save_and_commit(b, worker_b, "q0", "b0")
        assert b_pages and not set(b_pages) & a_pages  # the free pages only

        stall.gate.set()  # A's stalled layer lands (in A's pages), its next layer is refused
        worker_a.copies.submit(lambda: None).result()
        report = worker_a.take_done()
        assert report is not None and report.failed_saves == {(plan.step, "r")}
        until(lambda: sidecar.pool.stats().sequences == 0, "A's pages released once its writer let go")
        settle(b.link, sidecar)
        b_pages += save_and_commit(b, worker_b, "q1", "b1")
        assert set(b_pages) & a_pages, "B is handed A's former pages once A's writer is done"
        settle(b.link, sidecar, lambda sc: sc.pool.stats().sequences == 0)
        for page in b_pages:
            assert bool((storage.kv[page] == 2.0).all()), f"page {page}: a dead session's write landed in B's page"
        for link in (a.link, b.link):
            link.close()
        worker_a.close()
        worker_b.close()
    storage.close()


def _stalled_write(attached, fence, started: threading.Event, gate: threading.Event, page: int) -> threading.Thread:
    def write() -> None:
        with attached.writing(fence):
            started.set()
            gate.wait(30)
            attached.kv[page].fill_(7.0)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_a_takeover_waits_for_the_old_pools_writers_and_refuses_to_start_past_its_bound():
    """A sidecar restarted beside an engine whose writer is mid-slice in the old pool (its check passed
    before the restart): the new pool stamps its epoch at once (every later slice of the old session is
    refused), then waits for the slice; past its bound it refuses to start, naming why, and leaves the
    segment for the next try; once the writer is done the restart takes the segment over."""
    instance = f"test-{secrets.token_hex(4)}"
    old = KVStorage(SHAPE, PS, pages=4, shared=True, instance=instance)
    try:
        fence = old.open_fence()
        engine = KVStorage.attach(old.handle())
        other = KVStorage.attach(old.handle())  # another mapping of the session (a second worker)
        started, gate = threading.Event(), threading.Event()
        writer = _stalled_write(engine, fence, started, gate, page=2)
        assert started.wait(5)
        old.close()  # a graceful exit: the segment stays for the successor (stamped dead)
        with pytest.raises(WritersStillActive, match="still in the middle of a copy"):
            KVStorage(SHAPE, PS, pages=4, shared=True, instance=instance, takeover_wait=0.2)
        with pytest.raises(StaleHandle):  # the refused restart stamped a new epoch: later slices refuse,
            with other.writing(fence):  # while the stalled one is still in its slice
                pass
        other.close()
        gate.set()
        writer.join(5)
        new = KVStorage(SHAPE, PS, pages=4, shared=True, instance=instance, takeover_wait=5)
        assert new._shm is not None and new._shm.name.startswith(f"kvpool-{instance}-")
        with pytest.raises(StaleHandle):
            with engine.writing(fence):
                pass
        new.close()
        engine.close()
    finally:
        release_instance(instance)


def test_a_writer_stalled_when_its_process_dies_lets_the_takeover_go_on():
    """The lock is the kernel's: a writer process killed mid-slice (SIGKILL, OOM) holds nothing."""
    instance = f"test-{secrets.token_hex(4)}"
    old = KVStorage(SHAPE, PS, pages=4, shared=True, instance=instance)
    try:
        fence = old.open_fence()
        handle = old.handle()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the engine: maps the pool, starts a slice and never finishes it
            try:
                engine = KVStorage.attach(handle)
                with engine.writing(fence):
                    os.write(write, b"x")
                    time.sleep(60)
            finally:
                os._exit(0)
        assert os.read(read, 1) == b"x"
        assert old.writers_on(fence[0])
        old.close()
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        new = KVStorage(SHAPE, PS, pages=4, shared=True, instance=instance, takeover_wait=5)
        assert not new.writers_on(fence[0])
        new.close()
    finally:
        release_instance(instance)


def test_an_engine_speaking_the_previous_protocol_is_refused_at_hello_naming_both_versions():
    path = socket_path()
    storage = KVStorage(SHAPE, PS, pages=4, shared=True)
    with live_sidecar(CONFIG, pages=4, storage=storage, engine_socket=path):
        old = wire.Hello(wire.PROTOCOL - 1, "scheduler", "old", "m")
        with pytest.raises(Refused, match=f"protocol {wire.PROTOCOL - 1}: this sidecar speaks {wire.PROTOCOL}"):
            fetch_welcome(path, old, 2)
        assert fetch_welcome(path, hello(role="worker"), 2).storage is not None  # a current one is served
    storage.close()


def test_a_handle_or_a_segment_of_another_layout_is_refused_naming_both():
    storage = KVStorage(SHAPE, PS, pages=4, shared=True)
    try:
        handle = storage.handle()
        layout = tensors_module.LAYOUT
        with pytest.raises(LayoutMismatch, match=f"layout 1, this engine's kvpool reads layout {layout}"):
            KVStorage.attach({**handle, "layout": 1})
        attached = KVStorage.attach(handle)
        HEADER.pack_into(storage._shm.buf, 0, tensors_module.MAGIC_BASE + 1, storage.epoch)  # a layout-1 pool
        with pytest.raises(LayoutMismatch, match="segment has layout 1"):
            attached.check()
        attached.close()
    finally:
        storage.close()


def test_an_abandoned_hello_leaves_no_session_and_no_fence():
    """The engine's connect timed out: its hello arrives, its socket is already closed. The session is
    not left registered (a reconnect under its id is welcomed, not refused session_in_use), and its fence
    word is free again."""
    path = socket_path()
    storage = KVStorage(SHAPE, PS, pages=4, shared=True)
    with live_sidecar(CONFIG, pages=4, storage=storage, engine_socket=path) as (_, sidecar):
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.sendall(wire.frame(hello(session="gone")))
            s.close()
        until(lambda: not storage._fences, "every abandoned hello's fence freed")
        assert sidecar.metrics.registry.get_sample_value("kvpool_engine_sessions") == 0
        side = LongSteps(SidecarLink(path, hello(session="gone")), PS, session="gone", lookup_wait=1.0)
        wait_for(side, "r", hashes(2), 9, 0, None)
        assert side._requests["r"].epoch == storage.epoch  # welcomed and admitted under the same id
        side.link.close()
    storage.close()


def test_an_engine_unmaps_a_pool_whose_epoch_is_gone_as_soon_as_a_job_names_it():
    """tmpfs frees a segment's pages only once its last mapping goes: a worker that learns its pool is
    gone (its header's epoch moved) drops the mapping at once rather than when a new pool answers."""
    path = socket_path()
    storage = KVStorage(SHAPE, PS, pages=4, shared=True)
    with live_sidecar(CONFIG, pages=4, storage=storage, engine_socket=path):
        worker = mapped_worker(path)
        mapped = worker._mapped
        assert mapped is not None
        epoch = storage.epoch
        HEADER.pack_into(storage._shm.buf, 0, tensors_module.MAGIC, 0)  # what a stopping sidecar stamps
        worker.start_loads([LoadJob("r", epoch, [0], [1])])
        assert worker.finish_loads() == {1}  # the job failed: recomputed
        assert worker._mapped is None
        worker.copies.submit(lambda: None).result()
        assert mapped._shm.buf is None  # unmapped
        # A step with no job at all (the link is down: nothing is planned) unmaps a dead pool too.
        HEADER.pack_into(storage._shm.buf, 0, tensors_module.MAGIC, epoch)
        worker.attach(strict=True)
        again = worker._mapped
        assert again is not None
        HEADER.pack_into(storage._shm.buf, 0, tensors_module.MAGIC, 0)
        worker.save(StepPlan(step=1))
        worker.copies.submit(lambda: None).result()
        assert worker._mapped is None and again._shm.buf is None
        HEADER.pack_into(storage._shm.buf, 0, tensors_module.MAGIC, epoch)
        worker.close()
    storage.close()


def _serve(port: int, path: str, folder, *extra: str):
    import subprocess
    import sys
    from pathlib import Path

    config = folder / "config.yaml"
    config.write_text(f"pageSize: {PS}\neviction: {{policy: lru}}\npinning: {{autoPin: {{enabled: false}}}}\n")
    shape = f"{SHAPE.layers},{SHAPE.kv_heads},{SHAPE.head_dim},{SHAPE.dtype}"
    return subprocess.Popen([str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", "--port", str(port),
                             "--pages", "6", "--kv-shape", shape, "--config", str(config), "--engine-socket", path,
                             "--engine-quarantine-seconds", "0.1", "--log-level", "warning", *extra],
                            stderr=subprocess.PIPE, text=True)


def _healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_save_stalled_across_a_sidecar_restart_lands_before_the_new_pool_serves_and_no_later(tmp_path):
    """A real sidecar is killed -9 while engine A's save has passed its check and stalls before its write.
    The restart takes the segment over, stamps its epoch and does not serve while A's slice may still land;
    once it has, the restart serves, A's next layer is refused, and engine B's pages hold B's bytes."""
    from kvpool_sidecar.service.server import instance_name
    from kvpool_sidecar.storage.segment import release_instance
    from support import free_port

    port, path = free_port(), socket_path()
    first = _serve(port, path, tmp_path)
    try:
        until(lambda: _healthy(port), "the first sidecar serves", 60)
        worker_a, stall = stalled_worker(path, {n: torch.full_like(t, 1.0) for n, t in engine_kv(6, "cpu").items()})
        a = LongSteps(SidecarLink(path, hello(session="a")), PS, session="a", lookup_wait=1.0)
        wait_for(a, "r", hashes(3, "a"), 13, 0, None)
        a.allocated("r", [1, 2, 3, 4], 0)
        plan = a.plan([("r", [1, 2, 3, 4], True, 0, 13)])
        worker_a.save(plan)
        assert stall.started.wait(5)  # A's layer 0: locked, checked, not yet written
        first.kill()
        first.wait()
        second = _serve(port, path, tmp_path)
        time.sleep(3)  # long enough to start, were it not waiting for A's slice
        assert second.poll() is None and not _healthy(port), "the restart served while A's write could land"
        stall.gate.set()
        until(lambda: _healthy(port), "the restart serves once A's slice is written", 30)
        worker_a.copies.submit(lambda: None).result()
        report = worker_a.take_done()
        assert report is not None and (plan.step, "r") in report.failed_saves  # its next layer was refused

        worker_b = WorkerSide(welcome_of(path), engine_layers(
            {n: torch.full_like(t, 2.0) for n, t in engine_kv(6, "cpu").items()}, 6), PS)
        worker_b.attach(strict=True)
        b = LongSteps(SidecarLink(path, hello(session="b")), PS, session="b", lookup_wait=1.0)
        b_pages = save_and_commit(b, worker_b, "q", "b")
        assert set(b_pages) & set(plan.saves[0].pages)  # the same page ids, the new pool's
        mapped = KVStorage.attach(fetch_welcome(path, hello(role="worker"), 2).storage)
        for page in b_pages:
            assert bool((mapped.kv[page] == 2.0).all()), f"page {page}: A's stalled save landed after the restart"
        mapped.close()
        for side in (a, b):
            side.link.close()
        worker_a.close()
        worker_b.close()
        second.terminate()
        second.wait(10)

    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        release_instance(instance_name(port))


def test_releasing_an_instance_removes_only_what_no_sidecar_or_engine_holds():
    """release_instance (tools, tests) removes a leftover segment, never one a running sidecar owns or an
    engine maps: a concurrent run of the same tools keeps its pools."""
    instance = f"test-{secrets.token_hex(4)}"
    prefix = f"kvpool-{instance}-"
    storage = KVStorage(SHAPE, PS, pages=2, shared=True, instance=instance)
    try:
        release_instance(instance)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], "a running sidecar's pool was removed"
        engine = KVStorage.attach(storage.handle())
        storage.close()  # a SIGTERM beside an engine: the segment stays for the restart
        release_instance(instance)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], "an engine's mapping was removed"
        engine.close()
        release_instance(instance)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    finally:
        storage.close()
        release_instance(instance)


def test_a_pool_gone_mid_step_fails_the_steps_loads_and_leaks_no_lock():
    """The sidecar stops or restarts during a step that loads: the worker unmaps the dead pool when the
    step saves, and the step's loads are then reported failed (recomputed), not an error in the engine.
    A handle fetched just before a restart fails to attach and leaves no lock on the segment."""
    path = socket_path()
    storage = KVStorage(SHAPE, PS, pages=4, shared=True)
    with live_sidecar(CONFIG, pages=4, storage=storage, engine_socket=path):
        worker = mapped_worker(path)
        epoch = storage.epoch
        worker.start_loads([LoadJob("r", epoch, [0], [1])])
        worker.wait_layer("layer.0")
        HEADER.pack_into(storage._shm.buf, 0, tensors_module.MAGIC, 0)  # the pool goes mid-step
        worker.save(StepPlan(step=1))  # wait_for_save: the dead pool is unmapped
        worker.copies.submit(lambda: None).result()
        assert worker.finish_loads() == {1}  # get_block_ids_with_load_errors: recomputed
        handle = storage.handle()
        with pytest.raises(StaleHandle):
            KVStorage.attach(handle)  # the header says another epoch: refused
        assert not storage.writers_on(tensors_module.MAPPED_BYTE)  # and no mapping lock left behind
        HEADER.pack_into(storage._shm.buf, 0, tensors_module.MAGIC, epoch)
        worker.close()
    storage.close()


def test_a_host_row_move_outside_its_tensor_is_refused_not_skipped():
    from kvpool_sidecar.storage import reference

    src, dst = torch.ones((4, 8)), torch.zeros((4, 8))
    for bad_src, bad_dst in (([0], [4]), ([0], [-1]), ([4], [0])):
        with pytest.raises(IndexError):
            reference.move_rows(src, torch.tensor(bad_src), dst, torch.tensor(bad_dst))
    assert not dst.any()
