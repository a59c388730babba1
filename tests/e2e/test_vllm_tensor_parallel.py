"""A tensor-parallel engine (TP=2 on vLLM-CPU, one core per rank) through the connector: each rank writes
its share of every page (the tiny model's one KV head is replicated on both ranks, so the pool holds two
heads a block), a page is committed once both ranks have written theirs, and outputs equal the same
TP=2 engine computing alone."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVPOOL_REQUIRE_ENGINE"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the engine tests need the vllm extra (make test installs it)")

from engine_support import BLOCK, SidecarProcess, generate, make_engine, prompt
from kvpool_sidecar.engines.tiny_model import build_tiny_model

PREFIX_BLOCKS = 12
TP2_SHAPE = "2,2,64,float32"  # the tiny model's layers and head dim; its one KV head on each of 2 ranks


def test_a_tp2_engine_loads_what_it_saved_with_the_tokens_it_computes_alone(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    sidecar = SidecarProcess(tmp_path, kv_shape=TP2_SHAPE)
    sidecar.start()
    llm = make_engine(model, sidecar.socket, tensor_parallel=2)
    try:
        shared = prompt(900, PREFIX_BLOCKS * BLOCK)
        first, second = shared + prompt(901, 45), shared + prompt(902, 37)
        baseline, computed_alone = generate(llm, second, fresh=True)
        assert computed_alone == 0
        generate(llm, first)  # both ranks save their share of the prefix's pages
        tokens, from_pool = generate(llm, second)
        assert from_pool >= PREFIX_BLOCKS * BLOCK
        assert tokens == baseline  # rank 1 attends with its own copy of the head: it loaded its share too
        assert sidecar.metric('kvpool_connector_tokens_total{direction="loaded"}') >= PREFIX_BLOCKS * BLOCK
    finally:
        llm.llm_engine.engine_core.shutdown()
        sidecar.stop()
