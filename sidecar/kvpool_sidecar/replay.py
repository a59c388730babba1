"""Replay production traces through the real pool and policies; the project's performance record.

Formats (JSON Lines, detected from the fields of the first request):

* Mooncake: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token blocks).
* Bailian (Alibaba, ATC'25): ``chat_id``, ``parent_chat_id``, ``timestamp`` (s), ``input_length``,
  ``output_length``, ``type``, ``turn``, ``hash_ids`` (16-token blocks); optionally ``class``
  (``to-b``/``to-c``) as written by ``kvpool-sidecar synth``.

Semantics (as in ``shared/traces/README.md``): requests in timestamp order; a request hits the longest
cached prefix of its ids; then its pages are computed and its *full* blocks cached; token hit ratio =
sum(min(hit_blocks * block, input_length)) / sum(input_length).
"""

from __future__ import annotations

import heapq
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import TO_B, TO_C, PagePool, WorkloadMeta

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16
REFERENCE_POLICIES = ("belady", "infinite")


class TraceError(ValueError):
    """A trace line that is not a request of a known format; names the line."""

    def __init__(self, path: str, line_no: int, message: str) -> None:
        super().__init__(f"{path}:{line_no}: {message}")
        self.line_no = line_no


@dataclass(frozen=True, slots=True)
class Request:
    timestamp: float  # seconds from the trace start
    input_length: int
    output_length: int
    hash_ids: list[int]
    meta: WorkloadMeta


@dataclass(slots=True)
class Trace:
    name: str
    format: str
    block_size: int
    requests: list[Request]
    distinct_blocks: int = 0

    def total_input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


def _int(row: dict, key: str, path: str, line_no: int, minimum: int = 0) -> int:
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(path, line_no, f"field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _number(row: dict, key: str, path: str, line_no: int) -> float:
    value = row.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise TraceError(path, line_no, f"field {key!r} must be a number >= 0, got {value!r}")
    return float(value)


def _detect(row: dict) -> str:
    return "bailian" if "chat_id" in row or "turn" in row or "type" in row else "mooncake"


def parse_lines(lines: Iterable[str], path: str = "<trace>") -> Trace:
    """Parse a whole trace; raises :class:`TraceError` naming the first malformed line."""
    requests: list[Request] = []
    fmt = ""
    block = 0
    seen: set[int] = set()
    turns: dict[int, int] = {}
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(path, line_no, f"not JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise TraceError(path, line_no, "a request must be a JSON object")
        if not fmt:
            fmt = _detect(row)
            block = BAILIAN_BLOCK if fmt == "bailian" else MOONCAKE_BLOCK
        n = _int(row, "input_length", path, line_no, 1)
        out = _int(row, "output_length", path, line_no)
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise TraceError(path, line_no, "field 'hash_ids' must be a non-empty list of integers")
        if not (len(ids) - 1) * block < n <= len(ids) * block:
            raise TraceError(
                path, line_no, f"input_length {n} does not fit {len(ids)} blocks of {block} tokens ({fmt} format)"
            )
        if fmt == "mooncake":
            ts = _number(row, "timestamp", path, line_no) / 1000.0
            # Mooncake has no metadata. The engine knows a chat's turn; here it is how many earlier
            # requests continued the same prompt past its first block (the shared system prompt).
            turn = turns.get(ids[1], 0) if len(ids) > 1 else 0
            meta = WorkloadMeta(TO_C, "text", turn)
        else:
            ts = _number(row, "timestamp", path, line_no)
            klass = str(row.get("class", "to-c")).lower().replace("-", "")
            if klass not in ("toc", "tob"):
                raise TraceError(path, line_no, f"field 'class' must be to-b or to-c, got {row.get('class')!r}")
            turn = row.get("turn", 0)
            if not isinstance(turn, int) or turn < 0:
                raise TraceError(path, line_no, f"field 'turn' must be an integer >= 0, got {turn!r}")
            meta = WorkloadMeta(
                TO_B if klass == "tob" else TO_C, str(row.get("type", "text")), turn, user=str(row.get("user", ""))
            )
        seen.update(ids)
        if len(ids) > 1:
            turns[ids[1]] = turns.get(ids[1], 0) + 1
        requests.append(Request(ts, n, out, ids, meta))
    if not requests:
        raise TraceError(path, 0, "no requests")
    requests.sort(key=lambda r: r.timestamp)  # stable: equal timestamps keep file order
    return Trace(Path(path).name, fmt, block, requests, len(seen))


def read_trace(path: str | Path) -> Trace:
    with open(path) as fh:
        return parse_lines(fh, str(path))


# ---------------------------------------------------------------------------------------- results
@dataclass(slots=True)
class ReplayResult:
    policy: str
    capacity_pages: int
    capacity_fraction: float
    token_hit_ratio: float
    block_hit_ratio: float
    requests: int
    evictions: int
    seconds: float
    trace: str = ""
    per_class: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return asdict(self)


def capacity_pages(trace: Trace, capacity: float) -> tuple[int, float]:
    """A capacity of at most 1 is a fraction of the trace's distinct blocks, otherwise a page count."""
    if capacity <= 0:
        raise ValueError("--capacity must be above 0")
    if capacity <= 1:
        return max(1, int(trace.distinct_blocks * capacity)), capacity
    return int(capacity), capacity / trace.distinct_blocks


def replay_spec(policy: str, block: int, base: KVCachePolicySpec | None = None) -> KVCachePolicySpec:
    """The spec a replay runs: the given one (or defaults) with the policy and page size of the trace.

    Auto-pinning is off and, for a single-class trace, so is the to-B partition, so that every policy
    gets the same pages and LRU replays exactly what the reference simulator does.
    """
    data = (base or KVCachePolicySpec()).model_dump()
    data["pageSize"] = block
    data["eviction"]["policy"] = policy
    data["pinning"]["autoPin"]["enabled"] = False
    return KVCachePolicySpec.model_validate(data)


def _class_shares(trace: Trace) -> bool:
    return any(r.meta.workload_class == TO_B for r in trace.requests)


def replay_pool(
    trace: Trace,
    policy: str,
    capacity: float,
    spec: KVCachePolicySpec | None = None,
    progress: Callable[[int], None] | None = None,
    pool: PagePool | None = None,
) -> ReplayResult:
    """Drive the real pool with the trace: admit, commit the whole prompt, release, per request."""
    pages, fraction = capacity_pages(trace, capacity)
    spec = replay_spec(policy, trace.block_size, spec)
    if not _class_shares(trace):
        data = spec.model_dump()
        data["workloads"]["toB"]["isolationPercent"] = 0
        spec = KVCachePolicySpec.model_validate(data)
    pool = pool or PagePool(pages, spec, clock=lambda: 0.0)
    block = trace.block_size
    hit_tokens = hit_blocks = total_blocks = 0
    class_hits: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, req in enumerate(trace.requests):
        seq = str(i)
        now = req.timestamp
        adm = pool.admit(seq, block_hashes=req.hash_ids, num_tokens=req.input_length, meta=req.meta, now=now)
        pool.commit(seq, req.input_length, now=now)
        pool.release(seq, now=now)
        hit_tokens += adm.num_cached_tokens
        hit_blocks += adm.num_cached_tokens // block
        total_blocks += len(req.hash_ids)
        acc = class_hits.setdefault(req.meta.workload_class, [0, 0])
        acc[0] += adm.num_cached_tokens
        acc[1] += req.input_length
        if progress is not None and i % 256 == 255:
            progress(256)
    seconds = time.perf_counter() - start
    total = trace.total_input_tokens()
    return ReplayResult(
        policy, pages, fraction, hit_tokens / total, hit_blocks / total_blocks, len(trace.requests),
        pool.evictions, seconds, trace.name, {k: v[0] / v[1] for k, v in class_hits.items()},
    )


def replay_reference(trace: Trace, policy: str, capacity: float) -> ReplayResult:
    """``infinite`` (no eviction) or ``belady`` (offline optimum: evict the block reused furthest ahead)."""
    if policy == "infinite":
        pages, fraction = trace.distinct_blocks, 1.0
    else:
        pages, fraction = capacity_pages(trace, capacity)
    start = time.perf_counter()
    block = trace.block_size
    reqs = trace.requests
    # next_use[i][j]: index of the next request using block j of request i (len(reqs) = never).
    never = len(reqs)
    next_at: dict[int, int] = {}
    next_use: list[list[int]] = [[]] * len(reqs)
    for i in range(len(reqs) - 1, -1, -1):
        ids = reqs[i].hash_ids
        next_use[i] = [next_at.get(h, never) for h in ids]
        for h in ids:
            next_at[h] = i
    cached: dict[int, int] = {}  # block id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block id), lazily deleted
    hit_tokens = hit_blocks = total_blocks = evictions = 0
    for i, req in enumerate(reqs):
        full = req.input_length // block
        ids = req.hash_ids
        hits = 0
        while hits < full and ids[hits] in cached:
            hits += 1
        hit_tokens += min(hits * block, req.input_length)
        hit_blocks += hits
        total_blocks += len(ids)
        current = set(ids[:full])
        for j in range(full):
            h, nxt = ids[j], next_use[i][j]
            if h in cached or len(cached) < pages:
                if h in cached or nxt != never:
                    cached[h] = nxt
                    heapq.heappush(heap, (-nxt, h))
                continue
            if nxt == never:
                continue  # never used again: the oracle does not cache it
            victim = _furthest(heap, cached, current)
            if victim is None or victim[1] <= nxt:
                if victim is not None:
                    heapq.heappush(heap, (-victim[1], victim[0]))
                continue  # everything cached is needed sooner than this block: bypass it
            del cached[victim[0]]
            evictions += 1
            cached[h] = nxt
            heapq.heappush(heap, (-nxt, h))
    total = trace.total_input_tokens()
    return ReplayResult(
        policy, pages, fraction, hit_tokens / total, hit_blocks / total_blocks, len(reqs), evictions,
        time.perf_counter() - start, trace.name,
    )


def _furthest(heap: list[tuple[int, int]], cached: dict[int, int], current: set[int]) -> tuple[int, int] | None:
    """Pop the cached block used furthest ahead that the current request does not hold: (id, next use)."""
    held: list[tuple[int, int]] = []
    found = None
    while heap:
        neg, h = heapq.heappop(heap)
        if cached.get(h) != -neg:
            continue  # stale entry
        if h in current:
            held.append((neg, h))
            continue
        found = (h, -neg)
        break
    for entry in held:
        heapq.heappush(heap, entry)
    return found


def run_matrix(
    trace: Trace,
    policies: list[str],
    capacities: list[float],
    spec: KVCachePolicySpec | None = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[ReplayResult]:
    for capacity in capacities:
        for policy in policies:
            if policy in REFERENCE_POLICIES:
                yield replay_reference(trace, policy, capacity)
            else:
                yield replay_pool(trace, policy, capacity, spec, progress)


# ----------------------------------------------------------------------------------------- output
COLUMNS = ("policy", "capacity_fraction", "capacity_pages", "token_hit_ratio", "block_hit_ratio", "evictions",
           "seconds")


def format_table(results: list[ReplayResult]) -> str:
    header = f"{'policy':<22}{'capacity':>9}{'pages':>9}{'token hit':>11}{'block hit':>11}{'evictions':>11}{'s':>8}"
    lines = [header, "-" * len(header)]
    for r in results:
        label = r.policy + (" (oracle)" if r.policy == "belady" else "")
        lines.append(
            f"{label:<22}{r.capacity_fraction:>9.2%}{r.capacity_pages:>9}{r.token_hit_ratio:>11.4f}"
            f"{r.block_hit_ratio:>11.4f}{r.evictions:>11}{r.seconds:>8.2f}"
        )
    return "\n".join(lines)


def format_csv(results: list[ReplayResult]) -> str:
    lines = [",".join(COLUMNS)]
    for r in results:
        row = r.row()
        lines.append(",".join(str(row[c]) for c in COLUMNS))
    return "\n".join(lines)


def format_json(results: list[ReplayResult]) -> str:
    return "\n".join(json.dumps(r.row()) for r in results)


def plot(results: list[ReplayResult], path: str | Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvpool[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_policy: dict[str, list[ReplayResult]] = {}
    for r in results:
        if r.policy != "infinite":
            by_policy.setdefault(r.policy, []).append(r)
    for policy, rows in by_policy.items():
        rows.sort(key=lambda r: r.capacity_fraction)
        style = "--" if policy == "belady" else "-"
        label = f"{policy} (offline oracle)" if policy == "belady" else policy
        ax.plot([r.capacity_fraction * 100 for r in rows], [r.token_hit_ratio for r in rows], style,
                marker="o", label=label)
    for r in results:
        if r.policy == "infinite":
            ax.axhline(r.token_hit_ratio, color="grey", linestyle=":", label="infinite cache")
            break
    ax.set_xlabel("capacity (% of distinct blocks)")
    ax.set_ylabel("token hit ratio")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def progress_bar(total: int, enabled: bool) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr, shown only for runs long enough to need one."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="req", file=sys.stderr, mininterval=0.5, delay=2.0, leave=False)
    return bar.update, bar.close
