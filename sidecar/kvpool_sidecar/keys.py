"""What a request is and how its pages are named: workload metadata, statistics classes, page keys.

The pool, the replay and its simulated router alike: each derives the same keys from the same prompt.
A page's key covers its whole prefix (I3): key_i = H(key_{i-1} || tokens of page i), the first page
salted by its tenant unless the prefix is declared shared.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvpool_sidecar.errors import InvalidRequest

TO_C = "toC"
TO_B = "toB"
DEFAULT_TENANT = "default"
_TURN_BUCKETS = (0, 1, 2, 3, 3, 5)


def turn_bucket(turn: int) -> int:
    """Turns 0, 1, 2, 3-4, 5+: on the Mooncake chat trace the chance that a page is reused rises from
    0.28 on a first turn to 0.70 from the fifth turn on."""
    return _TURN_BUCKETS[min(turn, 5)]


# Request types with statistics classes of their own (``learning.classBy: [requestType]``); the types
# callers name after these share one class, OTHER_REQUEST_TYPES. Each class is held for good (a fit, a
# policy's queue slot), and a deployment's types are a short list: text, code, a few tools.
MAX_REQUEST_TYPES = 32
OTHER_REQUEST_TYPES = "(other)"


class ClassKey(NamedTuple):
    """A statistics class: workload class x request type x turn bucket (what ``learning.classBy``
    leaves out is "" or 0). The reuse model pools a class into its workload class, ``(workload_class,)``."""

    workload_class: str
    request_type: str = ""
    turn_bucket: int = 0


def workload_class_of(klass: Hashable) -> str:
    """The workload class of a statistics class (a ``ClassKey`` or its pooled 1-tuple); to-C if unknown."""
    if isinstance(klass, tuple) and klass:
        return str(klass[0])
    return TO_C


@dataclass(frozen=True, slots=True)
class WorkloadMeta:
    """What the engine knows about a request; drives partitioning, salting and the reuse statistics."""

    workload_class: str = TO_C
    request_type: str = "text"
    turn: int = 0
    tenant: str = DEFAULT_TENANT
    user: str = ""


DEFAULT_META = WorkloadMeta()


def tenant_salt(tenant: str) -> bytes:
    return hashlib.blake2b(b"kvpool-tenant\x00" + tenant.encode(), digest_size=16).digest()


def first_page_digest(tokens: Sequence[int], page_size: int) -> str:
    """The unsalted digest of a prompt's first page: what ``tenancy.sharedPrefixes`` lists."""
    buf = array("q", tokens[:page_size]).tobytes()
    return hashlib.blake2b(buf, digest_size=16).hexdigest()


def chain_token_keys(
    tokens: Sequence[int], page_size: int, salt: bytes | None, shared_first: frozenset[str] = frozenset()
) -> list[bytes]:
    """Chained keys of the full pages of ``tokens``: key_i = H(key_{i-1} || tokens of page i).

    The first page is salted with ``salt`` (its tenant) unless ``salt`` is None or its unsalted
    digest is declared shared, so tenants never hit each other's pages.
    """
    try:
        buf = array("q", tokens).tobytes()
    except (TypeError, OverflowError):
        raise InvalidRequest("tokens must be integers in [0, 2**63)", "tokens") from None
    stride = page_size * 8
    keys: list[bytes] = []
    blake = hashlib.blake2b
    parent = b""
    for i in range(len(tokens) // page_size):
        digest = blake(parent + buf[i * stride : (i + 1) * stride], digest_size=16).digest()
        if i == 0 and salt is not None and digest.hex() not in shared_first:
            digest = blake(salt + digest, digest_size=16).digest()
        keys.append(digest)
        parent = digest
    return keys


def salted(isolate: bool, tenant: str, from_tokens: bool) -> bool:
    """Whether a prompt's keys mix in its tenant's salt: token prompts whenever tenants are isolated;
    precomputed block hashes only for a named tenant (trace ids are used as they are)."""
    return isolate and (from_tokens or tenant != DEFAULT_TENANT)


def prompt_keys(
    tokens: Sequence[int] | None,
    block_hashes: Sequence[Hashable] | None,
    num_tokens: int | None,
    page_size: int,
    salt: bytes | None,
    shared_first: frozenset[str] = frozenset(),
) -> tuple[list[Hashable], int]:
    """The keys of a prompt's full pages, and its length in tokens; exactly one of tokens/block_hashes.

    Token prompts are chained (:func:`chain_token_keys`); precomputed block hashes (trace formats,
    engines hashing themselves) are used as they are, or each salted when ``salt`` is given.
    """
    ps = page_size
    if (tokens is None) == (block_hashes is None):
        raise InvalidRequest("give exactly one of tokens or block_hashes", "tokens")
    if tokens is not None:
        if num_tokens is not None and num_tokens != len(tokens):
            raise InvalidRequest("num_tokens must equal len(tokens)", "num_tokens")
        if not tokens:
            raise InvalidRequest("tokens must not be empty", "tokens")
        return chain_token_keys(tokens, ps, salt, shared_first), len(tokens)
    assert block_hashes is not None
    if not block_hashes:
        raise InvalidRequest("block_hashes must not be empty", "block_hashes")
    n = len(block_hashes) * ps if num_tokens is None else num_tokens
    if n < 1 or not (len(block_hashes) - 1) * ps < n <= len(block_hashes) * ps:
        raise InvalidRequest(f"num_tokens={n} does not fit {len(block_hashes)} blocks of {ps} tokens", "num_tokens")
    hashes = block_hashes[: n // ps]
    if salt is None:
        keys = hashes if type(hashes) is list else list(hashes)  # a list's slice is a copy already
    else:
        keys = [hashlib.blake2b(salt + repr(h).encode(), digest_size=16).digest() for h in hashes]
    try:
        hash(tuple(keys))  # hashes every key in C; an unhashable one fails here, before any change
    except TypeError:
        raise InvalidRequest("block_hashes must be integers or strings", "block_hashes") from None
    return keys, n


# ------------------------------------------------------------------------ the engine's key space
# An engine's pages are keyed by its own block hashes, namespaced by the identity of the model that
# computed them (the connector's ``model``): the namespace's 16 bytes and the hash.
ENGINE_HASHES = ("sha256",)  # vLLM's block-hash functions the sidecar can compute from token ids


def namespace(model: str) -> bytes:
    """The key namespace of an engine's model identity (16 bytes)."""
    return hashlib.blake2b(model.encode(), digest_size=16, person=b"kvpool-model").digest()


def namespaced(ns: bytes, hashes: list[bytes]) -> list[bytes]:
    """Each engine block hash made a pool key of model ``ns`` (a concatenation, not a second hash: it is
    on every admission's path)."""
    return list(map(ns.__add__, hashes))


def _vllm_sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def engine_block_hashes(tokens: Sequence[int], block_size: int, algo: str, seed: str) -> list[bytes]:
    """vLLM's block hashes of the full blocks of a prompt that carries no extra keys (no LoRA adapter,
    multimodal input or cache salt): the first block's parent is H(seed), and block i hashes
    H((parent, its token ids as a tuple, None)), H being vLLM's ``sha256`` (over a pickle). Each engine
    sends a probe computed by vLLM itself in its hello, and the channel checks this function against it
    before it uses it for that model."""
    if algo not in ENGINE_HASHES:
        raise InvalidRequest(f"the engine hashes its blocks with {algo!r}: the sidecar computes only "
                             f"{', '.join(ENGINE_HASHES)} (vLLM's prefix_caching_hash_algo)", "model")
    parent = _vllm_sha256(seed)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _vllm_sha256((parent, tuple(tokens[start : start + block_size]), None))
        out.append(parent)
    return out
