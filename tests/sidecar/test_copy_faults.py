"""The asynchronous copy path under faults (issue 62): no page published unwritten, none handed on while
a copy may still read or write it, however the worker lags, the engine finishes or preempts, or the
session's link fails. Real sidecars on their engine channel, the connector's two halves without an engine
(the real engine is in tests/e2e)."""

from __future__ import annotations

import torch
from kvpool_sidecar.engines import scheduler as scheduler_module
from kvpool_sidecar.engines.blocks import engine_layers
from kvpool_sidecar.engines.link import SidecarLink
from kvpool_sidecar.engines.scheduler import StepDone
from kvpool_sidecar.engines.worker import WorkerSide
from kvpool_sidecar.storage import KVStorage
from support import LongSteps, live_sidecar, socket_path
from test_engine_connector import (
    CONFIG,
    PS,
    SHAPE,
    done,
    engine_kv,
    gated_worker,
    hashes,
    hello,
    save_whole,
    settle,
    sidecar_with_channel,
    wait_for,
    welcome_of,
)
from test_engine_sessions import until


def test_a_full_pending_table_stops_saving_and_never_forgets_a_failed_save(monkeypatch):
    """A worker that lags behind the scheduler by the whole pending table: later steps plan no saves and
    promise no loads (rather than dropping the oldest steps, whose failures a later commit would then
    skip: step 1's unwritten page published by step 8's commit); once the reports come, step 1's failure
    holds back every commit of that request, and saving resumes for the others."""
    monkeypatch.setattr(scheduler_module, "MAX_PENDING_STEPS", 4)
    path, live = sidecar_with_channel(pages=64)
    with live as (_, sidecar):
        side = LongSteps(SidecarLink(path, hello()), PS, session="s", lookup_wait=1.0)
        save_whole(side, "cached", hashes(3, "c"), 13, [20, 21, 22, 23])
        settle(side.link, sidecar, lambda sc: sc.pool.stats().cached_pages == 3)
        n = 8
        wait_for(side, "r", hashes(n), n * PS + 1, 0, None)
        blocks = list(range(1, n + 2))
        side.allocated("r", blocks, 0)
        plans = [side.plan([("r", blocks if i == 0 else None, i == 0, i * PS, PS)]) for i in range(n)]
        assert [len(p.saves) for p in plans] == [1, 1, 1, 1, 0, 0, 0, 0]  # the table is full after 4 steps
        assert side.backlogged
        # No load is promised while the worker has not reported: the cached prompt is served without the pool.
        assert wait_for(side, "hit", hashes(3, "c"), 13, 0, None) == 0
        side.finished("hit")
        side.worker_done(StepDone({p.step: 1 for p in plans}, {(plans[0].step, "r")}))  # step 1's save failed
        assert not side.backlogged
        side.plan([("r", None, False, n * PS, 1)])
        assert side.finished("r") is False
        settle(side.link, sidecar)
        assert wait_for(side, "r again", hashes(n), n * PS + 1, 0, None) == 0  # nothing past the failed save
        side.finished("r again")
        assert wait_for(side, "hit again", hashes(3, "c"), 13, 0, None) == 3 * PS  # loads are promised again
        side.finished("hit again")
        save_whole(side, "later", hashes(2, "l"), 9, [30, 31, 32])  # and saves are planned again
        settle(side.link, sidecar, lambda sc: sc.pool.stats().cached_pages == 5)
        side.link.close()


def test_a_request_finished_while_its_load_runs_keeps_its_hit_pages_until_the_load_is_reported():
    """vLLM schedules a step ahead: a request can finish (an abort) while the step that loads it still
    runs. Its hit pages stay held until the worker reports that step, so no other writer is handed them
    while the load reads them (vLLM caches loaded blocks at allocation: a page rewritten under the load
    would poison its own prefix cache too)."""
    path, live = sidecar_with_channel(pages=8)
    with live as (_, sidecar):
        side = LongSteps(SidecarLink(path, hello()), PS, session="a", lookup_wait=1.0)
        save_whole(side, "first", hashes(3), 13, [1, 2, 3, 4])
        settle(side.link, sidecar, lambda sc: sc.pool.stats().cached_pages == 3)
        assert wait_for(side, "h", hashes(3), 13, 0, None) == 3 * PS
        side.allocated("h", [5, 6, 7, 8], 3 * PS)
        step = side.plan([("h", [5, 6, 7, 8], True, 3 * PS, 1)])
        hit = set(step.loads[0].pages)
        assert side.finished("h") is False  # aborted: the engine frees its blocks, its load still runs
        other = LongSteps(SidecarLink(path, hello(session="b")), PS, session="b", lookup_wait=1.0)
        handed: set[int] = set()
        steps = []
        for i in range(4):  # another engine's prompts want every page of the 8-page pool
            wait_for(other, f"q{i}", hashes(3, f"q{i}"), 13, 0, None)
            other.allocated(f"q{i}", [1, 2, 3, 4], 0)
            steps.append(other.plan([(f"q{i}", [1, 2, 3, 4], True, 0, 13)]).step)  # its saves take pages
            handed |= set(other._requests[f"q{i}"].page_ids)
        assert handed and not handed & hit  # none of the pages under the load
        side.worker_done(done(step.step))  # the load is done: now they go back
        other.worker_done(done(*steps))
        for i in range(4):
            other.finished(f"q{i}")
        other.sent({f"q{i}" for i in range(4)})
        settle(other.link, sidecar)
        assert wait_for(other, "after", hashes(6, "z"), 25, 0, None) == 0
        other.allocated("after", list(range(7)), 0)
        other.plan([("after", list(range(7)), True, 0, 25)])
        assert set(other._requests["after"].page_ids) & hit  # evictable cache again
        side.link.close()
        other.link.close()


def test_a_save_held_back_past_the_quarantine_never_overwrites_a_page_another_session_committed():
    """Engine A's saves are queued behind a held-back copy when its link fails; its quarantine ends, its
    pages go to engine B, which writes and commits its own KV there; then A's copies run. They find the
    session's fence cleared and write nothing: B's page holds B's bytes."""
    storage = KVStorage(SHAPE, PS, pages=4, shared=True)
    path = socket_path()
    with live_sidecar(CONFIG, pages=4, storage=storage, engine_socket=path, engine_quarantine=0.3) as (_, sidecar):
        kv_a = {name: torch.full_like(t, 1.0) for name, t in engine_kv(6, "cpu").items()}
        worker_a, gated = gated_worker(path, kv_a)
        a = LongSteps(SidecarLink(path, hello(session="a")), PS, session="a", lookup_wait=1.0)
        wait_for(a, "r", hashes(3, "a"), 13, 0, None)
        a.allocated("r", [1, 2, 3, 4], 0)
        first = a.plan([("r", [1, 2, 3, 4], True, 0, 4)])
        second = a.plan([("r", None, False, 4, 9)])
        worker_a.save(first)
        worker_a.save(second)  # queued behind the held-back one
        assert gated.started.wait(5)
        a_pages = set(first.saves[0].pages + second.saves[0].pages)
        a.link._conn.sock.close()  # A's link fails: its session lapses, then its quarantine ends
        until(lambda: sidecar.pool.stats().sequences == 0, "A's pages released after the quarantine")

        kv_b = {name: torch.full_like(t, 2.0) for name, t in engine_kv(6, "cpu").items()}
        worker_b = WorkerSide(welcome_of(path), engine_layers(kv_b, 6), PS)
        worker_b.attach(strict=True)
        b = LongSteps(SidecarLink(path, hello(session="b")), PS, session="b", lookup_wait=1.0)
        wait_for(b, "q", hashes(3, "b"), 13, 0, None)
        b.allocated("q", [1, 2, 3, 4], 0)
        plan = b.plan([("q", [1, 2, 3, 4], True, 0, 13)])
        b_pages = plan.saves[0].pages
        assert set(b_pages) & a_pages  # the same pages, B's now
        worker_b.save(plan)
        worker_b.copies.submit(lambda: None).result()
        b.worker_done(worker_b.take_done() or StepDone())
        b.finished("q")
        settle(b.link, sidecar, lambda sc: sc.pool.stats().cached_pages == 3)

        gated.gate.set()  # A's held-back copies run now
        worker_a.copies.submit(lambda: None).result()
        report = worker_a.take_done()
        assert report is not None and report.failed_saves == {(first.step, "r"), (second.step, "r")}
        for page in b_pages:
            assert bool((storage.kv[page] == 2.0).all()), f"page {page} was overwritten by a dead session's save"
        b.link.close()
        a.link.close()
        worker_a.close()
        worker_b.close()
    storage.close()


def test_the_save_lane_skips_saves_rather_than_fall_further_behind():
    """Back-pressure: while the oldest queued save has waited longer than max_save_backlog, a step's saves
    are not queued but reported failed (save_skipped), so nothing of them is committed and the lane's
    backlog, and the engine blocks held for it, stop growing."""
    storage = KVStorage(SHAPE, PS, pages=16, shared=True)
    path = socket_path()
    with live_sidecar(CONFIG, pages=16, storage=storage, engine_socket=path) as (_, sidecar):
        now = [100.0]
        worker, gated = gated_worker(path, engine_kv(8, "cpu"), max_save_backlog=1.0, clock=lambda: now[0])
        side = LongSteps(SidecarLink(path, hello()), PS, session="s", lookup_wait=1.0)
        wait_for(side, "r", hashes(6), 25, 0, None)
        side.allocated("r", list(range(1, 8)), 0)
        plans = [side.plan([("r", list(range(1, 8)) if i == 0 else None, i == 0, i * PS, PS)]) for i in range(3)]
        worker.save(plans[0])  # held
        now[0] += 0.5
        worker.save(plans[1])  # queued: the oldest has waited 0.5 s
        now[0] += 0.6
        worker.save(plans[2])  # the oldest has waited 1.1 s: skipped
        gated.gate.set()
        worker.copies.submit(lambda: None).result()
        report = worker.take_done()
        assert report is not None and set(report.steps) == {p.step for p in plans}
        assert report.failed_saves == {(plans[2].step, "r")}
        assert report.report.failures == {"save_skipped": 1}
        side.worker_done(report)
        side.plan([("r", None, False, 3 * PS, PS)])  # nothing more is saved for it after the skipped save
        side.finished("r")
        settle(side.link, sidecar, lambda sc: sc.pool.stats().cached_pages == 2)
        settle(side.link, sidecar, lambda sc: sc.metrics.registry.get_sample_value(
            "kvpool_connector_failures_total", {"operation": "save_skipped"}) == 1)
        side.link.close()
        worker.close()
    storage.close()


def test_a_sidecar_stopped_or_killed_beside_a_live_engine_restarts_in_a_nearly_full_shm_volume(tmp_path):
    """A pod's memory volume (a 64 MiB tmpfs on /dev/shm, in a mount namespace of its own) holds a pool
    of about 41 MiB. The sidecar is stopped (SIGTERM), then killed -9, while an engine maps the pool: each
    restarted sidecar must start (a second segment beside the one the engine still maps would not fit),
    and the engine remaps and saves and loads through it (tests/sidecar/small_shm_restart.py)."""
    from pathlib import Path

    from support import free_port, run_in_small_shm

    out = run_in_small_shm(Path(__file__).with_name("small_shm_restart.py"), free_port(), 1300, tmp_path)
    assert out.returncode == 0 and "restarted and served" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
