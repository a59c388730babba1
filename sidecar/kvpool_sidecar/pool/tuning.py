"""Self-tuning: which reuse weight would have hit most, asked of shadow caches of the live stream.

No fixed weight wins everywhere: chat pays back a credit of minutes for pages prompts keep
containing, API bursts want seconds, a scan of one-shot documents wants none (plain LRU). Each
candidate weight gets a shadow: a cache of keys only (no KV, no pool), fed a fixed spatial sample
of each prompt's pages (one page key in ``sampleOneIn`` by hash, so a page and its later reuses are
sampled together; a first-page sample fails on chat, whose prompts all share their first page) at
the same share of the partition's pages. It ranks pages by the live policy's own key
(:func:`~kvpool_sidecar.policies.credit_scale`, counts from the same sketch), exactly. Its hit pages
decay over ``horizonRequests`` requests. Every 16 sampled prompts the tuner adds each challenger's
lead over the candidate in force (hits in that interval; the leads decay over :data:`LEAD_MEMORY`
times that horizon, start again at each switch and never fall below :data:`LEAD_FLOOR` margins);
the live policy moves to the challenger whose lead is both over ``marginPercent`` of the in-force
score and consistent (over :data:`SIGNIFICANCE` times the root of the leads' squares): a switch costs
the live cache more than the shadows see, so a lead that comes and goes must move nothing. It starts
at the smallest weight (LRU by default), so a tuner that has seen little changes nothing.

Cost: the shadows hold, together, ``candidates / sampleOneIn`` times the partition's keys (two dict
entries each in Python; compiled, a 40-byte entry and two to four table slots) and do that share of
its per-page work. No I/O. A shadow's replay runs compiled where the package was built with
``_shadow.c`` (its queues, table and heap in C, the same decisions, tie for tie);
:class:`ShadowCache`'s own loops are its reference and run where it was not.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from heapq import heapify, heappop, heappush, heapreplace
from itertools import repeat
from typing import NamedTuple

from kvpool_sidecar.config import SelfTuning
from kvpool_sidecar.frequency import COUNT_CAP
from kvpool_sidecar.policies import credit_scale, run_limit

try:  # a shadow's replay compiled, where the package was built with it (see _shadow.c)
    from kvpool_sidecar._shadow import ShadowCore as _ShadowCore
except ImportError:  # pragma: no cover - a build without a C compiler
    _ShadowCore = None
COMPILED = _ShadowCore is not None

# Below this a sampled shadow ranks the candidates badly: sample more keys. Measured on the chat
# trace at 1-10 %: shadows of 512 pages and more chose as well as unsampled ones; at 256 the tuner
# held LRU for a quarter of the trace at 5 % (0.2189 against 0.2233).
MIN_SHADOW_PAGES = 512
# The shared partition's: chat's best weights there are close neighbours (0.03-0.12 on the count's
# lift), and shadows of 512 pages told them apart late (chat at 5 %: 0.2221, sampled 1 in 16). Larger
# shadows cost: six unsampled ones took a chat replay from about 2x LRU's time to 5-8.5x at 2-5 %
# (cachegrind). So the shared partition samples one key in at least SHARED_MIN_SHIFT powers of two (4)
# while its shadows keep MIN_SHADOW_PAGES, and more only while they keep SHARED_MIN_SHADOW_PAGES:
# chat at 5 % 0.2264, about 2x LRU's time at every capacity (session 21).
SHARED_MIN_SHADOW_PAGES = 2048
SHARED_MIN_SHIFT = 2
_DECIDE_EVERY = 16  # sampled requests between two decisions
_WARMUP_SAMPLES = 64  # sampled requests before the first decision
# How consistent a challenger's lead must be: its decayed sum of per-interval leads over at least
# this many times the root of their decayed sum of squares. A steady lead passes after this many
# squared intervals (4); a lead that comes and goes (sampling noise, phases) needs far more.
SIGNIFICANCE = 2.0
# The leads remember this many times the scores' horizon (and start again at each switch): the
# margin asks a lead to have gained, in hits, ``marginPercent`` of what the candidate in force hits
# over one horizon, which is what a switch may cost. With the scores' own memory a lead under the
# margin per request never added up to it: unsampled shadows held LRU for a third of the chat trace
# at 10 % (0.2986; a quarter and 0.2998 with this memory).
LEAD_MEMORY = 4.0
# A lead is never below minus this many margins (its squares then start again from the floor's): a
# candidate that was worse in an earlier phase is not made to repay that phase once it leads. Without
# it, a weight chosen rightly and then outgrown held for thousands of requests: on the to-b-burst
# synth trace of seed 5 at 2 % the default stayed at 0.1 to the end (0.0034 under LRU; 0.0007 with
# the floor, and no row of the shipped traces and synth seeds 1-8 more than 0.002 under LRU).
LEAD_FLOOR = 1.0


class SampledPrompt(NamedTuple):
    """One admitted prompt as the shadows see it: its sampled page keys in prompt order, their counts
    capped by the sampled page above (prefix-closed), its credit scale, its time, and the decay of
    the scores since the sampled prompt before it."""

    keys: list[Hashable]
    counts: list[int]
    scale: float
    now: float
    decay: float


class ShadowCache:
    """Keys of sampled pages only, ranked by the live policy's key, ``touched + scale * P(count)``.

    As in the live policy, pages of one credit (one scale, one count) sit in one FIFO queue in
    touch order, a prompt's deeper pages first, and the victim is the lowest of the queues' heads,
    ranked with the curve in force: a few dict operations per page and a heap of the heads only (a
    heap entry per touch cost about a microsecond per sampled page and shadow, most of the tuner's
    time).
    """

    def __init__(self, capacity: int, weight: float, compiled: bool | None = None) -> None:
        self._capacity = max(capacity, 1)
        self.weight = weight
        # The compiled twin of replay and _evict (_shadow.c), where it was built; this class's own
        # loops are its reference (compiled=False runs them).
        compiled = COMPILED if compiled is None else compiled
        if compiled and _ShadowCore is None:
            raise RuntimeError("kvpool_sidecar._shadow was not built: only compiled=False can run here")
        self._core = _ShadowCore(self._capacity, weight) if compiled else None
        self._queue_of: dict[Hashable, OrderedDict[Hashable, float]] = {}  # cached key -> its queue
        self._queues: dict[tuple[float, int], OrderedDict[Hashable, float]] = {}  # (scale, count) -> key -> touched
        # (a lower bound of a queue's head rank, a serial, the queue, the head it was made for)
        self._heap: list[tuple[float, int, tuple[float, int], Hashable]] = []
        self._heap_p: Sequence[float] = ()  # the curve the heap's ranks were computed with
        self._serial = 0
        self.score = 0.0  # decayed sampled pages hit
        self.interval_hits = 0.0  # sampled pages hit since the tuner's last decision
        self.lead = 0.0  # the tuner's decayed sum of this shadow's per-interval lead over the one in force
        self.lead_squares = 0.0  # and of their squares

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, keys: int) -> None:
        """Keys kept from the next replay on (a smaller capacity drops the lowest then)."""
        self._capacity = max(keys, 1)
        if self._core is not None:
            self._core.capacity = self._capacity

    # hot loop: every sampled page, once per candidate
    def replay(self, prompts: Sequence[SampledPrompt], p: Sequence[float]) -> None:
        """Look up and touch each prompt's pages in turn: its score gains the pages that lead the
        prompt cached (each stands for the unsampled pages around it); then the lowest keys over
        capacity leave (once per batch: the tuner keeps a batch under 1/64 of the capacity)."""
        if self._core is not None:
            self.score, self.interval_hits = self._core.replay(prompts, p, self.score, self.interval_hits)
            return
        queue_of = self._queue_of
        queues = self._queues
        weight = self.weight
        ranked = weight > 0  # weight 0 is LRU: one queue
        score = self.score
        interval = self.interval_hits
        heap, serial = self._heap, self._serial
        for keys, counts, scale, now, decay in prompts:
            hits = 0
            for key in keys:
                if key not in queue_of:
                    break
                hits += 1
            score = score * decay + hits
            interval += hits
            held = -1  # the count whose queue ``queue`` is (a prompt's counts come in runs)
            # deeper pages first: they leave first on equal keys
            for key, count in zip(reversed(keys), reversed(counts) if ranked else repeat(0), strict=False):
                if count != held:
                    held, where = count, (scale, count)
                    queue = queues.get(where)
                    if queue is None:
                        queue = queues[where] = OrderedDict()
                old = queue_of.get(key)
                if old is queue:  # a hit that stays in its queue: to its tail
                    queue.move_to_end(key)
                    queue[key] = now
                    continue
                if old is not None:
                    del old[key]
                if not queue:  # a new head: its entry (a later curve is seen by _evict's rebuild)
                    serial += 1
                    heappush(heap, (now + self._credit(where, p), serial, where, key))
                queue[key] = now
                queue_of[key] = queue
        self.score, self.interval_hits, self._serial = score, interval, serial
        over = len(queue_of) - self._capacity
        if over > 0:
            self._evict(over, p)

    def _evict(self, over: int, p: Sequence[float]) -> None:
        """Drop the ``over`` lowest keys, in runs from the lowest queue while its head stays below
        the next entries of the heads' heap.

        The heap holds, for every non-empty queue, at least one entry whose rank is at most its
        head's (a queue's head only ages forward: a touch moves a key to a tail); an entry that
        no longer names its queue's head at its rank is replaced by the head's when it surfaces.
        A new curve changes the credits: the heap is then rebuilt.
        """
        queue_of, queues = self._queue_of, self._queues
        if p is not self._heap_p or len(self._heap) > 4 * len(queues) + 64:
            self._rebuild(p)
        heap = self._heap
        while over > 0:
            rank, _, where, head = heap[0]
            queue = queues[where]
            if not queue:
                heappop(heap)
                continue
            gain = self._credit(where, p)
            first = next(iter(queue))
            if first != head or queue[first] + gain != rank:
                heapreplace(heap, self._head_entry(where, queue, gain))
                continue
            limit = run_limit(heap)
            pop = queue.popitem
            key, _ = pop(False)  # the head, valid: the lowest key
            del queue_of[key]
            over -= 1
            while over and queue:
                key, touched = pop(False)
                if touched + gain > limit:  # beyond the run: back to the front
                    queue[key] = touched
                    queue.move_to_end(key, False)
                    break
                del queue_of[key]
                over -= 1
            if queue:
                heapreplace(heap, self._head_entry(where, queue, gain))
            else:
                heappop(heap)

    def _credit(self, where: tuple[float, int], p: Sequence[float]) -> float:
        """Seconds of key the pages of queue ``where`` (scale, count) get ahead of their touch."""
        return where[0] * self.weight * p[where[1]]

    def _head_entry(self, where: tuple[float, int], queue: OrderedDict[Hashable, float],
                    gain: float) -> tuple[float, int, tuple[float, int], Hashable]:
        """A heap entry for the head of the non-empty ``queue`` at ``where``, whose credit is ``gain``."""
        first = next(iter(queue))
        self._serial += 1
        return queue[first] + gain, self._serial, where, first

    def _rebuild(self, p: Sequence[float]) -> None:
        """The heads' heap from scratch, with the curve ``p``."""
        heap = [self._head_entry(where, queue, self._credit(where, p))
                for where, queue in self._queues.items() if queue]
        heapify(heap)
        self._heap, self._heap_p = heap, p

    def queues(self) -> list[tuple[float, int, list[tuple[Hashable, float]]]]:
        """Every queue's scale, count and (key, touch time) pairs in order, in the order the queues
        were made (for tests: the compiled twin answers the same)."""
        if self._core is not None:
            return self._core.queues()
        return [(scale, count, list(queue.items())) for (scale, count), queue in self._queues.items()]

    def __len__(self) -> int:
        return len(self._core) if self._core is not None else len(self._queue_of)


class SelfTuner:
    """One partition's shadows and the choice they make; see the module's notes."""

    def __init__(self, pages: int, gamma: float, settings: SelfTuning, shared: bool = False) -> None:
        """A tuner of a partition of ``pages``: the shared one (``shared``) or the to-B one, which
        differ in their candidates (``SelfTuning.candidates``) and shadow sizes (see the floors)."""
        floor = SHARED_MIN_SHADOW_PAGES if shared else MIN_SHADOW_PAGES
        shift = 0
        while (1 << (shift + 1)) <= settings.sampleOneIn and pages >> (shift + 1) >= floor:
            shift += 1
        least = SHARED_MIN_SHIFT if shared else 0
        while (shift < least and (1 << (shift + 1)) <= settings.sampleOneIn
               and pages >> (shift + 1) >= MIN_SHADOW_PAGES):
            shift += 1
        self.sample_shift = shift
        self.sample_one_in = 1 << shift
        self.gamma = gamma
        self.shadows = [ShadowCache(pages >> shift, w) for w in settings.candidates(to_b=not shared)]
        self.current = self.shadows[0]
        self._horizon = float(settings.horizonRequests)
        self._margin = settings.marginPercent / 100.0
        self._since = 0
        self._requests = 0  # requests seen since the last sampled one (for the decay)
        self._interval_decay = 1.0  # the scores' decay since the last decision
        self.sampled = 0
        self.pages = 0.0  # decayed sampled pages looked up (replayed)
        self.switches = 0
        # Prompts not yet replayed into the shadows: a call per prompt and shadow cost more than the
        # pages (a prompt has one or two sampled pages at 1 in 32); bounded to 1/64 of a shadow.
        self._batch: list[SampledPrompt] = []
        self._batched = 0
        self._batch_pages = max(self.shadows[0].capacity // 64, 1)

    def follow(self, pages: int) -> None:
        """The partition can hold ``pages`` now (to-C: the pool less what to-B holds): the shadows
        keep that share of it, so that they compare the weights at the cache size the live policy
        really has (a shadow of the whole pool while to-B holds its share favoured long credits)."""
        keys = max(pages >> self.sample_shift, 1)
        if keys != self.shadows[0].capacity:
            for shadow in self.shadows:
                shadow.capacity = keys

    def flush(self, p: Sequence[float]) -> None:
        """Replay the batched prompts into every shadow."""
        for shadow in self.shadows:
            shadow.replay(self._batch, p)
        for prompt in self._batch:
            self.pages = self.pages * prompt.decay + len(prompt.keys)
        self._batch, self._batched = [], 0

    @property
    def weight(self) -> float:
        return self.current.weight

    def hit_ratios(self) -> dict[float, float]:
        """Each candidate's decayed share of sampled pages hit (about the block hit ratio), as of
        the last batch replayed."""
        return {s.weight: (s.score / self.pages if self.pages else 0.0) for s in self.shadows}

    def observe(self, keys: Sequence[Hashable], before: Sequence[int], sampled: Sequence[int],
                p: Sequence[float], window: float, now: float) -> bool:
        """Feed one admitted prompt (its page keys, their counts before it, the indexes of its pages in
        the sample); True when the choice changed."""
        self._requests += 1
        if not sampled:
            return False
        decay = math.exp(-self._requests / self._horizon)
        self._requests = 0
        self._interval_decay *= decay
        counts: list[int] = []
        cap = COUNT_CAP
        for i in sampled:  # as read at release, each capped by the sampled page above it
            count = before[i] + 1 if before[i] < cap else cap
            counts.append(count)
            cap = count
        self._batch.append(SampledPrompt([keys[i] for i in sampled], counts,
                                         credit_scale(1.0, window, self.gamma), now, decay))
        self._batched += len(sampled)
        self.sampled += 1
        self._since += 1
        deciding = self._since >= _DECIDE_EVERY and self.sampled >= _WARMUP_SAMPLES
        if deciding or self._batched >= self._batch_pages:
            self.flush(p)
        if not deciding:
            return False
        self._since = 0
        return self._decide()

    def _decide(self) -> bool:
        """Adopt the challenger whose lead over the candidate in force is large (the margin of the
        in-force score) and consistent (:data:`SIGNIFICANCE`), if any; True when it changed.

        A switch has a cost the shadows do not see (the live cache was shaped by the old weight),
        so a lead that comes and goes must not move the policy back and forth.
        """
        current = self.current
        decay, self._interval_decay = self._interval_decay ** (1.0 / LEAD_MEMORY), 1.0
        best: ShadowCache | None = None
        margin = self._margin * current.score
        floor = -LEAD_FLOOR * margin
        for shadow in self.shadows:
            lead = shadow.interval_hits - current.interval_hits
            shadow.lead = shadow.lead * decay + lead
            shadow.lead_squares = shadow.lead_squares * decay + lead * lead
            if shadow.lead < floor:
                shadow.lead, shadow.lead_squares = floor, floor * floor
        for shadow in self.shadows:
            shadow.interval_hits = 0.0
            if (shadow is not current and shadow.lead > margin
                    and shadow.lead > SIGNIFICANCE * math.sqrt(shadow.lead_squares)
                    and (best is None or shadow.lead > best.lead)):
                best = shadow
        if best is None:
            return False
        self.current = best
        for shadow in self.shadows:  # leads are against the candidate in force: start again
            shadow.lead = shadow.lead_squares = 0.0
        self.switches += 1
        return True
