"""Tensor-parallel ranks through the connector's halves (the real TP=2 engine is in
tests/e2e/test_vllm_tensor_parallel.py): each rank writes its share of every page, a page is committed
only once every rank wrote its share without failing, and an engine of another degree never meets it."""

from __future__ import annotations

import time

import pytest
import torch
from kvpool_sidecar.engines.blocks import LayoutError, PageCopier, check_compatible, engine_layers
from kvpool_sidecar.engines.link import SidecarLink
from kvpool_sidecar.engines.scheduler import StepDone
from kvpool_sidecar.storage import KVStorage, ModelShape
from support import LongSteps, live_sidecar, socket_path
from test_engine_connector import CONFIG, PS, done, hashes, hello, wait_for
from test_engine_identity import KV, config
from test_engine_sessions import until

TP2 = ModelShape(layers=2, kv_heads=2, head_dim=8, dtype="float32")  # 1 KV head on each of 2 ranks


def rank_kv(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """One rank's KV in vLLM's CPU layout: [blocks, kv_heads (1 here), block_size, 2 * head_dim]."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn((num_blocks, 1, PS, 16), generator=g) for i in range(2)}


def test_each_rank_writes_its_share_of_a_page_and_reads_back_its_own():
    storage = KVStorage(TP2, PS, pages=8, shared=True, backend="torch")
    try:
        ranks = [rank_kv(6, seed) for seed in (1, 2)]
        for r, kv in enumerate(ranks):
            layers = engine_layers(kv, 6)
            check_compatible(layers, PS, storage.handle(), ranks=2)
            PageCopier(layers, rank=r, ranks=2).save(storage.kv, [4], [7])
        # The page's layer row: rank 0's block, then rank 1's (its heads in rank order).
        row = storage.kv[7, 1].flatten()
        half = row.numel() // 2
        assert torch.equal(row[:half], ranks[0]["layer.1"][4].flatten())
        assert torch.equal(row[half:], ranks[1]["layer.1"][4].flatten())
        for r, kv in enumerate(ranks):
            fresh = {name: torch.zeros_like(t) for name, t in kv.items()}
            PageCopier(engine_layers(fresh, 6), rank=r, ranks=2).load(storage.kv, [7], [0])
            assert all(torch.equal(fresh[n][0], kv[n][4]) for n in kv)
    finally:
        storage.close()


def test_a_pool_shaped_for_another_degree_or_strided_kernels_are_refused_naming_both():
    storage = KVStorage(TP2, PS, pages=4, shared=True, backend="torch")
    try:
        layers = engine_layers(rank_kv(6, 1), 6)
        with pytest.raises(LayoutError, match="kv_heads: of all ranks together"):
            check_compatible(layers, PS, storage.handle())  # a TP=1 engine of this model on the TP=2 pool
        with pytest.raises(LayoutError, match="tensor_parallel_size > 1"):
            PageCopier(layers, backend="triton", rank=0, ranks=2)
    finally:
        storage.close()


def test_the_tensor_parallel_degree_is_part_of_the_identity():
    from kvpool_sidecar.engines.identity import model_identity

    assert model_identity(config(), KV, 2) != model_identity(config(), KV, 1)
    assert model_identity(config(), KV, 2) == model_identity(config(), KV, 2)


def test_a_page_is_committed_only_once_every_rank_wrote_its_share_and_never_after_a_failure():
    path = socket_path()
    storage = KVStorage(TP2, PS, pages=32, shared=True)
    with live_sidecar(CONFIG, pages=32, storage=storage, engine_socket=path) as (_, sidecar):
        side = LongSteps(SidecarLink(path, hello()), PS, session="s", lookup_wait=1.0, world_size=2)
        for req, tag, rank1_fails in (("ok", "a", False), ("bad", "b", True)):
            wait_for(side, req, hashes(3, tag), 13, 0, None)
            side.allocated(req, [1, 2, 3, 4], 0)
            step = side.plan([(req, [1, 2, 3, 4], True, 0, 13)]).step
            side.worker_done(done(step))  # rank 0 wrote its share: not yet
            side.worker_done(StepDone({step: 1}, {(step, req)} if rank1_fails else set()))  # rank 1
            side.finished(req)
            side.sent({req})
        until(lambda: sidecar.pool.stats().sequences == 0, "both requests released")
        assert wait_for(side, "ok again", hashes(3, "a"), 13, 0, None) == 3 * PS
        assert wait_for(side, "bad again", hashes(3, "b"), 13, 0, None) == 0  # rank 1's share is missing
        side.link.close()


def test_one_ranks_report_alone_commits_nothing():
    path = socket_path()
    with live_sidecar(CONFIG, pages=32, storage=KVStorage(TP2, PS, pages=32, shared=True),
                      engine_socket=path) as (_, sidecar):
        side = LongSteps(SidecarLink(path, hello()), PS, session="s", lookup_wait=1.0, world_size=2)
        wait_for(side, "r", hashes(3), 13, 0, None)
        side.allocated("r", [1, 2, 3, 4], 0)
        step = side.plan([("r", [1, 2, 3, 4], True, 0, 13)]).step
        side.worker_done(done(step))
        side.finished("r")
        side.sent({"r"})  # vLLM says finished only when every rank did; forced here
        side.plan([])  # a later step: the link has sent what was queued
        time.sleep(0.1)
        # Nothing committed, and the pages stay held: rank 1's copy may still be writing them.
        assert sidecar.pool.stats().cached_pages == 0 and sidecar.pool.stats().sequences == 1
        side.worker_done(StepDone({step: 1}, {(step, "r")}))  # rank 1: its share failed
        until(lambda: sidecar.pool.stats().sequences == 0, "released once every rank reported")
        assert sidecar.pool.stats().cached_pages == 0
        side.link.close()
