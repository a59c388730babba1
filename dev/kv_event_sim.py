"""Routing on KV events, simulated: N pods, each with an engine's own prefix cache (the GPU tier) and a real
kvpool pool (the CPU tier), whose KV events feed an index that scores pods the way llm-d's precise
prefix-cache scorer does.

Per request, the router scores every pod by the longest run of the request's leading blocks the index
says the pod holds, each block counted at the weight of the best tier holding it (llm-d's defaults: gpu
1.0, cpu 0.8), and adds a load score (llm-d's example profile: prefix weight 3, load 2). The pod serves
the request as vLLM with the connector would: its own cache's leading hit, or kvpool's if longer, then
computes the rest and saves it to both tiers. What the pods publish is what the index learns:

* GPU tier: a stored event per block it caches, a removal per block its LRU drops;
* kvpool: the connector's own bookkeeping (:class:`~kvpool_sidecar.routing.kv_events.EventLog`) fed by the
  pool's published count at commit and the keys the pool itself reports removed.

Routers compared on the same trace: ``events`` (the index reads both media, what kvpool's events give a
router) and ``gpu-only`` (the index ignores medium CPU: every router before kvpool published events).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import PagePool, PoolExhausted
from kvpool_sidecar.replay.run import capacity_pages, trace_spec
from kvpool_sidecar.replay.trace import Request, Trace
from kvpool_sidecar.routing.kv_events import EventLog, Removed, Stored

GPU, CPU = "GPU", "CPU"
TIER_WEIGHTS = {GPU: 1.0, CPU: 0.8}  # llm-d's defaults for its gpu and cpu tiers
PREFIX_WEIGHT, LOAD_WEIGHT = 3.0, 2.0  # llm-d's example scheduling profile (prefix 3, queue 2)
LOAD_WINDOW_S = 10.0  # requests routed to a pod within this window stand for its queue
ROUTERS = ("events", "gpu-only")


class PrefixIndex:
    """What the event streams say each pod holds: block hash -> pod -> media (llm-d's block index)."""

    def __init__(self, media: Iterable[str]) -> None:
        self.media = frozenset(media)
        self._where: dict[Hashable, dict[int, set[str]]] = {}

    def stored(self, pod: int, hashes: Iterable[Hashable], medium: str) -> None:
        if medium not in self.media:
            return
        for h in hashes:
            self._where.setdefault(h, {}).setdefault(pod, set()).add(medium)

    def removed(self, pod: int, hashes: Iterable[Hashable], medium: str) -> None:
        if medium not in self.media:
            return
        for h in hashes:
            pods = self._where.get(h)
            media = pods.get(pod) if pods else None
            if media is None:
                continue
            media.discard(medium)
            if not media:
                del pods[pod]  # type: ignore[union-attr]
                if not pods:
                    del self._where[h]

    def prefix_scores(self, hashes: list[Hashable], pods: int) -> list[float]:
        """Per pod: its longest run of leading blocks, each at its best tier's weight."""
        scores = [0.0] * pods
        alive = set(range(pods))
        for h in hashes:
            where = self._where.get(h, {})
            alive &= where.keys()
            if not alive:
                break
            for pod in alive:
                scores[pod] += max(TIER_WEIGHTS[m] for m in where[pod])
        return scores

    def run(self, hashes: list[Hashable], pod: int, medium: str) -> int:
        """How many leading blocks ``pod`` holds in ``medium``."""
        n = 0
        for h in hashes:
            if medium not in self._where.get(h, {}).get(pod, ()):
                break
            n += 1
        return n


class GpuCache:
    """An engine's own prefix cache: whole blocks, least recently used dropped first."""

    def __init__(self, blocks: int) -> None:
        self.capacity = blocks
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def leading_hits(self, hashes: list[Hashable]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n

    def store(self, hashes: list[Hashable]) -> tuple[list[Hashable], list[Hashable]]:
        """Cache ``hashes`` (most recent last); returns (newly stored, dropped)."""
        new = [h for h in hashes if h not in self._blocks]
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        dropped = []
        while len(self._blocks) > self.capacity:
            dropped.append(self._blocks.popitem(last=False)[0])
        return new, dropped


class Pod:
    """One engine and its kvpool, publishing both tiers' events."""

    def __init__(self, index: int, gpu_blocks: int, pool_pages: int, spec: KVCachePolicySpec) -> None:
        self.index = index
        self.gpu = GpuCache(gpu_blocks)
        self.pool = PagePool(pool_pages, spec)
        self.pool.removed_keys = []  # kvpool follows its removals, as the sidecar does for an events session
        self.events = EventLog()
        self._hash_of: dict[Hashable, Hashable] = {}  # pool key -> engine block hash, for what it holds
        self._seq = 0

    def serve(self, req: Request, block_size: int, indexes: list[PrefixIndex]) -> tuple[int, int]:
        """Serve ``req``; returns (leading blocks not computed, of which kvpool's beyond the GPU's)."""
        full = req.input_length // block_size
        hashes = req.hash_ids[:full]
        gpu_hits = self.gpu.leading_hits(hashes)
        self._seq += 1
        seq = f"r{self._seq}"
        now = req.timestamp
        if not hashes:  # shorter than a block: nothing to look up or save
            return 0, 0
        try:
            adm = self.pool.admit(seq, block_hashes=hashes, num_tokens=full * block_size, meta=req.meta, now=now)
        except PoolExhausted:
            pool_hits = 0
        else:
            pool_hits = adm.num_cached_tokens // block_size
            self._hash_of.update(zip(adm.keys, hashes, strict=False))
            published = self.pool.commit(seq, full * block_size, now=now)
            self.events.stored(hashes, pool_hits, published, None)
            self.pool.release(seq, now=now)
        removed = self.pool.removed_keys or []
        if removed:
            self.events.removed([self._hash_of.pop(k) for k in removed if k in self._hash_of])
            removed.clear()
        events = self.events.take()
        new, dropped = self.gpu.store(hashes)
        for index in indexes:
            for event in events:
                if isinstance(event, Stored):
                    index.stored(self.index, event.hashes, CPU)
                elif isinstance(event, Removed):
                    index.removed(self.index, event.hashes, CPU)
            index.stored(self.index, new, GPU)
            index.removed(self.index, dropped, GPU)
        hits = max(gpu_hits, pool_hits)
        return hits, hits - gpu_hits


@dataclass(slots=True)
class EventRoutingResult:
    router: str
    pods: int
    capacity_fraction: float
    gpu_fraction: float
    token_hit_ratio: float  # prompt tokens not computed (either tier)
    kvpool_token_ratio: float  # of those, the share beyond the GPU tier's, served by kvpool
    kvpool_history_followed: float  # requests whose history a kvpool held beyond every GPU tier: routed there
    kvpool_history_requests: int
    imbalance: float  # requests of the busiest pod over the mean


def replay_event_routing(trace: Trace, router: str, capacity: float, pods: int = 4, gpu_fraction: float = 0.25,
                         policy: str | None = None) -> EventRoutingResult:
    """``capacity``: kvpool's pages over all pods (a fraction of the trace's distinct blocks, split
    evenly); each GPU tier holds ``gpu_fraction`` of its pod's kvpool; ``policy``: kvpool's eviction
    policy (the shipped default when None), in the shipped setup."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}")
    if pods < 1:
        raise ValueError("pods must be at least 1")
    total, fraction = capacity_pages(trace, capacity)
    per_pod = max(1, total // pods)
    spec = trace_spec(trace, policy or KVCachePolicySpec().eviction.policy)
    cluster = [Pod(i, max(1, int(per_pod * gpu_fraction)), per_pod, spec) for i in range(pods)]
    index = PrefixIndex((GPU, CPU) if router == "events" else (GPU,))
    truth = PrefixIndex((GPU, CPU))  # what the pods really hold
    recent: list[deque[float]] = [deque() for _ in range(pods)]
    served = [0] * pods
    hit_tokens = kvpool_tokens = total_tokens = followed = history = 0
    bs = trace.block_size
    for req in trace.requests:
        hashes = req.hash_ids[: req.input_length // bs]
        for q in recent:
            while q and q[0] < req.timestamp - LOAD_WINDOW_S:
                q.popleft()
        loads = [len(q) for q in recent]
        chosen = pick(index.prefix_scores(hashes, pods), loads, max(1, len(hashes)))
        # Its history lives in a kvpool: some pod's kvpool holds more of its leading blocks than any
        # GPU tier does (the next turn of a conversation whose blocks left the engines' own caches).
        cpu_runs = [truth.run(hashes, i, CPU) for i in range(pods)]
        if max(cpu_runs) > max(truth.run(hashes, i, GPU) for i in range(pods)):
            history += 1
            followed += cpu_runs[chosen] == max(cpu_runs)
        hits, from_pool = cluster[chosen].serve(req, bs, [index, truth])
        recent[chosen].append(req.timestamp)
        served[chosen] += 1
        hit_tokens += min(hits * bs, req.input_length)
        kvpool_tokens += min(from_pool * bs, req.input_length)
        total_tokens += req.input_length
    mean = sum(served) / pods
    return EventRoutingResult(
        router, pods, fraction, gpu_fraction, hit_tokens / total_tokens if total_tokens else 0.0,
        kvpool_tokens / hit_tokens if hit_tokens else 0.0, followed / history if history else 0.0, history,
        max(served) / mean if mean else 1.0,
    )


def pick(prefix: list[float], loads: list[int], blocks: int) -> int:
    """llm-d's weighted sum: the prefix score over the request's blocks, and the load score (the least
    loaded pod 1, the most 0); ties go to the less loaded pod, then the lower index."""
    top = max(loads)
    scores = [PREFIX_WEIGHT * prefix[i] / blocks + LOAD_WEIGHT * (1 - loads[i] / top if top else 1.0)
              for i in range(len(loads))]
    return max(range(len(loads)), key=lambda i: (scores[i], -loads[i], -i))
