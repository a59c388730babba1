"""Engine KV blocks <-> pool pages: the pool stores each page in the engine's own block layout.

A pool page is ``kv[page, layer, ...]``: per layer, ``2 * page_size * kv_heads * head_dim`` elements.
An engine keeps one tensor per layer; its blocks are found along the dimension of size ``num_blocks``:
* first (``[num_blocks, ...]``, e.g. vLLM's CPU backend ``[blocks, kv_heads, block_size, 2*head_dim]``):
  one block is one contiguous row, copied verbatim into the page's layer row;
* second (``[parts, num_blocks, ...]``, e.g. ``[2, blocks, block_size, kv_heads, head_dim]``, K and V
  apart): the page's layer row holds the parts one after the other.
So a load or a save is a plain row copy (``storage`` kernels: Triton on CUDA, torch on CPU), and the
bytes in the pool mean whatever the engine's attention backend reads. Other layouts are refused. A GPU
engine beside the pool in host memory moves a layer's rows of all of a step's pages at once: gathered
into a staging buffer on one side, one transfer, scattered on the other (the kernels' half on the device).

Tensor parallelism: each of ``ranks`` workers holds its share of the KV heads, and a page holds every
rank's share of its block: the page's row (per layer and part) is the ranks' rows one after the other,
rank ``r`` reading and writing its own ``1/ranks`` of it. So ``--kv-shape``'s kv_heads is the heads of
all ranks together (a head replicated on several ranks counts once per rank). The bytes are the
engine's, in the order its ranks hold them: the connector puts the tensor-parallel size in the model's
identity, so that an engine of another degree never meets these pages.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from kvpool_sidecar.engines.copies import host_staging
from kvpool_sidecar.storage import reference
from kvpool_sidecar.storage.backend import Backend, choose_backend
from kvpool_sidecar.storage.tensors import ModelShape

log = logging.getLogger("kvpool.engine")


class LayoutError(ValueError):
    """The engine's KV and the pool do not match (the message names both values)."""


@dataclass(frozen=True)
class EngineLayer:
    name: str
    rows: torch.Tensor  # [parts * num_blocks, row_len]: part j of block b is row j * num_blocks + b
    parts: int


def engine_layers(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[EngineLayer]:
    layers = []
    for name, t in kv_caches.items():
        if not t.is_contiguous():
            raise LayoutError(f"engine KV of {name} is not contiguous (strides {t.stride()}): not supported")
        if t.dim() >= 2 and t.shape[0] == num_blocks:
            parts = 1
        elif t.dim() >= 3 and t.shape[1] == num_blocks:
            parts = t.shape[0]
        else:
            raise LayoutError(f"engine KV of {name} has shape {tuple(t.shape)}: no block dimension of "
                              f"{num_blocks} blocks in the first two")
        layers.append(EngineLayer(name, t.view(parts * num_blocks, -1), parts))
    if not layers:
        raise LayoutError("the engine registered no KV cache layers")
    return layers


# What of the connector has never run on a GPU (bench/gpu.py runs it where one is lent).
UNTESTED_CUDA = ("KVPoolConnector's CUDA copy path (engines/copies.py's copy streams, engines/blocks.py's staged "
                 "transfers, storage/kernels.py's Triton kernels on the device) has never run on a GPU")


def check_cuda_path(layers: list[EngineLayer], untested_cuda: bool) -> None:
    """A CUDA engine runs the connector's copy path only when the deployment opted in (with a warning
    naming that code); without the opt-in, a start-up refusal naming the path to use instead."""
    if layers[0].rows.device.type != "cuda":
        return
    if not untested_cuda:
        raise LayoutError(UNTESTED_CUDA + ": on a GPU, run vLLM's OffloadingConnector with kvpool as its secondary "
                          "tier (KVPoolTier, manifests/examples/inference.yaml), or set "
                          "kv_connector_extra_config.untested_cuda: true to run this path anyway")
    log.warning("kvpool: %s, and runs because untested_cuda is set", UNTESTED_CUDA)


def check_compatible(layers: list[EngineLayer], block_size: int, handle: dict[str, Any], ranks: int = 1) -> None:
    """Refuse a pool whose page size, layer count, dtype or per-layer page size differ from the engine's
    (``ranks`` tensor-parallel workers of this shape together)."""
    shape = ModelShape(**handle["shape"])
    page_size = handle["page_size"]
    if page_size != block_size:
        raise LayoutError(f"the pool's page size is {page_size} tokens, the engine's block_size {block_size}: "
                          "set the policy's pageSize to the engine's block_size")
    if shape.layers != len(layers):
        raise LayoutError(f"the pool holds {shape.layers} layers (--kv-shape), the engine {len(layers)}")
    dtype = layers[0].rows.dtype
    if shape.torch_dtype != dtype:
        raise LayoutError(f"the pool's dtype is {shape.dtype}, the engine's KV dtype {dtype}")
    pool_row = 2 * page_size * shape.kv_heads * shape.head_dim
    for layer in layers:
        engine_row = layer.parts * layer.rows.shape[1] * ranks
        if engine_row != pool_row:
            of = f"{ranks} tensor-parallel ranks' blocks" if ranks > 1 else "an engine block"
            raise LayoutError(
                f"a pool page holds {pool_row} elements per layer (2 x {page_size} x {shape.kv_heads} kv heads x "
                f"{shape.head_dim} head dim), {of} of {layer.name} {engine_row}: --kv-shape must be the model's "
                "layers,kv_heads,head_dim,dtype (kv_heads: of all ranks together)"
            )


class PageCopier:
    """Copies whole blocks between the engine's layers and a mapped pool tensor (rank ``rank`` of
    ``ranks`` tensor-parallel workers: its own share of each page row)."""

    def __init__(self, layers: list[EngineLayer], backend: str | None = None, rank: int = 0, ranks: int = 1) -> None:
        self.layers = layers
        self.num_layers = len(layers)
        self.rank, self.ranks = rank, ranks
        self._kernels: Any = reference
        if ranks > 1 and backend not in (None, "torch"):
            raise LayoutError(f"kernels {backend!r} move whole page rows, and a tensor-parallel rank's share of a "
                              "row is a strided view: leave kernels unset (or 'torch') with tensor_parallel_size > 1")
        try:
            chosen = choose_backend(layers[0].rows.device, backend)
        except ValueError as exc:
            raise LayoutError(f"kernels {backend!r} cannot run here: {exc}") from None
        if ranks == 1 and chosen is not Backend.TORCH:
            from kvpool_sidecar.storage import kernels

            self._kernels = kernels

    def _pool_rows(self, pool_kv: torch.Tensor, parts: int) -> torch.Tensor:
        rows = pool_kv.view(pool_kv.shape[0] * self.num_layers * parts, -1)
        if self.ranks == 1:
            return rows
        width = rows.shape[1] // self.ranks
        return rows[:, self.rank * width : (self.rank + 1) * width]

    def _row_ids(self, pages: list[int], blocks: list[int], li: int, layer: EngineLayer) -> tuple[torch.Tensor, ...]:
        n_blocks = layer.rows.shape[0] // layer.parts
        page_t = torch.tensor(pages, dtype=torch.int64)
        block_t = torch.tensor(blocks, dtype=torch.int64)
        pool_ids = torch.cat([(page_t * self.num_layers + li) * layer.parts + j for j in range(layer.parts)])
        engine_ids = torch.cat([j * n_blocks + block_t for j in range(layer.parts)])
        return pool_ids, engine_ids

    def _move(self, src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
        if src.device == dst.device:
            self._kernels.move_rows(src, src_ids.to(src.device), dst, dst_ids.to(dst.device))
        elif src.device.type == "cpu":
            self._host_to_device(src, src_ids, dst, dst_ids)
        else:
            self._device_to_host(src, src_ids, dst, dst_ids)

    def _host_to_device(self, src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor,
                        dst_ids: torch.Tensor) -> None:
        """Host pool rows -> device blocks: one gather into a staging buffer, one transfer, one scatter
        (the storage kernels) on the device."""
        staged = host_staging(len(src_ids), src.shape[1], src.dtype, dst.device.type == "cuda")
        torch.index_select(src, 0, src_ids, out=staged)
        rows = staged.to(dst.device, non_blocking=True)
        order = torch.arange(len(src_ids), dtype=torch.int64, device=dst.device)
        self._kernels.move_rows(rows, order, dst, dst_ids.to(dst.device))

    def _device_to_host(self, src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor,
                        dst_ids: torch.Tensor) -> None:
        """Device blocks -> host pool rows: one gather on the device, one transfer into a staging buffer
        (waited for), one scatter on the host."""
        rows = torch.empty((len(src_ids), src.shape[1]), dtype=src.dtype, device=src.device)
        order = torch.arange(len(src_ids), dtype=torch.int64, device=src.device)
        self._kernels.move_rows(src, src_ids.to(src.device), rows, order)
        staged = host_staging(len(src_ids), src.shape[1], src.dtype, src.device.type == "cuda")
        staged.copy_(rows)  # not non_blocking: the host scatter below reads it
        dst.index_copy_(0, dst_ids, staged)

    def load_layer(self, pool_kv: torch.Tensor, li: int, pages: list[int], blocks: list[int]) -> None:
        """Pool pages -> engine blocks, layer ``li``."""
        layer = self.layers[li]
        pool_ids, engine_ids = self._row_ids(pages, blocks, li, layer)
        self._move(self._pool_rows(pool_kv, layer.parts), pool_ids, layer.rows, engine_ids)

    def load(self, pool_kv: torch.Tensor, pages: list[int], blocks: list[int]) -> None:
        """Pool pages -> engine blocks, every layer."""
        for li in range(self.num_layers):
            self.load_layer(pool_kv, li, pages, blocks)

    def save(self, pool_kv: torch.Tensor, blocks: list[int], pages: list[int],
             guard: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        """Engine blocks -> pool pages, every layer; each layer's write is one slice made within ``guard()``
        (which raises to stop the save: the worker's right to write these pages, :meth:`AttachedKV.writing`)."""
        for li, layer in enumerate(self.layers):
            pool_ids, engine_ids = self._row_ids(pages, blocks, li, layer)
            with guard() if guard is not None else contextlib.nullcontext():
                self._move(layer.rows, engine_ids, self._pool_rows(pool_kv, layer.parts), pool_ids)
