"""A router reading kvpool's KV events: the index scores as llm-d's precise prefix-cache scorer does, and
over a cluster of pods it sends a conversation's next turn to the pod whose kvpool holds its history."""

from __future__ import annotations

import json
import random

from kv_event_sim import CPU, GPU, PrefixIndex, pick, replay_event_routing
from kvpool_sidecar.replay.trace import parse_lines


def test_the_index_scores_the_longest_leading_run_at_each_blocks_best_tier():
    index = PrefixIndex((GPU, CPU))
    index.stored(0, ["a", "b", "c"], CPU)
    index.stored(0, ["a"], GPU)
    index.stored(1, ["a", "b"], GPU)
    index.stored(2, ["b", "c"], GPU)  # not a leading run: scores nothing
    assert index.prefix_scores(["a", "b", "c", "d"], 3) == [1.0 + 0.8 + 0.8, 2.0, 0.0]
    index.removed(0, ["b"], CPU)  # the run of pod 0 stops at its gap
    assert index.prefix_scores(["a", "b", "c"], 3) == [1.0, 2.0, 0.0]
    gpu_only = PrefixIndex((GPU,))
    gpu_only.stored(0, ["a", "b"], CPU)
    assert gpu_only.prefix_scores(["a", "b"], 1) == [0.0]  # a router blind to the CPU tier


def test_the_prefix_outweighs_a_moderate_load_and_a_tie_goes_to_the_less_loaded():
    assert pick([4.0, 0.0], [3, 2], 4) == 0  # the whole prefix beats being a little busier
    assert pick([0.0, 0.0], [3, 2], 4) == 1
    assert pick([0.0, 0.0], [0, 0], 4) == 0


def conversations(seed: int, n: int = 48, turns: int = 6) -> list[str]:
    """Conversations whose turns extend their history by 2 blocks, interleaved, 2 s apart."""
    rng = random.Random(seed)
    next_id = 0
    history: list[list[int]] = [[] for _ in range(n)]
    order = [c for c in range(n) for _ in range(turns)]
    rng.shuffle(order)
    lines = []
    for i, c in enumerate(order):
        history[c] += [next_id, next_id + 1]
        next_id += 2
        lines.append(json.dumps({"timestamp": 2000 * i, "input_length": 512 * len(history[c]) - 100,
                                 "output_length": 10, "hash_ids": list(history[c])}))
    return lines


def test_a_router_reading_kvpools_events_follows_the_history_kvpool_holds():
    trace = parse_lines(conversations(7))
    events = replay_event_routing(trace, "events", 0.5, pods=4, gpu_fraction=0.1)
    blind = replay_event_routing(trace, "gpu-only", 0.5, pods=4, gpu_fraction=0.1)
    assert events.kvpool_history_requests > 50 and blind.kvpool_history_requests > 50
    # Blind, the holder is picked about as often as chance (1 in 4); with the events most of the time
    # (not always: llm-d's load score outweighs a short history on a busier pod).
    assert blind.kvpool_history_followed < 0.4 < 0.6 < events.kvpool_history_followed
    assert events.token_hit_ratio > 2 * blind.token_hit_ratio
    assert events.imbalance < 1.5  # following the history does not pile the load on one pod
