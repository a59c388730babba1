"""KV storage: Triton kernels (interpreted on the CPU) bit-exact against torch; pool + storage;
sharing the pool with another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.storage import Backend, Fenced, KVStorage, ModelShape, StaleHandle, kernels, memory, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPE = dict(layers=2, kv_heads=2, head_dim=8)


def pool_tensor(dtype: torch.dtype, pages: int = 5, page_size: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn((pages, 2, 2, page_size, 2, 8), generator=g).to(dtype)


def test_tests_run_the_interpreter():
    assert os.environ["TRITON_INTERPRET"] == "1"
    storage = KVStorage(ModelShape(**SHAPE), 4, pages=2)
    assert storage.backend is Backend.TRITON_INTERPRETER and storage.describe()["kernels"] == "triton-interpreter"
    assert KVStorage(ModelShape(**SHAPE), 4, pages=2, backend="torch").backend is Backend.TORCH


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_from_a_fused_qkv_view_is_bit_exact(dtype):
    tokens, heads, dim = 6, 2, 8
    qkv = torch.randn(tokens, 3 * heads, dim).to(dtype)  # [q | k | v] heads, as engines fuse them
    key, value = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    assert not key.is_contiguous()
    slots = torch.tensor([0, 5, -1, 9, 19, 2])
    got, want = pool_tensor(dtype), pool_tensor(dtype)
    kernels.write_kv(got, 1, key, value, slots)
    reference.write_kv(want, 1, key, value, slots)
    assert torch.equal(got.view(torch.uint8) if dtype != torch.float32 else got, want.view(torch.uint8)
                       if dtype != torch.float32 else want)
    assert torch.equal(got[1, 1, 0, 1], key[1])  # slot 5 = page 1, offset 1
    assert torch.equal(got[4, 1, 1, 3], value[4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_page_moves_are_bit_exact(dtype):
    got, want = pool_tensor(dtype), pool_tensor(dtype)
    src, dst = torch.tensor([0, 3]), torch.tensor([4, 1])
    kernels.copy_pages(got, src, dst)
    reference.copy_pages(want, src, dst)
    assert torch.equal(got.view(torch.int8), want.view(torch.int8))
    packed = kernels.gather_pages(got, torch.tensor([2, 0]))
    assert torch.equal(packed.view(torch.int8), reference.gather_pages(want, torch.tensor([2, 0])).view(torch.int8))
    fresh = torch.zeros_like(got)
    kernels.scatter_pages(fresh, torch.tensor([3, 1]), packed)
    assert torch.equal(fresh[3], got[2]) and torch.equal(fresh[1], got[0])


def test_sizes_and_budget():
    shape = ModelShape(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    assert shape.bytes_per_token() == 2 * 32 * 8 * 128 * 2  # 128 KiB: Llama-3-8B's KV per token
    storage = KVStorage(ModelShape(**SHAPE, dtype="float32"), 4, memory_bytes=10_000, backend="torch")
    assert storage.num_pages == 10_000 // (2 * 2 * 2 * 8 * 4 * 4)
    with pytest.raises(ValueError, match="dtype"):
        ModelShape(1, 1, 1, "int4")


def test_pool_and_storage_together():
    spec = KVCachePolicySpec.model_validate({"pageSize": 4, "eviction": {"policy": "lru"},
                                            "pinning": {"autoPin": {"enabled": False}}})
    pool = PagePool(8, spec, clock=lambda: 0.0)
    storage = KVStorage(ModelShape(**SHAPE, dtype="float16"), 4, pages=8)
    prompt = list(range(10))  # 2 full pages and a partial one
    adm = pool.admit("a", prompt)
    slots = torch.tensor([adm.page_ids[t // 4] * 4 + t % 4 for t in range(10)])
    written = {}
    for layer in range(2):
        k, v = torch.randn(10, 2, 8).half(), torch.randn(10, 2, 8).half()
        storage.write_kv(layer, k, v, slots)
        written[layer] = (k, v)
    pool.commit("a", 10)
    pool.release("a")
    hit = pool.admit("b", prompt[:8] + [77, 78])
    assert hit.num_cached_tokens == 8
    packed = storage.gather_pages(hit.page_ids[:2]).view(2, 2, 2, 4, 2, 8)
    for layer, (k, v) in written.items():
        assert torch.equal(packed[:, layer, 0].reshape(8, 2, 8), k[:8])
        assert torch.equal(packed[:, layer, 1].reshape(8, 2, 8), v[:8])
    # Fork: the partial last page is copied so the two continuations can diverge.
    pool.commit("b", 10)
    forked = pool.fork("b", "c")
    storage.copy_pages([forked.copy_src], [forked.copy_dst])
    assert torch.equal(storage.kv[forked.copy_dst], storage.kv[forked.copy_src])


ENGINE = """
import json, sys, torch
from kvpool_sidecar.storage import KVStorage, StaleHandle
handle = json.loads(sys.argv[1])
try:
    attached = KVStorage.attach(handle)
except StaleHandle as exc:
    print("STALE", exc)
    sys.exit(3)
page = int(sys.argv[2])
attached.kv[page].fill_(1.5)  # the engine writes KV into a page the sidecar allocated
attached.kv[page, 0, 0, 0, 0, 0] = 7.25
attached.close()
print("WROTE")
"""


def run_engine(handle: dict, page: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENGINE, json.dumps(handle), str(page)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TRITON_INTERPRET": "0"})


def test_another_process_shares_the_pool_and_a_stale_handle_is_refused():
    storage = KVStorage(ModelShape(**SHAPE, dtype="float32"), 4, pages=4, shared=True)
    handle = storage.handle()
    assert handle["kind"] == "shm" and handle["epoch"] == storage.epoch
    done = run_engine(handle, 2)
    assert done.returncode == 0 and "WROTE" in done.stdout, done.stderr
    assert float(storage.kv[2, 0, 0, 0, 0, 0]) == 7.25 and float(storage.kv[2, 1, 1, 3, 1, 7]) == 1.5
    assert float(storage.kv[1].abs().sum()) == 0  # other pages untouched
    storage.close()  # the sidecar restarts: a new pool, a new epoch
    again = KVStorage(ModelShape(**SHAPE, dtype="float32"), 4, pages=4, shared=True)
    stale = run_engine(handle, 2)
    assert stale.returncode == 3 and "STALE" in stale.stdout and "fetch a new handle" in stale.stdout
    assert again.epoch != handle["epoch"]
    again.close()


def test_bad_arguments_change_nothing():
    storage = KVStorage(ModelShape(**SHAPE, dtype="float32"), 4, pages=2)
    before = storage.kv.clone()
    with pytest.raises(IndexError):
        storage.copy_pages([0], [2])
    with pytest.raises(IndexError):
        storage.write_kv(0, torch.ones(1, 2, 8), torch.ones(1, 2, 8), [8])
    with pytest.raises(ValueError, match="buffer"):
        storage.scatter_pages([0], torch.ones(3))
    assert torch.equal(storage.kv, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_moves_between_two_tensors_are_bit_exact(dtype):
    # An engine's blocks and the pool's pages: two tensors, rows of one length, ids in any order.
    g = torch.Generator().manual_seed(1)
    engine = torch.randn((6, 96), generator=g).to(dtype)
    got, want = torch.zeros((9, 96), dtype=dtype), torch.zeros((9, 96), dtype=dtype)
    src, dst = torch.tensor([5, 0, 3]), torch.tensor([8, 2, 4])
    kernels.move_rows(engine, src, got, dst)
    reference.move_rows(engine, src, want, dst)
    assert torch.equal(got.view(torch.int8), want.view(torch.int8))
    assert torch.equal(got[8], engine[5]) and not got[0].any()
    with pytest.raises(ValueError, match="rows differ"):
        kernels.move_rows(engine, src, torch.zeros((9, 95), dtype=dtype), dst)


def test_host_row_moves_copy_runs_and_equal_an_indexed_copy():
    """Runs of rows consecutive on both sides go in one copy; the bytes are those of an indexed copy."""
    assert reference.row_runs([4, 5, 6, 0, 9, 10], [1, 2, 3, 4, 7, 9]) == [(4, 1, 3), (0, 4, 1), (9, 7, 1),
                                                                          (10, 9, 1)]
    g = torch.Generator().manual_seed(2)
    engine = torch.randn((64, 40), generator=g)
    src = torch.cat([torch.arange(10, 20), torch.randperm(64, generator=g)[:20]])
    dst = torch.cat([torch.arange(30, 40), torch.randperm(30, generator=g)[:20]])
    got, want = torch.zeros((40, 40)), torch.zeros((40, 40))
    reference.move_rows(engine, src, got, dst)
    want[dst] = engine[src]
    assert torch.equal(got, want)


def test_a_named_instance_takes_over_the_segment_its_killed_predecessor_left():
    """A restart reuses its predecessor's file (an engine still mapping it would otherwise hold a second
    pool's worth of the shm volume), resized to the new pool, under a new epoch and with every fence
    cleared: the old mapping, and every copy a session of the old sidecar planned, fail their checks."""
    first = KVStorage(ModelShape(**SHAPE), 4, pages=2, shared=True, instance="test-host-1")
    other = KVStorage(ModelShape(**SHAPE), 4, pages=2, shared=True, instance="test-host-10")
    stale = first.handle()
    fence = first.open_fence()
    engine = KVStorage.attach(stale)  # an engine's mapping, which outlives the sidecar
    engine.check(fence)
    first._shm = None  # as if killed: never closed, never unlinked
    extra = f"/dev/shm/kvpool-test-host-1-{'f' * 16}"  # a second leftover (two crashes in a row)
    open(extra, "wb").close()
    second = KVStorage(ModelShape(**SHAPE), 4, pages=5, shared=True, instance="test-host-1")
    try:
        assert second.handle()["name"] == stale["name"] and second.epoch != stale["epoch"]
        assert not os.path.exists(extra)
        assert os.path.getsize(f"/dev/shm/{stale['name']}") == memory.segment_bytes(
            second.shape.bytes_per_page(4), 5)
        with pytest.raises(StaleHandle):
            engine.check()
        remapped = KVStorage.attach(second.handle())
        new_fence = second.open_fence()
        remapped.check(new_fence)
        with pytest.raises(Fenced):
            remapped.check(fence)  # a copy of the old sidecar's session
        second.kv[4].fill_(3.0)
        assert torch.equal(remapped.kv[4], second.kv[4])  # one pool, seen by both
        second.close_fence(new_fence)
        with pytest.raises(Fenced):
            remapped.check(new_fence)
        assert os.path.exists(f"/dev/shm/{other.handle()['name']}")  # another instance's segment is not touched
        remapped.close()
        engine.close()
    finally:
        second.close()
        other.close()


def test_a_pool_that_would_exceed_its_containers_memory_is_refused_naming_the_sizes():
    gib = 2**30
    memory.check_fits(10 * gib, 20 * gib, (16 * gib, 2 * gib), 1000)  # fits both
    with pytest.raises(memory.PoolDoesNotFit, match=r"need 10.00 GiB of shared memory, and the shm mount has 5.00 GiB"):
        memory.check_fits(10 * gib, 5 * gib, None, 1000)
    with pytest.raises(memory.PoolDoesNotFit, match=r"memory limit is 8.00 GiB with 2.00 GiB in use.*give the "
                       r"container 11.\d\d GiB"):
        memory.check_fits(10 * gib, 20 * gib, (8 * gib, 2 * gib), 1000)


def test_a_shared_pool_is_host_memory_allocated_at_start_without_being_written():
    storage = KVStorage(ModelShape(2, 1, 8, "float32"), 4, pages=64, shared=True)
    try:
        path = os.path.join("/dev/shm", storage.handle()["name"])
        assert os.stat(path).st_blocks * 512 >= storage.num_pages * storage.shape.bytes_per_page(4)  # allocated
        assert storage.device.type == "cpu" and not storage.kv.any()  # the kernel's zeros
    finally:
        storage.close()
    with pytest.raises(ValueError, match="host memory"):
        KVStorage(ModelShape(2, 1, 8, "float32"), 4, pages=4, shared=True, device="cuda")
