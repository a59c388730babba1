# ruff: noqa: ANN001  -- triton reads annotations of jit arguments as specialisation hints: pointers stay bare
"""Triton kernels for the KV pages. Each has a torch twin in :mod:`.reference` that it equals bit for bit.

The kernels only load and store (no arithmetic on values), so every dtype is copied exactly; address
arithmetic is int64. Grids: one program per token (write) or per (page, chunk) (page moves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAGE_CHUNK = 1024  # elements per program in page moves


@triton.jit
def _write_kv_kernel(
    kv_ptr, key_ptr, value_ptr, slots_ptr,
    layer, page_size, heads, dim,
    s_page, s_layer, s_kv, s_slot, s_head,
    k_tok, k_head, k_dim, v_tok, v_head, v_dim,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // page_size
        offset = slot % page_size
        i = tl.arange(0, BLOCK)
        mask = i < heads * dim
        h = (i // dim).to(tl.int64)
        d = (i % dim).to(tl.int64)
        dst = page * s_page + layer * s_layer + offset * s_slot + h * s_head + d
        k = tl.load(key_ptr + t.to(tl.int64) * k_tok + h * k_head + d * k_dim, mask=mask)
        v = tl.load(value_ptr + t.to(tl.int64) * v_tok + h * v_head + d * v_dim, mask=mask)
        tl.store(kv_ptr + dst, k, mask=mask)
        tl.store(kv_ptr + dst + s_kv, v, mask=mask)


@triton.jit
def _move_pages_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, row_len, BLOCK: tl.constexpr):
    """dst[dst_rows[i], chunk] = src[src_rows[i], chunk] over rows of ``row_len`` elements."""
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    src_row = tl.load(src_rows_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_rows_ptr + i).to(tl.int64)
    cols = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_len
    data = tl.load(src_ptr + src_row * row_len + cols, mask=mask)
    tl.store(dst_ptr + dst_row * row_len + cols, data, mask=mask)


def write_kv(kv: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Same contract as :func:`.reference.write_kv`; ``key``/``value`` may be strided views (a fused
    QKV tensor's slices), and must already have the pool's dtype."""
    tokens, heads, dim = key.shape
    if tokens == 0:
        return
    if key.dtype != kv.dtype or value.dtype != kv.dtype:
        raise TypeError(f"key/value dtype {key.dtype} must equal the pool's {kv.dtype}: convert first")
    assert kv.is_contiguous(), "the pool tensor is allocated contiguous"
    block = triton.next_power_of_2(heads * dim)
    _write_kv_kernel[(tokens,)](
        kv, key, value, slots,
        layer, kv.shape[3], heads, dim,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        BLOCK=block,
    )


def _move(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor, row_len: int) -> None:
    n = len(src_rows)
    if n == 0:
        return
    grid = (n, triton.cdiv(row_len, PAGE_CHUNK))
    _move_pages_kernel[grid](src, dst, src_rows, dst_rows, row_len, BLOCK=PAGE_CHUNK)


def move_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` between two contiguous 2-D tensors with rows of one length
    (an engine's KV blocks and the pool's pages, see :mod:`kvpool_sidecar.engines.blocks`)."""
    if src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"rows differ: {tuple(src.shape)} {src.dtype} against {tuple(dst.shape)} {dst.dtype}")
    assert src.is_contiguous() and dst.is_contiguous(), "row moves address rows as flat offsets"
    _move(src, dst, src_rows, dst_rows, src.shape[1])


def copy_pages(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole pages ``src[i] -> dst[i]`` (copy-on-write at fork, defragmentation). The pairs must
    not chain (no page both a source and a destination), as the pool never asks for that."""
    row_len = kv[0].numel()
    _move(kv, kv, src, dst, row_len)


def gather_pages(kv: torch.Tensor, pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    row_len = kv[0].numel()
    if out is None:
        out = torch.empty((len(pages), row_len), dtype=kv.dtype, device=kv.device)
    rows = torch.arange(len(pages), device=kv.device, dtype=torch.int64)
    _move(kv, out, pages, rows, row_len)
    return out


def scatter_pages(kv: torch.Tensor, pages: torch.Tensor, buffer: torch.Tensor) -> None:
    row_len = kv[0].numel()
    rows = torch.arange(len(pages), device=kv.device, dtype=torch.int64)
    _move(buffer.contiguous(), kv, rows, pages, row_len)
