"""`make run`: the local stack in one command.

Renders crds/examples/chat.yaml with the operator's own renderer, starts `kvpool-sidecar serve` with it
on 127.0.0.1 (embedded CPU pool), replays the Mooncake chat trace into it over HTTP with a progress
bar, prints the hit ratio per class and the /metrics and /docs URLs, and keeps serving until Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "crds" / "examples" / "chat.yaml"
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
PORT = int(os.environ.get("KVPOOL_PORT", "8000"))
BATCH = 32


def main() -> int:
    bindir = Path(sys.executable).parent
    rendered = subprocess.run([bindir / "kvpool-operator", "render", "-f", str(POLICY)], check=True,
                              capture_output=True, text=True).stdout
    config = yaml.safe_load(yaml.safe_load(rendered)["data"]["config.yaml"])
    # The trace's blocks are 512 tokens: the pool's pages must be the same size to replay it.
    config["pageSize"] = 512
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-run-"))
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    print(f"rendered {POLICY.relative_to(ROOT)} with kvpool-operator render (pageSize 512, the trace's block size)")
    server = subprocess.Popen([bindir / "kvpool-sidecar", "serve", "--config", str(workdir / "config.yaml"),
                               "--port", str(PORT), "--pages", "9139", "--log-level", "error"])
    url = f"http://127.0.0.1:{PORT}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/healthz", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            print("the sidecar did not start", file=sys.stderr)
            return 1
        rows = [json.loads(line) for line in TRACE.open()]
        hits: dict[str, list[int]] = {}
        with httpx.Client(base_url=url, timeout=60) as http, tqdm(total=len(rows), unit="req",
                                                                   desc="replaying " + TRACE.name) as bar:
            for start in range(0, len(rows), BATCH):
                chunk = rows[start : start + BATCH]
                admit = [{"op": "admit", "seq_id": f"r{start + i}", "block_hashes": r["hash_ids"],
                          "num_tokens": r["input_length"]} for i, r in enumerate(chunk)]
                answers = http.post("/v1/batch", json={"ops": admit}).json()["results"]
                done = []
                for i, (r, a) in enumerate(zip(chunk, answers, strict=True)):
                    acc = hits.setdefault("toC", [0, 0])
                    acc[1] += r["input_length"]
                    if a["ok"]:
                        acc[0] += a["result"]["num_cached_tokens"]
                        done += [{"op": "commit", "seq_id": f"r{start + i}", "num_computed_tokens": r["input_length"]},
                                 {"op": "release", "seq_id": f"r{start + i}"}]
                if done:
                    http.post("/v1/batch", json={"ops": done})
                bar.update(len(chunk))
        for klass, (hit, total) in hits.items():
            print(f"token hit ratio, class {klass}: {hit / total:.4f} ({hit} of {total} prompt tokens from cache)")
        print("(the trace's hour ran in seconds on the sidecar's own clock, so the time windows see one burst;"
              " `kvpool-sidecar replay` replays on the trace's timestamps)")
        print(f"metrics: {url}/metrics   API docs: {url}/docs   (serving until Ctrl-C)")
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
