"""The page-transfer payload: a prefix's KV pages plus everything the importer must verify.

Layout: ``MAGIC`` (8 bytes), the signing key's id (a length byte, then the id), the HMAC-SHA256 tag
(32 bytes), the header length (uint32 little-endian), the header (JSON, see :class:`TransferHeader`),
then the pages' KV as one contiguous ``[pages, page_elements]`` block in the header's dtype.

Authenticity: the tag is HMAC-SHA256 under a cluster key (:class:`TransferKeys`, from a mounted
Secret) over the magic, the key id and the header bytes as sent; the header carries the sha256 of
the KV bytes and the time it was issued, so the tag covers the pages, their keys, the prompt and
the KV. The importer checks the tag before it parses the header, refuses a payload older than
``MAX_AGE_SECONDS`` (a replay), and writes nothing unless every check passed. A sha256 alone would
only catch accidental damage: anyone can compute one over forged KV.

The header carries the model shape, dtype and page size (the importer's pool must
match them), the prompt those pages cache (tokens or block hashes, with its workload metadata), the
pool keys of its pages (the importer recomputes them from the prompt with its own hashing rules:
same tenant salt, same page boundaries, or no import) and the sha256 of the KV bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpool_sidecar.storage.tensors import DTYPES, KVStorage, ModelShape

MAGIC = b"KVPXFER2"
HEADER_LENGTH = struct.Struct("<I")
TAG_BYTES = 32
MAX_AGE_SECONDS = 300.0  # a payload older than this is refused as a replay (the pods' clocks agree to NTP)
MIN_SECRET_BYTES = 32
MAX_HEADER_BYTES = 64 << 20  # a 2M-token prompt as JSON fits well inside
CONTENT_TYPE = "application/vnd.kvpool.pages"


class TransferError(ValueError):
    """A payload that cannot be imported; ``reason`` is the error name, ``field`` the header field."""

    def __init__(self, reason: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field


@dataclass(frozen=True)
class TransferKeys:
    """Cluster keys that sign and verify page transfers: the first signs, any verifies (rotation)."""

    keys: tuple[tuple[str, bytes], ...]

    @property
    def signing(self) -> tuple[str, bytes]:
        return self.keys[0]

    def secret(self, key_id: str) -> bytes | None:
        return next((secret for kid, secret in self.keys if kid == key_id), None)

    @classmethod
    def parse(cls, text: str, where: str = "transfer key file") -> TransferKeys:
        """Lines ``KEY_ID SECRET`` (the signing key first; blank lines and ``#`` comments skipped)."""
        keys: list[tuple[str, bytes]] = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or not 1 <= len(parts[0]) <= 64 or not parts[0].isascii():
                raise ValueError(f"{where} line {n}: expected 'KEY_ID SECRET' with an ASCII id of 1-64 characters")
            if len(parts[1].encode()) < MIN_SECRET_BYTES:
                raise ValueError(f"{where} line {n}: the secret must be at least {MIN_SECRET_BYTES} bytes")
            if any(kid == parts[0] for kid, _ in keys):
                raise ValueError(f"{where} line {n}: key id {parts[0]!r} appears twice")
            keys.append((parts[0], parts[1].encode()))
        if not keys:
            raise ValueError(f"{where}: no key")
        return cls(tuple(keys))

    @classmethod
    def load(cls, path: str | Path) -> TransferKeys:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"transfer key file {path}: {exc.strerror}") from None
        return cls.parse(text, f"transfer key file {path}")


def _tag(secret: bytes, key_id: bytes, head: bytes) -> bytes:
    return hmac.new(secret, MAGIC + bytes([len(key_id)]) + key_id + head, hashlib.sha256).digest()


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
    issued_at: float = Field(default_factory=time.time, description="unix time of the export (replays expire)")

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


def encode(header: TransferHeader, data: torch.Tensor | bytes, keys: TransferKeys) -> bytes:
    head = header.model_dump_json(exclude_none=True).encode()
    raw = data if isinstance(data, bytes) else kv_bytes(data)
    key_id, secret = keys.signing
    kid = key_id.encode()
    return MAGIC + bytes([len(kid)]) + kid + _tag(secret, kid, head) + HEADER_LENGTH.pack(len(head)) + head + raw


def decode(payload: bytes, keys: TransferKeys, now: float | None = None) -> tuple[TransferHeader, memoryview]:
    """Authenticate a payload (key id, tag, age), then split and validate its header; the KV bytes are
    checked by :func:`verify`."""
    if len(payload) < len(MAGIC) + 1 or payload[: len(MAGIC)] != MAGIC:
        raise TransferError("corrupt_payload", "not a kvpool page transfer (bad magic)", "body")
    at = len(MAGIC)
    kid = bytes(payload[at + 1 : at + 1 + payload[at]])
    at += 1 + len(kid)
    fixed = at + TAG_BYTES + HEADER_LENGTH.size
    if len(payload) < fixed:
        raise TransferError("corrupt_payload", "the payload ends inside its framing", "body")
    secret = keys.secret(kid.decode("ascii", errors="replace"))
    if secret is None:
        raise TransferError("unknown_key", f"signed with key id {kid[:64]!r}, which this sidecar does not hold",
                            "key_id")
    tag = bytes(payload[at : at + TAG_BYTES])
    (length,) = HEADER_LENGTH.unpack_from(payload, at + TAG_BYTES)
    if length > MAX_HEADER_BYTES or fixed + length > len(payload):
        raise TransferError("corrupt_payload", f"header length {length} does not fit the payload", "body")
    head = bytes(payload[fixed : fixed + length])
    if not hmac.compare_digest(tag, _tag(secret, kid, head)):
        raise TransferError("bad_signature", "the signature does not match: forged or altered in transit",
                            "signature")
    try:
        raw: Any = json.loads(head)
        header = TransferHeader.model_validate(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            where = ".".join(["header", *(str(p) for p in first["loc"])])
            raise TransferError("corrupt_payload", f"{where}: {first['msg']}", where) from None
        raise TransferError("corrupt_payload", f"header is not JSON: {exc}", "header") from None
    age = (time.time() if now is None else now) - header.issued_at
    if not -MAX_AGE_SECONDS <= age <= MAX_AGE_SECONDS:
        raise TransferError("expired_payload", f"issued {age:.0f} s ago; at most {MAX_AGE_SECONDS:.0f} s are "
                            "accepted (a replay, or the pods' clocks disagree)", "header.issued_at")
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
