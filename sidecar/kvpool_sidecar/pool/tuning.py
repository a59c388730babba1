"""Self-tuning: which reuse weight would have hit most, asked of shadow caches of the live stream.

No fixed weight wins everywhere: chat pays back a credit of minutes for pages prompts keep
containing, API bursts want seconds, a scan of one-shot documents wants none (plain LRU). Each
candidate weight gets a shadow: a cache of keys only (no KV, no pool), fed the prompts whose first
page falls in a fixed sample (one in ``sampleOneIn`` by hash, so a shared prefix and its
continuations are sampled together) at the same share of the partition's pages. It ranks pages by
the live policy's own key (:func:`~kvpool_sidecar.policies.credit_scale`, counts from the same
sketch), evaluated exactly with a heap. Its hit tokens decay over ``horizonRequests`` requests; the
live policy moves to the best candidate when that beats the one in force by ``marginPercent``. It
starts at the smallest weight (LRU by default), so a tuner that has seen little changes nothing.

Cost: the shadows hold, together, ``candidates / sampleOneIn`` times the partition's keys (one dict
entry and a heap entry or two each) and do that share of its per-page work. Plain Python, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from heapq import heapify, heappop, heappush

from kvpool_sidecar.config import SelfTuning
from kvpool_sidecar.frequency import COUNT_CAP
from kvpool_sidecar.policies import credit_scale

MIN_SHADOW_PAGES = 2048  # below this a sampled shadow ranks the candidates badly: sample more keys
_DECIDE_EVERY = 16  # sampled requests between two decisions
_WARMUP_SAMPLES = 64  # sampled requests before the first decision
PERSISTENCE = 4  # decisions in a row a challenger must lead by the margin before it is adopted


class ShadowCache:
    """Keys of sampled pages only, ranked by ``released + scale * P(count)`` capped by the key of the
    sampled page above (prefix-closed), the later touched (a prompt's deeper page) first on ties;
    lazily deleted heap entries are compacted at twice the live keys."""

    def __init__(self, capacity: int, weight: float) -> None:
        self.capacity = max(capacity, 1)
        self.weight = weight
        self._serial: dict[Hashable, int] = {}  # cached key -> the (negated) serial of its live heap entry
        self._heap: list[tuple[float, int, Hashable]] = []  # (key rank, -serial, key)
        self._next = 0
        self.score = 0.0  # decayed sampled pages hit

    # hot loop: every sampled page, once per candidate
    def access(self, keys: Sequence[Hashable], counts: Sequence[int], p: Sequence[float], scale: float,
               now: float) -> int:
        """The prompt's sampled pages (``keys`` in prompt order, with their counts): how many lead the
        prompt cached (each stands for the unsampled pages around it), then all touched at ``now``."""
        serial_of = self._serial
        hits = 0
        for key in keys:
            if key not in serial_of:
                break
            hits += 1
        heap = self._heap
        serial = self._next
        credit = scale * self.weight
        cap = math.inf
        for key, count in zip(keys, counts, strict=True):
            rank = now + credit * p[count]
            if rank > cap:
                rank = cap
            cap = rank
            serial -= 1
            serial_of[key] = serial
            heappush(heap, (rank, serial, key))
        self._next = serial
        over = len(serial_of) - self.capacity
        while over > 0:
            _, serial, key = heappop(heap)
            if serial_of.get(key) == serial:
                del serial_of[key]
                over -= 1
        if len(heap) > 2 * len(serial_of) + 64:
            self._heap = [e for e in heap if serial_of.get(e[2]) == e[1]]
            heapify(self._heap)
        return hits

    def __len__(self) -> int:
        return len(self._serial)


class SelfTuner:
    """One partition's shadows and the choice they make; see the module's notes."""

    def __init__(self, pages: int, gamma: float, settings: SelfTuning) -> None:
        shift = 0
        while (1 << (shift + 1)) <= settings.sampleOneIn and pages >> (shift + 1) >= MIN_SHADOW_PAGES:
            shift += 1
        self.sample_shift = shift
        self.sample_one_in = 1 << shift
        self.gamma = gamma
        self.shadows = [ShadowCache(pages >> shift, w) for w in settings.reuseWeights]
        self.current = self.shadows[0]
        self._horizon = float(settings.horizonRequests)
        self._margin = 1.0 + settings.marginPercent / 100.0
        self._since = 0
        self._leader: ShadowCache | None = None  # the challenger leading by the margin, and for how long
        self._lead = 0
        self._requests = 0  # requests seen since the last sampled one (for the decay)
        self.sampled = 0
        self.pages = 0.0  # decayed sampled pages looked up
        self.switches = 0

    @property
    def weight(self) -> float:
        return self.current.weight

    def hit_ratios(self) -> dict[float, float]:
        """Each candidate's decayed share of sampled pages hit (about the block hit ratio)."""
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
        sample_keys = [keys[i] for i in sampled]
        counts = [before[i] + 1 if before[i] < COUNT_CAP else COUNT_CAP for i in sampled]  # as read at release
        scale = credit_scale(1.0, window, self.gamma)
        self.pages = self.pages * decay + len(sampled)
        for shadow in self.shadows:
            hit = shadow.access(sample_keys, counts, p, scale, now)
            shadow.score = shadow.score * decay + hit
        self.sampled += 1
        self._since += 1
        if self._since < _DECIDE_EVERY or self.sampled < _WARMUP_SAMPLES:
            return False
        self._since = 0
        best = max(self.shadows, key=lambda s: s.score)  # the smallest weight among equals
        if best is self.current or best.score <= self.current.score * self._margin:
            self._leader, self._lead = None, 0
            return False
        self._lead = self._lead + 1 if best is self._leader else 1
        self._leader = best
        if self._lead < PERSISTENCE:
            return False
        self.current, self._leader, self._lead = best, None, 0
        self.switches += 1
        return True
