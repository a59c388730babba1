"""Pure-torch reference of every kernel: the runtime fallback, and what the kernels must equal bit for bit.

Layout: ``kv[page, layer, k_or_v, slot_in_page, kv_head, head_dim]``: one page is contiguous across
all layers, so whole-page moves (copy, gather, scatter) are single contiguous rows.
"""

from __future__ import annotations

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
    if src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"rows differ: {tuple(src.shape)} {src.dtype} against {tuple(dst.shape)} {dst.dtype}")
    dst[dst_rows.long()] = src[src_rows.long()]


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
