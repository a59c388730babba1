"""Replicas sharing one cache (issue 66): peer fetch throughput between two sidecars on this machine, and two
real vLLM replicas with their own sidecars (``--engines``).

    .venv/bin/python bench/replicas.py                  # 64 MiB fetches of Qwen2.5-7B-shaped pages, 10 rounds
    .venv/bin/python bench/replicas.py --mib 16 --rounds 5
    .venv/bin/python bench/replicas.py --huge-shm         # /dev/shm as a tmpfs in huge pages (needs unshare -m)
    .venv/bin/python bench/replicas.py --engines                          # tiny model, 16 prompts of 1024 + 24
    .venv/bin/python bench/replicas.py --engines --prompts 8 --prefix-len 512 --fetch-wait-ms 1000
    .venv/bin/python bench/replicas.py --engines --model mid

A real ``kvpool-sidecar serve --peer-port`` (the source) holds one prompt of ``--mib`` MiB of the pool's own
pages per round, saved through its engine channel as an engine saves them (random KV) just before the round.
This process is the reader: a sidecar with its own shared pool and NIXL agent whose peer client fetches each
round's prompt from the source (the whole path: the control round trip, the source's hold, the admission here, the NIXL
READ of the held pages into fresh pages, the commit, the done) and checks the bytes against the source's.
Beside each fetch, in the same run, plain copies of the same number of bytes: one core's ``memcpy``
(``np.copyto``; a NIXL read is one kernel copy on one core) between two halves of a second shared segment laid
out as a pool (shared memory, in 4 KiB pages unless the machine lets tmpfs use huge pages, as both pools are)
and between two buffers of process memory (which the kernel backs with huge pages), and torch's ``copy_`` of
the shared segment (every core). The first ``--warmup`` rounds touch the pages for the first time and are not
counted; the figures are medians. ``--huge-shm`` runs the same in a mount namespace of its own whose
``/dev/shm`` is a tmpfs mounted ``huge=always`` (both pools in 2 MiB pages: the kernel's single copy pins a
page at a time, and 4 KiB pages cost it roughly 40 % of its speed on this machine).

``--engines``: two vLLM OpenAI servers on this machine, A bound to core 0 and B to core 1
(``VLLM_CPU_OMP_THREADS_BIND``), each with its own ``kvpool-sidecar`` wired by the KVPoolConnector (started as
bench/serve.py's ``Stack`` starts them; ``--model tiny|mid`` as there), the two sidecars each other's peers
(``--peer-port``, ``--peer-host 127.0.0.1``, ``--peers`` naming the other's peer port) proving one cluster key
written here at random (``--transfer-key-file``). The workload, fixed by ``--seed``: ``--prompts`` distinct
prompts, each a long prefix of its own (``--prefix-len``) and a short suffix (``--suffix-len``). All are sent to A
first, one at a time (A computes them and its sidecar saves them; the run waits until A's connector has released
them all), then to B, one at a time, alternately with and without the hint (the two arms interleave in time): the
request body's ``kv_transfer_params`` ``{"remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": A's peer
port}}``, which vLLM's server hands to the connector, and the connector's request waits up to
``peer_fetch_wait_ms`` (250 ms unless ``--fetch-wait-ms``) while B's sidecar fetches the pages from A's. Before the
arms, one hinted request to B with a prompt of its own warms B's first NIXL connection to A (slow on a loaded
machine) and is not counted (the arms start once its fetch has ended). Requests stream (bench/classes.py's ``one``;
TTFT is the first token's arrival) with ``--enable-prompt-tokens-details``. Figures per arm on B: prompts, prompt
tokens, tokens computed (prompt tokens less cached ones), tokens loaded from B's tier (the usage's cached tokens: B
never saw these prompts, so its own cache holds none of them), TTFT p50, and how many answers equal A's token for
token (greedy, ``ignore_eos``, ``--output-len`` tokens; the exit status is 1 when one does not). Then B's sidecar's
fetch figures over the arms (``kvpool_peer_fetches_total`` by result, ``kvpool_peer_fetch_pages_total``,
``kvpool_peer_fetch_bytes_total``, ``kvpool_peer_fetch_late_total``, and ``kvpool_peer_fetch_seconds``' sum over
its count: a fetch's mean latency and the GB/s it makes of the bytes), beside the plain copies above of one fetch's
mean number of pages, in the same run (``--copies`` each after one that touches the pages; medians).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sidecar"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "dev"))

from classes import one  # noqa: E402
from kvpool_sidecar import wire  # noqa: E402
from kvpool_sidecar.config import SidecarConfig  # noqa: E402
from kvpool_sidecar.engines.link import Connection  # noqa: E402
from kvpool_sidecar.keys import WorkloadMeta  # noqa: E402
from kvpool_sidecar.peers.host import pool_keys  # noqa: E402
from kvpool_sidecar.peers.keys import TransferKeys  # noqa: E402
from kvpool_sidecar.peers.node import Peers  # noqa: E402
from kvpool_sidecar.service.server import parse_shape  # noqa: E402
from kvpool_sidecar.service.state import Sidecar  # noqa: E402
from kvpool_sidecar.storage import KVStorage, ModelShape  # noqa: E402
from serve import BLOCK, Stack, build_mid_model, metric  # noqa: E402
from tiny_model import KV_SHAPE as TINY_KV_SHAPE  # noqa: E402
from tiny_model import VOCAB, build_tiny_model  # noqa: E402

MODEL = "bench@replicas"
FETCH = "peer fetch (NIXL READ, the whole fetch path)"
SHM = "plain copy, one core, the pool's shared memory"
ANON = "plain copy, one core, process memory"
TORCH = "plain copy, torch copy_ (every core), shared memory"
KEYS = TransferKeys.parse("bench " + "k" * 40)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_source(folder: Path, shape: ModelShape, page_size: int, pages: int) -> tuple[subprocess.Popen, int, int,
                                                                                         str]:
    (folder / "config.yaml").write_text(f"pageSize: {page_size}\neviction: {{policy: lru}}\n"
                                        "pinning: {autoPin: {enabled: false}}\n")
    (folder / "keys").write_text(f"bench {'k' * 40}\n")
    port, peer_port, sock = free_port(), free_port(), str(folder / "engine.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool_sidecar.cli", "serve", "--port", str(port), "--pages", str(pages), "--kv-shape",
         f"{shape.layers},{shape.kv_heads},{shape.head_dim},{shape.dtype}", "--config", str(folder / "config.yaml"),
         "--engine-socket", sock, "--transfer-key-file", str(folder / "keys"), "--peer-port", str(peer_port),
         "--peer-host", "127.0.0.1", "--log-level", "warning"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "sidecar")}, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200:
                return proc, port, peer_port, sock
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the source sidecar did not start")
        time.sleep(0.1)


def fill(sock: str, blocks: list[bytes], page_size: int) -> torch.Tensor:
    """Save and commit the blocks on the source as an engine would; returns their KV."""
    conn = Connection(sock, wire.Hello(wire.PROTOCOL, "scheduler", f"fill-{blocks[0].hex()}", MODEL), 10.0)
    attached = KVStorage.attach(conn.welcome.storage)
    try:
        n = len(blocks) * page_size
        admitted = conn.step(wire.Step(admits=[wire.Admit("fill", blocks, n)])).admits[0]
        assert isinstance(admitted, wire.Admitted), admitted
        kv = torch.randn((len(blocks), *attached.kv.shape[1:]), dtype=torch.float32).to(attached.kv.dtype)
        with attached.writing(admitted.fence):
            attached.kv[admitted.page_ids] = kv
        conn.step(wire.Step(commits=[wire.Commit("fill", n)], releases=["fill"]))
        return kv
    finally:
        attached.close()
        conn.close()


def in_huge_shm(argv: list[str]) -> int:
    """This benchmark again, in a mount namespace whose /dev/shm is a tmpfs in huge pages."""
    script = (f"mount -t tmpfs -o size=2g,huge=always tmpfs /dev/shm && grep -q huge=always /proc/self/mounts && "
              f"exec {sys.executable} {Path(__file__).resolve()} {' '.join(argv)}")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], check=False)
    if done.returncode:
        print("could not run in a mount namespace with a huge-page /dev/shm (unshare -m and mount need root)",
              file=sys.stderr)
    return done.returncode


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class PlainCopies:
    """Plain copies of ``pages`` pages' bytes: one core's ``memcpy`` between two halves of a shared segment laid
    out as a pool and between two buffers of process memory, and torch's ``copy_`` of the shared segment."""

    def __init__(self, shape: ModelShape, page_size: int, pages: int) -> None:
        self.pages = pages
        self.nbytes = pages * shape.bytes_per_page(page_size)
        self.plain = KVStorage(shape, page_size, pages=2 * pages, shared=True)  # the copy's two regions
        self.plain.kv.fill_(1)
        self.anon_src = np.ones(self.nbytes, dtype=np.uint8)
        self.anon_dst = np.zeros(self.nbytes, dtype=np.uint8)
        shm_bytes = self.plain.kv.view(-1).view(torch.uint8).numpy()
        self.shm_src, self.shm_dst = shm_bytes[:self.nbytes], shm_bytes[self.nbytes:]

    def time(self) -> dict[str, float]:
        """Seconds of one copy of each kind."""
        timed = {}
        for name, copy in ((SHM, lambda: np.copyto(self.shm_dst, self.shm_src)),
                           (ANON, lambda: np.copyto(self.anon_dst, self.anon_src)),
                           (TORCH, lambda: self.plain.kv[self.pages:].copy_(self.plain.kv[:self.pages]))):
            start = time.perf_counter()
            copy()
            timed[name] = time.perf_counter() - start
        return timed

    def close(self) -> None:
        self.plain.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="MiB of pages per fetch")
    parser.add_argument("--shape", default="28,4,128,bfloat16", help="layers,kv_heads,head_dim,dtype of a page")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--huge-shm", action="store_true", help="/dev/shm as a tmpfs mounted huge=always")
    two = parser.add_argument_group("--engines: two vLLM replicas, each with its own sidecar")
    two.add_argument("--engines", action="store_true", help="run two vLLM OpenAI servers with their sidecars "
                     "(the flags below) instead of the fetch throughput above")
    two.add_argument("--model", choices=("tiny", "mid"), default="tiny")
    two.add_argument("--prompts", type=int, default=16, help="distinct prompts, half sent to B with the hint")
    two.add_argument("--prefix-len", type=int, default=1024, help="tokens of each prompt's own long prefix")
    two.add_argument("--suffix-len", type=int, default=24, help="tokens of each prompt's short suffix")
    two.add_argument("--output-len", type=int, default=4, help="tokens generated (greedy, ignore_eos)")
    two.add_argument("--seed", type=int, default=0, help="the prompts' tokens")
    two.add_argument("--gpu-blocks", type=int, default=120, help="each vLLM's own cache (blocks of 32 tokens)")
    two.add_argument("--pool-pages", type=int, default=2000, help="each sidecar's tier (pages of 32 tokens)")
    two.add_argument("--fetch-wait-ms", type=float, help="the connector's peer_fetch_wait_ms on B (default: the "
                     "connector's, 250)")
    two.add_argument("--copies", type=int, default=5, help="plain copies timed beside the fetch figures (median)")
    args = parser.parse_args()
    if args.engines:
        return engines(args)
    if args.huge_shm:
        return in_huge_shm([a for a in sys.argv[1:] if a != "--huge-shm"])
    layers, heads, dim, dtype = args.shape.split(",")
    shape = ModelShape(int(layers), int(heads), int(dim), dtype)
    page_bytes = shape.bytes_per_page(args.page_size)
    per_fetch = max(1, (args.mib << 20) // page_bytes)
    nbytes = per_fetch * page_bytes
    rounds = args.warmup + args.rounds
    print(f"{per_fetch} pages of {page_bytes} bytes ({args.page_size} tokens of {args.shape}) a fetch: "
          f"{nbytes / 2**20:.1f} MiB; {args.rounds} rounds after {args.warmup} of warm-up; medians")
    with tempfile.TemporaryDirectory(prefix="kvp-bench-") as tmp:
        # Room for two rounds' prompts: each round's is saved just before its fetch, the last but one evicted.
        proc, _, peer_port, sock = start_source(Path(tmp), shape, args.page_size, 2 * per_fetch + 8)
        try:
            return measure(shape, args.page_size, per_fetch, nbytes, rounds, sock, peer_port, args.warmup)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def measure(shape: ModelShape, page_size: int, per_fetch: int, nbytes: int, rounds: int, sock: str, peer_port: int,
            warmup: int) -> int:
    pages = per_fetch + 8  # a fetch's pages and some slack: each round's fetch evicts the last round's
    storage = KVStorage(shape, page_size, pages=pages, shared=True)
    plain = PlainCopies(shape, page_size, per_fetch)
    config = SidecarConfig.model_validate({"pageSize": page_size, "eviction": {"policy": "lru"},
                                           "workloads": {"toB": {"isolationPercent": 0}},
                                           "pinning": {"autoPin": {"enabled": False}}})
    sidecar = Sidecar(config, pages, storage=storage, transfer_keys=KEYS)
    peer = ("127.0.0.1", peer_port)
    peers = Peers(sidecar, KEYS, members=frozenset({peer}))
    peers.agent.populate()  # as `serve` does at start
    runs: list[int] = []
    read = peers.agent.read

    def counted(descs: list, name: str) -> object:
        runs.append(len(descs))
        return read(descs, name)

    peers.agent.read = counted  # type: ignore[method-assign]
    figures: dict[str, list[float]] = {FETCH: [], SHM: [], ANON: [], TORCH: []}
    loop = asyncio.new_event_loop()
    try:
        for r in range(rounds):
            blocks = [f"r{r}b{i}".encode() for i in range(per_fetch)]
            source_kv = fill(sock, blocks, page_size)
            start = time.perf_counter()
            result = loop.run_until_complete(peers.client.fetch(peer, MODEL, blocks, WorkloadMeta(), 30.0))
            fetch = time.perf_counter() - start
            if result.result != "hit" or result.pages != per_fetch:
                raise RuntimeError(f"round {r}: the fetch answered {result}")
            _, got = sidecar.pool.cached_prefix(block_hashes=pool_keys(MODEL, blocks))
            if not torch.equal(storage.kv[got], source_kv):
                raise RuntimeError(f"round {r}: the fetched bytes differ from the source's")
            timed = {FETCH: fetch, **plain.time()}
            if r >= warmup:
                for name, seconds in timed.items():
                    figures[name].append(gbps(nbytes, seconds))
    finally:
        loop.run_until_complete(peers.client.close())
        loop.close()
        peers.agent.close()
        sidecar.close()
        storage.close()
        plain.close()
    fetch_median = statistics.median(figures[FETCH])
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"{name:<52} {median:6.2f} GB/s (min {min(values):.2f}, max {max(values):.2f})")
    for name in list(figures)[1:]:
        print(f"peer fetch / {name}: {fetch_median / statistics.median(figures[name]):.2f}x")
    print(f"descriptors per fetch (runs of pages contiguous on both sides): {sorted(set(runs))}; "
          "bytes equal to the source's in every round")
    return 0


def engines(args: argparse.Namespace) -> int:
    """Two vLLM replicas, A and B, each on one core with its own sidecar, the sidecars each other's peers."""
    work = Path(tempfile.mkdtemp(prefix="kvpool-replicas-"))
    if args.model == "tiny":
        model, kv_shape = build_tiny_model(work / "tiny"), TINY_KV_SHAPE
    else:
        model, kv_shape = build_mid_model(Path(tempfile.gettempdir()) / "kvpool-mid-model")
    # The sidecars (the console script) and vLLM's connector import this checkout's kvpool_sidecar.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "sidecar"), os.environ.get("PYTHONPATH"))
                                               if p)
    keyfile = work / "cluster-key"  # the cluster key both sidecars prove: lines KEY_ID SECRET
    keyfile.touch(mode=0o600)
    keyfile.write_text(f"bench {secrets.token_urlsafe(48)}\n")
    peer_ports = {"A": free_port(), "B": free_port()}
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    # Each prompt a prefix of its own and a short suffix; one more, first, warms B's connection to A.
    warm, *prompts = [tokens(args.prefix_len) + tokens(args.suffix_len) for _ in range(args.prompts + 1)]
    ns = argparse.Namespace(gpu_blocks=args.gpu_blocks, pool_pages=args.pool_pages, tensor_parallel_size=1,
                            kvpool_config=f"pageSize: {BLOCK}\n", vllm_extra=["--enable-prompt-tokens-details"])
    fetch_wait = {} if args.fetch_wait_ms is None else {"peer_fetch_wait_ms": args.fetch_wait_ms}

    def start(name: str, core: int, other: str) -> Stack:
        (work / name).mkdir()
        peer = ["--transfer-key-file", str(keyfile), "--peer-port", str(peer_ports[name]), "--peer-host", "127.0.0.1",
                "--peers", f"127.0.0.1:{peer_ports[other]}"]
        return Stack("kvpool", ns, model, kv_shape, work / name, sidecar_args=peer, connector_extra=fetch_wait,
                     vllm_env={"VLLM_CPU_OMP_THREADS_BIND": str(core)})

    print("starting A (core 0) and B (core 1), each vLLM with its own sidecar ...", flush=True)
    stacks: dict[str, Stack] = {}
    with ThreadPoolExecutor(2) as pool:
        futures = {"A": pool.submit(start, "A", 0, "B"), "B": pool.submit(start, "B", 1, "A")}
        failed = None
        for name, future in futures.items():
            try:
                stacks[name] = future.result()
            except Exception as exc:  # a failed start stopped its own processes; the other stack is stopped below
                failed = failed or exc
    try:
        if failed is not None:
            raise failed
        return asyncio.run(drive(args, stacks["A"], stacks["B"], peer_ports["A"], str(model), kv_shape, warm, prompts))
    finally:
        for stack in stacks.values():
            stack.close()


async def drive(args: argparse.Namespace, a: Stack, b: Stack, peer_a: int, model: str, kv_shape: str,
                warm: list[int], prompts: list[list[int]]) -> int:
    hint = {"kv_transfer_params": {"remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": peer_a}}}
    async with httpx.AsyncClient(timeout=600) as client:

        async def ask(stack: Stack, prompt: list[int], hinted: bool) -> tuple[float, int, list[int]]:
            out: list[int] = []
            ttft, cached = await one(client, stack.url, model, prompt, args.output_len, extra=hint if hinted else None,
                                     token_ids=out)
            return ttft, cached, out

        answers = [(await ask(a, p, False))[2] for p in [warm, *prompts]]  # A computes; its sidecar saves them
        await settled(client, a)
        fetched = "kvpool_peer_fetch_seconds_count"
        before = metric((await client.get(b.sidecar_url + "/metrics")).text, fetched)
        ttft, cached, _ = await ask(b, warm, True)
        deadline = time.monotonic() + 5  # its fetch ends (lands or fails) within the sidecar's budget, 2 s
        while metric(side0 := (await client.get(b.sidecar_url + "/metrics")).text, fetched) == before:
            if time.monotonic() > deadline:
                raise RuntimeError("B's sidecar started no fetch for the warm-up (is A's peer port among B's --peers?)")
            await asyncio.sleep(0.05)
        print(f"warm-up (not counted): one hinted request to B, {cached} of {len(warm)} prompt tokens loaded, "
              f"TTFT {ttft:.0f} ms (B's first NIXL connection to A)", flush=True)
        engine0 = (await client.get(b.url + "/metrics")).text
        rows: dict[bool, list[tuple[float, int, int, bool]]] = {True: [], False: []}
        for i, (prompt, answer) in enumerate(zip(prompts, answers[1:], strict=True)):
            hinted = i % 2 == 0  # the arms alternate
            ttft, cached, out = await ask(b, prompt, hinted)
            rows[hinted].append((ttft, cached, len(prompt), out == answer))
        await asyncio.sleep(1.0)  # a fetch the engine stopped waiting for still lands
        side1 = (await client.get(b.sidecar_url + "/metrics")).text
        engine1 = (await client.get(b.url + "/metrics")).text
    report(args, kv_shape, rows, side0, side1, engine0, engine1)
    return 0 if all(same for arm in rows.values() for *_, same in arm) else 1


async def settled(client: httpx.AsyncClient, stack: Stack) -> None:
    """Until the engine's connector has released every request on its sidecar (their saves committed)."""
    deadline = time.monotonic() + 30
    while (stats := (await client.get(stack.sidecar_url + "/v1/stats")).json())["sequences"] or stats["in_use_pages"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"A's sidecar still holds requests: {stats}")
        await asyncio.sleep(0.05)


def delta(before: str, after: str, name: str) -> float:
    return metric(after, name) - metric(before, name)


def report(args: argparse.Namespace, kv_shape: str, rows: dict, side0: str, side1: str, engine0: str,
           engine1: str) -> None:
    print(f"\nmodel {args.model} ({kv_shape}); {args.prompts} prompts of {args.prefix_len} + {args.suffix_len} "
          f"tokens (each its own prefix), {args.output_len} out, greedy; sent to A, then to B one at a time, "
          "hinted and not hinted alternating; peer_fetch_wait_ms "
          f"{'250 (default)' if args.fetch_wait_ms is None else format(args.fetch_wait_ms, 'g')}")
    print("| B's arm | prompts | prompt tokens | computed | loaded from B's tier | TTFT p50 ms | same tokens as A |")
    print("|---|---|---|---|---|---|---|")
    for hinted, arm in ((True, rows[True]), (False, rows[False])):
        prompt_tokens, cached = sum(n for _, _, n, _ in arm), sum(c for _, c, _, _ in arm)
        print(f"| {'hinted' if hinted else 'not hinted'} | {len(arm)} | {prompt_tokens:,} | {prompt_tokens - cached:,} "
              f"| {cached:,} | {statistics.median(t for t, *_ in arm):.0f} | {sum(s for *_, s in arm)}/{len(arm)} |")
    hits = delta(engine0, engine1, "vllm:external_prefix_cache_hits_total")
    print(f"B's vLLM: {hits:,.0f} prompt tokens from the connector (external_prefix_cache_hits) over both arms")
    results = {line.split('result="', 1)[1].split('"', 1)[0]: 0.0 for line in side1.splitlines()
               if line.startswith("kvpool_peer_fetches_total{")}
    results = {r: delta(side0, side1, f'kvpool_peer_fetches_total{{result="{r}"}}') for r in results}
    pages = delta(side0, side1, "kvpool_peer_fetch_pages_total")
    nbytes = delta(side0, side1, "kvpool_peer_fetch_bytes_total")
    seconds = delta(side0, side1, "kvpool_peer_fetch_seconds_sum")
    count = delta(side0, side1, "kvpool_peer_fetch_seconds_count")
    late = delta(side0, side1, "kvpool_peer_fetch_late_total")
    by_result = ", ".join(f"{r} {n:.0f}" for r, n in results.items() if n) or "none"
    print(f"B's sidecar (kvpool_peer_fetches_total and the like): fetches {by_result}; "
          f"{pages:.0f} pages, {nbytes / 2**20:.2f} MiB; engine lookups that stopped waiting: {late:.0f}")
    if not count or not pages:
        print("no pages fetched: no plain copy to compare")
        return
    per_fetch = max(1, round(pages / count))
    print(f"fetch latency {1000 * seconds / count:.1f} ms a fetch (histogram sum/count, {count:.0f} fetches, the "
          f"whole fetch: control round trip, hold, NIXL READ, commit): {gbps(int(nbytes), seconds):.3f} GB/s")
    plain = PlainCopies(parse_shape(kv_shape), BLOCK, per_fetch)
    try:
        timed = [plain.time() for _ in range(1 + args.copies)][1:]  # the first touches the pages
    finally:
        plain.close()
    for name in (SHM, ANON, TORCH):
        median = statistics.median(t[name] for t in timed)
        print(f"  beside it, {name} of a fetch's {per_fetch} pages ({plain.nbytes / 2**20:.2f} MiB): "
              f"{gbps(plain.nbytes, median):.2f} GB/s (median of {args.copies})")


if __name__ == "__main__":
    sys.exit(main())
