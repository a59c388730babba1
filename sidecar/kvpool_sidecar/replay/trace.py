"""Reading request traces.

Formats (JSON Lines, detected from the fields of the first request):

* Mooncake: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token blocks).
* Bailian (Alibaba, ATC'25): ``chat_id``, ``parent_chat_id``, ``timestamp`` (s), ``input_length``,
  ``output_length``, ``type``, ``turn``, ``hash_ids`` (16-token blocks); optionally ``class``
  (``to-b``/``to-c``) as written by ``kvpool-sidecar synth``.

A file whose name ends in ``.gz`` is read through gzip (the repository ships its traces so).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kvpool_sidecar.keys import TO_B, TO_C, WorkloadMeta

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16


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
            meta = WorkloadMeta(TO_C, "text", 0)  # turns are inferred below, in time order
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
        requests.append(Request(ts, n, out, ids, meta))
    if not requests:
        raise TraceError(path, 0, "no requests")
    requests.sort(key=lambda r: r.timestamp)  # stable: equal timestamps keep file order
    if fmt == "mooncake":
        requests = _infer_turns(requests)
    return Trace(Path(path).name, fmt, block, requests, len(seen))


def _infer_turns(requests: list[Request]) -> list[Request]:
    """Mooncake has no metadata. The engine knows a chat's turn; here it is how many earlier requests
    continued the same prompt past its first block (the system prompt every chat shares)."""
    turns: dict[int, int] = {}
    out = []
    for r in requests:
        turn = 0
        if len(r.hash_ids) > 1:
            turn = turns.get(r.hash_ids[1], 0)
            turns[r.hash_ids[1]] = turn + 1
        out.append(Request(r.timestamp, r.input_length, r.output_length, r.hash_ids, WorkloadMeta(TO_C, "text", turn)))
    return out


def open_trace(path: str | Path) -> TextIO:
    """A trace file's lines, through gzip when its name ends in ``.gz``."""
    return gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)


def read_trace(path: str | Path) -> Trace:
    try:
        with open_trace(path) as fh:
            return parse_lines(fh, str(path))
    except (gzip.BadGzipFile, EOFError) as exc:  # a .gz that is not one, or cut short
        raise TraceError(str(path), 0, f"not a whole gzip file ({exc})") from None
