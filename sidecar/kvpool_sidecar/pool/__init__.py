"""The paged KV pool's bookkeeping (no I/O; the shadow caches compiled where built); see :mod:`.pool` for its parts."""

from kvpool_sidecar.errors import (
    DuplicateSequence,
    InvalidRequest,
    PoolError,
    PoolExhausted,
    QuotaExceeded,
    TooLong,
    TooManyPins,
    TooManySequences,
    UnknownPin,
    UnknownSequence,
)
from kvpool_sidecar.keys import (
    DEFAULT_META,
    DEFAULT_TENANT,
    TO_B,
    TO_C,
    ClassKey,
    WorkloadMeta,
    chain_token_keys,
    first_page_digest,
    prompt_keys,
    salted,
    tenant_salt,
    turn_bucket,
)
from kvpool_sidecar.pool.ghost import GHOST_SAMPLE
from kvpool_sidecar.pool.pool import PagePool
from kvpool_sidecar.pool.records import Admission, ForkResult, PartitionStats, Pin, PoolStats

__all__ = [
    "DEFAULT_META",
    "DEFAULT_TENANT",
    "GHOST_SAMPLE",
    "TO_B",
    "TO_C",
    "Admission",
    "ClassKey",
    "DuplicateSequence",
    "ForkResult",
    "InvalidRequest",
    "PagePool",
    "PartitionStats",
    "Pin",
    "PoolError",
    "PoolExhausted",
    "PoolStats",
    "QuotaExceeded",
    "TooLong",
    "TooManyPins",
    "TooManySequences",
    "UnknownPin",
    "UnknownSequence",
    "WorkloadMeta",
    "chain_token_keys",
    "first_page_digest",
    "prompt_keys",
    "salted",
    "tenant_salt",
    "turn_bucket",
]
