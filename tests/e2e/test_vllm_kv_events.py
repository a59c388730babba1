"""kvpool's tier in vLLM's own KV event stream: a real engine, the connector with ``kv_events``, vLLM's ZMQ
publisher, and a subscriber decoding with vLLM's own types (what llm-d's and Dynamo's indexers read).

vLLM's own prefix cache is off, so every event in the stream is kvpool's. The pool is small (40 pages of
32 tokens for prompts of 12 pages), so pages are evicted while the engine runs.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

if os.environ.get("KVPOOL_REQUIRE_ENGINE"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the engine tests need the vllm extra (make test installs it)")

import msgspec
import zmq
from engine_support import BLOCK, SidecarProcess, generate, make_engine, prompt
from support import free_port
from tiny_model import build_tiny_model

POOL_PAGES = 40
PROMPT_BLOCKS = 12


class Subscriber:
    """A ZMQ SUB socket bound on 127.0.0.1 (vLLM's publisher connects to it), decoding every batch."""

    def __init__(self) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = self._decoder.decode(payload)
            with self._lock:
                self.events.extend(batch.events)

    def snapshot(self) -> list:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("events")
    model = build_tiny_model(folder / "model")
    sub = Subscriber()
    sidecar = SidecarProcess(folder, pages=POOL_PAGES)
    sidecar.start()
    llm = make_engine(model, sidecar.socket, kv_events_endpoint=sub.endpoint, kv_events=True)
    try:
        yield llm, sidecar, sub
    finally:
        llm.llm_engine.engine_core.shutdown()
        sidecar.stop()
        sub.close()


def engine_hashes(tokens: list[int]) -> list[int]:
    """vLLM's block hashes of ``tokens`` as its events carry them, computed the way an indexer does (llm-d
    computes them from token ids): vLLM's own chain over full blocks, sha256, no extra keys."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)
    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


def held(events: list) -> dict:
    """What the stream says kvpool holds: hash -> (parent, token ids), replaying stores and removals."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    state: dict = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                state[h] = (parent, ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert h in state, "a removal of a block the stream never stored (or removed twice)"
                del state[h]
    return state


def settle(llm, sidecar, sub, *, quiet_s: float = 1.0, timeout_s: float = 20.0) -> list:
    """Run small requests until the stream stops growing: a step's commits and removals reach the stream
    with a later step (vLLM takes a connector's events once per step)."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        generate(llm, prompt(9_999, 20), max_tokens=2)  # shorter than a block: stores nothing
        time.sleep(quiet_s)
        n = len(sub.snapshot())
        if n == last:
            return sub.snapshot()
        last = n
    raise AssertionError("the event stream did not settle")


def test_the_stream_shows_every_page_kvpool_stored_and_evicted_then_loses_them_with_the_sidecar(stack):
    """One test, in this order: the second part reads a stream the first part wrote (the module's
    engine and subscriber live across tests, and the run's order is random)."""
    stream_shows_every_page_kvpool_stored_and_evicted_in_the_engines_own_hashes(stack)
    a_lost_sidecar_takes_its_pages_out_of_the_stream_one_removal_each(stack)


def stream_shows_every_page_kvpool_stored_and_evicted_in_the_engines_own_hashes(stack):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    llm, sidecar, sub = stack
    prompts = [prompt(1_000 + i, PROMPT_BLOCKS * BLOCK + 20) for i in range(8)]
    for p in prompts + prompts[:3]:
        generate(llm, p)
    events = settle(llm, sidecar, sub)

    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert stored and removed, "eight prompts of 12 pages in a 40-page pool: pages were stored and evicted"
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    assert all(e.medium == "CPU" for e in stored + removed)
    assert all(e.block_size == BLOCK and e.group_idx == 0 for e in stored)

    # Each stored block is a block of one of the prompts, under the engine's own hash of it.
    expected = {}
    for p in prompts:
        hashes = engine_hashes(p)
        for i, h in enumerate(hashes):
            expected[h] = (hashes[i - 1] if i else None, p[i * BLOCK : (i + 1) * BLOCK])
    for ev in stored:
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            assert h in expected, "a stored hash that is not the engine's hash of a prompt block"
            assert expected[h] == (parent, ev.token_ids[i * BLOCK : (i + 1) * BLOCK])
            parent = h

    # The stream agrees with the sidecar: what it says is held is what the pool caches, and it removed
    # exactly as many blocks as the pool evicted.
    state = held(events)
    stats = sidecar.get("/v1/stats")
    assert stats["sequences"] == 0
    assert len(state) == stats["cached_pages"]
    n_removed = sum(len(e.block_hashes) for e in removed)
    assert n_removed == sidecar.metric("kvpool_evicted_pages_total")
    n_stored = sum(len(e.block_hashes) for e in stored)
    assert sidecar.metric('kvpool_connector_kv_events_total{type="stored"}') == n_stored
    assert sidecar.metric('kvpool_connector_kv_events_total{type="removed"}') == n_removed

    # And a router reading it would send the next turn of a prompt still held to this pod: the pool
    # serves every block the stream says it holds.
    last = prompts[-1]
    hashes = engine_hashes(last)
    announced = 0
    while announced < len(hashes) and hashes[announced] in state:
        announced += 1
    assert announced >= 1
    _, from_pool = generate(llm, last)
    assert from_pool >= announced * BLOCK


def a_lost_sidecar_takes_its_pages_out_of_the_stream_one_removal_each(stack):
    from vllm.distributed.kv_events import AllBlocksCleared

    llm, sidecar, sub = stack
    generate(llm, prompt(2_000, PROMPT_BLOCKS * BLOCK + 20))
    before = held(settle(llm, sidecar, sub))
    assert before, "the pool holds pages the stream announced"
    sidecar.kill()
    try:
        events = settle(llm, sidecar, sub)
        assert held(events) == {}, "every page the stream announced was removed once the sidecar was gone"
        assert not any(isinstance(e, AllBlocksCleared) for e in events)
    finally:
        sidecar.start()
