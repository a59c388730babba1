"""Docs say only what the code does: every file a doc, docstring or comment names exists.

A path is resolved from the repository, the package roots, the folder of the file that names it, and
the shared folder beside the checkout (traces, notes), and the installed packages a text cites by their
source (kopf's, as ``_cogs/clients/events.py`` or ``kopf/_cogs/...``). ``COMMIT:path`` (a file in git history, as
``git show`` takes it) is not a file of the checkout and is not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import kopf
import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"(?<![\w/.:\-])((?:[\w\-]+/)*[\w\-]+\.(?:py|pyi|c|md|yaml|yml|toml))(?![\w/])")
TEXTS = sorted({
    *ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("scripts/*.py"),
    *(ROOT / "sidecar" / "kvpool_sidecar").rglob("*.py"), *(ROOT / "sidecar" / "kvpool_sidecar").rglob("*.c"),
    *(ROOT / "operator" / "kvpool_operator").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
})
KOPF = Path(kopf.__file__).parent
BASES = (ROOT, ROOT / "sidecar", ROOT / "sidecar" / "kvpool_sidecar", ROOT / "operator",
         ROOT / "operator" / "kvpool_operator", ROOT / "tests", ROOT / "bench", ROOT / "docs", ROOT.parent,
         KOPF, KOPF.parent)


def missing(path: Path) -> list[str]:
    """The files ``path`` names (with a folder, or a test module by name) that exist nowhere."""
    out = []
    for match in NAMED.finditer(path.read_text()):
        named = match.group(1)
        if "/" not in named and not named.startswith("test_"):
            continue  # a bare module name ("state.py") names a module of its own package, in prose
        if not any((base / named).exists() for base in (*BASES, path.parent)):
            out.append(named)
    return sorted(set(out))


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_text_names_exists(path: Path) -> None:
    assert missing(path) == []


def test_the_check_finds_a_file_that_does_not_exist(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    absent = "tests/sidecar/test_" + "nothing_here.py"  # spelled in two parts: this file is checked too
    doc.write_text(f"See `{absent}` and sidecar/kvpool_sidecar/pool/pool.py; "
                   "old figures: `git show abc1234:docs/benchmarks-history.md`.")
    assert missing(doc) == [absent]


def unlisted_benchmarks(root: Path) -> list[str]:
    """bench/'s runnable scripts that neither ``make bench-report`` (bench/report.py) runs nor README names:
    a user could not tell them from a one-off measurement (those live in bench/measurements/)."""
    listed = (root / "bench" / "report.py").read_text() + (root / "README.md").read_text()
    return sorted(f"bench/{p.name}" for p in (root / "bench").glob("*.py")
                  if "__main__" in p.read_text() and f"bench/{p.name}" not in listed)


def test_every_benchmark_is_in_the_report_or_the_readme(tmp_path: Path) -> None:
    assert unlisted_benchmarks(ROOT) == []
    (tmp_path / "bench").mkdir()
    script = "bench/{}" + ".py"  # spelled in two parts: this file is checked too
    (tmp_path / "bench" / "report.py").write_text(f'SECTIONS = ["{script.format("listed")}"]\n'
                                                  'if __name__ == "__main__": ...\n')
    (tmp_path / "README.md").write_text(f"Run `{script.format('named')}`.\n")
    for name in ("listed", "named", "stray"):
        (tmp_path / "bench" / f"{name}.py").write_text('if __name__ == "__main__": ...\n')
    (tmp_path / "bench" / "helper.py").write_text("def helper() -> None: ...\n")  # imported, not run
    assert unlisted_benchmarks(tmp_path) == [script.format("report"), script.format("stray")]
