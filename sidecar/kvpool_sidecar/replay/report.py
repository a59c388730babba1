"""Replay results as a table, CSV, JSON Lines or a plot; a progress bar for long runs."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvpool_sidecar.replay.run import REFERENCE_POLICIES, ReplayResult

COLUMNS = ("policy", "capacity_fraction", "capacity_pages", "token_hit_ratio", "block_hit_ratio", "evictions",
           "seconds", "setup")
SETUP_NOTE = "shipped: the spec as a user gets it, to-B share and auto-pins on; reference: both off for one class"
CLUSTER_COLUMNS = ("pods", "routing", "load_imbalance", "token_imbalance", "keys_moved")


def format_table(results: list[ReplayResult]) -> str:
    cluster = any(r.routing for r in results)
    header = f"{'policy':<22}{'capacity':>9}{'pages':>9}"
    if cluster:
        header += f"{'pods':>5}  {'routing':<22}"
    header += f"{'token hit':>11}{'block hit':>11}{'evictions':>11}"
    if cluster:
        header += f"{'req max/mean':>13}{'tok max/mean':>13}{'keys moved':>11}"
    header += f"{'s':>8}"
    lines = [header, "-" * len(header)]
    for r in results:
        label = r.policy + (" (oracle)" if r.policy == "belady" else "")
        line = f"{label:<22}{r.capacity_fraction:>9.2%}{r.capacity_pages:>9}"
        if cluster:
            line += f"{r.pods:>5}  {r.routing or '-':<22}"
        line += f"{r.token_hit_ratio:>11.4f}{r.block_hit_ratio:>11.4f}{r.evictions:>11}"
        if cluster:
            moved = "-" if r.keys_moved is None else f"{r.keys_moved:.2%}"
            line += f"{r.load_imbalance:>13.3f}{r.token_imbalance:>13.3f}{moved:>11}"
        lines.append(line + f"{r.seconds:>8.2f}")
    setups = sorted({r.setup for r in results if r.policy not in REFERENCE_POLICIES})
    if setups:
        lines.append(f"setup: {', '.join(setups)} ({SETUP_NOTE})")
    return "\n".join(lines)


def format_csv(results: list[ReplayResult]) -> str:
    columns = COLUMNS + (CLUSTER_COLUMNS if any(r.routing for r in results) else ())
    lines = [",".join(columns)]
    for r in results:
        row = r.row()
        lines.append(",".join("" if row[c] is None else str(row[c]) for c in columns))
    return "\n".join(lines)


def format_json(results: list[ReplayResult]) -> str:
    return "\n".join(json.dumps(r.row()) for r in results)


def plot(results: list[ReplayResult], path: str | Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvpool[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_policy: dict[str, list[ReplayResult]] = {}
    for r in results:
        if r.policy != "infinite":
            label = f"{r.policy}, {r.pods} pods, {r.routing}" if r.routing else r.policy
            by_policy.setdefault(label, []).append(r)
    for policy, rows in by_policy.items():
        rows.sort(key=lambda r: r.capacity_fraction)
        style = "--" if policy == "belady" else "-"
        label = f"{policy} (offline oracle)" if policy == "belady" else policy
        ax.plot([r.capacity_fraction * 100 for r in rows], [r.token_hit_ratio for r in rows], style,
                marker="o", label=label)
    for r in results:
        if r.policy == "infinite":
            ax.axhline(r.token_hit_ratio, color="grey", linestyle=":", label="infinite cache")
            break
    ax.set_xlabel("capacity (% of distinct blocks)")
    ax.set_ylabel("token hit ratio")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def progress_bar(total: int, enabled: bool) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr, shown only for runs long enough to need one."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="req", file=sys.stderr, mininterval=0.5, delay=2.0, leave=False, disable=None)
    return bar.update, bar.close
