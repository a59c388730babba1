"""The pool's typed errors: each names the request field at fault and maps to an HTTP status."""

from __future__ import annotations


class PoolError(Exception):
    """Base of the pool's typed errors; ``field`` names the request field at fault, when one is."""

    status = 400

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class InvalidRequest(PoolError):
    status = 422


class UnknownSequence(PoolError):
    status = 404


class UnknownPin(PoolError):
    status = 404


class DuplicateSequence(PoolError):
    status = 409


class QuotaExceeded(PoolError):
    status = 409


class TooManySequences(PoolError):
    """The live-sequence limit is reached (every sequence costs memory, even one that holds no new page)."""

    status = 429


class TooLong(PoolError):
    """A sequence (or a prefix to pin or look up) longer than the pool accepts: hashing it alone costs."""

    status = 413


class TooManyPins(PoolError):
    """A credential holds as many pin records as it may (each costs memory, even on pinned pages)."""

    status = 429


class PoolExhausted(PoolError):
    status = 503

    def __init__(self, needed: int, evictable: int, partition: str) -> None:
        super().__init__(
            f"partition {partition} needs {needed} pages but only {evictable} are free or evictable"
        )
        self.needed = needed
        self.evictable = evictable
        self.partition = partition
