"""The peer control channel's messages, framing and key proofs (the bytes themselves move with NIXL).

One frame is a 4-byte big-endian length and a msgpack body (msgspec), as on the engine channel
(:mod:`kvpool_sidecar.wire`). A connection goes:

1. server -> :class:`Challenge` (a random nonce; nothing else is sent before the proofs);
2. client -> :class:`Proof` (its own nonce, the id of a cluster key and the HMAC-SHA256 of both nonces under
   that key); a wrong proof is answered :class:`Refused` and the connection closed (counted);
3. server -> :class:`Accept` (its own HMAC of both nonces: the client checks the server holds the key too
   before it trusts a byte of it, then the server's NIXL agent metadata and its pool's layout);
4. any number of fetches, one at a time: client -> :class:`Fetch` (the model identity, the prompt's leading
   block hashes, its workload metadata), server -> :class:`Offer` (the pages it holds for the longest leading
   run it has: their page ids, held until the client says :class:`Done`, the connection ends, or
   ``hold_seconds`` pass), client -> :class:`Done` once its read is over (or abandoned);
   or client -> :class:`Schemes` (a model's name), server -> :class:`Known` (how the source's engines of that
   model hash their blocks: a reader whose own engine has not connected yet names a prompt's pages with it).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Any

import msgspec

from kvpool_sidecar.wire import Meta

PROTOCOL = 1
NONCE_BYTES = 32
MAX_HANDSHAKE_FRAME = 4 << 10  # bytes of a frame before both sides have proved the key
MAX_FRAME = 8 << 20  # after: a fetch of MAX_BLOCKS hashes of MAX_HASH_BYTES
MAX_BLOCKS = 1 << 15  # block hashes in one fetch (the engine channel's admission bound)
MAX_HASH_BYTES = 64
MAX_MODEL = 4096  # characters of a model identity
MAX_SCHEMES = 64  # engine model identities a source answers for one model (the sidecar keeps 64 at most)
MAX_METADATA = 1 << 20  # bytes of a NIXL agent's metadata (a few hundred bytes for UCX)
_LEN = struct.Struct(">I")


class PeerProtocolError(ValueError):
    """A frame or message that breaks the protocol (the message names the field and the rule)."""


class Challenge(msgspec.Struct, tag="challenge", array_like=True):
    protocol: int
    nonce: bytes


class Proof(msgspec.Struct, tag="proof", array_like=True):
    protocol: int
    key_id: str
    nonce: bytes
    tag: bytes


class Layout(msgspec.Struct, array_like=True, frozen=True):
    """What a reader must share with the source to read its pages as its own."""

    shape: tuple[int, int, int, str]  # layers, kv_heads, head_dim, dtype
    page_size: int
    page_bytes: int
    pages: int
    base: int  # the address of page 0 in the source's registered memory


class Accept(msgspec.Struct, tag="accept", array_like=True):
    tag: bytes
    agent: str
    metadata: bytes
    layout: Layout


class Refused(msgspec.Struct, tag="refused", array_like=True):
    error: str
    detail: str


class Fetch(msgspec.Struct, tag="fetch", array_like=True):
    model: str
    hashes: list[bytes]
    meta: Meta
    first: int = 0  # the leading pages the reader holds already: offered pages start here


class Offer(msgspec.Struct, tag="offer", array_like=True):
    first: int  # the index of the first offered page in the fetch's hashes
    pages: list[int]  # the source's page ids, held (empty: nothing past ``first`` is cached there)
    hold_seconds: float


class Done(msgspec.Struct, tag="done", array_like=True):
    pass


class Schemes(msgspec.Struct, tag="schemes", array_like=True):
    model: str  # a model's name (an engine's --model) or a whole model identity


class Scheme(msgspec.Struct, array_like=True, frozen=True):
    """How the engines of one model identity hash their blocks (their hello's hashing, checked by its probe)."""

    identity: str
    algo: str
    seed: str


class Known(msgspec.Struct, tag="known", array_like=True):
    schemes: list[Scheme]


Message = Challenge | Proof | Accept | Refused | Fetch | Offer | Done | Schemes | Known
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def frame(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes, limit: int) -> int:
    (n,) = _LEN.unpack(header)
    if n > limit:
        raise PeerProtocolError(f"frame of {n} bytes: the limit is {limit}")
    return n


def decode(body: bytes) -> Any:
    try:
        return _decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PeerProtocolError(f"invalid message: {exc}") from None


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256 of both nonces under a cluster key; ``side`` (``b"client"``, ``b"server"``) keeps one side's
    proof from serving as the other's."""
    return hmac.new(secret, b"kvpool-peer/%d " % PROTOCOL + side + server_nonce + client_nonce,
                    hashlib.sha256).digest()


def proved(secret: bytes | None, side: bytes, server_nonce: bytes, client_nonce: bytes, tag: bytes) -> bool:
    return secret is not None and hmac.compare_digest(proof(secret, side, server_nonce, client_nonce), tag)


def check_schemes(msg: Schemes) -> None:
    if not 0 < len(msg.model) <= MAX_MODEL:
        raise PeerProtocolError(f"model must be 1-{MAX_MODEL} characters (field model)")


def check_known(msg: Known) -> None:
    if len(msg.schemes) > MAX_SCHEMES or any(not 0 < len(s.identity) <= MAX_MODEL or len(s.algo) > 64
                                             or len(s.seed) > MAX_MODEL for s in msg.schemes):
        raise PeerProtocolError(f"schemes: at most {MAX_SCHEMES}, each an identity of 1-{MAX_MODEL} characters "
                                "(field schemes)")


def check_fetch(msg: Fetch) -> None:
    if not 0 < len(msg.model) <= MAX_MODEL:
        raise PeerProtocolError(f"model must be 1-{MAX_MODEL} characters (field model)")
    if not 0 < len(msg.hashes) <= MAX_BLOCKS:
        raise PeerProtocolError(f"hashes: 1-{MAX_BLOCKS} block hashes (field hashes)")
    if any(not 0 < len(h) <= MAX_HASH_BYTES for h in msg.hashes):
        raise PeerProtocolError(f"each hash must be 1-{MAX_HASH_BYTES} bytes (field hashes)")
    if not 0 <= msg.first < len(msg.hashes):
        raise PeerProtocolError("first must be below the number of hashes (field first)")
    if len(msg.meta.tenant) > 128 or len(msg.meta.workload_class) > 64:
        raise PeerProtocolError("meta.tenant: at most 128 characters, meta.workload_class at most 64 (field meta)")
