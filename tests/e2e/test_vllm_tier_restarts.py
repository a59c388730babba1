"""KVPoolTier through sidecar restarts and stalled writers (issue 65): vLLM's own tiering manager beside a
real ``kvpool-sidecar serve``. A restart (SIGTERM or SIGKILL) in a nearly full memory volume comes back and
serves the tier again; a store stalled between its check and its write never lands in a page handed on,
before or across a restart."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
from engine_support import SidecarProcess
from kvpool_sidecar.storage import tensors
from support import run_in_small_shm
from test_vllm_tier import KV_SHAPE, keys, loaded_bytes, lookups, manager, shipped_tier, steps_until, store
from vllm.v1.kv_offload.base import LookupResult, ReqContext


@pytest.fixture
def tier_sidecar(tmp_path):
    """A sidecar whose pages hold the shipped tier's chunks (its lapsed sessions quarantined 2 s)."""
    side = SidecarProcess(tmp_path, pages=64, kv_shape=KV_SHAPE, config={
        "pageSize": shipped_tier()[0]["block_size"], "eviction": {"policy": "lru"},
        "pinning": {"autoPin": {"enabled": False}}})
    side.start()
    yield side
    side.stop()


def test_the_tier_stores_and_loads_through_a_sidecar_stopped_then_killed_in_a_nearly_full_shm_volume(tmp_path):
    """A 64 MiB tmpfs on /dev/shm (a mount namespace of its own) holds a pool of about 41 MiB and vLLM's
    primary region: the sidecar is stopped (SIGTERM), then killed -9, while the tier maps the pool; each
    restart starts (a second pool would not fit), and the tier stores and promotes the right bytes again
    (tests/e2e/tier_shm_restart.py)."""
    out = run_in_small_shm(Path(__file__).with_name("tier_shm_restart.py"), 21000, tmp_path, timeout=300)
    assert out.returncode == 0 and "restarted and served" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@contextlib.contextmanager
def stalled_slices(monkeypatch):
    """The first slice any writer makes waits, after its lock and its check, until ``gate`` is set."""
    started, gate = threading.Event(), threading.Event()
    original = tensors.AttachedKV.writing

    @contextlib.contextmanager
    def writing(self, fence):
        with original(self, fence):
            if not started.is_set():
                started.set()
                assert gate.wait(30), "the test never let the stalled writer go"
            yield

    monkeypatch.setattr(tensors.AttachedKV, "writing", writing)
    try:
        yield started, gate
    finally:
        gate.set()


def stall_a_store(one, started: threading.Event) -> None:
    """Engine one stores two chunks; returns once its copy has locked, checked and stalled."""
    store(one, "r1", keys("stalled", 2), fill=3)
    steps_until(one, started.is_set, "the store never reached its write")


def promoted(m, req: str, ks: list) -> list[int]:
    """What engine ``m`` reads after promoting ``ks`` from kvpool (every key must be a HIT)."""
    ctx = ReqContext(req)
    m.on_new_request(ctx)
    assert lookups(m, ctx, ks) == [LookupResult.HIT] * len(ks)
    out = loaded_bytes(m, ctx, ks)
    m.on_request_finished(ctx)
    return out


def test_a_store_stalled_between_its_check_and_its_write_keeps_its_pages_until_it_is_done(tier_sidecar, monkeypatch):
    """The tier's store has locked and checked, and stalls before its write; its link fails and the
    sidecar's quarantine (2 s) runs out: the pages stay out of circulation while the writer holds its
    slot. When the write lands, it lands in those pages, nothing of it is published, and the pages go
    back; another engine's store and load are unaffected."""
    sidecar = tier_sidecar
    one, two = manager("e1", sidecar), manager("e2", sidecar)
    try:
        with stalled_slices(monkeypatch) as (started, gate):
            stall_a_store(one, started)
            one.secondary_tiers[0].side.link._conn.sock.close()  # the session ends, its fence is cleared
            steps_until(one, lambda: sidecar.metric("kvpool_engine_lapsed_sequences_total") == 1, "never lapsed")
            time.sleep(3)  # past the quarantine
            stats = sidecar.get("/v1/stats")
            assert stats["sequences"] == 1 and stats["in_use_pages"] >= 2, "released while its writer could write"
            ks = keys("other", 2)  # another engine meanwhile: served from the other pages
            store(two, "r2", ks, fill=40)
            steps_until(two, lambda: sidecar.get("/v1/stats")["cached_pages"] == 2 and not two.has_pending_work(),
                        "the other engine's store was never committed")
            gate.set()
            steps_until(one, lambda: not one.has_pending_work(), "the stalled store was never reported")
            steps_until(one, lambda: sidecar.get("/v1/stats")["sequences"] == 0, "its pages never went back")
            assert sidecar.get("/v1/stats")["cached_pages"] == 2  # nothing of the dead session published
        three = manager("e3", sidecar)
        try:
            assert promoted(three, "r3", ks) == [40, 41]
        finally:
            three.shutdown()
    finally:
        one.shutdown()
        two.shutdown()


def test_a_store_stalled_across_a_sidecar_restart_lands_before_the_new_pool_serves(tier_sidecar, monkeypatch):
    """The sidecar is killed -9 while the tier's store is between its check and its write: the restart
    takes the segment over and does not serve until that slice is written; then stores and loads through
    it give the right bytes."""
    sidecar = tier_sidecar
    one, two = manager("e1", sidecar), manager("e2", sidecar)
    try:
        with stalled_slices(monkeypatch) as (started, gate):
            stall_a_store(one, started)
            sidecar.kill()
            restart = threading.Thread(target=sidecar.start)
            restart.start()
            time.sleep(3)
            assert not sidecar.healthy(), "the restart served while the old pool's write could land"
            gate.set()
            restart.join(60)
            assert sidecar.healthy()
        steps_until(one, lambda: not one.has_pending_work(), "the stalled store was never reported")
        assert sidecar.get("/v1/stats")["cached_pages"] == 0  # the old session's write published nothing
        deadline = time.monotonic() + 30
        for attempt in range(1000):  # the link's backoff, the lane's remap
            ks = keys(f"after{attempt}", 2)
            store(one, f"r-{attempt}", ks, fill=60)
            steps_until(one, lambda: not one.has_pending_work(), "a store was never reported")
            if sidecar.get("/v1/stats")["cached_pages"] >= 2:
                break
            assert time.monotonic() < deadline, "the tier never stored through the restarted sidecar"
            time.sleep(0.2)
        assert promoted(two, "r2", ks) == [60, 61]
    finally:
        one.shutdown()
        two.shutdown()
