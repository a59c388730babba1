"""A commit checked out beside this one, for benchmarks that compare two commits side by side."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def checked_out(commit: str) -> Iterator[Path]:
    """The tree of ``commit`` in a temporary git worktree (removed afterwards); "worktree": this checkout."""
    if commit == "worktree":
        yield ROOT
        return
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
        try:
            _build_extensions(tree)
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)


def _build_extensions(tree: Path) -> None:
    """Compile a checked-out commit's C extensions in place (from 5d79724 on it has some), so that it
    is measured as an install would run it and not on its Python fallbacks."""
    if not (tree / "setup.py").exists():
        return
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                           capture_output=True, text=True, check=False)
    if built.returncode:
        raise SystemExit(f"{tree}: its C extensions did not build:\n{built.stderr[-2000:]}")
