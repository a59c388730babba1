"""Regenerate docs/benchmarks.md: every current figure, each under the command that printed it.

    .venv/bin/python bench/report.py          # the quick set (about 35 minutes on 2 cores)
    .venv/bin/python bench/report.py --all    # also the real engine and authentication's cost (+15 min)
    make bench-report

The file is written whole from what the commands print in this run, so a figure that is no longer
measured cannot survive in it; a section not run says so. ``--only WORD`` re-runs the sections
whose title has WORD and splices them into the file in place, each marked with its own commit.
What earlier changes did, adopted or rejected, is one row each in ``docs/decisions.md``, never mixed in.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
OUT = ROOT / "docs" / "benchmarks.md"
POLICIES = ("lru", "fifo", "s3fifo", "lfu", "workload_adaptive", "belady")
CAPACITIES = ("0.01", "0.02", "0.05", "0.1", "0.2")


@dataclass(frozen=True)
class Section:
    title: str
    what: str  # how to read the figures
    command: list[str]
    slow: bool = False


def replay(trace: str, policies: tuple[str, ...] = POLICIES) -> list[str]:
    args = ["kvpool-sidecar", "replay", trace, "--no-progress"]
    for policy in policies:
        args += ["--policy", policy]
    for capacity in CAPACITIES:
        args += ["--capacity", capacity]
    return args


def sections(synth_dir: str) -> list[Section]:
    conversation = "traces/mooncake_conversation.jsonl.gz"
    synthetic = "traces/mooncake_synthetic.jsonl.gz"
    out = [
        Section("Replay: Mooncake conversation trace (12,031 requests, 512-token pages)",
                "Token and block hit ratio by policy and capacity (a fraction of the trace's distinct blocks); "
                "belady is the offline optimum. The reference table is in `traces/README.md`.",
                replay(conversation)),
        Section("Replay: Mooncake synthetic trace", "As above, on the second shipped trace.", replay(synthetic)),
    ]
    for profile in ("to-b", "to-c", "mixed"):
        out.append(Section(
            f"Replay: synth profile {profile} (seed 1, 10,000 requests, 16-token pages)",
            f"`kvpool-sidecar synth --profile {profile} --seed 1 --requests 10000` first; then the replay.",
            replay(f"{synth_dir}/{profile}.jsonl", POLICIES[:-1])))
    out += [
        Section("Never below LRU: the default policy on every trace and synth profile",
                "Token hit ratio of the self-tuned policy minus LRU's, per trace and capacity (LRU's own in "
                "brackets), the shipped traces and 4,000-request synth traces of each profile, seeds 1-4; "
                "the rule (issue 19) is never more than 0.002 below.",
                ["python", "bench/policy_matrix.py", "--requests", "4000"]),
        Section("Never below LRU on unseen seeds: synth seeds 5-8",
                "The same matrix on synth traces of seeds 5-8, which no recorded measurement used before "
                "session 17: how the rule holds on workloads the policy was not tuned to.",
                ["python", "bench/policy_matrix.py", "--requests", "4000", "--seeds", "5,6,7,8", "--no-shipped"]),
        Section("Replay time, default policy against LRU", "The conversation trace replayed by each, in "
                "alternation; medians and their ratio.", ["python", "bench/replay_time.py"]),
        Section("Replay time in instructions (cachegrind), default policy against LRU",
                "The conversation trace replayed once by each under cachegrind, less a run that only loads "
                "it: the ratio of the issue-19 bound (at most 3x), in a measure that does not swing.",
                ["python", "bench/replay_time.py", "--instructions",
                 *(arg for capacity in CAPACITIES for arg in ("--capacity", capacity))]),
        Section("Self-tuner by trace segment, conversation trace at 5 %",
                "Token hit ratio of LRU, the self-tuned default and each candidate weight held fixed, over "
                "eighths of the requests, and the tuner's switches: where its gap to the best fixed weight lies.",
                ["python", "bench/tuner_phases.py", "--capacity", "0.05"]),
        Section("Issue 19's recipe, measured",
                "The recipe the issue gives as a floor (t_last + S * min(log2 count, 3), counts kept by an exact "
                "ghost of 4x the capacity, S chosen online by unsampled shadows), replayed standalone on the "
                "conversation trace beside the pool's LRU and default policy.",
                ["python", "bench/recipe_floor.py"]),
        Section("Pool operations", "Page ops per second of the LRU pool replaying the conversation trace, and "
                "Python memory per cached page of a 1,000,000-page pool.", ["python", "bench/pool_ops.py"]),
        Section("Eviction cost", "Per evicted page, each policy, a full pool of 1,000,000 pages; memory per cached "
                "page with each policy.", ["python", "bench/eviction.py"]),
        Section("Drift detection", "How fast the reuse model sees a class's reuse rate change.",
                ["python", "bench/drift.py"]),
        Section("Cluster routing", "Hit ratio and load imbalance of the routing modes over 4 pods.",
                ["python", "bench/routing.py"]),
        Section("Sidecar under load, authentication off and on", "Concurrent HTTP clients against a live "
                "`kvpool-sidecar serve`; the ratios compare the two runs of one invocation.",
                ["python", "bench/sidecar_load.py", "--seconds", "10", "--compare-auth"]),
        Section("Kernels", "Page copies: the torch path on this CPU (Triton is checked bit for bit in the "
                "tests, under the interpreter).", ["python", "bench/kernels.py"]),
        Section("Peer fetch throughput (NIXL) beside a plain copy",
                "Two sidecars on this machine: a real `serve --peer-port` holding 64 MiB of its pool's own pages "
                "(Qwen2.5-7B-shaped, 16-token pages) per round and a reader fetching them over NIXL (UCX, one "
                "kernel copy), the whole fetch path timed, bytes checked; beside each fetch, plain copies of "
                "the same bytes (one core's memcpy, as a NIXL read is one kernel copy on one core; torch's copy_ "
                "on every core). Issue 66's target: at least 0.7x a plain copy.",
                ["python", "bench/replicas.py", "--rounds", "20"]),
        Section("Peer fetch throughput (NIXL), /dev/shm in huge pages",
                "The same with both pools on a tmpfs mounted `huge=always` (a mount namespace of the benchmark's "
                "own): what the kernel's single copy does without pinning 4 KiB pages one by one.",
                ["python", "bench/replicas.py", "--rounds", "20", "--huge-shm"]),
        Section("Two replicas sharing one cache: the router's hint through vLLM",
                "Two vLLM OpenAI servers on this machine, one core each, each with its own sidecar, peers of each "
                "other (issue 66): prompts A computed, then sent to B one at a time, with and without the hint "
                "naming A's sidecar (kv_transfer_params.remote_kv_source); the mid-size model, whose prefill "
                "costs about what a real one's does on this machine; B's answers checked against A's.",
                ["python", "bench/replicas.py", "--engines", "--model", "mid", "--prompts", "8"], slow=True),
        Section("Operator reconcile latency", "From a policy update to its ConfigMap, against KMock's emulator.",
                ["python", "bench/reconcile_latency.py"]),
        Section("A real engine: vLLM serving from kvpool", "800 requests of the conversation trace through real "
                "vLLM (a tiny random model on the CPU): tokens served from the second tier, cost per request, "
                "TTFT, and greedy tokens against vLLM alone.", ["python", "bench/engine.py"], slow=True),
        Section("Authentication's cost in instructions", "cachegrind counts per admit + release pair, "
                "credentials off and on.", ["python", "bench/auth_cost.py", "--requests", "3000"], slow=True),
    ]
    return out


def splice(report: str, fresh: dict[str, str]) -> str:
    """``report`` with the sections titled as in ``fresh`` replaced by them (the others as they
    were; a fresh section the report lacks is appended)."""
    head, *parts = report.split("\n## ")
    kept = {part.split("\n", 1)[0]: "## " + part for part in parts}
    for title, text in fresh.items():
        kept[title] = text
    return "\n".join([head.rstrip("\n") + "\n", *(text.rstrip("\n") + "\n" for text in kept.values())])


def run(section: Section) -> tuple[str, float, int]:
    argv = list(section.command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "kvpool-sidecar":
        argv = [sys.executable, "-m", "kvpool_sidecar.cli", *argv[1:]]
    start = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    text = done.stdout.rstrip() or done.stderr[-3000:].rstrip()
    return text, time.monotonic() - start, done.returncode


def commit() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + (" with uncommitted changes" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="also the slow sections (engine, cachegrind)")
    parser.add_argument("--only", action="append", help="run only the sections whose title has this word")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as synth_dir:
        for profile in ("to-b", "to-c", "mixed"):
            subprocess.run([sys.executable, "-m", "kvpool_sidecar.cli", "synth", "--profile", profile, "--seed", "1",
                            "--requests", "10000", "-o", f"{synth_dir}/{profile}.jsonl"], check=True, cwd=ROOT)
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        parts = [
            "# Measured figures\n",
            f"Generated by `make bench-report` (`bench/report.py`) on {when}, commit {commit()}, on the "
            "development machine (2 cores, no GPU, a shared VM whose wall times move by 20-30 %: compare rows of "
            "one run, or instruction counts from `bench/instructions.py`). Every figure is what the command above "
            "it printed in that run; do not edit by hand. What each adopted or rejected change did: "
            "[decisions.md](decisions.md).\n",
        ]
        fresh: dict[str, str] = {}  # title -> its part of the file, as run now
        for section in sections(synth_dir):
            if args.only and not any(word.lower() in section.title.lower() for word in args.only):
                continue
            part = f"## {section.title}\n\n{section.what}\n\n"
            shown = " ".join(section.command).replace(synth_dir, "<synth>").replace("python ", ".venv/bin/python ", 1)
            if section.slow and not args.all:
                skipped = "Not run in this report (slow: `bench/report.py --all`)."
                fresh[section.title] = part + f"```\n{shown}\n```\n\n{skipped}\n"
                continue
            print(f"running: {shown}", file=sys.stderr, flush=True)
            text, seconds, code = run(section)
            status = "" if code == 0 else f" **(exit status {code})**"
            again = f" (re-run alone by `bench/report.py --only`, {when}, commit {commit()})" if args.only else ""
            fresh[section.title] = part + f"```\n{shown}\n```\n\n{seconds:.0f} s{status}{again}:\n\n```\n{text}\n```\n"
    if args.only and OUT.exists():
        OUT.write_text(splice(OUT.read_text(), fresh))
    else:
        OUT.write_text("\n".join(parts + list(fresh.values())))
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
