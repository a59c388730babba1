"""Token prompts for a real engine from a trace of block ids (which carry no tokens).

Each id becomes ``block_size`` tokens drawn from a generator seeded by the id, so two requests share
their first k blocks of tokens exactly when they share their first k ids (an id stands for a block and
its whole prefix); the prompt's length is its ``input_length`` scaled from the trace's block size to
the engine's, and capped at ``max_blocks`` blocks (the model's context).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpool_sidecar.replay.trace import Trace


@dataclass(frozen=True)
class EnginePrompt:
    timestamp: float  # seconds from the first prompt of the slice
    tokens: list[int]


def block_tokens(hash_id: int, block_size: int, vocab: int, first_token: int = 3) -> list[int]:
    rng = random.Random(hash_id * 1_000_003 + 17)
    return [rng.randrange(first_token, vocab) for _ in range(block_size)]


def engine_prompts(trace: Trace, start: int, count: int, *, block_size: int, max_blocks: int,
                   vocab: int) -> list[EnginePrompt]:
    requests = trace.requests[start : start + count]
    if not requests:
        return []
    t0 = requests[0].timestamp
    out = []
    for req in requests:
        ids = req.hash_ids[:max_blocks]
        tokens = [t for h in ids for t in block_tokens(h, block_size, vocab)]
        length = min(len(tokens), max(1, -(-req.input_length * block_size // trace.block_size)))
        out.append(EnginePrompt(req.timestamp - t0, tokens[:length]))
    return out
