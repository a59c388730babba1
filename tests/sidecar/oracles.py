"""The Python references of the two compiled loops: what ``_sketch.c`` and ``_shadow.c`` must do,
decision for decision. Slow (1.4 us a key for the sketch), so they live here, not in the package:
tests/sidecar/test_adaptive.py feeds each and its compiled twin the same input and compares them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from heapq import heapify, heappop, heappush, heapreplace
from itertools import repeat

from kvpool_sidecar.frequency import _MASK64, _MIX, _MIX2
from kvpool_sidecar.policies import run_limit


def count_python(cells: bytearray, line_mask: int, keys: Sequence[Hashable], cap: int,
                 drop: int) -> tuple[list[int], list[int]]:
    """``_sketch.count``: one request's increments. Each key's count (the smaller of its two cells)
    before it, raised by one up to ``cap`` (conservative update: only the cells below the new count
    move), and the indexes of the keys whose mixed hash has no bit set from bit ``drop`` up (none when
    ``drop`` < 0)."""
    before: list[int] = []
    sampled: list[int] = []
    for depth, key in enumerate(keys):
        h = (hash(key) * _MIX) & _MASK64  # frequency.mixed_hash
        h = ((h ^ (h >> 31)) * _MIX2) & _MASK64
        line = ((h >> 12) & line_mask) << 6  # FrequencySketch._cell_pair
        i, j = line | (h & 63), line | ((h >> 6) & 63)
        a, b = cells[i], cells[j]
        count = a if a < b else b
        before.append(count)
        if count < cap:
            count += 1
            if a < count:
                cells[i] = count
            if b < count:
                cells[j] = count
        if drop >= 0 and not h >> drop:
            sampled.append(depth)
    return before, sampled


Where = tuple[float, int]  # a queue: (scale, count)


class PythonShadowCore:
    """``_shadow.ShadowCore``: a shadow's keys (each one's hash, as the compiled core keeps them) in
    FIFO queues by (scale, count), in touch order, and a heap of lower bounds of the queues' head
    ranks ordered by (rank, serial), serials handed out at the same steps as the compiled core's, so
    that ties break alike."""

    def __init__(self, capacity: int, weight: float) -> None:
        self.capacity = capacity
        self.weight = weight
        self._queue_of: dict[Hashable, OrderedDict[Hashable, float]] = {}  # cached key -> its queue
        self._queues: dict[Where, OrderedDict[Hashable, float]] = {}  # key -> touched, per queue
        self._heap: list[tuple[float, int, Where, Hashable]] = []  # (rank bound, serial, queue, head)
        self._heap_p: Sequence[float] = ()  # the curve the heap's ranks were computed with
        self._serial = 0

    def replay(self, prompts: Sequence[tuple], p: Sequence[float], score: float,
               interval: float) -> tuple[float, float]:
        queue_of, queues = self._queue_of, self._queues
        ranked = self.weight > 0  # weight 0 is LRU: one queue
        for objects, counts, scale, now, decay in prompts:
            keys = [hash(key) for key in objects]
            hits = 0
            for key in keys:
                if key not in queue_of:
                    break
                hits += 1
            score = score * decay + hits
            interval += hits
            held = -1  # the count whose queue ``queue`` is
            for key, count in zip(reversed(keys), reversed(counts) if ranked else repeat(0), strict=False):
                if count != held:  # deeper pages first: they leave first on equal keys
                    held, where = count, (scale, count)
                    queue = queues.setdefault(where, OrderedDict())
                old = queue_of.get(key)
                if old is queue:  # a hit that stays in its queue: to its tail
                    queue.move_to_end(key)
                    queue[key] = now
                    continue
                if old is not None:
                    del old[key]
                if not queue:  # a new head: its entry
                    self._serial += 1
                    heappush(self._heap, (now + self._credit(where, p), self._serial, where, key))
                queue[key] = now
                queue_of[key] = queue
        over = len(queue_of) - max(self.capacity, 1)
        if over > 0:
            self._evict(over, p)
        return score, interval

    def _evict(self, over: int, p: Sequence[float]) -> None:
        """Drop the ``over`` lowest keys, in runs from the lowest queue while its head stays below
        the next entries of the heap; an entry that no longer names its queue's head at its rank is
        replaced when it surfaces, and a new curve rebuilds the heap."""
        queue_of, queues = self._queue_of, self._queues
        if p is not self._heap_p or len(self._heap) > 4 * len(queues) + 64:
            self._heap = [self._head_entry(where, queue, self._credit(where, p))
                          for where, queue in queues.items() if queue]
            heapify(self._heap)
            self._heap_p = p
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
            key, _ = queue.popitem(False)  # the head, valid: the lowest key
            del queue_of[key]
            over -= 1
            while over and queue:
                key, touched = queue.popitem(False)
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

    def _credit(self, where: Where, p: Sequence[float]) -> float:
        return where[0] * self.weight * p[where[1]]

    def _head_entry(self, where: Where, queue: OrderedDict[Hashable, float],
                    gain: float) -> tuple[float, int, Where, Hashable]:
        first = next(iter(queue))
        self._serial += 1
        return queue[first] + gain, self._serial, where, first

    def queues(self) -> list[tuple[float, int, list[tuple[Hashable, float]]]]:
        return [(scale, count, list(queue.items())) for (scale, count), queue in self._queues.items()]

    def __len__(self) -> int:
        return len(self._queue_of)
