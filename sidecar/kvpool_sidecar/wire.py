"""The engine channel's messages: what a connector and its sidecar say to each other per scheduler step.

One frame is a 4-byte big-endian length and a msgpack body (msgspec, the encoding vLLM itself uses for
its KV events). A connection opens with :class:`Hello` (the engine's bearer token, its role, its
session and the identity of the model it serves), answered by :class:`Welcome` or :class:`Refused`;
then every :class:`Step` (all of one scheduler step's admissions, commits and releases, and the
connector's measurements) is answered by one :class:`StepReply`, in order. Within a step the sidecar
applies the commits first, then the releases, then the admissions (a request's last commit precedes its
release; an admission sees what the step published and freed). Block hashes travel as raw bytes.
The connection is the session's lease: when it closes (the engine exited or was killed) the sidecar
releases every sequence the session still holds.

This module is the contract only (types, limits, framing); the sidecar serves it
(:mod:`kvpool_sidecar.service.channel`), the connector speaks it (:mod:`kvpool_sidecar.engines.link`).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

import msgspec

PROTOCOL = 3  # 3: an admission's peer source (Admit.source, Admitted.fetching) and grows (a save's pages taken
# when it is planned); 2: the segment layout with the writers' slot locks (storage.tensors.LAYOUT); any change to a
# message or to the segment's layout changes it, and a hello of another version is refused naming both
MAX_FRAME = 64 << 20  # bytes of one frame after the hello (the connector keeps its steps under STEP_BYTES)
MAX_HELLO = 16 << 10  # bytes of the first frame, read before anyone is authenticated (a model id is 4 KiB)
MAX_OPS = 4096  # admissions, commits, releases or grows in one step
MAX_BLOCKS = 1 << 15  # block hashes in one admission (a million tokens in 32-token pages); the connector
# admits a longer prompt's first MAX_BLOCKS blocks, and a longer admission fails alone (field hashes)
MAX_HASH_BYTES = 64
MAX_SEQ_ID = 128  # characters of a session or sequence id; a longer sequence id fails its op alone
# The channel's promise to engines: a lapsed session's pages (its connection ended) stay out of
# circulation this long by default (the sidecar's --engine-quarantine-seconds). Its engine plans a step's
# copies before it runs them and learns of a failed round trip at most its link's timeout_s (2 s by
# default) later, so the copies already planned end within a step or two of that: a busy engine's
# longest prefill step is seconds, and 30 s leaves an order of magnitude to spare while holding the
# pages only briefly.
QUARANTINE_SECONDS = 30.0
# The connector's budget for one step's encoded size: a quarter of MAX_FRAME, so that its estimate
# (:func:`admit_bytes`) may be off by 4x and the frame still fits.
STEP_BYTES = MAX_FRAME // 4
ROLES = ("scheduler", "worker")
_LEN = struct.Struct(">I")


class WireError(ValueError):
    """A frame or message that breaks the protocol (the message names the field and the rule)."""


class Meta(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    workload_class: str = "toC"
    request_type: str = "text"
    turn: int = 0
    tenant: str = "default"
    user: str = ""
    adapter: str = ""  # the LoRA adapter the engine serves the request with ("": the base model)


class Hashing(msgspec.Struct, array_like=True, frozen=True):
    """How the engine hashes its blocks, so that the sidecar can name its pages from token ids."""

    algo: str  # vLLM's prefix_caching_hash_algo
    seed: str  # the seed of its first block's parent (vLLM's NONE_HASH seed)
    probe: bytes  # vLLM's own hash of the block of token ids 0..block_size-1: the sidecar checks itself


class Hello(msgspec.Struct, tag="hello", array_like=True):
    protocol: int
    role: str
    session: str  # the engine instance: its sequences are released together when it goes
    model: str  # the served model's identity (name, revision, dtype, KV layout): keys are namespaced by it
    token: str | None = None
    events: bool = False  # follow the pool's removals of this model's pages (the engine's KV events)
    hashing: Hashing | None = None  # the scheduler's block hashing (pins and exports by token ids)


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    session: str
    storage: dict[str, Any] | None  # the storage handle (None: the sidecar keeps no KV)
    page_size: int


class Refused(msgspec.Struct, tag="refused", array_like=True):
    error: str
    detail: str
    field: str = ""


class Source(msgspec.Struct, array_like=True, frozen=True):
    """A peer sidecar that may hold the prompt's pages (the request's ``remote_kv_source`` hint): its host
    and peer port (``--peer-port``)."""

    host: str
    port: int


class Admit(msgspec.Struct, array_like=True):
    seq_id: str
    hashes: list[bytes]
    num_tokens: int
    meta: Meta | None = None
    # Hold the cached prefix only, allocating nothing (a lookup: vLLM's tiering asks before it stores);
    # no sequence is made when nothing is cached (the answer's page_ids are empty).
    hold_only: bool = False
    # Where the missing leading pages may be fetched from: a member of the sidecar's peers, or ignored.
    source: Source | None = None
    # Hold the cached prefix and allocate nothing yet, but make the sequence whatever is cached: the pages
    # for the blocks the engine will save are taken when it saves them (Grow), not while it waits.
    save_later: bool = False


class Grow(msgspec.Struct, array_like=True):
    """A sequence admitted with ``save_later`` grows to ``num_tokens`` (its first tokens, whole pages):
    pages for the blocks past its own, allocated now, as many as the pool can give (maybe none)."""

    seq_id: str
    num_tokens: int


class Commit(msgspec.Struct, array_like=True):
    seq_id: str
    num_tokens: int


class Report(msgspec.Struct, array_like=True):
    loaded_tokens: int = 0
    saved_tokens: int = 0
    lookup_seconds: list[float] = msgspec.field(default_factory=list)
    failures: dict[str, int] = msgspec.field(default_factory=dict)
    events: dict[str, int] = msgspec.field(default_factory=dict)  # KV events published, by type


class Step(msgspec.Struct, tag="step", array_like=True):
    admits: list[Admit] = msgspec.field(default_factory=list)
    commits: list[Commit] = msgspec.field(default_factory=list)
    releases: list[str] = msgspec.field(default_factory=list)
    report: Report | None = None
    grows: list[Grow] = msgspec.field(default_factory=list)


class Admitted(msgspec.Struct, tag="admitted", array_like=True):
    page_ids: list[int]
    cached_tokens: int
    epoch: int | None
    # The session's fence word (slot, value) in the pool's header: every copy of this admission names it,
    # and a worker copies nothing once the sidecar has cleared it (the session ended).
    fence: tuple[int, int] | None = None
    # A fetch of the admission's missing pages from its source is under way: nothing was admitted (no
    # sequence, page_ids empty); the same admission asked again is answered once the fetch has ended.
    fetching: bool = False


class Grown(msgspec.Struct, tag="grown", array_like=True):
    page_ids: list[int]  # the pages a grow added, in key order (maybe none: the pool had no room)


class Failed(msgspec.Struct, tag="failed", array_like=True):
    error: str
    detail: str
    field: str = ""


class StepReply(msgspec.Struct, tag="reply", array_like=True):
    admits: list[Admitted | Failed]  # one per admission, in order
    commits: list[int | Failed]  # pages published, one per commit, in order
    releases: list[Failed | None]  # None: released
    # With Hello.events: this model's block hashes that left the pool since the session's last step,
    # before this step's commits and during its admissions; lost: more left than the sidecar keeps
    # between two steps (the connector then counts none of what it announced as held).
    removed_before: list[bytes] = msgspec.field(default_factory=list)
    removed_after: list[bytes] = msgspec.field(default_factory=list)
    removals_lost: bool = False
    grows: list[Grown | Failed] = msgspec.field(default_factory=list)  # one per grow, in order


Message = Hello | Welcome | Refused | Step | StepReply
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_hello_decoder = msgspec.msgpack.Decoder(Hello)  # the first frame: nothing else is decoded unauthenticated


def frame(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes, limit: int = MAX_FRAME) -> int:
    (n,) = _LEN.unpack(header)
    if n > limit:
        raise WireError(f"frame of {n} bytes: the limit is {limit}")
    return n


async def read_frame(reader: asyncio.StreamReader, limit: int,
                     length: Callable[[bytes, int], int] = frame_length) -> bytes | None:
    """The next length-prefixed frame's body (``length`` checks its header against ``limit``: this
    channel's, or another protocol's framed the same way), or None at a clean end of the stream."""
    try:
        header = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    return await reader.readexactly(length(header, limit))


def decode(body: bytes) -> Message:
    return _decode(_decoder, body)


def decode_hello(body: bytes) -> Hello:
    """The first frame of a connection, which must be a hello (read with the :data:`MAX_HELLO` cap)."""
    return _decode(_hello_decoder, body)


def _decode(decoder: msgspec.msgpack.Decoder, body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise WireError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireError(f"not a message: {exc}") from None


def admit_bytes(op: Admit) -> int:
    """An upper estimate of an admission's encoded size (the connector's step budget)."""
    return 64 + len(op.seq_id) + sum(len(h) + 2 for h in op.hashes) + (0 if op.source is None else
                                                                       len(op.source.host) + 8)


def check_hello(msg: Hello) -> None:
    if msg.protocol != PROTOCOL:
        raise WireError(f"protocol {msg.protocol}: this sidecar speaks {PROTOCOL} (field protocol)")
    if msg.role not in ROLES:
        raise WireError(f"role {msg.role!r}: one of {', '.join(ROLES)} (field role)")
    if not 0 < len(msg.session) <= MAX_SEQ_ID:
        raise WireError(f"session must be 1-{MAX_SEQ_ID} characters (field session)")
    if not 0 < len(msg.model) <= 4096:
        raise WireError("model must be 1-4096 characters (field model)")
    if msg.hashing is not None and not (0 < len(msg.hashing.algo) <= 64 and len(msg.hashing.seed) <= 256
                                        and len(msg.hashing.probe) <= MAX_HASH_BYTES):
        raise WireError("hashing: algo 1-64 characters, seed at most 256, probe at most "
                        f"{MAX_HASH_BYTES} bytes (field hashing)")


def check_step(msg: Step) -> None:
    """The bounds of one step as a whole; each op's own bounds (:data:`MAX_BLOCKS`, :data:`MAX_SEQ_ID`)
    and rules are answered per op, so that one request over a bound never costs the session."""
    for name in ("admits", "commits", "releases", "grows"):
        if len(getattr(msg, name)) > MAX_OPS:
            raise WireError(f"{name}: at most {MAX_OPS} per step")
