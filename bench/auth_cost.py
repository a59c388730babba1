"""What authentication costs the sidecar, in CPU instructions (cachegrind), per admit + release pair.

    .venv/bin/python bench/auth_cost.py [--requests 3000]

The ASGI app is driven in-process (no sockets, no uvicorn, no HTTP client: only the server's own
work is counted), once without credentials and once with an engine-role token from a token file of
four roles. Each mode runs under ``valgrind --tool=cachegrind`` twice, with no requests and with
``--requests`` pairs, so start-up (imports, app construction) cancels out; the difference divided by the
pairs is the cost of one pair. The run without requests moves by tens of millions of instructions between
runs (threads, the event loop): thousands of pairs keep that under 1 % of a pair; 300 left it near 10 %.
Instruction counts are stable where wall time on these machines is not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

TOKENS = "admin admin-token-0123456789\nengine engine-token-0123456789\n" \
         "tenant:acme acme-token-0123456789\ntenant:globex globex-token-0123456789\n"


async def call(app: Any, method: str, path: str, body: dict[str, Any] | None, token: str | None) -> int:
    data = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": headers, "scheme": "http",
             "server": ("127.0.0.1", 8100), "client": ("127.0.0.1", 40000), "root_path": ""}
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def drive(requests: int, auth: bool) -> None:
    from kvpool_sidecar.config import SidecarConfig
    from kvpool_sidecar.service.app import create_app
    from kvpool_sidecar.service.credentials import Credentials
    from kvpool_sidecar.service.state import Sidecar

    config = SidecarConfig.model_validate({"pageSize": 16, "pinning": {"autoPin": {"enabled": False}}})
    sidecar = Sidecar(config, 4096)
    app = create_app(sidecar, token=Credentials.parse(TOKENS) if auth else None, serve_metrics=False,
                     pre_evict_interval=0)
    token = "engine-token-0123456789" if auth else None
    for i in range(requests):
        hashes = [f"{i % 50:04x}{j:04x}" for j in range(8)]  # 50 prompts of 8 pages: hits and misses
        admitted = await call(app, "POST", "/v1/sequences", {"seq_id": f"s{i}", "block_hashes": hashes,
                                                             "meta": {"tenant": "acme"}}, token)
        released = await call(app, "DELETE", f"/v1/sequences/s{i}", None, token)
        assert (admitted, released) == (200, 204) or (admitted, released) == (200, 200), (admitted, released)
    sidecar.close()


def instructions(requests: int, auth: bool) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={tmp}/cg.out",
             sys.executable, __file__, "--run", str(requests), *(["--auth"] if auth else [])],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    match = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if match is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="admit + release pairs per measured run")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the measured child
    parser.add_argument("--auth", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run is not None:
        asyncio.run(drive(args.run, args.auth))
        return
    per_pair = {}
    for auth in (False, True):
        base, loaded = instructions(0, auth), instructions(args.requests, auth)
        per_pair[auth] = (loaded - base) / args.requests
        print(f"auth {'on ' if auth else 'off'}: {per_pair[auth]:,.0f} instructions per admit + release "
              f"({loaded:,} - {base:,} over {args.requests} pairs)")
    print(f"ratio on / off: {per_pair[True] / per_pair[False]:.3f} "
          f"(authentication costs {100 * (per_pair[True] / per_pair[False] - 1):+.1f} %)")


if __name__ == "__main__":
    main()
