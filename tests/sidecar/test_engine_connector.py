"""The connector's halves without an engine: the scheduler's plan against a live sidecar on its engine
channel, the ordering of saves, commits and releases, sessions, model namespaces, untrusted request
params, a hung or absent sidecar, the worker's start-up checks and page copies (the real engine is in
tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
import torch
import yaml
from kvpool_sidecar import wire
from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.engines.blocks import LayoutError, PageCopier, check_compatible, engine_layers
from kvpool_sidecar.engines.link import Backoff, SidecarLink, fetch_welcome
from kvpool_sidecar.engines.scheduler import LoadJob, SchedulerSide, StepDone, StepPlan, loadable_tokens
from kvpool_sidecar.engines.settings import ConnectorConfigError, parse_settings
from kvpool_sidecar.engines.worker import WorkerSide
from kvpool_sidecar.storage import KVStorage, ModelShape
from support import LongSteps, free_port, live_sidecar, socket_path

PS = 4
SHAPE = ModelShape(layers=2, kv_heads=1, head_dim=8, dtype="float32")
CONFIG = SidecarConfig.model_validate({"pageSize": PS, "eviction": {"policy": "lru"},
                                       "pinning": {"autoPin": {"enabled": False}}})


def hello(model: str = "m", token: str | None = None, session: str = "s1", role: str = "scheduler") -> wire.Hello:
    return wire.Hello(wire.PROTOCOL, role, session, model, token)


def hashes(n: int, tag: str = "h") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


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


def settle(link: SidecarLink, sidecar, check=lambda sc: sc.pool.stats().sequences == 0) -> None:
    """Until the link's queued ops have reached the sidecar."""
    deadline = time.monotonic() + 5
    while not check(sidecar):
        assert time.monotonic() < deadline, "the sidecar never saw the link's ops"
        time.sleep(0.005)


def done(*steps: int, failed: set[tuple[int, str]] | None = None) -> StepDone:
    return StepDone({s: 1 for s in steps}, failed or set())


def save_whole(side: SchedulerSide, req_id: str, hs: list[bytes], prompt_len: int, blocks: list[int],
               params: dict | None = None) -> None:
    """A request computes its whole prompt in one step, the worker reports it, and it finishes."""
    wait_for(side, req_id, hs, prompt_len, 0, params)
    side.allocated(req_id, blocks, 0)
    plan = side.plan([(req_id, blocks, True, 0, prompt_len)])
    side.worker_done(done(plan.step))
    side.finished(req_id)
    side.sent({req_id})


def sidecar_with_channel(pages: int = 64, **kw):
    path = socket_path()
    return path, live_sidecar(CONFIG, pages=pages, storage=KVStorage(SHAPE, PS, pages=pages, shared=True),
                              engine_socket=path, **kw)


def test_the_scheduler_plans_saves_commits_after_the_worker_reports_and_loads_them_later():
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        link = SidecarLink(path, hello())
        side = LongSteps(link, PS, session="s1", lookup_wait=0.5)
        # First request: nothing cached; 5 full pages are saved over two steps of chunked prefill.
        assert wait_for(side, "r1", hashes(5), 22, 0, None) == 0
        side.allocated("r1", list(range(100, 106)), 0)
        step1 = side.plan([("r1", list(range(100, 106)), True, 0, 12)])
        assert not step1.loads and [s.blocks for s in step1.saves] == [[100, 101, 102]]
        assert step1.saves[0].epoch == sidecar.storage_epoch
        step2 = side.plan([("r1", None, False, 12, 10)])
        assert [s.blocks for s in step2.saves] == [[103, 104]]
        assert side.plan([("r1", None, False, 22, 1)]).saves == []  # decode: nothing more to save
        time.sleep(0.05)
        assert sidecar.pool.stats().cached_pages == 0  # nothing is visible before the worker's report
        side.worker_done(done(step1.step, step2.step))
        # Every save written and reported before it finished: the engine frees its blocks at once (not a
        # step later through finished_sending), and the next plan tells the worker not to name it there.
        assert side.finished("r1") is False
        # Second request: first 4 hashes; the engine's own cache holds one block.
        assert wait_for(side, "r2", hashes(4) + [b"x"], 22, PS, None) == 3 * PS
        side.allocated("r2", [7, 8, 9, 10, 11, 12], 3 * PS)
        step = side.plan([("r2", [7, 8, 9, 10, 11, 12], True, 4 * PS, 6)])
        assert step.released == {"r1"}
        assert [(job.pages, job.blocks) for job in step.loads] == [(step1.saves[0].pages[1:] + step2.saves[0].pages[:1],
                                                                   [8, 9, 10])]
        assert [s.blocks for s in step.saves] == [[11]]  # the one block the pool lacks
        assert side.finished("r2") is True  # its save is not reported yet: its blocks stay the engine's
        side.worker_done(done(step.step))
        side.sent({"r2"})
        settle(link, sidecar)
        sidecar.pool.check_invariants()
        link.close()


def test_pages_for_unwritten_bytes_are_taken_step_by_step_not_while_requests_wait():
    """Requests waiting for the engine hold only their hits; a running one holds pages for the blocks its
    step computes, and none once they are committed: the pool's pages held for bytes not yet written
    stay bounded by the saves in flight, not by the requests admitted."""
    path, live = sidecar_with_channel(pages=64)
    with live as (_, sidecar):
        side = LongSteps(SidecarLink(path, hello()), PS, session="s", lookup_wait=0.5)
        for i in range(6):  # a queue of 6 requests of 8 full blocks each: looked up, none scheduled yet
            assert wait_for(side, f"w{i}", hashes(8, f"w{i}"), 8 * PS + 1, 0, None) == 0
        assert sidecar.pool.stats().unwritten_pages == 0
        side.allocated("w0", list(range(9)), 0)
        step1 = side.plan([("w0", list(range(9)), True, 0, 3 * PS)])  # chunked prefill: 3 blocks
        assert [len(job.pages) for job in step1.saves] == [3]
        assert sidecar.pool.stats().unwritten_pages == 3
        side.worker_done(done(step1.step))
        step2 = side.plan([("w0", None, False, 3 * PS, 5 * PS + 1)])  # the rest of its prompt
        settle(side.link, sidecar, lambda sc: len(sc.pool.table.index) == 3)  # step 1's, committed
        assert [len(job.pages) for job in step2.saves] == [5]
        assert sidecar.pool.stats().unwritten_pages == 5
        side.worker_done(done(step2.step))
        settle(side.link, sidecar, lambda sc: len(sc.pool.table.index) == 8)
        assert sidecar.pool.stats().unwritten_pages == 0
        sidecar.pool.check_invariants()
        side.link.close()


class ShortSteps(SchedulerSide):
    """A busy engine's scheduler: its steps leave no time to wait for a grow's answer."""

    def step_budget(self) -> float:
        return 0.0


def test_a_request_finishing_before_its_pages_come_is_saved_by_a_later_plan_and_its_blocks_kept_until():
    """The grow of a request's last blocks is answered after the step that computed them, and the request
    finishes meanwhile (max_tokens=1): the engine keeps its blocks, a later plan saves them, the worker
    names it in finished_sending only once that save is written, and the page is committed."""
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        side = ShortSteps(SidecarLink(path, hello()), PS, session="s1", lookup_wait=0.5)
        kv = engine_kv(4, "cpu")
        worker = WorkerSide(welcome_of(path), engine_layers(kv, 4), PS)
        worker.attach(strict=True)
        wait_for(side, "r", hashes(3), 13, 0, None)
        side.allocated("r", [1, 2, 3, 0], 0)
        first = side.plan([("r", [1, 2, 3, 0], True, 0, 13)])
        assert first.saves == []  # its grow is not answered within the step
        worker.save(first)
        assert side.finished("r") is True  # its blocks stay the engine's
        settle(side.link, sidecar, lambda sc: sc.pool.stats().unwritten_pages == 3)
        later = side.plan([])
        assert later.coming == {"r"} and [job.blocks for job in later.saves] == [[1, 2, 3]]
        assert worker.finished({"r"}, later.released, later.coming) == set()  # not before its save is written
        worker.save(later)
        worker.copies.submit(lambda: None).result(5)  # the save lane ran it
        after = side.plan([])
        assert after.coming == set()
        assert worker.finished(set(), after.released, after.coming) == {"r"}
        reported = worker.take_done()
        assert reported is not None and not reported.failed_saves, reported
        side.worker_done(reported)
        side.sent({"r"})
        settle(side.link, sidecar)
        assert wait_for(side, "again", hashes(3), 13, 0, None) == 3 * PS  # committed
        assert not side._draining and not side._finishing and "r" not in side._saved  # nothing of it is kept
        sidecar.pool.check_invariants()
        worker.close()
        side.link.close()


def test_a_request_finishing_in_its_saving_step_keeps_its_save_and_is_released_after_the_commit():
    """max_tokens=1 or an abort: the engine finishes the request before the worker's report arrives."""
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        link = SidecarLink(path, hello())
        side = LongSteps(link, PS, session="s1", lookup_wait=0.5)
        wait_for(side, "r", hashes(3), 13, 0, None)
        side.allocated("r", [1, 2, 3, 4], 0)
        plan = side.plan([("r", [1, 2, 3, 4], True, 0, 13)])
        assert side.finished("r") is True  # blocks stay with the engine: the save is not done yet
        side.sent(set())
        assert sidecar.pool.stats().sequences == 1  # not released before its save is committed
        side.worker_done(done(plan.step))
        side.sent({"r"})
        settle(link, sidecar)
        assert wait_for(side, "again", hashes(3), 13, 0, None) == 3 * PS  # the save was committed
        side.finished("again")
        settle(link, sidecar)
        link.close()


def test_a_failed_save_is_never_committed_nor_anything_after_it():
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        link = SidecarLink(path, hello())
        side = LongSteps(link, PS, session="s1", lookup_wait=0.5)
        wait_for(side, "r", hashes(4), 17, 0, None)
        side.allocated("r", [1, 2, 3, 4, 5], 0)
        s1 = side.plan([("r", [1, 2, 3, 4, 5], True, 0, 8)])
        s2 = side.plan([("r", None, False, 8, 9)])
        side.worker_done(done(s1.step, s2.step, failed={(s1.step, "r")}))
        assert side.finished("r") is False  # both steps reported (one failed): no copy reads its blocks
        settle(link, sidecar)
        assert wait_for(side, "again", hashes(4), 17, 0, None) == 0  # pages 1-2 unwritten: 3-4 unreachable
        side.finished("again")
        link.close()


def test_an_engine_that_dies_holding_sequences_gets_them_released_and_counted():
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        link = SidecarLink(path, hello())
        side = LongSteps(link, PS, session="s1", lookup_wait=0.5)
        for i in range(5):
            wait_for(side, f"r{i}", hashes(3, f"p{i}"), 13, 0, None)
        assert sidecar.pool.stats().sequences == 5
        link._conn.sock.close()  # the process died: the kernel closes its socket, nobody says release
        settle(link, sidecar)
        assert sidecar.metrics.registry.get_sample_value("kvpool_engine_lapsed_sequences_total") == 5
        sidecar.pool.check_invariants()
        link.close()


def test_keys_are_namespaced_by_the_model():
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        a = LongSteps(SidecarLink(path, hello(model="llama@1")), PS, session="a", lookup_wait=0.5)
        save_whole(a, "r", hashes(3), 13, [1, 2, 3, 4])
        settle(a.link, sidecar)
        assert wait_for(a, "same", hashes(3), 13, 0, None) == 3 * PS
        b = LongSteps(SidecarLink(path, hello(model="llama@2", session="b")), PS, session="b", lookup_wait=0.5)
        assert wait_for(b, "other", hashes(3), 13, 0, None) == 0  # other weights: never the first model's KV
        a.link.close()
        b.link.close()


def test_request_params_choose_nothing_unless_the_deployment_trusts_them():
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        link = SidecarLink(path, hello())
        side = LongSteps(link, PS, session="s", lookup_wait=0.5, default_meta={"tenant": "acme"})
        save_whole(side, "victim", hashes(3), 13, [1, 2, 3, 4])
        # A client naming another tenant and the to-B class: the configured defaults apply.
        assert side.meta_of({"tenant": "alice", "workload_class": "toB"}) == {"tenant": "acme"}
        assert wait_for(side, "attacker", hashes(3), 13, 0, {"tenant": "alice", "workload_class": "toB"}) == 3 * PS
        seq = sidecar.pool.sequences.live[next(iter(sidecar.pool.sequences.live))]
        assert (seq.meta.tenant, seq.meta.workload_class) == ("acme", "toC")
        trusting = LongSteps(link, PS, session="t", lookup_wait=0.5, trust_request_params=True)
        assert trusting.meta_of({"tenant": "alice"}) == {"tenant": "alice"}
        assert wait_for(trusting, "gw", hashes(3), 13, 0, {"tenant": "alice"}) == 0  # alice's own namespace
        link.close()


def test_a_hung_sidecar_costs_each_request_at_most_lookup_wait(caplog):
    """Counted, not timed: each lookup's wait is the timeout it hands its future, on the scheduler's
    clock, which moves exactly by what was waited."""
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout

    path = socket_path()
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts (the kernel's backlog), never answers
    hung.bind(path)
    hung.listen(64)
    now = [0.0]
    waits: list[float] = []

    class Unanswered(Future):
        def result(self, timeout=None):
            waits.append(timeout)
            now[0] += timeout
            raise FutureTimeout

    try:
        link = SidecarLink(path, hello(), timeout=5)
        link.admit = lambda op: Unanswered()
        side = SchedulerSide(link, PS, session="s", lookup_wait=0.02, clock=lambda: now[0])
        answers = [side.matched_tokens(f"r{i}", hashes(3, f"p{i}"), 13, 0, None) for i in range(20)]
        assert answers == [None] * 20  # ask again next step ...
        assert waits == [0.02] + [0.0] * 19  # ... after 20 ms for the whole step, not 20 ms per request
        now[0] += 0.02  # the next step, 20 ms later
        side.plan([])
        waits.clear()
        with caplog.at_level(logging.WARNING, logger="kvpool.engine"):
            assert [side.matched_tokens(f"r{i}", hashes(3, f"p{i}"), 13, 0, None) for i in range(20)] == [0] * 20
        assert waits == [0.0] * 20  # their own budget is spent: served without the pool, no wait
        late = [r.message for r in caplog.records if "not answered within lookup_wait_ms=20" in r.message]
        assert late == ["kvpool: 1 lookup(s) not answered within lookup_wait_ms=20 ran without the pool "
                        "(the sidecar is slow: starved of CPU?)"]  # one warning for the 20, not one each
        link.close(timeout=0.1)
    finally:
        hung.close()


def test_a_busy_engine_waits_for_lookups_at_most_its_step_time_shared_by_the_requests_it_runs():
    """Waiting stalls every running request, a deferred lookup costs only its own request a step: a step
    that runs 10 requests every 10 ms waits at most 1 ms for its lookups (lookup_wait 20 ms); the
    deferred request is answered in the next step; an idle engine waits the whole lookup_wait."""
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout

    now = [0.0]
    waits: list[float] = []

    class Answered(Future):  # answered by the sidecar 5 ms after it was asked
        def __init__(self) -> None:
            super().__init__()
            self.at = now[0] + 0.005

        def result(self, timeout=None):
            waits.append(timeout)
            if now[0] + timeout < self.at:
                now[0] += timeout
                raise FutureTimeout
            now[0] = max(now[0], self.at)
            return 0, wire.Admitted([7, 8, 9], 3 * PS, 1)

    path = socket_path()
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a live socket; the answers are the futures'
    hung.bind(path)
    hung.listen(64)
    link = SidecarLink(path, hello(), timeout=5)
    link.admit = lambda op: Answered()
    side = SchedulerSide(link, PS, session="s", lookup_wait=0.02, clock=lambda: now[0])
    assert side.step_budget() == 0.02  # nothing measured yet: an idle engine
    running = [(f"run{i}", None, False, 0, 1) for i in range(10)]
    for _ in range(5):
        side.plan(running)
        now[0] += 0.010
    assert abs(side.step_budget() - 0.001) < 1e-9
    assert side.matched_tokens("new", hashes(3), 13, 0, None) is None  # 1 ms waited, then the next step
    assert len(waits) == 1 and abs(waits[0] - 0.001) < 1e-9
    side.plan(running)
    now[0] += 0.010
    assert side.matched_tokens("new", hashes(3), 13, 0, None) == 3 * PS  # answered meanwhile
    side.plan([])  # the engine went idle: nobody to stall
    now[0] += 2.0
    side.plan([])
    assert side.step_budget() == 0.02
    link.close(timeout=0.1)
    hung.close()


def test_an_unreachable_sidecar_costs_no_wait_and_is_retried_with_backoff(caplog):
    link = SidecarLink(socket_path(), hello(), timeout=0.5, backoff=Backoff("test sidecar", base=0.2))
    side = LongSteps(link, PS, session="s", lookup_wait=0.5)
    with caplog.at_level(logging.WARNING, logger="kvpool.engine"):
        assert wait_for(side, "a", hashes(3), 13, 0, None) == 0
        assert side.matched_tokens("b", hashes(3), 13, 0, None) == 0
        assert side._requests["b"].future is None  # down: not even asked, so nothing to wait for
        side.allocated("a", [1, 2, 3, 4], 0)
        assert side.plan([("a", [1, 2, 3, 4], True, 0, 13)]).saves == []  # nothing to save into
    assert sum("test sidecar unreachable" in r.message for r in caplog.records) == 1  # one warning, not one per request
    time.sleep(0.25)
    assert link.available()  # the backoff has passed: the next op is the probe
    link.close()


def test_a_refused_admission_fails_alone_and_is_counted(caplog):
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        link = SidecarLink(path, hello())
        side = LongSteps(link, PS, session="s", lookup_wait=0.5, trust_request_params=True)
        bad = side._admit("bad", hashes(3, "b"), 13, {"workload_class": "bulk"})
        good = side._admit("good", hashes(3, "g"), 13, None)
        with caplog.at_level(logging.WARNING, logger="kvpool.engine"):
            assert wait_for(side, "bad", hashes(3, "b"), 13, 0, None) == 0
        assert wait_for(side, "good", hashes(3, "g"), 13, 0, None) == 0
        assert bad.future is None and good.epoch is not None
        assert "meta.workload_class" in caplog.text
        assert link.available()  # a bad request is not a dead sidecar
        side.finished("good")
        settle(link, sidecar, lambda sc: sc.metrics.registry.get_sample_value(
            "kvpool_connector_failures_total", {"operation": "lookup"}) == 1)
        link.close()


def test_lookups_from_one_step_share_a_round_trip():
    path, live = sidecar_with_channel(pages=256)
    with live as (_, sidecar):
        link = SidecarLink(path, hello())
        futures = [link.admit(wire.Admit(f"s{i}", hashes(2, f"p{i}"), 2 * PS)) for i in range(50)]
        assert all(f.result(5)[1].cached_tokens == 0 for f in futures)
        assert link.round_trips < 50
        link.release("s0", link.generation)  # carries the pending report along
        settle(link, sidecar, lambda sc: sc.metrics.registry.get_sample_value(
            "kvpool_connector_lookup_seconds_count") == 50)  # every lookup timed and reported
        link.close()


def test_the_channel_refuses_a_bad_token_and_garbage_and_keeps_serving():
    from kvpool_sidecar.service.credentials import Credentials

    path = socket_path()
    creds = Credentials.parse("engine " + "e" * 24 + "\ntenant:t " + "t" * 24)
    with live_sidecar(CONFIG, pages=8, storage=KVStorage(SHAPE, PS, pages=8, shared=True), engine_socket=path,
                      token=creds):
        assert oct(os.stat(path).st_mode & 0o777) == "0o660"
        for token in (None, "x" * 24, "t" * 24):  # none, unknown, and a tenant's (not an engine's)
            with pytest.raises(ConnectionError, match="unauthorized"):
                fetch_welcome(path, hello(token=token), 2)
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(path)
            raw.sendall(b"\x00\x00\x00\x03abc")
            assert b"protocol" in raw.recv(4096)
        with socket.socket(socket.AF_UNIX) as raw:  # a frame longer than the limit is refused unread
            raw.connect(path)
            raw.sendall(b"\xff\xff\xff\xff")
            assert b"protocol" in raw.recv(4096)
        welcome = fetch_welcome(path, hello(token="e" * 24), 2)
        assert welcome.page_size == PS and welcome.storage["kind"] == "shm"


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


def test_a_kernels_setting_that_cannot_run_on_the_engines_device_refuses_to_start():
    layers = engine_layers(engine_kv(6, "cpu"), 6)  # a CPU engine: compiled Triton cannot run here
    with pytest.raises(LayoutError, match="kernels 'triton' cannot run here: .*needs a CUDA device"):
        PageCopier(layers, backend="triton")


@pytest.mark.parametrize(("shape", "page_size", "message"), [
    (SHAPE, 8, "page size is 8 tokens, the engine's block_size 4"),
    (ModelShape(layers=3, kv_heads=1, head_dim=8, dtype="float32"), PS, "3 layers (--kv-shape), the engine 2"),
    (ModelShape(layers=2, kv_heads=1, head_dim=8, dtype="float16"), PS, "dtype is float16, the engine's KV dtype"),
    (ModelShape(layers=2, kv_heads=2, head_dim=8, dtype="float32"), PS, "holds 128 elements per layer .*layer.0 64"),
])
def test_an_incompatible_pool_is_refused_at_start_up_naming_both_values(shape, page_size, message):
    storage = KVStorage(shape, page_size, pages=4, shared=True)
    config = SidecarConfig.model_validate({"pageSize": page_size})
    path = socket_path()
    try:
        with live_sidecar(config, pages=4, storage=storage, engine_socket=path):
            worker = WorkerSide(welcome_of(path), engine_layers(engine_kv(6, "cpu"), 6), PS)
            with pytest.raises(LayoutError, match=message.replace("(--kv-shape)", r"\(--kv-shape\)")):
                worker.attach(strict=True)
    finally:
        storage.close()


def load(worker: WorkerSide, jobs: list[LoadJob]) -> set[int]:
    """A step's loads, queued and waited for: the blocks that could not be loaded."""
    worker.start_loads(jobs)
    return worker.finish_loads()


def welcome_of(path: str):
    return lambda: fetch_welcome(path, hello(role="worker"), 0.5)


def test_a_sidecar_without_kv_storage_is_refused_and_an_absent_one_only_warned_about(caplog):
    path = socket_path()
    with live_sidecar(CONFIG, pages=4, engine_socket=path):
        worker = WorkerSide(welcome_of(path), engine_layers(engine_kv(6, "cpu"), 6), PS)
        with pytest.raises(LayoutError, match="keeps no KV storage"):
            worker.attach(strict=True)
    worker = WorkerSide(welcome_of(socket_path()), engine_layers(engine_kv(6, "cpu"), 6), PS)
    with caplog.at_level(logging.WARNING, logger="kvpool.engine"):
        worker.attach(strict=True)
    assert "not reachable at start-up" in caplog.text


def test_a_job_from_another_pool_epoch_or_a_lapsed_session_is_never_copied():
    storage = KVStorage(SHAPE, PS, pages=8, shared=True)
    path = socket_path()
    with live_sidecar(CONFIG, pages=8, storage=storage, engine_socket=path):
        kv = engine_kv(6, "cpu")
        before = {name: t.clone() for name, t in kv.items()}
        worker = WorkerSide(welcome_of(path), engine_layers(kv, 6), PS)
        worker.attach(strict=True)
        failed = load(worker, [LoadJob("r", storage.epoch + 1, [0, 1], [2, 3])])  # a pool that is gone
        assert failed == {2, 3}  # reported: the engine recomputes these blocks
        assert load(worker, [LoadJob("r", storage.epoch, [0, 1], [4, 5], valid=False)]) == {4, 5}
        assert all(torch.equal(kv[n], before[n]) for n in kv)
        assert load(worker, [LoadJob("r", storage.epoch, [0, 1], [2, 3])]) == set()
        assert not kv["layer.0"][2].any()  # the pool's (zero) page was copied in
        # A save into a pool that is gone is reported failed with its step (the scheduler never commits it).
        from kvpool_sidecar.engines.scheduler import SaveJob

        worker.save(StepPlan(7, [], [SaveJob("r", storage.epoch + 1, [0], [1]), SaveJob("q", storage.epoch, [1], [1])]))
        worker.copies.submit(lambda: None).result()  # the queued saves are written
        report = worker.take_done()
        assert report.steps == {7: 1} and report.failed_saves == {(7, "r")}
        assert worker.finished({"r", "q", "z"}, released={"q"}) == {"r"}  # had saves; q: freed at once
        worker.close()
    storage.close()  # attached in this same process: the tracker no longer holds the segment


def test_settings_errors_name_the_field():
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.socket"):
        parse_settings({"socket": "relative/engine.sock"})
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.defaults.workload_class"):
        parse_settings({"defaults": {"workload_class": "bulk"}})
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.lookup_wait_ms"):
        parse_settings({"lookup_wait_ms": -1})
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.surprise"):
        parse_settings({"surprise": 1})
    assert parse_settings(None).socket == "/tmp/kvpool/engine.sock"
    assert parse_settings(None).trust_request_params is False


def test_a_second_sidecar_refuses_a_live_engine_socket_and_takes_over_a_stale_one(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path = socket_path()
    with live_sidecar(CONFIG, pages=8, engine_socket=path):
        serve = [str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", "--port", str(free_port()),
                 "--pages", "8", "--engine-socket", path]
        out = subprocess.run(serve, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "--engine-socket" in out.stderr and "another process serves it" in out.stderr
        assert fetch_welcome(path, hello(), 2).page_size == PS  # the first sidecar still serves it
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a killed sidecar's socket file: nobody listens
    stale.close()
    with live_sidecar(CONFIG, pages=8, engine_socket=path):
        assert fetch_welcome(path, hello(), 2).page_size == PS


def test_the_forward_path_never_waits_for_a_remap():
    """A job for a pool the worker has not mapped (the sidecar restarted) fails at once while the new
    handle is fetched on another thread, here held up until the test lets it go; later jobs use it."""
    import threading

    old, new = (KVStorage(SHAPE, PS, pages=8, shared=True) for _ in range(2))
    answering = threading.Event()
    current = [old]

    def welcome():
        if current[0] is new:
            answering.wait(30)  # a sidecar slow to answer the hello
        return wire.Welcome("s", current[0].handle(), PS)

    try:
        kv = engine_kv(6, "cpu")
        worker = WorkerSide(welcome, engine_layers(kv, 6), PS)
        worker.attach(strict=True)
        assert load(worker, [LoadJob("r", old.epoch, [0], [1])]) == set()
        current[0] = new  # the sidecar restarted: a new pool, a new epoch
        assert load(worker, [LoadJob("r", new.epoch, [0], [1])]) == {1}  # failed now, the engine recomputes
        assert not answering.is_set()  # ... while the remap still waits for the sidecar
        answering.set()
        deadline = time.monotonic() + 10
        while load(worker, [LoadJob("r", new.epoch, [0], [2])]):
            assert time.monotonic() < deadline, "the background remap never completed"
            time.sleep(0.01)
        worker.close()
    finally:
        old.close()
        new.close()


def test_a_save_for_a_pool_not_mapped_yet_is_written_once_the_remap_lands():
    """Issue 65: after a sidecar restart the first requests name the new pool in the step that saves
    them. The step returns at once (the remap is held up here), and the save is written on the save lane
    once the new pool's handle is fetched: neither reported failed nor written into the old pool."""
    import threading

    from kvpool_sidecar.engines.scheduler import SaveJob

    old, new = (KVStorage(SHAPE, PS, pages=8, shared=True) for _ in range(2))
    answering = threading.Event()
    current = [old]

    def welcome():
        if current[0] is new:
            answering.wait(30)  # a sidecar slow to answer the hello
        return wire.Welcome("s", current[0].handle(), PS)

    try:
        kv = engine_kv(6, "cpu")
        worker = WorkerSide(welcome, engine_layers(kv, 6), PS, max_save_backlog=30)
        worker.attach(strict=True)
        current[0] = new  # the sidecar restarted: a new pool, a new epoch
        started = time.monotonic()
        worker.save(StepPlan(1, [], [SaveJob("r", new.epoch, [2, 3], [1, 4])]))
        assert time.monotonic() - started < 10  # did not wait for the remap (held up 30 s here), even on a busy machine
        assert worker.take_done() is None  # not failed: the lane waits for the new pool's handle
        answering.set()
        worker.copies.submit(lambda: None).result(10)
        report = worker.take_done()
        assert report.steps == {1: 1} and not report.failed_saves
        for page, block in ((2, 1), (3, 4)):
            assert torch.equal(new.kv[page, 0].flatten(), kv["layer.0"][block].flatten())
        assert not old.kv.any()
        worker.close()
    finally:
        old.close()
        new.close()


def test_pool_pages_are_held_for_the_transfers_only_not_through_decode():
    """A request holds its admission until its loads are read and its saves committed, then gives it
    back while it decodes on: its hits and saved pages are evictable cache again, not held by it."""
    path, live = sidecar_with_channel(pages=16)
    with live as (_, sidecar):
        side = LongSteps(SidecarLink(path, hello()), PS, session="s", lookup_wait=1.0)
        save_whole(side, "first", hashes(3), 13, [1, 2, 3, 4])
        settle(side.link, sidecar, lambda sc: sc.pool.stats().cached_pages == 3)
        # A request hitting those 3 pages and saving 2 more, over two steps of chunked prefill.
        assert wait_for(side, "r", hashes(5), 5 * PS + 1, 0, None) == 3 * PS
        side.allocated("r", list(range(10, 16)), 3 * PS)
        step1 = side.plan([("r", list(range(10, 16)), True, 3 * PS, PS)])
        assert step1.loads and [j.blocks for j in step1.saves] == [[13]]
        step2 = side.plan([("r", None, False, 4 * PS, PS + 1)])
        assert [j.blocks for j in step2.saves] == [[14]]
        side.worker_done(done(step1.step))
        time.sleep(0.05)
        assert sidecar.pool.stats().sequences == 1  # its last save is not written yet: held
        side.worker_done(done(step2.step))
        for _ in range(3):  # decode steps: nothing to move, nothing held
            assert side.plan([("r", None, False, 5 * PS + 1, 1)]).saves == []
        settle(side.link, sidecar, lambda sc: sc.pool.stats().sequences == 0 and sc.pool.stats().cached_pages == 5)
        sidecar.pool.check_invariants()
        assert side.finished("r") is False  # its saves are all reported: the engine frees its blocks now
        # A request whose whole prompt is a hit: released once its load step is reported.
        assert wait_for(side, "h", hashes(5), 5 * PS + 1, 0, None) == 5 * PS
        side.allocated("h", list(range(20, 26)), 5 * PS)
        side.worker_done(done(side.plan([("h", list(range(20, 26)), True, 5 * PS, 1)]).step))
        side.plan([("h", None, False, 5 * PS + 1, 1)])
        settle(side.link, sidecar)
        assert side.finished("h") is False
        side.link.close()


def test_a_pin_by_token_ids_holds_the_pages_the_engine_saved_under_its_own_hashes():
    """The scheduler's hello says how its engine hashes blocks; the sidecar checks that against the
    engine's probe, and then a pin naming the served model and token ids pins the engine's pages. A
    hello whose probe the sidecar cannot reproduce leaves pins by tokens off for that model."""
    import httpx
    from kvpool_sidecar.keys import engine_block_hashes

    path, live = sidecar_with_channel(pages=16)
    seed, model = "vllm-none-hash", "org/served@0123abcd"
    probe = engine_block_hashes(list(range(PS)), PS, "sha256", seed)[0]
    tokens = list(range(500, 500 + 3 * PS + 1))
    with live as (url, sidecar):
        side = LongSteps(SidecarLink(path, wire.Hello(wire.PROTOCOL, "scheduler", "s1", model, None, False,
                                                          wire.Hashing("sha256", seed, probe))), PS, session="s1",
                             lookup_wait=1.0)
        save_whole(side, "r", engine_block_hashes(tokens, PS, "sha256", seed), len(tokens), [1, 2, 3, 4])
        settle(side.link, sidecar, lambda sc: sc.pool.stats().cached_pages == 3)
        for name in ("org/served", model):  # the served name, or the whole identity
            r = httpx.post(url + "/v1/pins", json={"tokens": tokens, "model": name})
            assert r.status_code == 201 and len(r.json()["pages"]) == 3, r.text
        r = httpx.post(url + "/v1/pins", json={"tokens": tokens, "model": "org/other"})
        assert r.status_code == 422 and r.json()["field"] == "model" and "org/served" in r.json()["detail"]
        r = httpx.post(url + "/v1/pins", json={"block_hashes": ["aa"], "model": "org/served"})
        assert r.status_code == 422 and "give tokens with it" in r.json()["detail"]
        side.link.close()
        liar = SidecarLink(path, wire.Hello(wire.PROTOCOL, "scheduler", "s2", "org/liar@1", None, False,
                                            wire.Hashing("sha256", seed, b"x" * 32)))
        assert wait_for(LongSteps(liar, PS, session="s2", lookup_wait=1.0), "q", hashes(1), 5, 0, None) == 0
        r = httpx.post(url + "/v1/pins", json={"tokens": tokens, "model": "org/liar"})
        assert r.status_code == 422 and r.json()["field"] == "model"
        liar.close()


def test_a_prompt_the_policy_names_is_pinned_once_its_engine_saved_it_and_outlives_a_flood():
    """pinning.prompts: a config names a prompt by token ids and served model; the sidecar pins its
    pages in the engine's key space once the engine has saved them, so after a flood through the pool
    the engine still finds all of it. A config whose prompts exceed the pin quota is refused naming
    pinning.prompts, the pool unchanged; a prompt dropped from the config is unpinned; a pin removed
    through the API comes back."""
    import httpx
    from kvpool_operator.status import prompts_pinned_from_metrics
    from kvpool_sidecar.keys import engine_block_hashes

    path, live = sidecar_with_channel(pages=16, pre_evict_interval=0.05)
    seed, model = "vllm-none-hash", "org/served@0123abcd"
    probe = engine_block_hashes(list(range(PS)), PS, "sha256", seed)[0]
    system = list(range(500, 500 + 3 * PS + 1))  # 3 full pages of a 4-page quota (30 % of 16)
    base = {"pageSize": PS, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}}}
    named = {**base, "pinning": {**base["pinning"], "prompts": [
        {"name": "system", "model": "org/served", "tokens": system}]}}

    def prompt_state(url: str) -> dict:
        return httpx.get(url + "/v1/config").json()["prompts"][0]

    def until(check, what: str) -> None:
        deadline = time.monotonic() + 5
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    with live as (url, sidecar):
        r = httpx.put(url + "/v1/config", json=named)
        assert r.status_code == 200, r.text
        until(lambda: "org/served" in (prompt_state(url)["problem"] or ""), "no engine of its model: not said")
        assert prompt_state(url)["pages"] == 3 and prompt_state(url)["pinned"] == 0
        side = LongSteps(SidecarLink(path, wire.Hello(wire.PROTOCOL, "scheduler", "s1", model, None, False,
                                                          wire.Hashing("sha256", seed, probe))), PS, session="s1",
                             lookup_wait=1.0)
        save_whole(side, "sys", engine_block_hashes(system, PS, "sha256", seed), len(system), [1, 2, 3, 4])
        until(lambda: prompt_state(url)["pinned"] == 3, "the named prompt was never pinned")
        assert prompt_state(url)["problem"] is None
        metrics = httpx.get(url + "/metrics").text
        assert 'kvpool_named_prompt_pages{kind="pinned",prompt="system"} 3.0' in metrics
        assert prompts_pinned_from_metrics(metrics) == {"system"}  # what the operator's status counts
        for i in range(8):  # 16 pages of other prompts through a 16-page pool
            others = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 2 * PS))
            save_whole(side, f"o{i}", engine_block_hashes(others, PS, "sha256", seed), len(others), [5, 6])
        keys = engine_block_hashes(system, PS, "sha256", seed)
        assert wait_for(side, "again", keys, len(system), 0, None) == 3 * PS  # all of it, for the engine
        side.finished("again")
        # Over the quota: refused naming the field; the prompt in force stays pinned.
        too_many = {**base, "pinning": {**base["pinning"], "prompts": [
            *named["pinning"]["prompts"], {"name": "doc", "model": "org/served", "tokens": list(range(2 * PS))}]}}
        before = httpx.get(url + "/v1/config").json()["hash"]
        r = httpx.put(url + "/v1/config", json=too_many)
        assert r.status_code == 409 and r.json()["field"] == "pinning.prompts" and "pin quota" in r.text, r.text
        assert httpx.get(url + "/v1/config").json()["hash"] == before and prompt_state(url)["pinned"] == 3
        # Removed through the API (an admin may): pinned again at the next tick.
        pin_id = next(p["pin_id"] for p in httpx.get(url + "/v1/pins").json()["pins"])
        assert httpx.delete(f"{url}/v1/pins/{pin_id}").status_code == 204
        until(lambda: sidecar.pool.stats().pinned_pages == 3 and prompt_state(url)["pinned"] == 3,
              "the removed pin of a named prompt was not restored")
        # Dropped from the config: unpinned at once.
        assert httpx.put(url + "/v1/config", json=base).status_code == 200
        assert sidecar.pool.stats().pinned_pages == 0 and httpx.get(url + "/v1/config").json()["prompts"] == []
        side.link.close()


def test_a_schedule_window_moves_the_to_b_share_at_its_hour_without_a_reload():
    """workloads.toB.schedule: inside a daily window (UTC) the to-B partition has the window's share,
    outside it isolationPercent's; the sidecar follows the clock on its own, no config write needed."""
    import datetime

    import httpx

    now = [datetime.datetime(2026, 12, 5, 8, 59, tzinfo=datetime.timezone.utc)]
    config = {"pageSize": PS, "eviction": {"policy": "lru"}, "workloads": {"toB": {
        "isolationPercent": 25, "schedule": [{"start": "09:00", "end": "17:30", "isolationPercent": 50}]}}}
    with live_sidecar(SidecarConfig.model_validate(config), pages=100, pre_evict_interval=0.05,
                      wall=lambda: now[0]) as (url, sidecar):

        def share() -> tuple[int, float]:
            stats = httpx.get(url + "/v1/stats").json()
            return stats["partitions"]["toB"]["capacity"], httpx.get(url + "/v1/config").json()["to_b_share_percent"]

        assert share() == (25, 25)
        for moment, expected in ((datetime.time(9, 0), (50, 50)), (datetime.time(17, 29), (50, 50)),
                                 (datetime.time(17, 30), (25, 25))):
            now[0] = datetime.datetime.combine(now[0].date(), moment, datetime.timezone.utc)
            deadline = time.monotonic() + 5
            while share() != expected:
                assert time.monotonic() < deadline, (moment, share())
                time.sleep(0.02)
        assert sidecar.state.reloads["applied"] == 0  # the clock moved it, not a config


class GatedCopier:
    """The worker's copier with its saves held at a gate: a deliberately slow copy."""

    def __init__(self, copier: PageCopier) -> None:
        self.copier, self.gate, self.started = copier, threading.Event(), threading.Event()
        self.load, self.load_layer = copier.load, copier.load_layer

    def save(self, *args) -> None:
        self.started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        self.copier.save(*args)


def gated_worker(path: str, kv: dict[str, torch.Tensor], **kw) -> tuple[WorkerSide, GatedCopier]:
    """A worker mapping the sidecar's pool at ``path``, its saves held at a gate."""
    blocks = next(iter(kv.values())).shape[0]
    worker = WorkerSide(welcome_of(path), engine_layers(kv, blocks), PS, **kw)
    worker.attach(strict=True)
    worker.copier = gated = GatedCopier(worker.copier)  # type: ignore[assignment]
    return worker, gated


def test_a_step_returns_before_its_save_is_written_and_the_page_is_committed_only_after():
    """Saves run off the forward path: the step returns with its copy still running; the scheduler
    commits nothing, and the engine gets the finished request back (its blocks) only once the copy
    is written (a preempted request's: the next test)."""
    storage = KVStorage(SHAPE, PS, pages=16, shared=True)
    path = socket_path()
    with live_sidecar(CONFIG, pages=16, storage=storage, engine_socket=path) as (_, sidecar):
        kv = engine_kv(6, "cpu")
        worker, gated = gated_worker(path, kv)
        side = LongSteps(SidecarLink(path, hello()), PS, session="s1", lookup_wait=0.5)
        wait_for(side, "r", hashes(3), 13, 0, None)
        side.allocated("r", [1, 2, 3, 4], 0)
        plan = side.plan([("r", [1, 2, 3, 4], True, 0, 13)])
        started = time.monotonic()
        worker.save(plan)  # the step's wait_for_save
        assert time.monotonic() - started < 1 and gated.started.wait(5)  # returned; the copy is running
        assert worker.finished({"r"}) == set()  # the engine keeps the blocks: the copy still reads them
        side.worker_done(worker.take_done() or StepDone())
        assert side.finished("r") is True
        time.sleep(0.05)
        assert sidecar.pool.stats().cached_pages == 0  # nothing committed before the copy is written
        gated.gate.set()
        deadline = time.monotonic() + 5
        while not (finished := worker.finished(set())):  # later steps: reported once written
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert finished == {"r"}
        side.worker_done(worker.take_done() or StepDone())  # the same output: commits, then the release
        side.sent(finished)
        settle(side.link, sidecar, lambda sc: sc.pool.stats().cached_pages == 3 and sc.pool.stats().sequences == 0)
        pages = plan.saves[0].pages
        for page, block in zip(pages, [1, 2, 3], strict=True):  # the blocks' bytes, written before the commit
            assert torch.equal(storage.kv[page, 0].flatten(), kv["layer.0"][block].flatten())

        side.link.close()
        worker.close()
    storage.close()


def test_a_preemption_under_a_held_back_save_lane_returns_at_once_and_commits_nothing_it_cancelled():
    """The engine preempts a request whose saves are queued behind a held-back copy and may rewrite its
    blocks in the very next step: ``preempted`` returns without waiting for the lane, the save under way
    and the queued one are reported failed (whatever they read), nothing of them is committed, and the
    old admission's pages stay held until the worker has reported both (the request comes back with a
    fresh admission meanwhile)."""
    storage = KVStorage(SHAPE, PS, pages=16, shared=True)
    path = socket_path()
    with live_sidecar(CONFIG, pages=16, storage=storage, engine_socket=path) as (_, sidecar):
        kv = engine_kv(8, "cpu")
        worker, gated = gated_worker(path, kv)
        side = LongSteps(SidecarLink(path, hello()), PS, session="s1", lookup_wait=0.5)
        wait_for(side, "q", hashes(4, "q"), 17, 0, None)
        side.allocated("q", [5, 4, 3, 2, 1], 0)
        first = side.plan([("q", [5, 4, 3, 2, 1], True, 0, 8)])
        worker.save(first)
        assert gated.started.wait(5)  # its first save is under way, held
        second = side.plan([("q", None, False, 8, 9)])
        worker.save(second)  # queued behind it
        started = time.monotonic()
        worker.preempted({"q"})  # the engine frees blocks 5-1 and may rewrite them in this step
        assert time.monotonic() - started < 0.1
        for t in kv.values():
            t[1:6] = 7.0  # another request's KV, written by the next forward
        assert wait_for(side, "q", hashes(4, "q"), 17, 0, None) == 0  # preempted and back: a fresh admission
        assert sidecar.pool.stats().sequences == 2  # the old one is held while its copies are unreported
        gated.gate.set()
        deadline = time.monotonic() + 5
        report = StepDone()
        while set(report.steps) != {first.step, second.step}:
            assert time.monotonic() < deadline, "the worker never reported the cancelled saves"
            report.merge(worker.take_done() or StepDone())
            time.sleep(0.005)
        assert report.failed_saves == {(first.step, "q"), (second.step, "q")}
        side.worker_done(report)
        side.finished("q")
        settle(side.link, sidecar)
        assert sidecar.pool.stats().cached_pages == 0  # nothing it read was published
        side.link.close()
        worker.close()
    storage.close()


class SlowLayerCopier:
    """The worker's copier with one layer's loads held at a gate (or failing)."""

    def __init__(self, copier: PageCopier, layer: int, fail: bool = False) -> None:
        self.copier, self.layer, self.fail = copier, layer, fail
        self.gate, self.started = threading.Event(), threading.Event()

    def load_layer(self, kv: torch.Tensor, li: int, pages: list[int], blocks: list[int]) -> None:
        if li == self.layer:
            self.started.set()
            assert self.gate.wait(30), "the test never opened the gate"
            if self.fail:
                raise RuntimeError("a copy that failed")
        self.copier.load_layer(kv, li, pages, blocks)


def test_loads_run_layer_by_layer_and_each_layer_waits_only_for_its_own_rows():
    """start_load_kv queues the step's loads and returns; an attention layer waits for its own layer's
    rows only (layer 0 computes while layer 1 is still copying); a layer whose copy fails has its
    blocks reported for recomputation, and nothing else of the step is lost."""
    storage = KVStorage(SHAPE, PS, pages=8, shared=True, backend="torch")
    g = torch.Generator().manual_seed(5)
    storage.kv.copy_(torch.randn(storage.kv.shape, generator=g))
    path = socket_path()
    with live_sidecar(CONFIG, pages=8, storage=storage, engine_socket=path):
        kv = {name: torch.zeros_like(t) for name, t in engine_kv(6, "cpu").items()}
        worker = WorkerSide(welcome_of(path), engine_layers(kv, 6), PS)
        worker.attach(strict=True)
        slow = SlowLayerCopier(worker.copier, layer=1)
        worker.copier = slow  # type: ignore[assignment]
        started = time.monotonic()
        worker.start_loads([LoadJob("r", storage.epoch, [6, 2], [0, 5])])
        assert time.monotonic() - started < 1 and slow.started.wait(5)  # returned; layer 1 is copying
        worker.wait_layer("layer.0")  # does not wait for layer 1
        assert torch.equal(kv["layer.0"][0].flatten(), storage.kv[6, 0].flatten())
        assert not kv["layer.1"].any()
        waiting = threading.Thread(target=worker.wait_layer, args=("layer.1",))
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive()  # layer 1's attention is held until its rows are in
        slow.gate.set()
        waiting.join(5)
        assert not waiting.is_alive() and worker.finish_loads() == set()
        for li in range(2):
            assert torch.equal(kv[f"layer.{li}"][5].flatten(), storage.kv[2, li].flatten())
        assert worker.take_done().report.loaded_tokens == 2 * PS

        worker.copier = failing = SlowLayerCopier(slow.copier, layer=1, fail=True)  # type: ignore[assignment]
        failing.gate.set()
        worker.start_loads([LoadJob("q", storage.epoch, [3], [4]), LoadJob("z", storage.epoch + 1, [1], [2])])
        worker.wait_layer("layer.0")
        assert worker.finish_loads() == {4, 2}  # both recomputed by the engine: a failed copy, a gone pool
        assert worker.finish_loads() == set()  # reported once
        worker.close()
    storage.close()


def test_the_gpu_transfer_path_moves_the_same_bytes_as_a_direct_copy():
    """A GPU engine beside a host pool stages each layer's rows of the step's pages through one buffer
    (gather, transfer, scatter); run here between two host tensors, it writes exactly what a direct row
    copy writes, for a whole page row and for a tensor-parallel rank's share of it."""
    storage = KVStorage(SHAPE, PS, pages=8, shared=True, backend="torch")
    try:
        for ranks, rank in ((1, 0), (2, 1)):
            kv = engine_kv(6, "split")
            if ranks > 1:  # each rank holds half of every block's row
                kv = {n: t[..., : t.shape[-1] // 2].contiguous() for n, t in kv.items()}
            layers = engine_layers(kv, 6)
            copier = PageCopier(layers, backend="torch", rank=rank, ranks=ranks)
            storage.kv.zero_()
            copier.save(storage.kv, [4, 1, 3], [7, 2, 5])
            direct = storage.kv.clone()
            storage.kv.zero_()
            copier._move = copier._device_to_host  # what a CUDA engine's save runs
            copier.save(storage.kv, [4, 1, 3], [7, 2, 5])
            assert torch.equal(storage.kv, direct)
            for move in (PageCopier._move, PageCopier._host_to_device):  # a direct load, then a staged one
                fresh = {name: torch.zeros_like(t) for name, t in kv.items()}
                loader = PageCopier(engine_layers(fresh, 6), backend="torch", rank=rank, ranks=ranks)
                loader._move = move.__get__(loader)
                loader.load(storage.kv, [7, 2, 5], [0, 5, 1])
                for name in kv:
                    assert torch.equal(fresh[name][:, [0, 5, 1]], kv[name][:, [4, 1, 3]])
    finally:
        storage.close()


def test_under_pressure_a_request_loads_its_hits_and_saves_what_fits():
    """The pool cannot hold the whole prompt: the request is not turned away, it loads its cached prefix
    and saves as many of its next blocks as there are pages; the rest is skipped, nothing waits."""
    path, live = sidecar_with_channel(pages=16)
    with live as (_, sidecar):
        side = LongSteps(SidecarLink(path, hello()), PS, session="s", lookup_wait=1.0)
        save_whole(side, "first", hashes(3), 13, [1, 2, 3, 4])
        settle(side.link, sidecar)
        free = sidecar.pool.capacity.obtainable(0, []) - 3  # what the to-C partition can give, not evicting
        hog = list(range(100, 100 + free - 1))
        wait_for(side, "hog", hashes(free - 2, "g"), (free - 2) * PS + 1, 0, None)
        side.allocated("hog", hog, 0)
        held = side.plan([("hog", hog, True, 0, (free - 2) * PS + 1)])  # all but two pages held for its save
        prompt = hashes(3) + hashes(10, "new")
        assert wait_for(side, "big", prompt, 13 * PS + 1, 0, None) == 3 * PS  # its hits, though 10 pages lack
        side.allocated("big", list(range(20, 34)), 3 * PS)
        plan = side.plan([("big", list(range(20, 34)), True, 3 * PS, 10 * PS + 1)])
        assert [(len(j.pages), j.blocks) for j in plan.loads] == [(3, [20, 21, 22])]
        assert [j.blocks for j in plan.saves] == [[23, 24]]  # the two pages there were
        side.worker_done(done(held.step, plan.step))
        # Its saves end there: no more grows, and its admission goes as soon as its transfers are over.
        assert side.plan([("big", None, False, 13 * PS + 1, 1)]).saves == []
        assert side.finished("big") is False
        side.link.close()


def test_the_policy_maps_lora_adapters_to_tenants_and_classes_and_a_live_edit_moves_them():
    """The admin's mapping, not the client: requests the engine serves with an adapter the policy names
    land in that adapter's class (its partition) and tenant; others keep the engine's defaults; an edit
    of the mapping applies to the next request without a restart, and a bad one changes nothing."""
    mapped = CONFIG.model_dump()
    mapped["workloads"] = {"toB": {"isolationPercent": 50},
                           "adapters": [{"adapter": "support-bot", "workloadClass": "toB", "tenant": "acme"},
                                        {"adapter": "chat", "workloadClass": "toC"}]}
    path = socket_path()
    with live_sidecar(SidecarConfig.model_validate(mapped), pages=64, engine_socket=path,
                      storage=KVStorage(SHAPE, PS, pages=64, shared=True)) as (_, sidecar):
        link = SidecarLink(path, hello())
        side = LongSteps(link, PS, session="s", lookup_wait=0.5)

        def admitted_meta(req_id: str, tag: str, adapter: str, params: dict | None = None) -> tuple[str, str]:
            assert wait_for(side, req_id, hashes(3, tag), 13, 0, params, None, adapter) == 0
            side.allocated(req_id, [1, 2, 3, 4], 0)
            assert [len(job.pages) for job in side.plan([(req_id, [1, 2, 3, 4], True, 0, 13)]).saves] == [3]
            seq = sidecar.pool.sequences.live[side._requests[req_id].seq_id]
            return seq.meta.workload_class, seq.meta.tenant

        parts = sidecar.pool.stats().partitions
        assert parts["toB"].owned == parts["toC"].owned == 0
        assert admitted_meta("b", "b", "support-bot") == ("toB", "acme")
        assert admitted_meta("c", "c", "chat") == ("toC", "default")
        assert admitted_meta("n", "n", "") == ("toC", "default")  # no adapter: the engine's defaults
        assert admitted_meta("u", "u", "unmapped") == ("toC", "default")
        parts = sidecar.pool.stats().partitions
        assert parts["toB"].owned == 3 and parts["toC"].owned == 9  # the adapter's pages in to-B's partition

        # A live edit: support-bot becomes to-C; the next request follows, no restart.
        mapped["workloads"]["adapters"][0]["workloadClass"] = "toC"
        assert sidecar.apply_config_text(yaml.safe_dump(mapped), "edit")[0] == "applied"
        assert admitted_meta("b2", "b2", "support-bot") == ("toC", "acme")
        # A mapping naming an unknown class: refused, naming the field; the mapping in force stays.
        mapped["workloads"]["adapters"][0]["workloadClass"] = "gold"
        result, error, field = sidecar.apply_config_text(yaml.safe_dump(mapped), "bad edit")
        assert result != "applied" and field == "workloads.adapters.0.workloadClass", (result, error, field)
        assert sidecar.state.config.workloads.adapter_rule("support-bot").workloadClass == "toC"
        link.close()


def test_a_request_preempted_before_its_pages_came_then_aborted_never_saves_the_freed_blocks():
    """Its grow misses the step's wait; the engine preempts it (its blocks go to other requests at once),
    then the client aborts it: no later plan saves those blocks under its prompt's keys, and its pages go
    back to the pool (a save of reused blocks would publish another request's KV under this prompt)."""
    path, live = sidecar_with_channel()
    with live as (_, sidecar):
        side = ShortSteps(SidecarLink(path, hello()), PS, session="s1", lookup_wait=0.5)
        wait_for(side, "r", hashes(3), 13, 0, None)
        side.allocated("r", [1, 2, 3, 0], 0)
        assert side.plan([("r", [1, 2, 3, 0], True, 0, 13)]).saves == []  # the grow not answered in time
        side.plan([], preempted={"r"})  # vLLM freed blocks 1, 2, 3, 0
        side.finished("r")  # the client aborts it while preempted
        later = side.plan([])
        assert later.saves == [] and "r" not in later.coming
        settle(side.link, sidecar, lambda sc: sc.pool.stats().sequences == 0)
        assert sidecar.pool.stats().unwritten_pages == 0
        side.link.close()
