"""Small modules with one job: no source module over 500 lines, no class over 400, no function over
60. A hot loop may run longer when the line above its ``def`` says why in a ``# hot loop:`` comment
(splitting it would cost a call per page)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sidecar/kvpool_sidecar", "operator/kvpool_operator")
SOURCES = sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py"))
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 400, 60


def oversized(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    found = []
    if len(lines) > MAX_MODULE:
        found.append(f"{len(lines)} lines (module limit {MAX_MODULE})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            size = node.end_lineno - node.lineno + 1
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            excused = "# hot loop:" in lines[node.lineno - 2]  # the line above the def says why
            if size > limit and not (excused and not isinstance(node, ast.ClassDef)):
                found.append(f"{node.name}: {size} lines (limit {limit})")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_classes_and_functions_stay_small(path: Path) -> None:
    assert oversized(path) == []


def test_no_policy_is_probed_for_what_it_has() -> None:
    """The policy protocol is complete (``policies/base.py``): the pool never asks with getattr."""
    for path in (ROOT / "sidecar/kvpool_sidecar/pool").glob("*.py"):
        assert "getattr(" not in path.read_text(), path


def foreign_private_reads(path: Path) -> list[str]:
    """Private names a module reads that it does not define: ``other._x``, or ``self._x`` set elsewhere."""
    tree = ast.parse(path.read_text())
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    own |= {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)}
    return sorted(
        f"{path.name}:{node.lineno} {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in own)
    )


@pytest.mark.parametrize("path", sorted((ROOT / "sidecar/kvpool_sidecar/pool").glob("*.py")), ids=lambda p: p.name)
def test_no_part_of_the_pool_reads_another_parts_private_state(path: Path) -> None:
    """The pool is composed (a page table, eviction, pins, sequences, frequencies): each part reaches the
    others through their public fields and methods, never their private ones."""
    assert foreign_private_reads(path) == []
