"""Synthetic Bailian-format traces calibrated to the published characteristics of to-C and to-B traffic.

* to-C (chat): about half the conversations go on for more turns, with a heavy tail; each turn
  resends the whole history, so pages are reused at the next turn, minutes later (reuse decaying at about 0.15/min:
  80 % of reuses inside 10 minutes). Infinite-cache token hit ratio near 0.62.
* to-B (API): single-turn calls from a few clients, each with its system prompt and often a shared
  document, in bursts seconds apart (reuse decaying at about 6/min). Infinite-cache hit ratio near
  0.54.
* mixed: both, to-C two thirds of the requests.

Two adversarial profiles, made to break policies tuned on the others (issue 19):

* to-b-burst: API calls re-sending long templates in tight bursts, every reuse within about 8 s
  (calls 2 s apart on average), from many clients, with a third of the traffic one-off long calls
  that are never reused: what matters is keeping the last few seconds, and a policy that holds pages
  for a chat-sized window or by their history loses to LRU.
* scan: a hot set of shared prefixes (system prompts, a few documents) reused all the time, with
  long one-shot documents streaming through between them: LRU lets each scan flush the hot set; a
  policy must keep what is reused without being told.

Deterministic for a seed. Block size 16 tokens; every block id stands for its whole prefix.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

BLOCK = 16
PROFILES = ("to-c", "to-b", "mixed", "to-b-burst", "scan")
RATE = 2.0  # sessions (conversations, API bursts) starting per second
TURN_GAP_RATE = 0.15 / 60.0  # per second: a chat's next turn comes after Exp(0.15/min)
CALL_GAP_RATE = 6.0 / 60.0  # per second: an API burst's next call comes after Exp(6/min)


@dataclass(slots=True)
class _Row:
    timestamp: float
    chat_id: int
    parent_chat_id: int
    input_length: int
    output_length: int
    type: str
    turn: int
    hash_ids: list[int]
    klass: str
    user: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "chat_id": self.chat_id,
                "parent_chat_id": self.parent_chat_id,
                "timestamp": round(self.timestamp, 3),
                "input_length": self.input_length,
                "output_length": self.output_length,
                "type": self.type,
                "turn": self.turn,
                "hash_ids": self.hash_ids,
                "class": self.klass,
                "user": self.user,
            }
        )


class _Ids:
    """Block ids: a prompt is a token count; its ids are shared exactly where its prefix is."""

    def __init__(self) -> None:
        self.next_id = 0

    def extend(self, ids: list[int], length: int, new_length: int) -> list[int]:
        """Ids of a prompt that continues the ``length``-token prompt ``ids`` to ``new_length`` tokens."""
        full = length // BLOCK  # a trailing partial block changes when tokens are appended
        out = ids[:full]
        for _ in range(full, -(-new_length // BLOCK)):
            out.append(self.next_id)
            self.next_id += 1
        return out


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(max(rng.lognormvariate(math.log(median), sigma), low), high))


def _to_c(
    rng: random.Random, ids: _Ids, rate: float, rows_wanted: int, chat_ids: Iterator[int], gap_scale: float = 1.0
) -> list[_Row]:
    """Chat conversations: Poisson starts; half continue; next turns after Exp(0.15/min) gaps."""
    system_prompts = []
    for _ in range(4):
        length = rng.choice([256, 512, 768, 1024])
        system_prompts.append((ids.extend([], 0, length), length))
    rows: list[_Row] = []
    t = 0.0
    user_no = 0
    while len(rows) < rows_wanted:
        t += rng.expovariate(rate)
        user_no += 1
        user = f"u{user_no}"
        prefix, length = rng.choice(system_prompts)
        kind = rng.choices(["text", "search", "file", "image"], [0.7, 0.15, 0.1, 0.05])[0]
        # Half the chats end after one turn; the rest have a heavy tail (the longer a chat has gone
        # on, the likelier it goes on: what the Mooncake chat trace shows).
        turns = 1 if rng.random() < 0.5 else min(1 + int(rng.paretovariate(1.1)), 40)
        when = t
        parent = -1
        history, hist_len = prefix, length
        for turn in range(turns):
            message = _lognormal(rng, 150 if kind == "text" else 3000, 1.0, 4, 16000)
            new_len = hist_len + message
            hash_ids = ids.extend(history, hist_len, new_len)
            out = _lognormal(rng, 250, 0.8, 1, 4000)
            chat_id = next(chat_ids)
            rows.append(_Row(when, chat_id, parent, new_len, out, kind, turn, hash_ids, "to-c", user))
            parent = chat_id
            # The next turn resends the history plus the answer.
            history, hist_len = ids.extend(hash_ids, new_len, new_len + out), new_len + out
            when += rng.expovariate(TURN_GAP_RATE * gap_scale)
    return rows


def _to_b(
    rng: random.Random, ids: _Ids, rate: float, rows_wanted: int, chat_ids: Iterator[int], gap_scale: float = 1.0
) -> list[_Row]:
    """API bursts: a client's system prompt, often a document, calls seconds apart (Exp(6/min))."""
    clients = []
    for c in range(6):
        length = rng.choice([512, 1024, 2048])
        clients.append((f"client{c}", ids.extend([], 0, length), length))
    documents = []
    for _ in range(12):
        documents.append(_lognormal(rng, 1500, 0.6, 200, 8000))
    rows: list[_Row] = []
    t = 0.0
    while len(rows) < rows_wanted:
        t += rng.expovariate(rate)
        user, prefix, length = rng.choice(clients)
        if rng.random() < 0.5:
            doc_len = rng.choice(documents)
            base = ids.extend(prefix, length, length + doc_len)  # a fresh copy: documents differ per burst
            base_len = length + doc_len
        else:
            base, base_len = prefix, length
        calls = 1 + int(rng.expovariate(1 / 3.0))
        when = t
        for _ in range(calls):
            query = _lognormal(rng, 700, 1.0, 8, 8000)
            hash_ids = ids.extend(base, base_len, base_len + query)
            out = _lognormal(rng, 120, 0.8, 1, 2000)
            rows.append(_Row(when, next(chat_ids), -1, base_len + query, out, "api", 0, hash_ids, "to-b", user))
            when += rng.expovariate(CALL_GAP_RATE * gap_scale)
    return rows


def _to_b_burst(rng: random.Random, ids: _Ids, rows_wanted: int, chat_ids: Iterator[int]) -> list[_Row]:
    """Bursts of 2-8 calls 2 s apart (Exp) on one of 64 long templates (a fresh copy per burst), and
    one-off long calls between them."""
    templates = [(f"client{c}", _lognormal(rng, 3000, 0.5, 800, 12000)) for c in range(64)]
    rows: list[_Row] = []
    t = 0.0
    while len(rows) < rows_wanted:
        t += rng.expovariate(4.0)
        user, length = rng.choice(templates)
        if rng.random() < 1 / 3:  # a one-off: never seen again
            hash_ids = ids.extend([], 0, length)
            rows.append(_Row(t, next(chat_ids), -1, length, 50, "api", 0, hash_ids, "to-b", "oneoff"))
            continue
        base = ids.extend([], 0, length)  # this burst's copy of the template
        when = t
        for _ in range(rng.randint(2, 8)):
            query = _lognormal(rng, 64, 0.8, 8, 1024)
            rows.append(_Row(when, next(chat_ids), -1, length + query, 50, "api", 0,
                             ids.extend(base, length, length + query), "to-b", user))
            when += rng.expovariate(0.5)
    return rows


def _scan(rng: random.Random, ids: _Ids, rows_wanted: int, chat_ids: Iterator[int]) -> list[_Row]:
    """Half the requests reuse one of 8 hot prefixes (plus a short question); the other half are long
    one-shot documents (a scan)."""
    hot = []
    for _ in range(8):
        length = rng.choice([1024, 2048, 4096])
        hot.append((ids.extend([], 0, length), length))
    rows: list[_Row] = []
    t = 0.0
    while len(rows) < rows_wanted:
        t += rng.expovariate(RATE)
        if rng.random() < 0.5:
            prefix, length = rng.choice(hot)
            question = _lognormal(rng, 100, 0.8, 8, 1000)
            rows.append(_Row(t, next(chat_ids), -1, length + question, 100, "text", 0,
                             ids.extend(prefix, length, length + question), "to-c", "hot"))
        else:
            length = _lognormal(rng, 12000, 0.5, 4000, 32000)
            rows.append(_Row(t, next(chat_ids), -1, length, 100, "file", 0, ids.extend([], 0, length), "to-c",
                             "scan"))
    return rows


def generate(profile: str, requests: int, seed: int, gap_scale: float = 1.0) -> list[str]:
    """``requests`` JSON lines of a ``profile`` trace, in timestamp order; ``gap_scale`` multiplies the
    rate of the reuse gaps (a chat's next turn, a burst's next call): 4 is reuse 4x sooner."""
    if profile not in PROFILES:
        raise ValueError(f"--profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if requests < 1:
        raise ValueError("--requests must be at least 1")
    rng = random.Random(seed)
    ids = _Ids()
    chat_ids = iter(range(1, 1 << 62))
    # Sessions start at RATE per second until they have made 1.3x the requests asked for (later turns
    # land after the cut); the earliest ``requests`` are kept.
    rows: list[_Row] = []
    if profile == "to-b-burst":
        rows += _to_b_burst(rng, ids, requests, chat_ids)
    if profile == "scan":
        rows += _scan(rng, ids, requests, chat_ids)
    if profile in ("to-c", "mixed"):
        share = 1.0 if profile == "to-c" else 2 / 3
        rows += _to_c(rng, ids, RATE, int(1.3 * requests * share) + 1, chat_ids, gap_scale)
    if profile in ("to-b", "mixed"):
        share = 1.0 if profile == "to-b" else 1 / 3
        rows += _to_b(rng, ids, RATE * share, int(1.3 * requests * share) + 1, chat_ids, gap_scale)
    rows.sort(key=lambda r: (r.timestamp, r.chat_id))
    return [r.to_json() for r in rows[:requests]]


def write(profile: str, requests: int, seed: int, out: TextIO) -> int:
    lines = generate(profile, requests, seed)
    for line in lines:
        out.write(line + "\n")
    return len(lines)
