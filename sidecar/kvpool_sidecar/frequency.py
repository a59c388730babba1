"""How often prompts contain a page: a bounded frequency sketch, and the reuse probability by count.

The one strong online signal of whether a cached page will be reused is how many requests have
contained it (on the conversation trace: P(reused later) is 0.26 for a page seen once, 0.42 twice,
0.52 three or four times, 0.70 up to eight, 0.83 beyond). A page's count has to outlive its eviction,
or a page that keeps coming back after short stays would look new every time; an exact map of the
evicted keys costs about 100 bytes a key.
The sketch keeps the counts in byte counters indexed by the key's hash (count-min with conservative
update, as TinyLFU does): a count is the smaller of its two cells, and every ``period`` increments
all cells are halved, so counts are recent frequencies and the cells never fill up. A key's two
cells lie in one 64-byte line (a blocked count-min): on a big pool the cells far outsize the CPU's
caches, and a second line per key cost about 0.4 us of its count.
``PERIOD_PER_PAGE`` increments per pool page between halvings keep a key's count for many times a
page's stay in the pool (chat turns come minutes apart; halving every 4 pool's worth of increments
cost 0.03 of token hit ratio on the conversation trace at 2 %), and ``SLOTS_PER_PAGE`` cells per pool
page for each of a key's two cells keep the cells under 40 % full, so a new key finds a false count
in at most about one case in seven (two such cells at once), fewer early in a period.

:class:`ReuseByCount` learns P(a page is contained in one more request | its count) from the same
increments: a key going from count c to c + 1 is a reuse of a page at count c. No I/O. The sketch's
per-key loop is compiled (``_sketch.c``: in Python the 64-bit mixing is arbitrary-precision
arithmetic, 1.4 us a key against 0.09); the tests hold its Python reference.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

from kvpool_sidecar._sketch import count as _count

COUNT_CAP = 15  # counters saturate here; the reuse curve is flat beyond a few counts anyway
SLOTS_PER_PAGE = 32  # cells per pool page for each of a key's two cells (rounded up to a power of two)
PERIOD_PER_PAGE = 16  # increments per pool page between two halvings
# Floors under both, so that a small pool's counts outlive more than a few hundred requests: at 913
# pages (chat at 0.5 %) the per-page sizes alone halve every 14,600 increments, about 600 chat
# requests, and a count of 2-8 is then a recent repeat that says little (see CountLift).
MIN_CELLS = 1 << 19  # 512 KiB
MIN_MEMORY = 65_536  # increments: the shortest memory of the sketch's counts and of the lift's flows
# Observations a learned rate needs before it counts: the prior's weight in P(reuse | count), the
# arrivals before the count's lift is measured (64 keys: a rate's standard error under 0.07).
EVIDENCE = 64.0
# A multiply, xor-shift, multiply mix (splitmix64's finaliser, shortened): Python's hash of an int is
# the int, and a multiply alone is linear, so a range of trace ids shifted by a constant would land
# on a shifted copy of the cells of the range before it (72 % false counts where 12 % is due).
_MIX = 0x9E3779B97F4A7C15
_MIX2 = 0xBF58476D1CE4E5B9
_MASK64 = (1 << 64) - 1
_HALVE = bytes(v >> 1 for v in range(256))
_LINE = 64  # a key's two cells share one 64-byte line: one memory miss per count, not two
# The prior curve (EVIDENCE pseudo-counts per count), close to what chat traffic shows
PRIOR_BY_COUNT = (0.0, 0.26, 0.42, 0.5, 0.55, 0.6, 0.64, 0.68, 0.7, 0.74, 0.77, 0.8, 0.82, 0.83, 0.84, 0.85)
_REFIT_EVERY = 256  # increments between two refits of the curve
REFIT_TOLERANCE = 0.005  # the change of some P(reuse | count) that makes a refit the new curve


def mixed_hash(key: Hashable) -> int:
    """A 64-bit hash of ``key`` whose bits are all well spread (also for small integer keys)."""
    h = (hash(key) * _MIX) & _MASK64
    h ^= h >> 31
    return (h * _MIX2) & _MASK64


class FrequencySketch:
    """Recent counts of keys in bounded memory; see the module's notes."""

    def __init__(self, pages: int) -> None:
        self.halvings = 0
        self.size_for(pages)

    def size_for(self, pages: int) -> None:
        """Room for a pool of ``pages`` (all counts forgotten); 0 releases the memory."""
        cells = _LINE
        while cells < max(2 * pages * SLOTS_PER_PAGE, MIN_CELLS if pages else 0):
            cells <<= 1
        self.pages = pages
        self._line_mask = cells // _LINE - 1
        self._cells = bytearray(cells)
        self._period = max(pages * PERIOD_PER_PAGE, MIN_MEMORY)
        self._added = 0

    @property
    def nbytes(self) -> int:
        return len(self._cells)

    def add(self, keys: Sequence[Hashable], sample_shift: int | None = None) -> tuple[list[int], list[int]]:
        """Count one more request containing each of ``keys``; returns their counts before it and
        the indexes of the keys in the spatial sample of one key in ``2**sample_shift`` (by hash;
        none when None), which the self-tuner's shadows follow."""
        # the sample reads the hash's top bits, the cells its lower ones
        drop = -1 if sample_shift is None else 64 - sample_shift
        before, sampled = _count(self._cells, self._line_mask, keys, COUNT_CAP, drop)
        self._added += len(keys)
        if self._added >= self._period:
            self._added = 0
            self.halvings += 1
            self._cells = self._cells.translate(_HALVE)
        return before, sampled

    def _cell_pair(self, h: int) -> tuple[int, int]:
        """The two cells of a key of mixed hash ``h``: a line by bits 12 and up, a cell in it by
        bits 0-5 and 6-11 (the sample reads the top bits)."""
        line = ((h >> 12) & self._line_mask) << 6
        return line | (h & 63), line | ((h >> 6) & 63)

    def count(self, key: Hashable) -> int:
        i, j = self._cell_pair(mixed_hash(key))
        return min(self._cells[i], self._cells[j])


class _Arrivals:
    """Keys reaching each count (``arrivals[c]``; a new key reaches 1), from the sketch's increments:
    what both curves by count learn from."""

    def __init__(self) -> None:
        self.arrivals = [0.0] * (COUNT_CAP + 2)
        self._since = 0

    def _arrive(self, before: Sequence[int]) -> bool:
        """One request's counts before its increments; True when a refit is due (every
        :data:`_REFIT_EVERY` increments)."""
        arrivals = self.arrivals
        for count in before:
            arrivals[count + 1] += 1.0
        self._since += len(before)
        if self._since < _REFIT_EVERY:
            return False
        self._since = 0
        return True

    def _halve(self) -> None:
        arrivals = self.arrivals
        for c in range(len(arrivals)):
            arrivals[c] *= 0.5


class ReuseByCount(_Arrivals):
    """P(reused once more | count), learned from the sketch's increments and halved with it.

    ``arrivals[c]`` counts keys reaching count c (a new key reaches 1); ``p[c]`` is then
    ``arrivals[c + 1] / arrivals[c]``, shrunk towards :data:`PRIOR_BY_COUNT` and made non-decreasing
    in c (a page seen more often is never ranked below one seen less).
    """

    def __init__(self) -> None:
        super().__init__()
        self.p = list(PRIOR_BY_COUNT)
        self._halvings = 0

    def observe(self, before: Sequence[int], halvings: int) -> None:
        """One request's counts before its increments (:meth:`FrequencySketch.add`)."""
        if halvings != self._halvings:  # the sketch forgot half: so do the rates learned from it
            self._halvings = halvings
            self._halve()
        if self._arrive(before):
            self.refit()

    def refit(self) -> None:
        arrivals = self.arrivals
        p = [0.0] * (COUNT_CAP + 1)
        best = 0.0
        for c in range(1, COUNT_CAP + 1):
            # A reuse at the cap leaves the count there: a visit at the cap is an arrival or a reuse.
            visits = arrivals[c] if c < COUNT_CAP else arrivals[c] + arrivals[c + 1]
            estimate = (arrivals[c + 1] + EVIDENCE * PRIOR_BY_COUNT[c]) / (visits + EVIDENCE)
            best = max(best, min(estimate, 1.0))
            p[c] = best
        # A new curve re-ranks every queue of the policies that read it; one that moved by less
        # than REFIT_TOLERANCE anywhere ranks as the old one does (a second or two of credit).
        if any(abs(new - old) >= REFIT_TOLERANCE for new, old in zip(p, self.p, strict=True)):
            self.p = p


# The shared partition's credit by count (CountLift): 0.5 min(log2 c, 3) / 3, about how much more
# often than a first-seen page a page seen c times comes back on chat (0.26 once; 0.42 twice, 0.52 three or
# four times, 0.70 up to eight: +0.16 / +0.26 / +0.44), flat from 8 on.
LIFT_TOP = 8  # the credit grows with log2 c up to this count; counts 2 to it are scaled by the lift, and
# those above it (templates every prompt sends) keep the shape
LIFT_SHAPE = tuple(0.5 * min(math.log2(c), math.log2(LIFT_TOP)) / math.log2(LIFT_TOP) if c else 0.0
                   for c in range(COUNT_CAP + 1))
LIFT_GATED = range(2, LIFT_TOP + 1)
LIFT_FULL = 0.5  # pages seen 2-8 times coming back this much (relatively) more often than once-seen ones: lift 1
LIFT_MEMORY_PER_PAGE = 4  # increments per pool page between two halvings of the lift's flows (at least MIN_MEMORY)


class CountLift(_Arrivals):
    """The shared partition's credit by count: :data:`LIFT_SHAPE`, with counts 2-8 scaled by the
    count's measured lift.

    Whether a count predicts reuse depends on the traffic. On chat a page seen 2-8 times comes back
    1.5-3 times as often as a page seen once; where only long-running conversations continue (every
    prompt a later turn), a conversation's newest pages come back as often as its oldest, the count
    only says how many turns ago a page was sent, and any credit for it loses to LRU. The lift is
    ``clamp((P_mid - P_1) / (LIFT_FULL P_1), 0, 1)``, P_1 the rate at which keys at count 1 reach 2
    and P_mid the pooled rate at which keys at counts 2-8 reach one more, from the sketch's
    increments (``arrivals`` as in :class:`ReuseByCount`) with their own, shorter memory: halved every
    ``max(LIFT_MEMORY_PER_PAGE x pool pages, MIN_MEMORY)`` increments, so a change of traffic
    shows within a few pools' worth of prompts (the sketch's own period is 16). The credit stays a
    probability's difference: ``p[c]`` is how much more likely than a first-seen page a page at count c
    is to come back, so it is non-decreasing in c and 0 at count 1, and the policy's order stays
    prefix-closed.
    """

    def __init__(self, pages: int = 0) -> None:
        super().__init__()
        self.lift = 1.0
        self.p = self._curve(1.0)
        self._added = 0
        self.size_for(pages)

    def size_for(self, pages: int) -> None:
        """The memory for a pool of ``pages`` (the flows learned so far are kept)."""
        self.memory = max(LIFT_MEMORY_PER_PAGE * pages, MIN_MEMORY)

    @staticmethod
    def _curve(lift: float) -> list[float]:
        return [shape * lift if c in LIFT_GATED else shape for c, shape in enumerate(LIFT_SHAPE)]

    def observe(self, before: Sequence[int], halvings: int = 0) -> None:
        """One request's counts before its increments (:meth:`FrequencySketch.add`); the sketch's
        ``halvings`` are not followed (the flows keep their own memory)."""
        due = self._arrive(before)
        self._added += len(before)
        if self._added >= self.memory:
            self._added = 0
            self._halve()
        if due:
            self.refit()

    def measured_lift(self) -> float:
        """The lift the flows show now (1 while they are too few to say)."""
        arrivals = self.arrivals
        gated = sum(arrivals[c] for c in LIFT_GATED)
        if arrivals[1] < EVIDENCE or gated < EVIDENCE:
            return 1.0
        once = arrivals[2] / arrivals[1]
        more = sum(arrivals[c + 1] for c in LIFT_GATED) / gated
        if once <= 0.0:
            return 1.0 if more > 0.0 else 0.0
        return min(max((more - once) / (LIFT_FULL * once), 0.0), 1.0)

    def refit(self) -> None:
        # As ReuseByCount's: a curve that moves the credit by less than the tolerance ranks as the old.
        lift = self.measured_lift()
        if abs(lift - self.lift) * LIFT_SHAPE[LIFT_GATED[-1]] >= REFIT_TOLERANCE:  # the shape's top gated credit
            self.lift = lift
            self.p = self._curve(lift)


class CountCurve(Protocol):
    """What policies and the self-tuner read of a partition's curve: its credit per count (replaced,
    not changed in place, when it is refitted), and what the pool feeds it."""

    p: Sequence[float]

    def observe(self, before: Sequence[int], halvings: int) -> None: ...


class FrequencyView(NamedTuple):
    """What a policy reads of the pool's page frequencies: each page's count when it was last
    admitted (indexed by page id, kept by the pool) and its partition's curve by count."""

    page_counts: list[int]
    curve: CountCurve
