"""Page counts and the self-tuner; a part of :class:`~kvpool_sidecar.pool.PagePool`.

Kept only while a partition's policy ranks by page counts (``uses_frequency``): every admitted
prompt's page keys are counted in the sketch, its partition's reuse-by-count curve learns from the
counts, and (with ``eviction.selfTuning`` on) its partition's tuner is fed and may move the policy's
reuse weight.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvpool_sidecar.frequency import COUNT_CAP, CountCurve, CountLift, FrequencySketch, FrequencyView, ReuseByCount
from kvpool_sidecar.keys import TO_B
from kvpool_sidecar.pool.capacity import Capacity
from kvpool_sidecar.pool.eviction import Eviction
from kvpool_sidecar.pool.records import PARTITIONS, PoolSettings
from kvpool_sidecar.pool.tuning import SelfTuner


class PageFrequencies:
    """Page counts, count curves and self-tuners by partition: an observer of a pool's admissions that
    moves its policies' reuse weights (the policies of an :class:`~.eviction.Eviction`)."""

    def __init__(self, eviction: Eviction, capacity: Capacity) -> None:
        self.eviction = eviction
        self.capacity = capacity
        self._sketch = FrequencySketch(0)
        self._page_counts: list[int] = []  # per page, its count when last admitted (while counting)
        # The to-B partition's credit is the learned P(reuse | count): template bursts, where the count
        # is a strong signal. The shared one's is the count's measured lift (CountLift): there the
        # count can say nothing, as where every prompt is a later turn of a long conversation.
        self._curves: list[CountCurve] = [ReuseByCount() if part == TO_B else CountLift() for part in PARTITIONS]
        self._tuners: list[SelfTuner | None] = [None] * len(PARTITIONS)
        self._tuner_shape: list[tuple | None] = [None] * len(PARTITIONS)
        self.counting = False
        self.tuning_switches = [0] * len(PARTITIONS)  # across tuner restarts (a counter for metrics)

    def view(self, part: int) -> FrequencyView:
        return FrequencyView(self._page_counts, self._curves[part])

    def configure(self, settings: PoolSettings) -> None:
        """Count pages (and tune) for the partitions whose policy ranks by counts; drop it otherwise."""
        self.window_of = settings.window_of
        counted = [p.uses_frequency for p in self.eviction.policies]
        self.counting = any(counted)
        want = self.eviction.table.total_pages if self.counting else 0
        # Sized when a policy first counts; kept (unused) when a switch drops counting: freeing a million
        # pages' counts would stall the switch, and a switch back finds them ready.
        if want > self._sketch.pages:
            self._sketch.size_for(want)
            self._page_counts[:] = [0] * want
            for curve in self._curves:
                if isinstance(curve, CountLift):
                    curve.size_for(want)
        tuning = settings.tuning
        gamma = settings.gamma
        for part, policy in enumerate(self.eviction.policies):
            limit = self.eviction.limits[part]  # the pages it may hold: to-C's include to-B's idle share
            shape = (limit, gamma, tuning) if counted[part] and tuning.enabled and limit else None
            if shape != self._tuner_shape[part]:
                self._tuner_shape[part] = shape
                self._tuners[part] = None if shape is None else SelfTuner(
                    limit, gamma, tuning, shared=PARTITIONS[part] != TO_B)
            if counted[part]:
                tuner = self._tuners[part]
                policy.set_reuse_weight(None if tuner is None else tuner.weight)

    def count(self, keys: list[Hashable], pages: list[int], part: int, workload_class: str,
                     now: float) -> list[int]:
        """One admitted prompt: its pages counted, its partition's curve and tuner fed. Returns each key's
        count before this admission (for the pages a sequence takes later: :meth:`assign`)."""
        sketch = self._sketch
        tuner = self._tuners[part]
        before, sampled = sketch.add(keys, tuner.sample_shift if tuner is not None else None)
        page_counts = self._page_counts
        for page, count in zip(pages, before, strict=False):  # the keys of its full pages lead
            page_counts[page] = count + 1 if count < COUNT_CAP else count
        curve = self._curves[part]
        curve.observe(before, sketch.halvings)
        if tuner is not None:
            tuner.follow(self.capacity.reach(part))
            window = self.window_of(workload_class)
            if tuner.observe(keys, before, sampled, curve.p, window, now):
                self.eviction.policies[part].set_reuse_weight(tuner.weight)
                self.tuning_switches[part] += 1
        return before

    def assign(self, pages: list[int], before: list[int]) -> None:
        """Pages a sequence took after its admission: their keys' counts as that admission saw them."""
        page_counts = self._page_counts
        for page, count in zip(pages, before, strict=False):
            page_counts[page] = count + 1 if count < COUNT_CAP else count

    def tuners(self) -> dict[str, SelfTuner]:
        """The self-tuners by partition (those running)."""
        return {PARTITIONS[i]: t for i, t in enumerate(self._tuners) if t is not None}

    def tuning(self) -> dict[str, dict]:
        """Per partition (with pages) whose policy ranks by counts: the reuse weight in force, whether the tuner
        chose it, the switches so far, each candidate's recent shadow hit ratio and the count's lift in
        force (the shared partition's; None for the to-B one, which learns P(reuse | count) instead)."""
        out: dict[str, dict] = {}
        for part, policy in enumerate(self.eviction.policies):
            if not policy.uses_frequency or not self.eviction.limits[part]:
                continue  # a partition with no pages ranks nothing
            tuner = self._tuners[part]
            out[PARTITIONS[part]] = {
                "reuse_weight": policy.weights[0],
                "self_tuned": tuner is not None,
                "switches": self.tuning_switches[part],
                "shadow_hit_ratios": {} if tuner is None else tuner.hit_ratios(),
                "sample_one_in": 0 if tuner is None else tuner.sample_one_in,
                "count_lift": curve.lift if isinstance(curve := self._curves[part], CountLift) else None,
            }
        return out
