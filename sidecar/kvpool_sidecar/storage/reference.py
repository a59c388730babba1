"""Pure-torch reference of every kernel: the runtime fallback, and what the kernels must equal bit for bit.

Layout: ``kv[page, layer, k_or_v, slot_in_page, kv_head, head_dim]``: one page is contiguous across
all layers, so whole-page moves (copy, gather, scatter) are single contiguous rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def write_kv(kv: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter ``key``/``value`` [tokens, kv_heads, head_dim] of one layer into their slots (-1 skips).

    A slot is ``page * page_size + offset``; slots must be distinct.
    """
    page_size = kv.shape[3]
    valid = slots >= 0
    idx = slots[valid].long()
    pages, offsets = idx // page_size, idx % page_size
    kv[pages, layer, 0, offsets] = key[valid].to(kv.dtype)
    kv[pages, layer, 1, offsets] = value[valid].to(kv.dtype)


def move_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]``. On the host, straight row copies, a run of rows consecutive
    on both sides in one copy: no temporary, and several times the speed of an indexed gather and scatter
    (bench/measurements/row_copies.py); on a device, one indexed copy (a launch per row would cost more)."""
    if src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"rows differ: {tuple(src.shape)} {src.dtype} against {tuple(dst.shape)} {dst.dtype}")
    if src.device.type != "cpu" or dst.device.type != "cpu":
        dst[dst_rows.long()] = src[src_rows.long()]
        return
    copy_row_runs(src, src_rows.tolist(), dst, dst_rows.tolist())


def copy_row_runs(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` between host tensors (rows may be strided), a run of rows
    consecutive on both sides in one ``copy_``; IndexError for a row outside its tensor, before anything
    is copied (a slice past the end would copy nothing, silently)."""
    for ids, rows, side in ((src_ids, src, "source"), (dst_ids, dst, "destination")):
        if ids and (min(ids) < 0 or max(ids) >= rows.shape[0]):
            raise IndexError(f"a {side} row is outside [0, {rows.shape[0]})")
    for s, d, n in row_runs(list(src_ids), list(dst_ids)):
        dst[d : d + n].copy_(src[s : s + n])


def row_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(source row, destination row, count) of each run of rows consecutive on both sides, in order."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source rows, {len(dst)} destination rows")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_pages(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    rows = kv.view(kv.shape[0], -1)
    rows[dst.long()] = rows[src.long()].clone()


def gather_pages(kv: torch.Tensor, pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    rows = kv.view(kv.shape[0], -1)
    picked = rows[pages.long()]
    if out is None:
        return picked
    out.copy_(picked)
    return out


def scatter_pages(kv: torch.Tensor, pages: torch.Tensor, buffer: torch.Tensor) -> None:
    rows = kv.view(kv.shape[0], -1)
    rows[pages.long()] = buffer.to(device=kv.device, dtype=kv.dtype).view(len(pages), -1)
