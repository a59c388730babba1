"""A tensor-parallel engine (TP=2 on vLLM-CPU, one core per rank) through the connector, on a tiny model
with two KV heads, one per rank: each rank writes its share of every page, a page is committed once both
ranks have written theirs, and outputs equal the same TP=2 engine computing alone. Then a TP=1 engine of
the same model on the same sidecar (the pool's shape fits both): another layout, another identity, so it
loads none of the TP=2 pages and computes the right tokens itself."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVPOOL_REQUIRE_ENGINE"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the engine tests need the vllm extra (make test installs it)")

from engine_support import BLOCK, SidecarProcess, generate, make_engine, prompt
from tiny_model import build_tiny_model

PREFIX_BLOCKS = 12
TWO_HEADS = "2,2,64,float32"  # the tiny model's layers and head dim, with two KV heads: one per TP=2 rank
LOADED = 'kvpool_connector_tokens_total{direction="loaded"}'


def until_loaded(llm, tokens: list[int], want: list[int], tries: int = 5) -> tuple[list[int], int]:
    """Generate until the pool served the prefix (every try with the right tokens)."""
    for _ in range(tries):
        out, from_pool = generate(llm, tokens)
        assert out == want
        if from_pool >= PREFIX_BLOCKS * BLOCK:
            break
    return out, from_pool


def test_a_tp2_engine_loads_what_it_saved_and_a_tp1_engine_never_loads_its_pages(tmp_path):
    model = build_tiny_model(tmp_path / "model", kv_heads=2)
    sidecar = SidecarProcess(tmp_path, kv_shape=TWO_HEADS)
    sidecar.start()
    shared = prompt(900, PREFIX_BLOCKS * BLOCK)
    first, second = shared + prompt(901, 45), shared + prompt(902, 37)
    try:
        tp2 = make_engine(model, sidecar.socket, tensor_parallel=2)
        try:
            baseline, computed_alone = generate(tp2, second, fresh=True)
            assert computed_alone == 0
            generate(tp2, first)  # both ranks save their share of the prefix's pages
            # Two bound ranks leave the sidecar little CPU on two cores: a lookup past lookup_wait_ms runs
            # without the pool (by design, with the right tokens), so a few tries.
            tokens, from_pool = until_loaded(tp2, second, baseline)
            assert from_pool >= PREFIX_BLOCKS * BLOCK
            assert tokens == baseline  # rank 1 attends with its own head: it loaded its share too
            assert sidecar.metric(LOADED) >= PREFIX_BLOCKS * BLOCK
        finally:
            tp2.llm_engine.engine_core.shutdown()
        loaded = sidecar.metric(LOADED)
        tp1 = make_engine(model, sidecar.socket)
        try:
            # First, before this engine saved anything of the prompt itself (a fresh run saves too):
            tokens, from_pool = generate(tp1, second)
            assert from_pool == 0  # the TP=2 pages are another layout: never loaded
            alone, _ = generate(tp1, second, fresh=True)
            assert tokens == alone
            tokens, from_pool = until_loaded(tp1, second, alone)
            assert from_pool >= PREFIX_BLOCKS * BLOCK and tokens == alone  # its own pages, its own layout
        finally:
            tp1.llm_engine.engine_core.shutdown()
        assert sidecar.metric(LOADED) > loaded
    finally:
        sidecar.stop()
