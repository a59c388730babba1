"""Cluster replay: a trace through N real pools (one per pod) behind the real router.

``capacity`` is the total over all pods, split evenly, so a cluster compares fairly with one pool of
the same size. A membership change (``join``: a fresh empty pod; ``leave``: the last pod and its
cache go away) can happen half-way through the trace; the share of the keys seen so far whose ring
owner changed is reported as ``keys_moved``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from typing import Literal

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.replay.run import (
    REFERENCE_POLICIES,
    ReplayResult,
    Setup,
    capacity_pages,
    serve_request,
    trace_spec,
)
from kvpool_sidecar.replay.trace import Trace
from kvpool_sidecar.routing import HashRing, KeySpec, Router, key_movement, key_position

Membership = Literal["none", "join", "leave"]
HASH_MODES = ("prefix-hash", "bounded-hash", "bounded-hash+replicas")


def pod_name(i: int) -> str:
    return f"pod-{i}"


def _imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def replay_cluster(
    trace: Trace,
    policy: str,
    capacity: float,
    pods: int,
    routing: str,
    spec: KVCachePolicySpec | None = None,
    *,
    membership: Membership = "none",
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    setup: Setup = "shipped",
) -> ReplayResult:
    if pods < 1:
        raise ValueError("--pods must be at least 1")
    if membership == "leave" and pods < 2:
        raise ValueError("--membership leave needs at least 2 pods")
    total_pages, fraction = capacity_pages(trace, capacity)
    per_pod = max(1, total_pages // pods)
    spec = trace_spec(trace, policy, spec, setup)
    names = [pod_name(i) for i in range(pods)]
    pools = {name: PagePool(per_pod, spec, clock=lambda: 0.0) for name in names}
    # Trace ids are already chained per prefix and carry no tenant: used as they are, like the pool.
    router = Router(spec.routing, KeySpec(trace.block_size, isolate=False), mode=routing, pods=names, seed=seed)
    requests: dict[str, int] = dict.fromkeys(names, 0)
    tokens: dict[str, int] = dict.fromkeys(names, 0)
    seen: set[Hashable] = set()
    change_at = len(trace.requests) // 2 if membership != "none" else -1
    moved: float | None = None
    hit_tokens = hit_blocks = total_blocks = oversized = 0
    block = trace.block_size
    start = time.perf_counter()
    for i, req in enumerate(trace.requests):
        if i == change_at:
            moved = _change_membership(router, pools, requests, tokens, membership, per_pod, spec, seen)
        key = router.prefix_key(block_hashes=req.hash_ids, num_tokens=req.input_length, meta=req.meta)
        if key is not None:
            seen.add(key)
        pod = router.route_key(key, req.timestamp).pod
        cached, uncached = serve_request(pools[pod], str(i), req)
        oversized += uncached
        requests[pod] += 1
        tokens[pod] += req.input_length
        hit_tokens += cached
        hit_blocks += cached // block
        total_blocks += len(req.hash_ids)
        if progress is not None and i % 256 == 255:
            progress(256)
    seconds = time.perf_counter() - start
    evictions = sum(p.evictions for p in pools.values())
    return ReplayResult(
        policy, per_pod * pods, fraction, hit_tokens / trace.total_input_tokens(), hit_blocks / total_blocks,
        len(trace.requests), evictions, seconds, trace.name, {}, oversized, pods, routing,
        _imbalance(list(requests.values())), _imbalance(list(tokens.values())),
        moved if routing in HASH_MODES else None, setup,
    )


def _change_membership(
    router: Router,
    pools: dict[str, PagePool],
    requests: dict[str, int],
    tokens: dict[str, int],
    membership: Membership,
    per_pod: int,
    spec: KVCachePolicySpec,
    seen: set[Hashable],
) -> float:
    before = HashRing(router.ring.virtual_nodes, router.pods)
    members = router.pods
    if membership == "join":
        name = pod_name(len(pools))
        pools[name] = PagePool(per_pod, spec, clock=lambda: 0.0)
        requests[name] = tokens[name] = 0
        members.append(name)
    else:
        gone = members.pop()
        del pools[gone]  # its cache is lost with it; its served counts stay in the imbalance figures
    router.set_pods(members)
    return key_movement((key_position(k) for k in seen), before, router.ring)


def run_cluster_matrix(
    trace: Trace,
    policies: list[str],
    capacities: list[float],
    pods: list[int],
    routings: list[str],
    spec: KVCachePolicySpec | None = None,
    *,
    membership: Membership = "none",
    progress: Callable[[int], None] | None = None,
    setup: Setup = "shipped",
) -> Iterator[ReplayResult]:
    for policy in policies:
        if policy in REFERENCE_POLICIES:
            raise ValueError(f"{policy} is a single-cache reference: it has no cluster replay")
    for capacity in capacities:
        for n in pods:
            for routing in routings:
                for policy in policies:
                    yield replay_cluster(trace, policy, capacity, n, routing, spec, membership=membership,
                                         progress=progress, setup=setup)
