"""The connector's halves without an engine: the scheduler's plan against a live sidecar, the link's faults,
the worker's start-up checks and page copies (the real engine is in tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.engines.blocks import LayoutError, PageCopier, check_compatible, engine_layers
from kvpool_sidecar.engines.link import Backoff, SidecarLink
from kvpool_sidecar.engines.scheduler import SchedulerSide, loadable_tokens
from kvpool_sidecar.engines.settings import ConnectorConfigError, parse_settings
from kvpool_sidecar.engines.worker import WorkerSide
from kvpool_sidecar.storage import KVStorage, ModelShape
from support import free_port, live_sidecar

PS = 4
SHAPE = ModelShape(layers=2, kv_heads=1, head_dim=8, dtype="float32")
CONFIG = SidecarConfig.model_validate({"pageSize": PS, "eviction": {"policy": "lru"},
                                       "pinning": {"autoPin": {"enabled": False}}})


def hashes(n: int, tag: str = "h") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


@pytest.mark.parametrize(("pool_pages", "local", "prompt_len", "want"), [
    (5, 0, 21, 20),  # all five pages
    (5, 0, 20, 16),  # the last token is computed: its page is not loaded
    (5, 8, 21, 12),  # only past the engine's own hit
    (2, 8, 21, 0),  # the engine holds more than the pool
    (0, 0, 3, 0),
])
def test_loadable_tokens(pool_pages, local, prompt_len, want):
    assert loadable_tokens(pool_pages, local, prompt_len, PS) == want


def wait_for(side: SchedulerSide, *args) -> int:
    deadline = time.monotonic() + 5
    while (got := side.matched_tokens(*args)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return got


def test_the_scheduler_plans_saves_then_loads_against_a_live_sidecar():
    storage = KVStorage(SHAPE, PS, pages=64, shared=True)
    with live_sidecar(CONFIG, pages=64, storage=storage) as (url, sidecar):
        link = SidecarLink(url)
        side = SchedulerSide(link, PS, lookup_wait=0.5)
        # First request: nothing cached; 5 full pages are saved over two steps of chunked prefill.
        assert wait_for(side, "r1", hashes(5), 22, 0, {"tenant": "t1"}) == 0
        side.allocated("r1", list(range(100, 106)), 0)
        step1 = side.plan([("r1", list(range(100, 106)), True, 0, 12)])
        assert not step1.loads and [s.blocks for s in step1.saves] == [[100, 101, 102]]
        assert step1.saves[0].commit_tokens == 12 and step1.saves[0].epoch == storage.epoch
        step2 = side.plan([("r1", None, False, 12, 10)])
        assert [s.blocks for s in step2.saves] == [[103, 104]]
        assert side.plan([("r1", None, False, 22, 1)]).saves == []  # decode: nothing more to save
        with SidecarClient(url) as client:  # the worker's commit, by hand
            client.batch([{"op": "commit", "seq_id": s.seq_id, "num_computed_tokens": s.commit_tokens}
                          for s in step1.saves + step2.saves])
        side.finished("r1")
        # Second request: same tenant and first 4 hashes; the engine's own cache holds one block.
        assert wait_for(side, "r2", hashes(4) + ["x"], 22, PS, {"tenant": "t1"}) == 3 * PS
        side.allocated("r2", [7, 8, 9, 10, 11, 12], 3 * PS)
        step = side.plan([("r2", [7, 8, 9, 10, 11, 12], True, 4 * PS, 6)])
        assert [(job.pages, job.blocks) for job in step.loads] == [(step1.saves[0].pages[1:] + step2.saves[0].pages[:1],
                                                                   [8, 9, 10])]
        assert [s.blocks for s in step.saves] == [[11]]  # the one block the pool lacks
        # Another tenant sees none of it (the sidecar salts its keys).
        assert wait_for(side, "r3", hashes(5), 22, 0, {"tenant": "t2"}) == 0
        side.finished("r2")
        side.finished("r3")
        link.close()
        time.sleep(0.05)
        assert sidecar.pool.stats().sequences == 0
        sidecar.pool.check_invariants()


def test_a_preempted_request_is_admitted_afresh():
    with live_sidecar(CONFIG, pages=64, storage=KVStorage(SHAPE, PS, pages=64, shared=True)) as (url, sidecar):
        link = SidecarLink(url)
        side = SchedulerSide(link, PS, lookup_wait=0.5)
        wait_for(side, "r", hashes(3), 13, 0, None)
        side.allocated("r", [1, 2, 3, 4], 0)
        side.plan([("r", [1, 2, 3, 4], True, 0, 13)])
        assert wait_for(side, "r", hashes(3), 13, 0, None) == 0  # preempted: blocks gone, a new admission
        side.finished("r")
        link.close()
        time.sleep(0.05)
        assert sidecar.pool.stats().sequences == 0


def test_an_unreachable_sidecar_costs_no_wait_and_is_retried_with_backoff(caplog):
    link = SidecarLink(f"http://127.0.0.1:{free_port()}", timeout=0.5, backoff=Backoff("test sidecar", base=0.2))
    side = SchedulerSide(link, PS, lookup_wait=0.5)
    with caplog.at_level(logging.WARNING, logger="kvpool.engine"):
        assert wait_for(side, "a", hashes(3), 13, 0, None) == 0
        start = time.perf_counter()
        assert side.matched_tokens("b", hashes(3), 13, 0, None) == 0  # down: not even asked
        assert time.perf_counter() - start < 0.01
        side.allocated("a", [1, 2, 3, 4], 0)
        assert side.plan([("a", [1, 2, 3, 4], True, 0, 13)]).saves == []  # nothing to save into
    assert sum("unreachable" in r.message for r in caplog.records) == 1  # one warning, not one per request
    time.sleep(0.25)
    assert link.available()  # the backoff has passed: the next op is the probe
    link.close()


def test_a_step_waits_on_lookups_for_lookup_wait_in_all():
    import socket

    with socket.socket() as hung:  # accepts connections (the kernel's backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        link = SidecarLink(f"http://127.0.0.1:{hung.getsockname()[1]}", timeout=5)
        side = SchedulerSide(link, PS, lookup_wait=0.02)
        start = time.perf_counter()
        answers = [side.matched_tokens(f"r{i}", hashes(3, f"p{i}"), 13, 0, None) for i in range(20)]
        elapsed = time.perf_counter() - start
        assert answers == [None] * 20  # ask again next step
        assert elapsed < 0.1  # 20 ms for the whole step, not 20 ms per request (400 ms)
        side.plan([])  # the next step has a fresh budget
        start = time.perf_counter()
        assert side.matched_tokens("r0", hashes(3, "p0"), 13, 0, None) is None
        assert 0.015 < time.perf_counter() - start < 0.1
        link.close(timeout=0.1)


def test_a_refused_admission_serves_the_request_without_the_pool(caplog):
    with live_sidecar(CONFIG, pages=64, storage=KVStorage(SHAPE, PS, pages=64, shared=True)) as (url, _):
        link = SidecarLink(url)
        side = SchedulerSide(link, PS, lookup_wait=0.5)
        with caplog.at_level(logging.WARNING, logger="kvpool.engine"):
            assert wait_for(side, "r", hashes(3), 13, 0, {"workload_class": "bulk"}) == 0
        assert "meta.workload_class" in caplog.text
        assert link.available()  # a bad request is not a dead sidecar
        link.close()


def test_lookups_from_one_step_share_a_round_trip():
    with live_sidecar(CONFIG, pages=256, storage=KVStorage(SHAPE, PS, pages=256, shared=True)) as (url, sidecar):
        link = SidecarLink(url)
        futures = [link.submit({"op": "admit", "seq_id": f"s{i}", "block_hashes": hashes(2, f"p{i}")})
                   for i in range(50)]
        assert all(f.result(5)["num_cached_tokens"] == 0 for f in futures)
        assert link.round_trips < 50
        link.submit({"op": "release", "seq_id": "s0"}).result(5)  # carries the pending report along
        reported = sidecar.metrics.registry.get_sample_value("kvpool_connector_lookup_seconds_count")
        assert reported + len(link.report.lookup_seconds) == 50  # every lookup timed and reported
        link.close()


# ------------------------------------------------------------------------------- the worker
def engine_kv(num_blocks: int, layout: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    if layout == "cpu":  # vLLM's CPU backend: [blocks, kv_heads, block_size, 2 * head_dim]
        shape = (num_blocks, 1, PS, 16)
    else:  # K and V apart: [2, blocks, block_size, kv_heads, head_dim]
        shape = (2, num_blocks, PS, 1, 8)
    return {f"layer.{i}": torch.randn(shape, generator=g) for i in range(2)}


@pytest.mark.parametrize("layout", ["cpu", "split"])
def test_blocks_round_trip_through_pool_pages_bit_exact(layout):
    storage = KVStorage(SHAPE, PS, pages=8, shared=True, backend="torch")
    try:
        kv = engine_kv(6, layout)
        layers = engine_layers(kv, 6)
        check_compatible(layers, PS, storage.handle())
        copier = PageCopier(layers)  # the Triton interpreter, as on a GPU the compiled kernels
        copier.save(storage.kv, [4, 1], [7, 2])
        if layout == "cpu":
            assert torch.equal(storage.kv[7, 1].flatten(), kv["layer.1"][4].flatten())  # the block, verbatim
        fresh = {name: torch.zeros_like(t) for name, t in kv.items()}
        PageCopier(engine_layers(fresh, 6), backend="torch").load(storage.kv, [7, 2], [0, 5])
        for name in kv:
            got, want = fresh[name], kv[name]
            if layout == "cpu":
                assert torch.equal(got[0], want[4]) and torch.equal(got[5], want[1]) and not got[1].any()
            else:
                assert torch.equal(got[:, 0], want[:, 4]) and torch.equal(got[:, 5], want[:, 1])
    finally:
        storage.close()


@pytest.mark.parametrize(("shape", "page_size", "message"), [
    (SHAPE, 8, "page size is 8 tokens, the engine's block_size 4"),
    (ModelShape(layers=3, kv_heads=1, head_dim=8, dtype="float32"), PS, "3 layers (--kv-shape), the engine 2"),
    (ModelShape(layers=2, kv_heads=1, head_dim=8, dtype="float16"), PS, "dtype is float16, the engine's KV dtype"),
    (ModelShape(layers=2, kv_heads=2, head_dim=8, dtype="float32"), PS, "holds 128 elements per layer .*layer.0 64"),
])
def test_an_incompatible_pool_is_refused_at_start_up_naming_both_values(shape, page_size, message):
    storage = KVStorage(shape, page_size, pages=4, shared=True)
    config = SidecarConfig.model_validate({"pageSize": page_size})
    try:
        with live_sidecar(config, pages=4, storage=storage) as (url, _):
            worker = WorkerSide(SidecarClient(url), engine_layers(engine_kv(6, "cpu"), 6), PS)
            with pytest.raises(LayoutError, match=message.replace("(--kv-shape)", r"\(--kv-shape\)")):
                worker.attach(strict=True)
    finally:
        storage.close()


def test_a_sidecar_without_kv_storage_is_refused_and_an_absent_one_only_warned_about(caplog):
    with live_sidecar(CONFIG, pages=4) as (url, _):
        worker = WorkerSide(SidecarClient(url), engine_layers(engine_kv(6, "cpu"), 6), PS)
        with pytest.raises(LayoutError, match="no_storage"):
            worker.attach(strict=True)
    worker = WorkerSide(SidecarClient(f"http://127.0.0.1:{free_port()}", timeout=0.5),
                        engine_layers(engine_kv(6, "cpu"), 6), PS)
    with caplog.at_level(logging.WARNING, logger="kvpool.engine"):
        worker.attach(strict=True)
    assert "not reachable at start-up" in caplog.text


def test_a_job_from_another_pool_epoch_is_never_copied():
    storage = KVStorage(SHAPE, PS, pages=8, shared=True)
    with live_sidecar(CONFIG, pages=8, storage=storage) as (url, _):
        kv = engine_kv(6, "cpu")
        before = {name: t.clone() for name, t in kv.items()}
        worker = WorkerSide(SidecarClient(url), engine_layers(kv, 6), PS)
        worker.attach(strict=True)
        from kvpool_sidecar.engines.scheduler import LoadJob
        failed = worker.load([LoadJob("r", storage.epoch + 1, [0, 1], [2, 3])])  # a pool that is gone
        assert failed == {2, 3}  # reported: the engine recomputes these blocks
        assert all(torch.equal(kv[n], before[n]) for n in kv)
        assert worker.load([LoadJob("r", storage.epoch, [0, 1], [2, 3])]) == set()
        assert not kv["layer.0"][2].any()  # the pool's (zero) page was copied in
        worker.close()
    storage.close()  # attached in this same process: the tracker no longer holds the segment


def test_settings_errors_name_the_field():
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.url"):
        parse_settings({"url": "127.0.0.1:8000"})
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.defaults.workload_class"):
        parse_settings({"defaults": {"workload_class": "bulk"}})
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.lookup_wait_ms"):
        parse_settings({"lookup_wait_ms": -1})
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.surprise"):
        parse_settings({"surprise": 1})
    assert parse_settings(None).url == "http://127.0.0.1:8000"
