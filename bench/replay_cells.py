"""Every replay cell of two commits, side by side: a refactor must leave each one identical.

    .venv/bin/python bench/replay_cells.py BEFORE AFTER      # commits (AFTER may be "worktree")
    .venv/bin/python bench/replay_cells.py --out cells.json  # this checkout's cells only
    .venv/bin/python bench/replay_cells.py --against cells.json  # this checkout against saved cells

A cell is (trace, policy, capacity): token and block hit ratio and evictions, from
`kvpool-sidecar replay`, the CLI being the interface both commits share. The traces are every shipped
trace and every `synth` profile (seed 1); the policies every pool policy; capacities 1 / 2 / 5 / 20 %.
Replays run the reference setup (``--setup``: auto-pins off, one partition for one class), the one
every commit shares. Each commit is checked out into a temporary git worktree and run with its own package first on the
path. Prints the cells that differ and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from worktrees import checked_out

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
POLICIES = ("lru", "fifo", "lfu", "s3fifo", "workload_adaptive")
CAPACITIES = ("0.01", "0.02", "0.05", "0.2")
PROFILES = ("to-c", "to-b", "mixed")
FIELDS = ("token_hit_ratio", "block_hit_ratio", "evictions", "per_class")


def traces(workdir: Path, source: Path) -> list[Path]:
    """The shipped traces and one synthesized trace per profile (made by ``source``'s code)."""
    out = sorted(TRACES.glob("*.jsonl.gz"))
    for profile in PROFILES:
        path = workdir / f"synth-{profile}.jsonl"
        if not path.exists():
            cli(source, ["synth", "--profile", profile, "--requests", "3000", "--seed", "1", "-o", str(path)])
        out.append(path)
    return out


def cli(source: Path, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(source / "sidecar"), "PYTHONHASHSEED": "0"}
    done = subprocess.run([sys.executable, "-m", "kvpool_sidecar.cli", *args], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{source}: kvpool-sidecar {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def cells(source: Path, workdir: Path, setup: str = "reference") -> dict[str, dict[str, float]]:
    """``setup`` goes to commits whose replay has ``--setup`` (older ones always ran the reference one)."""
    has_setup = "--setup" in cli(source, ["replay", "--help"])

    def one(trace: Path) -> list[dict]:
        args = ["replay", str(trace), "--format", "json", "--no-progress"]
        if has_setup:
            args += ["--setup", setup]
        for policy in POLICIES:
            args += ["--policy", policy]
        for capacity in CAPACITIES:
            args += ["--capacity", capacity]
        text = cli(source, args).strip()
        return json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()]

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        rows = [row for chunk in pool.map(one, traces(workdir, ROOT)) for row in chunk]
    return {f"{Path(r['trace']).name} {r['policy']} {r['capacity_fraction']:g}": {k: r[k] for k in FIELDS}
            for r in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commits", nargs="*", help="BEFORE AFTER (commits; 'worktree' for this checkout)")
    parser.add_argument("--out", help="write this checkout's cells as JSON here")
    parser.add_argument("--against", help="compare this checkout's cells with ones saved by --out")
    parser.add_argument("--setup", choices=("reference", "shipped"), default="reference",
                        help="replay setup of commits that have one (older commits ran the reference one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.out:
            Path(args.out).write_text(json.dumps(cells(ROOT, workdir, args.setup), indent=1, sort_keys=True))
            return 0
        if args.against:
            args.commits = [args.against, "worktree"]
            results = [json.loads(Path(args.against).read_text()), cells(ROOT, workdir, args.setup)]
        elif len(args.commits) != 2:
            parser.error("give two commits, --out or --against")
        else:
            results = []
        for commit in args.commits if not args.against else []:
            with checked_out(commit) as source:
                results.append(cells(source, workdir, args.setup))
    before, after = results
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for key in differ:
        print(f"DIFFERS {key}: {before.get(key)} -> {after.get(key)}")
    print(f"{len(before)} cells before, {len(after)} after; {len(differ)} differ "
          f"({' -> '.join(args.commits)})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
