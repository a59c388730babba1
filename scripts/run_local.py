"""`make run`: the real thing in one command, on this machine.

Renders crds/examples/chat.yaml with the operator's own renderer, starts `kvpool-sidecar serve` with
it (an embedded shared CPU pool shaped for the tiny model), starts a tiny vLLM engine with the kvpool
connector (its own prefix cache small), replays a slice of the Mooncake chat trace through the engine
with a progress bar, once with vLLM alone and once with kvpool, prints both side by side with the tokens
an unbounded cache could have served, and keeps the sidecar serving until Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import httpx
import yaml
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))  # what tests, benchmarks and the demo share
from kvpool_sidecar.service.server import instance_name
from kvpool_sidecar.storage.segment import release_instance
from tiny_model import KV_SHAPE, VOCAB

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "crds" / "examples" / "chat.yaml"
TRACE = ROOT / "traces" / "mooncake_conversation.jsonl.gz"
PORT = int(os.environ.get("KVPOOL_PORT", "8000"))
REQUESTS = int(os.environ.get("KVPOOL_REQUESTS", "400"))
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32: the pool's pages follow the engine's blocks
# The tier: 6,000 pages of 32 tokens (192 MiB of /dev/shm for the tiny model), 80 % of the 7,468 distinct
# blocks of the default slice. Its chats come back after about 2,000 to 6,000 other blocks: a tier of
# 1,500 pages (20 %) served, like an LRU of that size, 672 tokens beyond vLLM's own cache, of ~29,000.
POOL_PAGES = int(os.environ.get("KVPOOL_PAGES", "6000"))


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a SIGTERM stops the sidecar too, as Ctrl-C does


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    bindir = Path(sys.executable).parent
    rendered = subprocess.run([bindir / "kvpool-operator", "render", "-f", str(POLICY)], check=True,
                              capture_output=True, text=True).stdout
    config = yaml.safe_load(yaml.safe_load(rendered)["data"]["config.yaml"])
    config["pageSize"] = BLOCK
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-run-"))
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    print(f"rendered {POLICY.relative_to(ROOT)} with kvpool-operator render (pageSize {BLOCK}: the engine's block)")
    server = subprocess.Popen([bindir / "kvpool-sidecar", "serve", "--config", str(workdir / "config.yaml"),
                               "--port", str(PORT), "--pages", str(POOL_PAGES), "--kv-shape", KV_SHAPE,
                               "--log-level", "error", "--engine-socket", str(workdir / "engine.sock")])
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
        print(f"sidecar on {url}: {POOL_PAGES} pages of {BLOCK} tokens in shared memory")
        replay_through_engine(url, workdir)
        print(f"metrics: {url}/metrics   API docs: {url}/docs   (the sidecar serves until Ctrl-C)")
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=30)
        release_instance(instance_name(PORT))  # an exit may leave the pool's segment for a restart: done with it
    return 0


def replay_through_engine(url: str, workdir: Path) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from engine_prompts import engine_prompts
    from kvpool_sidecar.replay import read_trace
    from tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.gettempdir()) / "kvpool-tiny-model")
    prompts = engine_prompts(read_trace(TRACE), 0, REQUESTS, block_size=BLOCK, max_blocks=60, vocab=VOCAB)
    ideal = lru_hits(prompts, None)
    distinct = distinct_blocks(prompts)
    print(f"the slice: {len(prompts)} prompts, {distinct:,} distinct blocks; the tier holds {POOL_PAGES:,} pages "
          f"({POOL_PAGES / distinct:.0%} of them)", flush=True)
    print("vLLM alone first, then vLLM with kvpool, on the same prompts (each engine starts in about 25 s) ...",
          flush=True)
    alone = replay(model, prompts, None)
    pooled = replay(model, prompts, str(workdir / "engine.sock"))
    total = sum(len(p.tokens) for p in prompts)
    text = httpx.get(url + "/metrics").text
    print(f"\n{len(prompts)} prompts of {TRACE.name}, {total:,} prompt tokens; vLLM's own cache: 80 blocks")
    print("| engine | tokens computed | from vLLM's cache | from kvpool | wall time |")
    print("|---|---|---|---|---|")
    for name, r in (("vLLM alone", alone), ("vLLM + kvpool", pooled)):
        print(f"| {name} | {r['computed']:,} | {r['local']:,} | {r['external']:,} | {r['seconds']:.1f} s |")
    lru = lru_hits(prompts, POOL_PAGES + 80)
    print(f"an unbounded cache could have served {ideal:,} tokens ({ideal / total:.1%}); kvpool and vLLM's cache "
          f"served {pooled['local'] + pooled['external']:,} ({(pooled['local'] + pooled['external']) / total:.1%}); "
          f"one LRU of the tier's and vLLM's blocks together would serve {lru:,} (a smaller tier serves less: "
          "KVPOOL_PAGES=1500 make run)")
    saved = int(metric(text, 'kvpool_connector_tokens_total{direction="saved"}'))
    loaded = int(metric(text, 'kvpool_connector_tokens_total{direction="loaded"}'))
    print(f"kvpool: {saved:,} tokens saved, {loaded:,} loaded; the trace ran as fast as the engine could, "
          "so its minutes took seconds (the tiny model makes prefill nearly free: the hardest case for a tier)")


def prefix_ids(prompts: list) -> list[list[int]]:
    """Each prompt's full blocks as ids of their whole prefix (equal ids: equal tokens up to there)."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent's id, block tokens) -> this prefix's id
    out = []
    for p in prompts:
        parent, chain = -1, []
        for i in range(len(p.tokens) // BLOCK):
            parent = ids.setdefault((parent, tuple(p.tokens[i * BLOCK : (i + 1) * BLOCK])), len(ids))
            chain.append(parent)
        out.append(chain)
    return out


def distinct_blocks(prompts: list) -> int:
    return len({i for chain in prefix_ids(prompts) for i in chain})


def lru_hits(prompts: list, blocks: int | None) -> int:
    """Tokens an LRU cache of ``blocks`` (None: one that never evicts) would serve, prompts in order:
    each prompt's leading cached blocks (the last prompt token is always computed)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for p, chain in zip(prompts, prefix_ids(prompts), strict=True):
        n = next((i for i, block in enumerate(chain) if block not in cache), len(chain))
        hits += min(n, (len(p.tokens) - 1) // BLOCK) * BLOCK
        for block in chain:
            cache[block] = None
            cache.move_to_end(block)
        while blocks is not None and len(cache) > blocks:
            cache.popitem(last=False)
    return hits


def replay(model: Path, prompts: list, socket: str | None) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = {}
    if socket is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "KVPoolConnector",
                                        "kv_connector_module_path": "kvpool_sidecar.engines.vllm",
                                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                        "kv_connector_extra_config": {"socket": socket}}
    llm = LLM(model=str(model), dtype="float32", block_size=BLOCK, max_model_len=2048, seed=0, enforce_eager=True,
              num_gpu_blocks_override=80, enable_prefix_caching=True, gpu_memory_utilization=0.3,
              disable_log_stats=False, **kwargs)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    computed = 0
    label = "with kvpool" if socket else "alone"
    start = time.perf_counter()
    for p in tqdm(prompts, unit="req", desc=f"replaying {TRACE.name} through vLLM {label}"):
        out = llm.generate([{"prompt_token_ids": p.tokens}], sp, use_tqdm=False)[0]
        computed += len(p.tokens) - int(out.num_cached_tokens or 0)
    seconds = time.perf_counter() - start
    engine = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    llm.llm_engine.engine_core.shutdown()
    return {"computed": computed, "seconds": seconds, "external": int(engine.get("vllm:external_prefix_cache_hits", 0)),
            "local": int(engine.get("vllm:prefix_cache_hits", 0))}

if __name__ == "__main__":
    sys.exit(main())
