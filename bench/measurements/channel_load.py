"""The engine channel alone: what one engine's per-step traffic costs a live sidecar, no engine beside it.

    .venv/bin/python bench/measurements/channel_load.py [--requests 4000] [--per-step 4] [--policy workload_adaptive]

Starts ``kvpool-sidecar serve`` (its defaults but the policy) and replays the conversation trace's
requests as an engine does: each step message carries ``--per-step`` admissions (the trace's block
hashes), the previous step's commits and the releases of the step before; one round trip per step,
waited for. Prints the sidecar's CPU per request (its process's utime + stime), the round trip's
p50/p99 and the requests per second one connection sustains.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool_sidecar import wire
from kvpool_sidecar.engines.link import Connection
from kvpool_sidecar.replay import open_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from serve import cpu_seconds

TRACE = Path(__file__).resolve().parents[2] / "traces" / "mooncake_conversation.jsonl.gz"
PAGE = 512  # the trace's block size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--per-step", type=int, default=4)
    ap.add_argument("--pages", type=int, default=9139, help="pool pages (5 %% of the trace's blocks)")
    ap.add_argument("--policy", default=None, help="eviction policy (default: the shipped default)")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open_trace(TRACE)][: args.requests]
    work = Path(tempfile.mkdtemp(prefix="kvpool-channel-"))
    config = {"pageSize": PAGE}
    if args.policy:
        config["eviction"] = {"policy": args.policy}
    (work / "config.yaml").write_text(json.dumps(config))
    sock = str(work / "engine.sock")
    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen([Path(sys.executable).with_name("kvpool-sidecar"), "serve", "--port", str(port),
                             "--pages", str(args.pages), "--config", str(work / "config.yaml"),
                             "--engine-socket", sock, "--log-level", "warning"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert time.monotonic() < deadline, "the sidecar did not start"
            time.sleep(0.1)
        conn = Connection(sock, wire.Hello(wire.PROTOCOL, "scheduler", "bench", "bench-model"), 10)
        rtts: list[float] = []
        commits: list[wire.Commit] = []
        releases: list[str] = []
        cpu0 = cpu_seconds(proc.pid)
        start = time.perf_counter()
        for i in range(0, len(rows), args.per_step):
            batch = rows[i : i + args.per_step]
            admits = [wire.Admit(f"r{i + j}", [str(h).encode() for h in row["hash_ids"]],
                                 row["input_length"] if row["input_length"] <= len(row["hash_ids"]) * PAGE
                                 else len(row["hash_ids"]) * PAGE)
                      for j, row in enumerate(batch)]
            t = time.perf_counter()
            reply = conn.step(wire.Step(admits, commits, releases))
            rtts.append(time.perf_counter() - t)
            releases = [c.seq_id for c in commits]
            commits = [wire.Commit(a.seq_id, a.num_tokens) for a, r in zip(admits, reply.admits, strict=True)
                       if isinstance(r, wire.Admitted)]
        conn.step(wire.Step([], commits, releases))
        conn.step(wire.Step([], [], [c.seq_id for c in commits]))
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds(proc.pid) - cpu0
        conn.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    rtts.sort()
    n = len(rows)
    print(f"{n} requests, {args.per_step} per step, policy {args.policy or 'default'}, {args.pages} pages")
    print(f"sidecar CPU {1000 * cpu / n:.3f} ms/request; round trip p50 {1000 * statistics.median(rtts):.3f} ms, "
          f"p99 {1000 * rtts[int(0.99 * (len(rtts) - 1))]:.3f} ms; {n / elapsed:.0f} requests/s on one connection")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
