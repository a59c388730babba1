"""``kvpool-sidecar``: the command line (serve, replay, synth, plan, tune)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool_sidecar import wire
from kvpool_sidecar.config import ConfigError, KVCachePolicySpec, load_config
from kvpool_sidecar.policies import POLICIES
from kvpool_sidecar.replay import REFERENCE_POLICIES, SETUPS, TraceError, read_trace, report, run_matrix, synth, tune
from kvpool_sidecar.replay.cluster import run_cluster_matrix
from kvpool_sidecar.replay.trace import Trace
from kvpool_sidecar.routing import ROUTING_MODES

EXIT_USAGE = 2


def _above_zero(rule: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(rule)
        return value

    return parse


_capacity = _above_zero("must be above 0 (at most 1: a fraction of distinct blocks; above: pages)")
_seconds = _above_zero("must be a number of seconds above 0")


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be a number of seconds, 0 or more")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError("must be a port number in 1..65535")
    return value


def _spec(path: str | None) -> KVCachePolicySpec | None:
    return load_config(path).spec() if path else None


def cmd_replay(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    spec = _spec(args.config)
    cluster = bool(args.pods or args.routing or args.membership != "none")
    pool_runs = sum(1 for p in args.policy if p not in REFERENCE_POLICIES) * len(args.capacity)
    if cluster:
        args.pods = args.pods or [4]
        args.routing = args.routing or ["bounded-hash+replicas"]
        pool_runs *= len(args.pods) * len(args.routing)
    update, close = report.progress_bar(pool_runs * len(trace.requests), not args.no_progress)
    try:
        if cluster:
            results = list(run_cluster_matrix(trace, args.policy, args.capacity, args.pods, args.routing, spec,
                                              membership=args.membership, progress=update, setup=args.setup))
        else:
            results = list(run_matrix(trace, args.policy, args.capacity, spec, update, args.setup))
    finally:
        close()
    formatter = {"table": report.format_table, "json": report.format_json, "csv": report.format_csv}[args.format]
    print(formatter(results))
    if args.plot:
        report.plot(results, args.plot, f"{trace.name}: token hit ratio")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


LIMIT_FLAGS = ("max_body_bytes", "max_sequences", "max_sequence_tokens", "max_pins_per_owner")


def cmd_serve(args: argparse.Namespace) -> int:
    from kvpool_sidecar.service.server import ServeOptions, serve

    serve(
        ServeOptions(
            config=args.config, host=args.host, port=args.port, pages=args.pages, token_file=args.token_file,
            metrics_host=args.metrics_host, metrics_port=args.metrics_port, log_level=args.log_level,
            kv_shape=args.kv_shape, transfer_key_file=args.transfer_key_file,
            engine_socket=None if args.engine_socket == "none" else args.engine_socket,
            engine_quarantine=args.engine_quarantine_seconds, peer_port=args.peer_port, peer_host=args.peer_host,
            peers=args.peers, peer_namespace=args.peer_namespace, peer_refresh=args.peer_refresh_seconds,
            peer_warmup=args.peer_warmup_seconds,
            **{k: v for k in LIMIT_FLAGS if (v := getattr(args, k)) is not None},
        )
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kvpool_sidecar.replay import plan as planning

    gpu = planning.parse_bytes(args.gpu_memory)
    p = planning.plan(args.layers, args.kv_heads, args.head_dim, args.dtype, args.page_size, gpu, args.params,
                      max_seq_len=args.max_seq_len, batch=args.batch, d_model=args.d_model)
    gib = 2**30
    print(f"KV per token: {p.bytes_per_token} bytes ({p.bytes_per_token / 1024:.1f} KiB); "
          f"per page of {args.page_size} tokens: {p.bytes_per_page / 2**20:.2f} MiB")
    print(f"GPU {gpu / gib:.1f} GiB - weights {args.params * 2 / gib:.1f} GiB - 10 % reserve = "
          f"{p.kv_budget_bytes / gib:.1f} GiB for KV: {p.pages} pages, {p.pages * args.page_size} tokens")
    primary = 0
    if args.max_model_len:
        primary = planning.primary_tier_bytes(p.bytes_per_page, args.page_size, args.max_model_len,
                                              args.max_num_batched_tokens)
        print(f"vLLM's primary tier in front of kvpool (TieringOffloadingSpec, block_size {args.page_size}): "
              f"cpu_bytes_to_use {primary} ({primary / gib:.2f} GiB: one {args.max_model_len}-token prompt "
              f"promoted whole beside {planning.STORE_STEPS_IN_FLIGHT} steps of {args.max_num_batched_tokens} "
              "new tokens waiting for their cascade)")
    if args.tier_multiple or args.pool_pages:
        _plan_tier(args, p.pages, p.bytes_per_page, primary)
    if p.rule_of_thumb_bytes is not None:
        print(f"rule of thumb (not a measurement): HBM = params x 1.2 + max_seq_len x batch x d_model x 2.5 = "
              f"{p.rule_of_thumb_bytes / gib:.1f} GiB")
    if args.trace:
        trace = read_trace(args.trace)
        rows = planning.page_size_table([r.input_length for r in trace.requests])
        print(f"page size from {len(trace.requests)} prompts of {trace.name}:")
        print(f"{'page':>6}{'fragmentation':>15}{'pages/prompt':>14}")
        for size, frag, entries in rows:
            print(f"{size:>6}{frag:>15.2%}{entries:>14.1f}")
        print(f"recommended page size: {planning.recommend_page_size(rows)} tokens "
              "(the largest wasting at most 2 % of the slots)")
    return 0


def _plan_tier(args: argparse.Namespace, gpu_pages: int, bytes_per_page: int, primary: int = 0) -> None:
    """The second tier's pages and what its pod needs: the shm volume (the pool's segment and vLLM's
    ``primary`` tier, both in it, and room for one more primary tier: vLLM names its region anew at each
    start and leaves it behind when it exits uncleanly) and the sidecar's memory limit."""
    from kvpool_sidecar.storage import memory

    pages = args.pool_pages or round(args.tier_multiple * gpu_pages)
    segment = memory.segment_bytes(bytes_per_page, pages)
    print(f"second tier: --pages {pages} ({pages / max(gpu_pages, 1):.2f} x the GPU's KV), "
          f"{segment / 2**30:.1f} GiB of shared memory")
    volume = memory.gib_ceil(segment + 2 * primary)
    with_primary = " (with vLLM's primary tier and one it left behind)" if primary else ""
    print(f"memory volume sizeLimit >= {volume}Gi{with_primary}; "
          "sidecar container memory limit >= "
          f"{memory.gib_ceil(memory.sidecar_memory_bytes(segment, pages))}Gi (it allocates the segment at start-up "
          "and is charged for it, plus its process and bookkeeping and 10 % headroom)")


def cmd_synth(args: argparse.Namespace) -> int:
    out = Path(args.output)
    with out.open("w") as fh:
        n = synth.write(args.profile, args.requests, args.seed, fh)
    print(f"wrote {n} {args.profile} requests to {out}", file=sys.stderr)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    return _tune_adaptive(read_trace(args.trace), args.capacity, _spec(args.config))


def _tune_adaptive(trace: Trace, capacity: float, spec: KVCachePolicySpec) -> int:
    """Each candidate reuse weight held fixed, then what the self-tuner chose on the same replay."""
    print(f"{'reuse weight (fixed)':>20}{'token hit':>11}")
    rows = tune.fixed_weights(trace, capacity, spec, on_row=lambda r: print(
        f"{r.reuse:>20g}{r.token_hit_ratio:>11.4f}", flush=True))
    best = rows[0]
    report = tune.self_tuned(trace, capacity, spec)
    print(f"best fixed at capacity {capacity}: reuse={best.reuse:g} (token hit ratio {best.token_hit_ratio:.4f})")
    for part, weight in report.final.items():
        spent = ", ".join(f"{w:g}: {share:.0%}" for w, share in report.time_at.get(part, {}).items())
        print(f"self-tuning ({part}): ended on reuse={weight:g} after {report.switches[part]} switches; "
              f"weights in force by share of requests: {spent}")
    gap = report.token_hit_ratio - best.token_hit_ratio
    print(f"self-tuned token hit ratio {report.token_hit_ratio:.4f} ({gap:+.4f} against the best fixed weight, "
          "which needs the whole trace in advance)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool-sidecar", description="kvpool sidecar: the per-pod KV page pool")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_replay, _add_synth, _add_plan, _add_tune):
        add(sub)
    return parser


def _add_serve(sub: Any) -> None:
    srv = sub.add_parser("serve", help="serve the pool's HTTP API (defaults: embedded CPU pool, built-in config)")
    srv.add_argument("--config", help="sidecar config file (the policy spec as YAML); watched and hot-reloaded; "
                     "absent (its directory there): the defaults until it appears, and a file that goes "
                     "leaves the config in force")
    srv.add_argument("--host", default="127.0.0.1", help="control API address (beyond localhost needs --token-file)")
    srv.add_argument("--port", type=_port, default=8000)
    srv.add_argument("--pages", type=_positive_int, default=65_536, help="pages in the pool")
    srv.add_argument("--token-file", help="file holding the bearer token the control API requires")
    srv.add_argument("--metrics-host", help="serve /metrics on its own address (default 127.0.0.1 with --metrics-port)")
    srv.add_argument("--metrics-port", type=_port, help="serve /metrics on its own port instead of the API's")
    srv.add_argument("--kv-shape", help="allocate the KV tensors too: layers,kv_heads,head_dim[,dtype] "
                     "(shared with the engine: GET /v1/storage/handle)")
    srv.add_argument("--transfer-key-file", help="cluster keys (lines 'KEY_ID SECRET', the one this sidecar proves "
                     "first) that peers prove to each other (--peer-port, --peers need it)")
    srv.add_argument("--max-body-bytes", type=_positive_int,
                     help="largest JSON request body (default 16 MiB); larger: 413")
    srv.add_argument("--max-sequences", type=_positive_int,
                     help="live sequences at most (default 16,384); an admission past it: 429")
    srv.add_argument("--max-sequence-tokens", type=_positive_int,
                     help="tokens of one sequence, pin or lookup at most (default 1,048,576); longer: 413")
    srv.add_argument("--max-pins-per-owner", type=_positive_int,
                     help="live pin records one credential holds at most (default 4,096); past it: 429")
    srv.add_argument("--engine-socket", default="/tmp/kvpool/engine.sock",
                     help="the engine channel's Unix socket, where vLLM's KVPoolConnector connects ('none': off)")
    srv.add_argument("--engine-quarantine-seconds", type=_seconds, default=wire.QUARANTINE_SECONDS,
                     help="how long the pages of an engine session that ended stay out of circulation before they "
                     f"are released (its engine may still be copying them; default {wire.QUARANTINE_SECONDS:g})")
    srv.add_argument("--peer-port", type=_port, help="serve this pool's pages to peer sidecars on this TCP port "
                     "(NIXL reads; needs --transfer-key-file and --kv-shape; default: off)")
    srv.add_argument("--peer-host", default="0.0.0.0", help="the peer port's address (default: all)")
    srv.add_argument("--peers", metavar="HOST:PORT,...|kubernetes", help="the peer sidecars this one fetches "
                     "pages from: a static list of their --peer-port, or 'kubernetes': the Running, Ready pods of "
                     "the config's policy (source.name; labelled kvpool.dev/policy: NAME in its namespace), each "
                     "at this sidecar's --peer-port, polled every --peer-refresh-seconds (default: none)")
    srv.add_argument("--peer-namespace", help="--peers kubernetes: the pods' namespace where the config's source "
                     "names none (default: the pod's own)")
    srv.add_argument("--peer-warmup-seconds", type=_non_negative_seconds, default=30.0,
                     help="at start, fetch the policy's named prompts (pinning.prompts) from a peer that holds "
                     "them for at most this long, /readyz answering 503 meanwhile (0: no warm-up; default 30)")
    srv.add_argument("--peer-refresh-seconds", type=_seconds, default=10.0,
                     help="--peers kubernetes: seconds between two polls of the policy's pods (default 10)")
    srv.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    srv.set_defaults(func=cmd_serve)


def _add_replay(sub: Any) -> None:
    replay = sub.add_parser("replay", help="replay a trace through the real pool, per policy and capacity")
    replay.add_argument("trace", help="Mooncake or Bailian JSONL trace")
    replay.add_argument(
        "--policy", action="append", choices=[*POLICIES, *REFERENCE_POLICIES], help="repeatable; default lru"
    )
    replay.add_argument("--capacity", action="append", type=_capacity, help="<=1: fraction of distinct blocks; "
                        ">1: pages; repeatable; default 0.05")
    replay.add_argument("--format", choices=("table", "json", "csv"), default="table")
    replay.add_argument("--plot", help="write a hit-ratio-vs-capacity PNG here")
    replay.add_argument("--config", help="sidecar config / policy spec YAML for weights, windows...")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    replay.add_argument("--setup", choices=SETUPS, default="shipped",
                        help="shipped: the spec as a user gets it (to-B share, auto-pins); reference: auto-pin off "
                        "and, for a single-class trace, no to-B share (LRU then matches the reference simulator)")
    replay.add_argument("--pods", action="append", type=_positive_int,
                        help="cluster replay: this many pods (one pool each, --capacity split evenly); repeatable")
    replay.add_argument("--routing", action="append", choices=ROUTING_MODES,
                        help="cluster replay: how requests pick a pod; repeatable; default bounded-hash+replicas")
    replay.add_argument("--membership", choices=("none", "join", "leave"), default="none",
                        help="cluster replay: a pod joins (empty) or leaves (with its cache) half-way through")
    replay.set_defaults(func=cmd_replay)


def _add_synth(sub: Any) -> None:
    syn = sub.add_parser("synth", help="generate a Bailian-format trace")
    syn.add_argument("--profile", choices=synth.PROFILES, required=True)
    syn.add_argument("--requests", type=_positive_int, default=10_000)
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("-o", "--output", required=True)
    syn.set_defaults(func=cmd_synth)


def _add_plan(sub: Any) -> None:
    pln = sub.add_parser("plan", help="capacity planning: KV bytes per token, pages per GPU, page size")
    pln.add_argument("--layers", type=_positive_int, required=True)
    pln.add_argument("--kv-heads", type=_positive_int, required=True)
    pln.add_argument("--head-dim", type=_positive_int, required=True)
    pln.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float8_e4m3fn", "int8"), default="bfloat16")
    pln.add_argument("--page-size", type=_positive_int, default=16)
    pln.add_argument("--gpu-memory", required=True, help="e.g. 80GiB")
    pln.add_argument("--params", type=float, required=True, help="model parameters, e.g. 8e9")
    pln.add_argument("--max-seq-len", type=_positive_int)
    pln.add_argument("--batch", type=_positive_int)
    pln.add_argument("--d-model", type=_positive_int)
    pln.add_argument("--trace", help="recommend a page size from this trace's prompt lengths")
    pln.add_argument("--max-model-len", type=_positive_int,
                     help="size vLLM's CPU primary tier in front of kvpool (prints cpu_bytes_to_use)")
    pln.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                     help="vLLM's --max-num-batched-tokens (with --max-model-len)")
    tier = pln.add_mutually_exclusive_group()
    tier.add_argument("--tier-multiple", type=_above_zero("must be above 0"),
                      help="size the second tier as this multiple of the GPU's KV pages (prints --pages and memory)")
    tier.add_argument("--pool-pages", type=_positive_int, help="the second tier's pages (prints its memory)")
    pln.set_defaults(func=cmd_plan)


def _add_tune(sub: Any) -> None:
    tun = sub.add_parser("tune", help="offline tuning: each candidate reuse weight fixed, and self-tuning's choice")
    tun.add_argument("trace")
    tun.add_argument("--capacity", type=_capacity, default=0.05)
    tun.add_argument("--config", help="base sidecar config / policy spec YAML")
    tun.set_defaults(func=cmd_tune)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "replay":
        args.policy = args.policy or ["lru"]
        args.capacity = args.capacity or [0.05]
    try:
        return args.func(args)
    except (TraceError, ConfigError, OSError, ValueError) as exc:  # ServeError is a ValueError
        print(f"kvpool-sidecar {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
