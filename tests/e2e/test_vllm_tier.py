"""kvpool as the secondary tier of vLLM's own offloading (issue 61): vLLM's scheduler-side tiering classes
(``TieringOffloadingSpec`` and its ``TieringOffloadingManager``, with the real shared CPU primary region
vLLM allocates) build ``KVPoolTier`` from the very tier entry the GPU manifest ships, and KV bytes round-trip
through a real ``kvpool-sidecar serve`` process. The test plays vLLM's GPU worker: it writes chunks into
the primary region (what vLLM's DMA does) and reads them back after a promotion."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import yaml

if os.environ.get("KVPOOL_REQUIRE_ENGINE"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the tier tests need the vllm extra (make test installs it)")

from engine_support import SidecarProcess
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "inference.yaml"
LAYERS, HEADS, DIM = 2, 2, 8  # float16: a chunk of 16 tokens is 2 x 2 x 2 x 8 x 2 x 16 = 2,048 bytes
KV_SHAPE = f"{LAYERS},{HEADS},{DIM},float16"
CHUNK = 2 * LAYERS * HEADS * DIM * 2 * 16
END = ScheduleEndContext([], [])


def shipped_tier() -> tuple[dict, dict]:
    """The GPU manifest's kv_connector_extra_config and its kvpool tier entry."""
    deployment = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "Deployment")
    engine = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    extra = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    [tier] = extra["secondary_tiers"]
    return extra, tier


REGIONS: list[Path] = []  # vLLM's primary regions the tests made (its scheduler side leaves the file)


class Layout(NamedTuple):
    """How vLLM offloads the model's KV: the offloaded group's block (tokens), the hashing's granularity
    (tokens), blocks per chunk, the group's id in vLLM's KV cache config, and how many groups it offloads."""

    tokens_per_block: int
    tokens_per_hash: int
    blocks_per_chunk: int = 1
    group_id: int = 0
    groups: int = 1


def manager(engine_id: str, sidecar: SidecarProcess, events: bool = False, layout: Layout | None = None,
            **tier_changes):
    """vLLM's tiering manager for one engine: the shipped config, pointed at this test's sidecar (no token
    file: the sidecar serves its own user), lookups answered within a second, with a 64-chunk primary
    tier; a chunk is 16 tokens (a page) whatever ``layout`` says."""
    engine_id = f"kvpool-test-{os.getpid()}-{engine_id}"
    REGIONS.append(Path(f"/dev/shm/vllm_offload_{engine_id}.mmap"))
    extra, tier = shipped_tier()
    # A lookup's answer may take longer than the shipped budget (20 ms) on a busy 2-core machine, which
    # these tests would read as a miss; the budget itself: test_a_stopped_sidecar_holds_no_lookup_past_the_budget.
    tier = {k: v for k, v in tier.items() if k != "token_file"} | {"socket": sidecar.socket,
                                                                  "lookup_wait_ms": 1000, **tier_changes}
    extra = extra | {"cpu_bytes_to_use": 64 * 4096, "secondary_tiers": [tier]}
    ps = extra["block_size"]
    layout = layout or Layout(ps, ps)
    assert layout.tokens_per_block * layout.blocks_per_chunk == ps
    layers = tuple(f"layer.{i}" for i in range(LAYERS))
    config = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(layout.tokens_per_block, layers, layout.group_id + g)
                     for g in range(layout.groups)),
        worker_kv_bytes_per_block=CHUNK // layout.blocks_per_chunk, enable_kv_cache_events=events,
        extra_config=extra, engine_id=engine_id, model=OffloadingModelConfig("org/tiny", "float16"),
        cache=OffloadingCacheConfig(layout.tokens_per_hash, layout.blocks_per_chunk),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
    spec = TieringOffloadingSpec(config)
    return spec.get_manager()


def keys(tag: str, n: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), group) for i in range(n)]


def primary(m) -> np.ndarray:
    return np.asarray(m.primary_tier.get_kv_memoryview()).view(np.uint8)


def steps_until(m, check, what: str, timeout: float = 10.0) -> None:
    """Scheduler steps (each ends with on_schedule_end) until ``check()``; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        m.on_schedule_end(END)
        time.sleep(0.01)


def store(m, req: str, ks: list[bytes], fill: int) -> None:
    """vLLM's GPU->CPU store of ``ks`` (bytes ``fill + i`` in chunk i), then its cascade into kvpool."""
    ctx = ReqContext(req)
    m.on_new_request(ctx)
    out = m.prepare_store(ks, ctx)
    view = primary(m)
    for i, chunk in enumerate(out.store_spec.chunk_ids):
        view[chunk, :CHUNK] = fill + i
    del view
    m.complete_store(out.keys_to_store, ctx)  # -> KVPoolTier.submit_store
    m.on_request_finished(ctx)


def lookups(m, ctx: ReqContext, ks: list[bytes], timeout: float = 10.0) -> list[LookupResult]:
    """vLLM's scan of a request's keys, step after step, until every answer is final (HIT or MISS)."""
    deadline = time.monotonic() + timeout
    while True:
        got = []
        for k in ks:
            got.append(m.lookup(k, ctx))
            if got[-1] is LookupResult.MISS:
                break
        if all(r in (LookupResult.HIT, LookupResult.MISS) for r in got):
            return got
        assert time.monotonic() < deadline, f"lookups never settled: {got}"
        m.on_schedule_end(END)
        time.sleep(0.01)


def loaded_bytes(m, ctx: ReqContext, ks: list[bytes]) -> list[int]:
    spec = m.prepare_load(ks, ctx)
    view = primary(m)
    out = [int(view[c, :CHUNK].min()) if view[c, :CHUNK].min() == view[c, :CHUNK].max() else -1
           for c in spec.chunk_ids]
    del view
    m.complete_load(ks, ctx)
    return out


@pytest.fixture
def sidecar(tmp_path):
    side = SidecarProcess(tmp_path, pages=64, kv_shape=KV_SHAPE,
                          config={"pageSize": shipped_tier()[0]["block_size"], "eviction": {"policy": "lru"},
                                  "pinning": {"autoPin": {"enabled": False}}})
    side.start()
    yield side
    if side.proc is not None:
        os.kill(side.proc.pid, signal.SIGCONT)
    side.stop()
    while REGIONS:
        REGIONS.pop().unlink(missing_ok=True)


def test_two_engines_share_pages_through_kvpool_behind_vllms_primary_tier(sidecar):
    """Engine 1 stores three chunks; engine 2 (another manager, another primary region) finds them in
    kvpool, promotes them, and reads the very bytes engine 1 wrote. A page is committed only after its
    bytes are written: with the tier's copy held back, the sidecar has nothing cached yet."""
    one, two = manager("e1", sidecar), manager("e2", sidecar)
    try:
        tier = one.secondary_tiers[0]
        gate = threading.Event()
        tier.side._lane.submit(gate.wait, 30)  # the tier's store lane, held: the store's copy waits behind
        ks = keys("doc", 3)
        store(one, "r1", ks, fill=7)
        steps_until(one, lambda: sidecar.get("/v1/stats")["sequences"] == 1, "the store was never admitted")
        time.sleep(0.2)
        assert sidecar.get("/v1/stats")["cached_pages"] == 0  # admitted, not written: not published
        gate.set()
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 3 and not one.has_pending_work(),
                    "the written pages were never committed")

        ctx = ReqContext("r2")
        two.on_new_request(ctx)
        assert lookups(two, ctx, ks) == [LookupResult.HIT] * 3  # promoted from kvpool into engine 2's tier
        assert loaded_bytes(two, ctx, ks) == [7, 8, 9]
        two.on_request_finished(ctx)
        steps_until(two, lambda: sidecar.get("/v1/stats")["sequences"] == 0, "the lookup's hold was never released")
        assert sidecar.metric('kvpool_connector_tokens_total{direction="saved"}') == 3 * 16
        assert sidecar.metric('kvpool_connector_tokens_total{direction="loaded"}') == 3 * 16
    finally:
        one.shutdown()
        two.shutdown()


def test_a_store_whose_session_ended_before_its_write_is_never_published(sidecar):
    """The store is admitted, then the tier's link fails before the copy runs: the session's fence is
    cleared, the copy writes nothing and the job is reported failed; nothing of it is ever published."""
    one = manager("e1", sidecar)
    try:
        tier = one.secondary_tiers[0]
        gate = threading.Event()
        tier.side._lane.submit(gate.wait, 30)
        store(one, "r1", keys("lost", 2), fill=3)
        steps_until(one, lambda: sidecar.get("/v1/stats")["sequences"] == 1, "the store was never admitted")
        tier.side.link._conn.sock.close()  # the link fails: the sidecar ends the session and clears its fence
        steps_until(one, lambda: sidecar.metric("kvpool_engine_lapsed_sequences_total") == 1, "never lapsed")
        gate.set()
        steps_until(one, lambda: not one.has_pending_work(), "the failed store was never reported")
        time.sleep(2.5)  # past the sidecar's quarantine (2 s): its pages went back unpublished
        stats = sidecar.get("/v1/stats")
        assert stats["cached_pages"] == 0 and stats["sequences"] == 0
        assert sidecar.metric('kvpool_connector_failures_total{operation="save"}') >= 1
    finally:
        one.shutdown()


def test_a_load_of_a_page_the_pool_lost_is_reported_failed_and_vllm_recomputes(sidecar):
    """Engine 2 finds the chunks in kvpool, then the sidecar is killed -9 and restarted before the
    promotion's copy runs: the pool (a new epoch) no longer holds them, the job fails, and vLLM's manager
    answers MISS for those keys (the engine computes them)."""
    one = manager("e1", sidecar)
    two = manager("e2", sidecar)
    try:
        ks = keys("gone", 2)
        store(one, "r1", ks, fill=5)
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 2, "never stored")
        tier = two.secondary_tiers[0]
        gate = threading.Event()
        ctx = ReqContext("r2")
        two.on_new_request(ctx)
        two.lookup(ks[0], ctx)
        two.lookup(ks[1], ctx)
        two.on_schedule_end(END)  # the hold-only admission goes out
        steps_until(two, lambda: all(tier.side.lookup("r2", k[:-4]) == "hit" for k in ks), "no hit")
        tier.side._load_lane.submit(gate.wait, 30)  # the promotion's copy waits behind
        assert [two.lookup(k, ctx) for k in ks] == [LookupResult.HIT_PENDING] * 2  # promotions start
        two.on_schedule_end(END)  # -> KVPoolTier.submit_load, queued behind the gate
        sidecar.kill()
        sidecar.start()  # same port: it takes over its segment under a new epoch
        gate.set()
        steps_until(two, lambda: not two.has_pending_work(), "the load was never reported")
        two.lookup(ks[0], ctx)  # vLLM's manager takes the tier's report in
        # The promotion failed: vLLM's primary tier dropped the slots it had allocated (a success would
        # have made them HIT, with whatever bytes the old segment still held).
        assert [two.primary_tier.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 2
        two.on_request_finished(ctx)
    finally:
        one.shutdown()
        two.shutdown()


def test_a_stopped_sidecar_holds_no_lookup_past_the_budget(sidecar):
    """SIGSTOP: each lookup call returns at once (RETRY), and once the tier's lookup_wait_ms has passed
    since its keys were sent the answer is MISS: vLLM computes the prompt; nothing waited for the sidecar."""
    one = manager("e1", sidecar, lookup_wait_ms=50)
    try:
        os.kill(sidecar.proc.pid, signal.SIGSTOP)
        ctx = ReqContext("r")
        one.on_new_request(ctx)
        ks = keys("stopped", 4)
        started = time.monotonic()
        slowest = 0.0
        verdict = None
        while verdict is None:
            for k in ks:
                t = time.monotonic()
                result = one.lookup(k, ctx)
                slowest = max(slowest, time.monotonic() - t)
                if result is LookupResult.MISS:
                    verdict = time.monotonic() - started
                    break
            one.on_schedule_end(END)
            time.sleep(0.005)
            assert time.monotonic() - started < 5, "the lookups never gave up"
        assert slowest < 0.02  # no lookup call waited for the sidecar
        assert 0.05 <= verdict < 1.0  # MISS once the budget was spent, not before
        one.on_request_finished(ctx)
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
        one.shutdown()


def test_the_tier_announces_what_it_published_as_vllms_offloading_events(sidecar):
    """With vLLM's KV events on, the chunks a store published in kvpool come out of vLLM's manager as
    this tier's events (stored, medium CPU), once committed."""
    from vllm.v1.kv_offload.base import Medium

    one = manager("e1", sidecar, events=True)
    try:
        ks = keys("announced", 3)
        store(one, "r1", ks, fill=1)
        seen: list = []
        steps_until(one, lambda: seen.extend(e for e in one.take_events() if e.ownership == "KVPoolTier")
                    or any(not e.removed for e in seen), "no stored event from the tier")
        stored = [k for e in seen if not e.removed for k in e.keys]
        assert stored == ks and all(e.medium is Medium.CPU for e in seen)
    finally:
        one.shutdown()


def test_a_pin_by_token_ids_holds_the_chunks_the_tier_stored(sidecar):
    """Once vLLM's engine core has seeded its block hashes, the tier's hello tells the sidecar how the
    engine hashes (a chunk of one block is keyed by that block's hash): a pin naming the served model and
    a prompt's token ids then pins the chunks the tier stored for it."""
    import httpx
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    sha256 = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(sha256)  # what vLLM's engine core does once its scheduler is built
    one = manager("e1", sidecar)
    try:
        tokens = list(range(100, 100 + 3 * 16 + 1))
        parent, hashes = kv_cache_utils.NONE_HASH, []
        for i in range(3):  # vLLM's chained hashes of the prompt's full blocks, as its scheduler makes them
            parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[i * 16 : (i + 1) * 16], None)
            hashes.append(bytes(parent))
        store(one, "r1", [make_offload_key(h, 0) for h in hashes], fill=4)
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 3, "never stored")
        r = httpx.post(sidecar.url + "/v1/pins", json={"tokens": tokens, "model": "org/tiny"}, timeout=5)
        assert r.status_code == 201 and len(r.json()["pages"]) == 3, r.text
        assert sidecar.get("/v1/stats")["pinned_pages"] == 3
    finally:
        one.shutdown()


def test_a_pin_by_token_ids_works_when_the_idle_link_would_connect_before_the_hashes_are_seeded(sidecar,
                                                                                                 monkeypatch):
    """With vLLM's KV events on (as the example ships), the tier's link steps when idle; the engine core
    builds the tier before it seeds its block hashes (NONE_HASH). The link waits for them before it
    connects, so the hello that opens the session carries the engine's hashing and a pin by token ids
    pins the chunks the tier stored (it answered 422 'no engine serving model' when an idle step had
    connected first)."""
    import httpx
    from kvpool_sidecar.engines import link
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    monkeypatch.setattr(link, "REPORT_EVERY", 0.02)  # idle steps every 20 ms (1 s in production)
    monkeypatch.delattr(kv_cache_utils, "NONE_HASH", raising=False)  # an engine core not yet seeded
    one = manager("e1", sidecar, events=True)
    try:
        time.sleep(0.3)  # many idle steps
        sha256 = get_hash_fn_by_name("sha256")
        kv_cache_utils.init_none_hash(sha256)  # what vLLM's engine core does once its scheduler is built
        tokens = list(range(200, 200 + 2 * 16))
        parent, hashes = kv_cache_utils.NONE_HASH, []
        for i in range(2):
            parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[i * 16 : (i + 1) * 16], None)
            hashes.append(bytes(parent))
        store(one, "r1", [make_offload_key(h, 0) for h in hashes], fill=2)
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 2, "never stored")
        r = httpx.post(sidecar.url + "/v1/pins", json={"tokens": tokens, "model": "org/tiny"}, timeout=5)
        assert r.status_code == 201 and len(r.json()["pages"]) == 2, r.text
    finally:
        one.shutdown()


def test_reset_cache_waits_for_a_store_whose_admission_was_just_answered(sidecar):
    """vLLM's reset_cache (/reset_prefix_cache, sleep) drains the tier, then asserts no job is left. A store
    whose admission has been answered, but whose copy the link's thread has not queued yet, is still a job:
    drain returns once it is reported, and vLLM's manager takes the report in."""
    one = manager("e1", sidecar)
    go = threading.Event()
    try:
        link = one.secondary_tiers[0].side.link
        admit, answered = link.admit, threading.Event()

        def admit_then_pause(op):  # the link's thread, between the answer and the tier's own callback
            future = admit(op)
            future.add_done_callback(lambda f: (answered.set(), go.wait(10)))
            return future

        link.admit = admit_then_pause
        store(one, "r1", keys("drain", 2), fill=1)
        assert answered.wait(10), "the store was never admitted"
        threading.Timer(0.3, go.set).start()
        one.reset_cache()  # asserts every job was reported once the tiers drained
        assert not one.has_pending_work()
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 2, "the store was lost")
    finally:
        go.set()
        one.shutdown()


def test_a_job_whose_copy_raises_anything_is_reported_failed_and_vllm_unpins_its_chunks(sidecar, monkeypatch):
    """A bug in a copy (a TypeError here), or a lane that refuses the copy once the store's admission is
    answered, still reports the job (failed): vLLM unpins the primary chunks of a cascade and drops the
    slots of a promotion (the keys are a MISS, recomputed); the store's admission is released."""
    from kvpool_sidecar.storage.tensors import AttachedKV

    one, two = manager("e1", sidecar), manager("e2", sidecar)
    try:
        ks = keys("bug", 2)
        store(one, "r1", ks, fill=2)
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 2 and not one.has_pending_work(),
                    "never stored")

        def bug(mapped, fence=None):
            raise TypeError("a bug in a copy")

        monkeypatch.setattr(AttachedKV, "check", bug)  # the fence check of every store slice and load
        store(one, "r3", keys("bug-store", 2), fill=3)
        steps_until(one, lambda: not one.has_pending_work(), "the store that raised was never reported")

        tier = two.secondary_tiers[0]
        ctx = ReqContext("r2")
        two.on_new_request(ctx)
        assert [two.lookup(k, ctx) for k in ks] == [LookupResult.RETRY] * 2
        two.on_schedule_end(END)
        steps_until(two, lambda: all(tier.side.lookup("r2", k[:-4]) == "hit" for k in ks), "no hit")
        assert [two.lookup(k, ctx) for k in ks] == [LookupResult.HIT_PENDING] * 2
        two.on_schedule_end(END)  # -> submit_load, whose copy raises
        steps_until(two, lambda: not two.has_pending_work(), "the load that raised was never reported")
        two.lookup(ks[0], ctx)
        assert [two.primary_tier.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 2
        two.on_request_finished(ctx)

        monkeypatch.undo()
        lane = one.secondary_tiers[0].side._lane

        def refused(*args, **kwargs):
            raise RuntimeError("cannot schedule new futures after shutdown")

        monkeypatch.setattr(lane, "submit", refused)
        store(one, "r4", keys("bug-lane", 2), fill=4)
        steps_until(one, lambda: not one.has_pending_work(), "the store whose copy was refused was never reported")
        steps_until(one, lambda: sidecar.get("/v1/stats")["sequences"] == 0, "the refused store's admission is held")
        assert sidecar.get("/v1/stats")["cached_pages"] == 2
    finally:
        monkeypatch.undo()
        one.shutdown()
        two.shutdown()


def test_events_expect_the_tiers_removals_as_vllms_own_removing_tiers_do(sidecar):
    """kvpool announces its removals, so its stored events say so (``removal_expected``, as vLLM's kvcr
    tier's): vLLM's event tracker then keeps a chunk's payload after vLLM's primary tier evicts it, and
    kvpool's later removal names every block hash of the chunk (a chunk of two 8-token blocks here), not
    a placeholder of its key's hash alone, which would leave the first block in a router's index."""
    from types import SimpleNamespace

    from vllm.distributed.kv_events import BlockRemoved
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventGroupSpec,
        OffloadingEventsTracker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    one = manager("e1", sidecar, events=True, layout=Layout(8, 8, blocks_per_chunk=2))
    try:
        tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, True))
        group = GroupOffloadConfig(0, 8, 16, 2, OffloadingEventGroupSpec("full_attention", None), None, None, None)
        first, last = hashlib.sha256(b"block 0").digest(), hashlib.sha256(b"block 1").digest()
        request = SimpleNamespace(block_hashes=[first, last], all_token_ids=list(range(16)), lora_request=None)
        key = make_offload_key(last, 0)
        tracker.record_store(request, group, 0, key)  # what vLLM's scheduler records before it stores
        published: list = []

        def drain() -> list:
            published.extend(tracker.take_events(one.take_events()))
            return published

        store(one, "r1", [key], fill=1)
        steps_until(one, lambda: any(e.ownership == "KVPoolTier" for e in drain()), "never announced")
        store(one, "r2", keys("filler", 40), fill=2)  # both tiers (64 chunks, 64 pages) fill up
        steps_until(one, lambda: not one.has_pending_work(), "the stores were never reported")
        ctx = ReqContext("r3")
        one.on_new_request(ctx)
        out = one.prepare_store(keys("more", 40), ctx)  # evicts the chunk from vLLM's primary tier ...
        assert any(isinstance(e, BlockRemoved) and e.ownership is None for e in drain())
        one.complete_store(out.keys_to_store, ctx)  # ... and their cascade evicts it from kvpool
        one.on_request_finished(ctx)
        ours = [maybe_convert_block_hash(h) for h in (first, last)]  # as vLLM's events name them

        def removed() -> list:
            return [e for e in drain() if isinstance(e, BlockRemoved) and e.ownership == "KVPoolTier"
                    and ours[-1] in e.block_hashes]

        steps_until(one, removed, "kvpool never removed the chunk")
        [event] = removed()
        assert ours[0] in event.block_hashes  # the chunk's first block too
    finally:
        one.shutdown()


def test_a_chunk_of_the_offloaded_groups_own_block_size_and_id_round_trips(sidecar):
    """The offloaded group is vLLM's KV cache group 1, with 16-token blocks hashed every 8 tokens (a
    hybrid model's hash granularity): a chunk is one 16-token block (a page) and its keys carry group 1.
    Two offloaded groups are refused, naming how many."""
    from kvpool_sidecar.engines.blocks import LayoutError

    layout = Layout(16, 8, group_id=1)
    one, two = manager("e1", sidecar, layout=layout), manager("e2", sidecar, layout=layout)
    try:
        ks = keys("group", 3, group=1)
        store(one, "r1", ks, fill=11)
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 3, "never stored")
        ctx = ReqContext("r2")
        two.on_new_request(ctx)
        assert lookups(two, ctx, ks) == [LookupResult.HIT] * 3
        assert loaded_bytes(two, ctx, ks) == [11, 12, 13]
        two.on_request_finished(ctx)
    finally:
        one.shutdown()
        two.shutdown()
    with pytest.raises(LayoutError, match="offloading has 2"):
        manager("e3", sidecar, layout=Layout(16, 16, groups=2))


def test_vllms_own_tier_keys_are_accepted_and_kvpools_typos_refused(sidecar):
    """``locality`` (vLLM reads it from every secondary_tiers entry and passes it on) is the tier's: vLLM's
    per-request tier filter honours it and its events carry it. A typo of kvpool's own field is refused,
    naming it."""
    from kvpool_sidecar.engines.settings import ConnectorConfigError
    from vllm.v1.kv_offload.base import Locality, TierFilter, TierMatcher

    one = manager("e1", sidecar, events=True, locality="LOCAL")
    two = manager("e2", sidecar, locality="LOCAL")
    try:
        assert one.secondary_tiers[0].locality is Locality.LOCAL
        ks = keys("local", 2)
        store(one, "r1", ks, fill=1)
        seen: list = []
        steps_until(one, lambda: seen.extend(e for e in one.take_events() if e.ownership == "KVPoolTier")
                    or seen, "no event from the tier")
        assert all(e.locality is Locality.LOCAL for e in seen)
        remote_only = ReqContext("r2", load_tier_filter=TierFilter((TierMatcher(locality=Locality.REMOTE),)))
        two.on_new_request(remote_only)
        assert two.lookup(ks[0], remote_only) is LookupResult.MISS  # kvpool, a local tier, is not asked
        two.on_request_finished(remote_only)
        anywhere = ReqContext("r3")
        two.on_new_request(anywhere)
        assert two.lookup(ks[0], anywhere) is LookupResult.RETRY  # kvpool is asked
        two.on_request_finished(anywhere)
    finally:
        one.shutdown()
        two.shutdown()
    with pytest.raises(ConnectorConfigError, match=r"secondary_tiers\[KVPoolTier\]\.sockte"):
        manager("e2", sidecar, sockte="/tmp/x.sock")
    with pytest.raises(ConnectorConfigError, match=r"secondary_tiers\[KVPoolTier\]\.locality"):
        manager("e3", sidecar, locality="NEARBY")


def test_a_hold_no_load_will_use_is_released_once_its_request_is_scheduled(sidecar):
    """Two requests of one engine ask kvpool about the same prefix in the same step: one hold each. The
    first promotes the chunks; the second then finds them in vLLM's primary tier and never asks kvpool
    again. Once vLLM schedules both, neither hold pins the pool's pages (not only when they finish)."""
    one, two = manager("e1", sidecar), manager("e2", sidecar)
    try:
        ks = keys("shared", 3)
        store(one, "r1", ks, fill=1)
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 3, "never stored")
        a, b = ReqContext("a"), ReqContext("b")
        two.on_new_request(a)
        two.on_new_request(b)
        assert [two.lookup(k, a) for k in ks] == [LookupResult.RETRY] * 3
        assert [two.lookup(k, b) for k in ks] == [LookupResult.RETRY] * 3
        two.on_schedule_end(END)
        steps_until(two, lambda: sidecar.get("/v1/stats")["sequences"] == 2, "the holds were never made")
        assert lookups(two, a, ks) == [LookupResult.HIT] * 3  # promoted for a
        assert lookups(two, b, ks) == [LookupResult.HIT] * 3  # vLLM's primary tier: kvpool not asked
        two.on_schedule_end(ScheduleEndContext(["a", "b"], []))  # both scheduled, still running
        steps_until(two, lambda: sidecar.get("/v1/stats")["sequences"] == 0, "an unused hold stays pinned")
        two.on_request_finished(a)
        two.on_request_finished(b)
    finally:
        one.shutdown()
        two.shutdown()


def test_a_promotion_never_waits_behind_a_cascade(sidecar):
    """The tier's cascades are held up (their lane blocked); a promotion of chunks kvpool holds still
    completes: loads have a lane of their own."""
    one, two = manager("e1", sidecar), manager("e2", sidecar)
    gate = threading.Event()
    try:
        ks = keys("promoted", 2)
        store(one, "r1", ks, fill=6)
        steps_until(one, lambda: sidecar.get("/v1/stats")["cached_pages"] == 2, "never stored")
        two.secondary_tiers[0].side._lane.submit(gate.wait, 30)  # the cascades' lane, blocked
        store(two, "w", keys("waiting", 2), fill=1)  # a cascade queued behind it
        ctx = ReqContext("r2")
        two.on_new_request(ctx)
        assert lookups(two, ctx, ks, timeout=5) == [LookupResult.HIT] * 2
        assert loaded_bytes(two, ctx, ks) == [6, 7]
        two.on_request_finished(ctx)
    finally:
        gate.set()
        one.shutdown()
        two.shutdown()


def test_a_hinted_lookup_finds_chunks_only_the_peer_sidecar_held_with_its_bytes(tmp_path):
    """Issue 66 on the tier path: engine 1's tier stores chunks on sidecar A; engine 2's tier, on sidecar B
    whose member is A, finds none without a hint, and all of them, with A's bytes, when its request names A
    (vLLM's remote_kv_source): B's hold-only admission fetched them from A."""
    from kvpool_sidecar.peers import agent

    if not agent.available():
        pytest.skip("NIXL is not installed: the peers extra")
    config = {"pageSize": shipped_tier()[0]["block_size"], "eviction": {"policy": "lru"},
              "pinning": {"autoPin": {"enabled": False}}}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = SidecarProcess(tmp_path / "a", pages=64, kv_shape=KV_SHAPE, config=config, peers=())
    b = SidecarProcess(tmp_path / "b", pages=64, kv_shape=KV_SHAPE, config=config, peers=(f"127.0.0.1:{a.peer_port}",))
    a.launch()
    b.launch()
    a.wait_ready()
    b.wait_ready()
    one, two = manager("e1", a), manager("e2", b, peer_fetch_wait_ms=2000)
    try:
        ks = keys("peer", 3)
        store(one, "r1", ks, fill=5)
        steps_until(one, lambda: a.get("/v1/stats")["cached_pages"] == 3 and not one.has_pending_work(),
                    "the chunks were never committed on A")
        plain = ReqContext("plain")
        two.on_new_request(plain)
        assert lookups(two, plain, ks)[0] is LookupResult.MISS  # no hint: A is not asked
        two.on_request_finished(plain)
        hinted = ReqContext("hinted", kv_transfer_params={
            "remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": a.peer_port}})
        two.on_new_request(hinted)
        assert lookups(two, hinted, ks) == [LookupResult.HIT] * 3
        assert loaded_bytes(two, hinted, ks) == [5, 6, 7]
        two.on_request_finished(hinted)
        assert b.metric("kvpool_peer_fetch_pages_total") == 3
        steps_until(two, lambda: b.get("/v1/stats")["sequences"] == 0, "B's hold was never released")
        steps_until(one, lambda: a.get("/v1/stats")["sequences"] == 0, "A still holds pages for B")
    finally:
        one.shutdown()
        two.shutdown()
        a.stop()
        b.stop()
        while REGIONS:
            REGIONS.pop().unlink(missing_ok=True)
