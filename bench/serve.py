"""vLLM's OpenAI server driven by vLLM's own load generator, side by side in one run: vLLM alone, vLLM
with an own cache as large as both tiers (the ceiling), LMCache's multiprocess server with the same bytes
(when installed), and kvpool; ``kvpool-events`` (not in the default list) is kvpool with its tier published
as vLLM KV events (``"kv_events": true``; vLLM's ZMQ publisher on an ipc socket a subscriber thread of this
script reads), to measure what the events cost the engine against ``kvpool``; ``kvpool-vllm-events`` has
vLLM's own events on and kvpool's off (what vLLM's own tier costs).

    .venv/bin/python bench/serve.py                                  # tiny model, 8 and 32 clients
    .venv/bin/python bench/serve.py --model mid --num-prompts 96     # ~33k prefill FLOP per KV byte
    .venv/bin/python bench/serve.py --systems vllm,kvpool --concurrency 8
    .venv/bin/python bench/serve.py --tensor-parallel-size 2         # TP=2 (vLLM-CPU: one core per rank)

Workloads (``--workload``): ``prefix``: ``vllm bench serve --dataset-name prefix_repetition``
(prompts sharing ``--num-prefixes`` prefixes); ``mooncake``: the Mooncake conversation trace's first
``--num-prompts`` requests through vLLM's ``timed_trace`` dataset, each hash id ``--chunk`` tokens (so
requests sharing ids share tokens), prompts capped at 60 blocks (the model's context), ``--output-len``
tokens out, issued as fast as ``--concurrency`` allows (``--no-self-timed``). Greedy, ``--ignore-eos``.
The server runs as a module (the ``vllm`` console script does not start with vllm-cpu), as does the
load generator (``vllm.benchmarks.serve``).

Figures per system and concurrency: requests/s, TTFT p50/p99, mean TPOT, the tokens the second tier
served (vLLM's own ``external_prefix_cache_hits``), CPU milliseconds per request of the engine (vLLM's
server and engine core: utime+stime of its process session over the run) and of the tier's own process
(kvpool's sidecar, LMCache's server), the connector's lookup round trip p50/p99 (from the sidecar's histogram of
what the connector reported: bucket upper bounds; in brackets the share answered within the connector's
default ``lookup_wait_ms`` of 2: a later answer costs its request a scheduling step), and how many
generated texts equal vLLM alone's.
Ratios are against vLLM alone in the same round; with ``--rounds``, every other round runs the systems
in reverse order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "dev"))  # what tests, benchmarks and the demo share
from engine import free_port, wait_http  # noqa: E402
from kvpool_sidecar.replay import open_trace  # noqa: E402
from kvpool_sidecar.service.server import instance_name, parse_shape  # noqa: E402
from kvpool_sidecar.storage.segment import release_instance  # noqa: E402
from tiny_model import KV_SHAPE as TINY_KV_SHAPE  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

TRACE = ROOT / "traces" / "mooncake_conversation.jsonl.gz"
BLOCK = 32
SYSTEMS = ("vllm", "ceiling", "lmcache", "kvpool")
# kvpool publishing its tier as KV events (vLLM's own events on too), and kvpool with vLLM's own events only
OPTIONAL = ("kvpool-events", "kvpool-vllm-events")
MID = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 6, "num_attention_heads": 12,
       "num_key_value_heads": 1, "head_dim": 64}


def build_mid_model(folder: Path) -> tuple[Path, str]:
    """A random Llama whose prefill costs about 33k FLOP per fp32 KV byte (Llama-3-8B: ~107k)."""
    stamp = folder / "kvpool-mid.json"
    shape = f"{MID['num_hidden_layers']},{MID['num_key_value_heads']},{MID['head_dim']},float32"
    if stamp.exists():
        return folder, shape
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = build_tiny_model(folder.parent / "tiny-for-tokenizer")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, initializer_range=0.02, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False, **MID)
    LlamaForCausalLM(config).save_pretrained(folder)
    for f in tiny.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            (folder / f.name).write_bytes(f.read_bytes())
    stamp.write_text(json.dumps(MID))
    return folder, shape


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def session_cpu_seconds(sid: int) -> float:
    """utime+stime of every live process in session ``sid`` (vLLM's server and its engine core)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def buckets_of(text: str, name: str) -> dict[float, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantiles(before: str, after: str, name: str, qs: tuple[float, ...]) -> list[float | None]:
    """Quantiles (bucket upper bounds) of what a histogram observed between two scrapes."""
    old = buckets_of(before, name)
    buckets = sorted((le, n - old.get(le, 0.0)) for le, n in buckets_of(after, name).items())
    total = buckets[-1][1] if buckets else 0
    out: list[float | None] = []
    for q in qs:
        out.append(next((le for le, n in buckets if total and n >= q * total), None))
    return out


class Subscriber:
    """Counts the blocks of vLLM's KV event batches by type and medium (decoded with vLLM's own types)."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.counts: dict[str, int] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop:
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            for ev in self._decode(frames[-1]).events:
                kind = f"{type(ev).__name__}/{getattr(ev, 'medium', '')}"
                self.counts[kind] = self.counts.get(kind, 0) + len(getattr(ev, "block_hashes", ()))

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()


class Stack:
    """One system: its services and vLLM's OpenAI server."""

    def __init__(self, system: str, args: argparse.Namespace, model: Path, kv_shape: str, work: Path, *,
                 sidecar_args: Sequence[str] = (), connector_extra: dict | None = None,
                 vllm_env: dict[str, str] | None = None) -> None:
        """``sidecar_args``: more ``kvpool-sidecar serve`` flags (a replica's peer flags: bench/replicas.py);
        ``connector_extra``: more keys of the connector's ``kv_connector_extra_config``; ``vllm_env``:
        environment variables of vLLM's server, over the ones set here (a core to bind to). A start that fails
        stops what it started."""
        self.procs: list[subprocess.Popen] = []
        self.subscriber: Subscriber | None = None
        self.sidecar_port: int | None = None
        self.log = None
        try:
            self._start(system, args, model, kv_shape, work, sidecar_args, connector_extra or {}, vllm_env or {})
        except BaseException:
            self.close()
            raise

    def _start(self, system: str, args: argparse.Namespace, model: Path, kv_shape: str, work: Path,
               sidecar_args: Sequence[str], connector_extra: dict, vllm_env: dict[str, str]) -> None:
        self.system, self.work = system, work
        self.sidecar_pid: int | None = None
        self.sidecar_url: str | None = None
        gpu_blocks = args.gpu_blocks + (args.pool_pages if system == "ceiling" else 0)
        bytes_per_page = parse_shape(kv_shape).bytes_per_page(BLOCK)
        kv_transfer = None
        bindir = Path(sys.executable).parent
        kv_events = None
        if system in ("kvpool", *OPTIONAL):
            port = free_port()
            (work / "config.yaml").write_text(args.kvpool_config)
            sock = str(work / "engine.sock")
            p = subprocess.Popen([bindir / "kvpool-sidecar", "serve", "--port", str(port), "--pages",
                                  str(args.pool_pages), "--kv-shape", kv_shape, "--config", str(work / "config.yaml"),
                                  "--log-level", "warning", "--engine-socket", sock, *sidecar_args],
                                 start_new_session=True)
            self.procs.append(p)
            self.sidecar_pid = p.pid
            self.sidecar_url = f"http://127.0.0.1:{port}"
            self.sidecar_port = port
            wait_http(self.sidecar_url + "/healthz")
            kv_transfer = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_sidecar.engines.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket": sock, **connector_extra}}
            if system in OPTIONAL:
                kv_transfer["kv_connector_extra_config"]["kv_events"] = system == "kvpool-events"
                endpoint = f"ipc://{work / 'kv-events.sock'}"
                kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
                self.subscriber = Subscriber(endpoint)
        elif system == "lmcache":
            port = free_port()
            gib = args.pool_pages * bytes_per_page / 2**30
            env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost", "--port", str(port),
                 "--chunk-size", "64", "--l1-size-gb", f"{gib:.6f}", "--eviction-policy", "LRU",
                 "--supported-transfer-mode", "auto"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            self.sidecar_pid = self.procs[-1].pid  # its CPU is counted as the sidecar's is
            time.sleep(3)
            if self.procs[-1].poll() is not None:  # not installed here (../shared/notes/vllm-on-cpu.md)
                raise RuntimeError(f"LMCache's server exited at start ({self.procs[-1].returncode}): is lmcache "
                                   "installed in this environment?")
            kv_transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"lmcache.mp.port": port}}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
               "--block-size", str(BLOCK), "--max-model-len", "2048", "--enforce-eager", "--enable-prefix-caching",
               "--num-gpu-blocks-override", str(gpu_blocks), "--gpu-memory-utilization", "0.3",
               "--port", str(self.port), "--host", "127.0.0.1", "--seed", "0"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        tp = args.tensor_parallel_size
        if tp > 1:  # vLLM-CPU binds one core per rank only when told which
            cmd += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        cmd += getattr(args, "vllm_extra", [])  # bench/classes.py: a LoRA adapter, prompt token details
        if kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
        if kv_events is not None:
            cmd += ["--kv-events-config", json.dumps(kv_events)]
        env.pop("TRITON_INTERPRET", None)
        env.update(vllm_env)
        self.log = open(work / f"vllm-{system}.log", "w")
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        self.engine_sid = self.procs[-1].pid
        wait_http(self.url + "/health", deadline=300)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        if self.sidecar_port is not None:  # an exit may leave the pool's segment for a restart: done with it
            release_instance(instance_name(self.sidecar_port))
        if self.log is not None:
            self.log.close()


def mooncake_slice(args: argparse.Namespace, folder: Path) -> Path:
    """The trace's first requests, scaled to the model: ``--chunk`` tokens per hash id, 60 ids at most."""
    path = folder / "mooncake-slice.jsonl"
    if path.exists():
        return path
    with open_trace(TRACE) as src, path.open("w") as out:
        for i, line in enumerate(src):
            if i >= args.num_prompts:
                break
            row = json.loads(line)
            ids = row["hash_ids"][:60]
            out.write(json.dumps({"timestamp": row["timestamp"], "input_length": len(ids) * args.chunk,
                                  "output_length": args.output_len, "hash_ids": ids}) + "\n")
    return path


def run_bench(stack: Stack, args: argparse.Namespace, model: Path, concurrency: int) -> dict:
    out = stack.work / f"{stack.system}-{concurrency}.json"
    code = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
            "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
            "main(p.parse_args(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "--backend", "vllm", "--base-url", stack.url, "--model", str(model)]
    if args.workload == "prefix":
        cmd += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
                str(args.num_prefixes), "--prefix-repetition-output-len", str(args.output_len)]
    else:
        cmd += ["--dataset-name", "timed_trace", "--dataset-path", str(mooncake_slice(args, stack.work.parent)),
                "--timed-trace-chunk-hash-size", str(args.chunk), "--no-self-timed"]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--ignore-eos", "--temperature", "0", "--seed", str(args.seed), "--save-result", "--save-detailed",
           "--result-dir", str(stack.work), "--result-filename", out.name, "--disable-tqdm"]
    before = httpx.get(stack.url + "/metrics", timeout=10).text
    side_before = httpx.get(stack.sidecar_url + "/metrics", timeout=10).text if stack.sidecar_url else ""
    cpu0 = cpu_seconds(stack.sidecar_pid) if stack.sidecar_pid else 0.0
    engine0 = session_cpu_seconds(stack.engine_sid)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}  # timed_trace seeds tokens by hash()
    env.pop("TRITON_INTERPRET", None)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu1 = cpu_seconds(stack.sidecar_pid) if stack.sidecar_pid else 0.0
    engine1 = session_cpu_seconds(stack.engine_sid)
    after = httpx.get(stack.url + "/metrics", timeout=10).text
    result = json.loads(out.read_text())
    hits = "vllm:external_prefix_cache_hits_total"
    external = metric(after, hits) - metric(before, hits)
    row = {
        "rps": result["request_throughput"], "ttft_p50": result["median_ttft_ms"],
        "ttft_p99": result["p99_ttft_ms"], "tpot": result["mean_tpot_ms"], "completed": result["completed"],
        "external_tokens": external, "texts": result.get("generated_texts", []),
        "sidecar_cpu_ms": 1000 * (cpu1 - cpu0) / max(1, result["completed"]) if stack.sidecar_pid else None,
        "engine_cpu_ms": 1000 * (engine1 - engine0) / max(1, result["completed"]),
        "rtt": None,
    }
    if stack.subscriber is not None:
        row["events"] = dict(stack.subscriber.counts)
    if stack.sidecar_url:
        time.sleep(1.5)  # the connector's last report
        side_after = httpx.get(stack.sidecar_url + "/metrics", timeout=10).text
        name = "kvpool_connector_lookup_seconds"
        if metric(side_after, name + "_count") > metric(side_before, name + "_count"):
            row["rtt"] = histogram_quantiles(side_before, side_after, name, (0.5, 0.99))
            old, new = buckets_of(side_before, name), buckets_of(side_after, name)
            total = new[float("inf")] - old.get(float("inf"), 0.0)
            row["in_budget"] = (new[0.002] - old.get(0.002, 0.0)) / total  # the connector's lookup_wait_ms 2
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "mid"), default="tiny")
    ap.add_argument("--workload", choices=("prefix", "mooncake"), default="prefix")
    ap.add_argument("--chunk", type=int, default=32, help="mooncake: tokens per hash id")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--num-prompts", type=int, default=480)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=98)
    ap.add_argument("--num-prefixes", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--gpu-blocks", type=int, default=120, help="vLLM's own cache (blocks of 32 tokens)")
    ap.add_argument("--pool-pages", type=int, default=2000, help="the second tier (pages of 32 tokens)")
    ap.add_argument("--kvpool-config", default="pageSize: 32\n", help="the sidecar's config (YAML): the defaults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="run the systems this many times, alternating (noise)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="every system's engine at this TP degree")
    args = ap.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS) - set(OPTIONAL)
    if unknown:
        ap.error(f"--systems: unknown {', '.join(sorted(unknown))} (known: {', '.join(SYSTEMS + OPTIONAL)})")
    if "lmcache" in systems:
        try:
            import lmcache  # noqa: F401
        except ImportError:
            print("lmcache is not installed: skipped (see bench/engine.py for its install line)")
            systems.remove("lmcache")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvpool-serve-"))
    if args.model == "tiny":
        model, kv_shape = build_tiny_model(work / "tiny"), TINY_KV_SHAPE
    else:
        model, kv_shape = build_mid_model(Path(tempfile.gettempdir()) / "kvpool-mid-model")
    kv_shape = ranks_shape(kv_shape, args.tensor_parallel_size)
    runs: list[dict[tuple[str, int], dict]] = []
    for rnd in range(args.rounds):
        rows: dict[tuple[str, int], dict] = {}
        runs.append(rows)
        for system in (systems if rnd % 2 == 0 else systems[::-1]):  # alternate who runs first
            sys_work = work / f"{system}-{rnd}"
            sys_work.mkdir()
            print(f"starting {system} (round {rnd + 1}) ...", flush=True)
            stack = Stack(system, args, model, kv_shape, sys_work)
            try:
                for c in concurrencies:
                    rows[(system, c)] = run_bench(stack, args, model, c)
                    r = rows[(system, c)]
                    print(f"  {system} @ {c}: {r['rps']:.2f} req/s", flush=True)
            finally:
                stack.close()
    what = (f"{args.num_prefixes} prefixes of {args.prefix_len} + {args.suffix_len} tokens" if args.workload == "prefix"
            else f"the Mooncake conversation trace, {args.chunk} tokens per hash id")
    print(f"\nmodel {args.model} ({kv_shape}), tensor parallel {args.tensor_parallel_size}; {args.num_prompts} "
          f"prompts, {what}, {args.output_len} out; vLLM's cache {args.gpu_blocks} blocks, second tier "
          f"{args.pool_pages} pages")
    print("| system | clients | req/s | x vLLM | TTFT p50 ms | TTFT p99 ms | TPOT ms | x vLLM | 2nd-tier tokens "
          "| CPU ms/req engine+tier | lookup RTT p50/p99 ms | same texts |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rnd, rows in enumerate(runs):
        if args.rounds > 1:
            print(f"| round {rnd + 1} |||||||||||| ")
        print_rows(rows)
    return 0


def ranks_shape(kv_shape: str, ranks: int) -> str:
    """The pool's --kv-shape for ``ranks`` tensor-parallel workers: the heads of all ranks together (a
    model with fewer KV heads than ranks replicates one head on each)."""
    layers, heads, *rest = kv_shape.split(",")
    stored = ranks * max(1, int(heads) // ranks)
    return ",".join([layers, str(stored), *rest])


def print_rows(rows: dict[tuple[str, int], dict]) -> None:
    for (system, c), r in rows.items():
        base = rows.get(("vllm", c))
        same = "-"
        if base and system != "vllm":
            same = f"{sum(a == b for a, b in zip(r['texts'], base['texts'], strict=False))}/{len(base['texts'])}"
        ratio = f"{r['rps'] / base['rps']:.2f}" if base else "-"
        tpot = f"{r['tpot'] / base['tpot']:.2f}" if base and base["tpot"] else "-"
        side = r["sidecar_cpu_ms"] or 0.0
        cpu = f"{r['engine_cpu_ms'] + side:.1f} ({r['engine_cpu_ms']:.1f}+{side:.1f})"
        rtt = "/".join(f"{1000 * v:.1f}" if v is not None else "-" for v in r["rtt"]) if r["rtt"] else "-"
        if "in_budget" in r:
            rtt += f" ({100 * r['in_budget']:.0f} % <= 2)"
        print(f"| {system} | {c} | {r['rps']:.2f} | {ratio} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | "
              f"{r['tpot']:.2f} | {tpot} | {int(r['external_tokens']):,} | {cpu} | {rtt} | {same} |")
    for (system, c), r in rows.items():
        if "events" in r:
            kvpool = rows.get(("kvpool", c))
            vs = f", {r['rps'] / kvpool['rps']:.3f}x kvpool's req/s" if kvpool else ""
            print(f"{system} @ {c}: KV event blocks seen by the subscriber (cumulative) {r['events']}{vs}")


if __name__ == "__main__":
    raise SystemExit(main())
