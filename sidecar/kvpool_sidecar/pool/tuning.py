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

Cost: the shadows hold, together, ``candidates / sampleOneIn`` times the partition's keys (a 40-byte
entry and two to four table slots each, in ``_shadow.c``) and do that share of its per-page work. No
I/O. The tests hold a Python shadow, decision for decision the compiled one's, as its reference.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from kvpool_sidecar._shadow import ShadowCore
from kvpool_sidecar.config import SelfTuning
from kvpool_sidecar.frequency import COUNT_CAP
from kvpool_sidecar.policies import credit_scale

# Below this a sampled shadow ranks the candidates badly: sample more keys (on the chat trace at
# 1-10 %, shadows of 512 pages chose as well as unsampled ones; shadows of 256 held LRU far longer).
MIN_SHADOW_PAGES = 512
# The shared partition's candidates are close neighbours (their credits differ by the count's lift,
# a few hundredths): its shadows sample at most one key in 2**SHARED_MIN_SHIFT while they keep
# MIN_SHADOW_PAGES, and fewer only while they keep that many times more. Unsampled shadows took a
# chat replay to 5-8.5x LRU's time (cachegrind); these keep it about 2x.
SHARED_MIN_SHIFT = 2
_DECIDE_EVERY = 16  # sampled requests between two decisions
# How consistent a challenger's lead must be: its decayed sum of per-interval leads over at least
# this many times the root of their decayed sum of squares. A steady lead passes after this many
# squared intervals (4), so no decision comes before; a lead that comes and goes (sampling noise,
# phases) needs far more.
SIGNIFICANCE = 2.0
# The leads remember this many times the scores' horizon (and start again at each switch): the
# margin asks a lead to have gained, in hits, ``marginPercent`` of what the candidate in force hits
# over one horizon, which is what a switch may cost; with the scores' own memory a lead under the
# margin per request never added up to it, and the tuner held LRU where a credit paid.
LEAD_MEMORY = 4.0
# A lead is never below minus this many margins (its squares then start again from the floor's): a
# candidate that was worse in an earlier phase is not made to repay that phase once it leads, so
# after a change of traffic the tuner follows within a few intervals, not thousands of requests.
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
    """Keys of sampled pages only, ranked by the live policy's key, ``touched + scale * P(count)``,
    in the compiled core (``_shadow.c``); this class holds what the tuner keeps of it.

    As in the live policy, pages of one credit (one scale, one count) sit in one FIFO queue in touch
    order, a prompt's deeper pages first, and the victim is the lowest of the queues' heads, ranked
    with the curve in force (a heap of the heads only). A replay looks up and touches each prompt's
    pages in turn, and its score gains the pages that lead the prompt cached (each stands for the
    unsampled pages around it); then the lowest keys over capacity leave (once per batch: the tuner
    keeps a batch under 1/64 of the capacity).
    """

    def __init__(self, capacity: int, weight: float) -> None:
        self.weight = weight
        self.core = ShadowCore(max(capacity, 1), weight)
        self.score = 0.0  # decayed sampled pages hit
        self.interval_hits = 0.0  # sampled pages hit since the tuner's last decision
        self.lead = 0.0  # the tuner's decayed sum of this shadow's per-interval lead over the one in force
        self.lead_squares = 0.0  # and of their squares

    @property
    def capacity(self) -> int:
        return self.core.capacity

    @capacity.setter
    def capacity(self, keys: int) -> None:
        """Keys kept from the next replay on (a smaller capacity drops the lowest then)."""
        self.core.capacity = max(keys, 1)

    # hot loop: every sampled page, once per candidate (compiled)
    def replay(self, prompts: Sequence[SampledPrompt], p: Sequence[float]) -> None:
        self.score, self.interval_hits = self.core.replay(prompts, p, self.score, self.interval_hits)

    def __len__(self) -> int:
        return len(self.core)


class SelfTuner:
    """One partition's shadows and the choice they make; see the module's notes."""

    def __init__(self, pages: int, gamma: float, settings: SelfTuning, shared: bool = False) -> None:
        """A tuner of a partition of ``pages``: the shared one (``shared``) or the to-B one, which
        differ in their candidates (``SelfTuning.candidates``) and shadow sizes (see the floors)."""
        floor = MIN_SHADOW_PAGES << SHARED_MIN_SHIFT if shared else MIN_SHADOW_PAGES
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
        deciding = self._since >= _DECIDE_EVERY and self.sampled >= SIGNIFICANCE**2 * _DECIDE_EVERY
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
