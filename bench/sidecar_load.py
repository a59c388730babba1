"""Concurrent clients replaying the conversation trace over HTTP against a live sidecar.

    .venv/bin/python bench/sidecar_load.py [--seconds 30] [--clients 8]

Starts `kvpool-sidecar serve` (one uvicorn worker) on 127.0.0.1, replays the trace's requests as
admit + commit + release (block hashes, 512-token pages), and prints requests/s, admit+release pairs/s,
p50/p99 latency per call, the errors, and whether the pool's invariants hold with no leaked pages.
With --batch N the engine's way is measured: one /v1/batch call admits a scheduling step's N
sequences, a second commits and releases them. With --compare-auth the same load runs twice in one
invocation, authentication off and on (an engine-role bearer token from a --token-file), and the
ratios of throughput and p99 are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from kvpool_sidecar.replay import open_trace

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation.jsonl.gz"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RawConnection:
    """A keep-alive HTTP/1.1 connection over asyncio streams: the load generator must cost far less
    CPU than the server it measures (a general client such as httpx costs about a millisecond per
    call, which on two cores would measure the client)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
                 token: str | None = None) -> None:
        self.reader, self.writer, self.host = reader, writer, host
        self.auth = f"Authorization: Bearer {token}\r\n" if token else ""

    @classmethod
    async def open(cls, host: str, port: int, token: str | None = None) -> RawConnection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}", token)

    async def request(self, method: str, path: str, body: dict | None) -> tuple[int, bytes]:
        payload = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"{self.auth}Content-Length: {len(payload)}\r\n\r\n").encode()
        self.writer.write(head + payload)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        data = await self.reader.readexactly(length) if length else b""
        return status, data

    def close(self) -> None:
        self.writer.close()


async def client(conn: RawConnection, requests: list[dict], start: int, step: int, deadline: float,
                 latencies: list[float], errors: list[str], counts: list[int], batch: int) -> None:
    i = start
    while time.perf_counter() < deadline:
        rows = [(f"c{start}-{i + k * step}", requests[(i + k * step) % len(requests)]) for k in range(batch)]
        if batch == 1:
            seq, row = rows[0]
            calls = [
                ("POST", "/v1/sequences", {"seq_id": seq, "block_hashes": row["hash_ids"],
                                           "num_tokens": row["input_length"]}),
                ("POST", f"/v1/sequences/{seq}/commit", {"num_computed_tokens": row["input_length"]}),
                ("DELETE", f"/v1/sequences/{seq}", None),
            ]
        else:  # one scheduling step: admit the batch; then commit and release it
            admit = [{"op": "admit", "seq_id": seq, "block_hashes": row["hash_ids"],
                      "num_tokens": row["input_length"]} for seq, row in rows]
            finish = [op for seq, row in rows for op in (
                {"op": "commit", "seq_id": seq, "num_computed_tokens": row["input_length"]},
                {"op": "release", "seq_id": seq})]
            calls = [("POST", "/v1/batch", {"ops": admit}), ("POST", "/v1/batch", {"ops": finish})]
        for method, path, payload in calls:
            t0 = time.perf_counter()
            status, data = await conn.request(method, path, payload)
            latencies.append(time.perf_counter() - t0)
            if status >= 400 or b'"ok":false' in data:
                errors.append(f"{method} {path}: {status} {data[:200]!r}")
        counts[0] += batch
        i += step * batch


async def run(port: int, requests: list[dict], seconds: float, clients: int,
              batch: int, token: str | None = None) -> tuple[list[float], list[str], int]:
    latencies: list[float] = []
    errors: list[str] = []
    counts = [0]
    conns = [await RawConnection.open("127.0.0.1", port, token) for _ in range(clients)]
    deadline = time.perf_counter() + seconds
    await asyncio.gather(*(client(conns[c], requests, c, clients, deadline, latencies, errors, counts, batch)
                           for c in range(clients)))
    for conn in conns:
        conn.close()
    return latencies, errors, counts[0]


def measure(args: argparse.Namespace, requests: list[dict], token: str | None) -> dict:
    """One sidecar process, the load for ``args.seconds``; with ``token``, the API requires it."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as cfg:
        cfg.write(f"pageSize: 512\neviction: {{policy: {args.policy}}}\nworkloads: {{toB: {{isolationPercent: 0}}}}\n"
                  "pinning: {autoPin: {enabled: false}}\n")
    extra: list[str] = []
    token_path = None
    if token:
        with tempfile.NamedTemporaryFile("w", suffix=".tokens", delete=False) as tokens:
            tokens.write(f"engine {token}\nadmin admin-{token}\n")
        token_path = tokens.name
        extra = ["--token-file", token_path]
    server = subprocess.Popen(
        [sys.executable, "-m", "kvpool_sidecar.cli", "serve", "--port", str(port), "--pages", str(args.pages),
         "--config", cfg.name, "--log-level", "warning", *extra],
    )
    url = f"http://127.0.0.1:{port}"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        for _ in range(200):
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        latencies, errors, pairs = asyncio.run(run(port, requests, args.seconds, args.clients, args.batch, token))
        stats = httpx.get(url + "/v1/stats", headers=headers).json()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        os.unlink(cfg.name)
        if token_path:
            os.unlink(token_path)
    latencies.sort()
    return {"latencies": latencies, "errors": errors, "pairs": pairs, "stats": stats}


def report(args: argparse.Namespace, label: str, result: dict) -> None:
    latencies, errors, pairs, stats = result["latencies"], result["errors"], result["pairs"], result["stats"]
    n = len(latencies)
    mode = "one call per operation" if args.batch == 1 else f"/v1/batch, {args.batch} sequences per call"
    print(f"{label}{mode}: HTTP calls/s {n / args.seconds:.0f}, sequences admitted+committed+released/s "
          f"{pairs / args.seconds:.0f}")
    print(f"latency per call: p50 {latencies[n // 2] * 1000:.2f} ms, p99 {latencies[int(n * 0.99)] * 1000:.2f} ms")
    print(f"errors: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    leaked = stats["free_pages"] + stats["cached_pages"] != stats["total_pages"] or stats["sequences"] != 0
    print(f"after: {stats['sequences']} live sequences, free+cached == total: {not leaked}, "
          f"token hit ratio {stats['token_hit_ratio']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--policy", default="workload_adaptive")
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences per call: 1 = one call per operation, N = /v1/batch per scheduling step")
    parser.add_argument("--pages", type=int, default=9139, help="pool pages (default: 5%% of the trace's blocks)")
    parser.add_argument("--compare-auth", action="store_true", help="run without and with a bearer token")
    args = parser.parse_args()
    requests = [json.loads(line) for line in open_trace(args.trace)]
    print(f"{args.clients} clients, {args.seconds:.0f} s, pool of {args.pages} pages of 512 tokens, {args.policy}")
    if not args.compare_auth:
        report(args, "", measure(args, requests, None))
        return
    off = measure(args, requests, None)
    on = measure(args, requests, "bench-engine-token-0123456789")
    report(args, "authentication off, ", off)
    report(args, "authentication on (engine token), ", on)
    p99 = [r["latencies"][int(len(r["latencies"]) * 0.99)] for r in (off, on)]
    print(f"on / off: throughput {len(on['latencies']) / len(off['latencies']):.3f}, p99 {p99[1] / p99[0]:.3f}")


if __name__ == "__main__":
    main()
