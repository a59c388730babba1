"""Capacity planning: KV bytes per token from model dimensions, pages a GPU holds, page size from a trace."""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}
PAGE_SIZES = (8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Plan:
    bytes_per_token: int
    bytes_per_page: int
    pages: int
    kv_budget_bytes: int
    rule_of_thumb_bytes: float | None


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V, every layer: 2 x layers x kv_heads x head_dim x bytes per element."""
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def plan(layers: int, kv_heads: int, head_dim: int, dtype: str, page_size: int, gpu_bytes: float,
         params: float, weight_bytes: int = 2, reserve: float = 0.1,
         max_seq_len: int | None = None, batch: int | None = None, d_model: int | None = None) -> Plan:
    """Pages that fit once the weights and a ``reserve`` share (activations, CUDA graphs) are set aside."""
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, dtype)
    per_page = per_token * page_size
    budget = int(gpu_bytes * (1 - reserve) - params * weight_bytes)
    rule = None
    if max_seq_len and batch and d_model:
        rule = params * 1.2 + max_seq_len * batch * d_model * 2.5
    return Plan(per_token, per_page, max(budget // per_page, 0), max(budget, 0), rule)


# vLLM's primary tier in front of kvpool (TieringOffloadingSpec): chunks in flight, not a cache of its own.
STORE_STEPS_IN_FLIGHT = 4  # steps of new chunks that may wait in it for their cascade into kvpool
HOST_PAGE = 4096  # vLLM pads each chunk of its region to the host page size


def primary_tier_bytes(bytes_per_chunk: int, tokens_per_chunk: int, max_model_len: int,
                       max_batched_tokens: int) -> int:
    """``cpu_bytes_to_use`` for vLLM's CPU primary tier when kvpool is the tier behind it: room for one
    prompt of ``max_model_len`` promoted whole (a promotion that does not fit is a miss) beside
    :data:`STORE_STEPS_IN_FLIGHT` steps of ``max_batched_tokens`` new tokens waiting for their cascade,
    each chunk padded as vLLM pads it."""
    chunks = -(-max_model_len // tokens_per_chunk) + STORE_STEPS_IN_FLIGHT * -(-max_batched_tokens // tokens_per_chunk)
    return chunks * -(-bytes_per_chunk // HOST_PAGE) * HOST_PAGE


def page_size_table(lengths: list[int], sizes: tuple[int, ...] = PAGE_SIZES) -> list[tuple[int, float, float]]:
    """(page size, internal fragmentation as a share of allocated slots, mean page-table entries)."""
    rows = []
    total = sum(lengths)
    for size in sizes:
        pages = [math.ceil(n / size) for n in lengths]
        allocated = sum(p * size for p in pages)
        rows.append((size, (allocated - total) / allocated, sum(pages) / len(lengths)))
    return rows


def recommend_page_size(rows: list[tuple[int, float, float]], max_fragmentation: float = 0.02) -> int:
    """The largest page size (fewest page-table entries, cheapest bookkeeping) wasting at most
    ``max_fragmentation`` of the slots; the smallest size if none does."""
    fitting = [size for size, frag, _ in rows if frag <= max_fragmentation]
    return max(fitting) if fitting else min(size for size, _, _ in rows)


def parse_bytes(text: str) -> float:
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6,
             "gb": 1e9, "tb": 1e12}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in units or not num:
        raise ValueError(f"{text!r} is not a size: use a number with B, KiB, MiB, GiB, TiB, KB, MB, GB or TB")
    return float(num) * units[unit]
