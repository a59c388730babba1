"""The page-transfer payload: a prefix's KV pages plus everything the importer must verify.

Layout: ``MAGIC`` (8 bytes), the header length (uint32 little-endian), the header (JSON, see
:class:`TransferHeader`), then the pages' KV as one contiguous ``[pages, page_elements]`` block in the
header's dtype. The header carries the model shape, dtype and page size (the importer's pool must
match them), the prompt those pages cache (tokens or block hashes, with its workload metadata), the
pool keys of its pages (the importer recomputes them from the prompt with its own hashing rules:
same tenant salt, same page boundaries, or no import) and the sha256 of the KV bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Hashable
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpool_sidecar.storage.tensors import DTYPES, KVStorage, ModelShape

MAGIC = b"KVPXFER1"
HEADER_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 64 << 20  # a 2M-token prompt as JSON fits well inside
CONTENT_TYPE = "application/vnd.kvpool.pages"


class TransferError(ValueError):
    """A payload that cannot be imported; ``reason`` is the error name, ``field`` the header field."""

    def __init__(self, reason: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field


def key_text(key: Hashable) -> str:
    """A pool key as text that keeps its type (a chained digest, a trace id, an engine's string id)."""
    if isinstance(key, bytes):
        return "b:" + key.hex()
    if isinstance(key, int):
        return f"i:{key}"
    return f"s:{key}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class WireShape(_Strict):
    layers: Annotated[int, Field(ge=1)]
    kv_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=1)]
    dtype: Literal[tuple(DTYPES)]  # type: ignore[valid-type]


class WireMeta(_Strict):
    workload_class: str = "toC"
    request_type: str = "text"
    turn: int = 0
    tenant: str = "default"
    user: str = ""


class TransferHeader(_Strict):
    version: Literal[1] = 1
    page_size: Annotated[int, Field(ge=1)]
    shape: WireShape
    pages: Annotated[int, Field(ge=1)]
    keys: list[str]
    tokens: list[Annotated[int, Field(ge=0, lt=2**63)]] | None = None
    block_hashes: list[int | str] | None = None
    num_tokens: Annotated[int, Field(ge=1)]
    meta: WireMeta = Field(default_factory=WireMeta)
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]

    @model_validator(mode="after")
    def _consistent(self) -> TransferHeader:
        if (self.tokens is None) == (self.block_hashes is None):
            raise ValueError("give exactly one of tokens or block_hashes")
        if len(self.keys) != self.pages:
            raise ValueError(f"keys lists {len(self.keys)} pages, the payload {self.pages}")
        if self.num_tokens != self.pages * self.page_size:
            raise ValueError("num_tokens must be pages x page_size (only full pages are transferred)")
        if self.tokens is not None and len(self.tokens) != self.num_tokens:
            raise ValueError("tokens must hold num_tokens tokens")
        if self.block_hashes is not None and len(self.block_hashes) != self.pages:
            raise ValueError("block_hashes must hold one hash per page")
        return self


def kv_bytes(data: torch.Tensor) -> bytes:
    """The raw bytes of gathered pages (what the header's sha256 covers)."""
    return data.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode(header: TransferHeader, data: torch.Tensor | bytes) -> bytes:
    head = header.model_dump_json(exclude_none=True).encode()
    raw = data if isinstance(data, bytes) else kv_bytes(data)
    return MAGIC + HEADER_LENGTH.pack(len(head)) + head + raw


def decode(payload: bytes) -> tuple[TransferHeader, memoryview]:
    """Split and validate a payload's framing and header; the KV bytes are checked by :func:`verify`."""
    fixed = len(MAGIC) + HEADER_LENGTH.size
    if len(payload) < fixed or payload[: len(MAGIC)] != MAGIC:
        raise TransferError("corrupt_payload", "not a kvpool page transfer (bad magic)", "body")
    (length,) = HEADER_LENGTH.unpack_from(payload, len(MAGIC))
    if length > MAX_HEADER_BYTES or fixed + length > len(payload):
        raise TransferError("corrupt_payload", f"header length {length} does not fit the payload", "body")
    try:
        raw: Any = json.loads(payload[fixed : fixed + length])
        header = TransferHeader.model_validate(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            where = ".".join(["header", *(str(p) for p in first["loc"])])
            raise TransferError("corrupt_payload", f"{where}: {first['msg']}", where) from None
        raise TransferError("corrupt_payload", f"header is not JSON: {exc}", "header") from None
    return header, memoryview(payload)[fixed + length :]


def verify(header: TransferHeader, data: memoryview, storage: KVStorage) -> torch.Tensor:
    """Check the payload against this pool (shape, dtype, page size, size, digest); the pages' KV."""
    mine = storage.shape
    theirs = ModelShape(**header.shape.model_dump())
    if theirs != mine:
        raise TransferError("incompatible_payload", f"KV shape {theirs} is not this pool's {mine}", "header.shape")
    if header.page_size != storage.page_size:
        raise TransferError(
            "incompatible_payload", f"page size {header.page_size} is not this pool's {storage.page_size}",
            "header.page_size",
        )
    per_page = mine.bytes_per_page(storage.page_size)
    if len(data) != header.pages * per_page:
        raise TransferError(
            "corrupt_payload", f"{len(data)} KV bytes for {header.pages} pages of {per_page} bytes", "body"
        )
    if hashlib.sha256(data).hexdigest() != header.sha256:
        raise TransferError("corrupt_payload", "the KV bytes do not match their sha256", "header.sha256")
    flat = torch.frombuffer(bytearray(data), dtype=mine.torch_dtype)
    return flat.view(header.pages, -1)
