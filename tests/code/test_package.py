"""The shipped packages hold only what a user runs: every module is reached from an entry point.

Entry points: the two console scripts, the connector module vLLM loads by path, and the client library
tools import. Code that only tests, benchmarks or the demo use lives in ``dev/`` (not shipped).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvpool_sidecar": ROOT / "sidecar" / "kvpool_sidecar",
            "kvpool_operator": ROOT / "operator" / "kvpool_operator"}
ENTRY_POINTS = ("kvpool_sidecar.cli", "kvpool_operator.cli", "kvpool_sidecar.engines.vllm",
                "kvpool_sidecar.engines.tier", "kvpool_sidecar.client")


def modules() -> dict[str, Path]:
    out = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (``from a import b`` counts ``a.b`` when that is a module),
    with the packages above each (importing a module runs its packages' ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    out = set()
    for mod in found:
        parts = mod.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known)
    return out


def unreached() -> list[str]:
    known = modules()
    seen: set[str] = set()
    todo = [m for m in ENTRY_POINTS if m in known]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        todo.extend(imports(mod, known[mod], known) - seen)
    return sorted(set(known) - seen)


def test_every_shipped_module_is_reached_from_an_entry_point() -> None:
    assert unreached() == []


def test_a_module_only_tests_use_is_found(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "kvpool_sidecar"
    (package / "replay").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("from kvpool_sidecar.replay import run\n")
    (package / "client.py").write_text("")
    (package / "replay" / "__init__.py").write_text("")
    (package / "replay" / "run.py").write_text("from . import trace\n")
    (package / "replay" / "trace.py").write_text("")
    (package / "replay" / "demo.py").write_text("from kvpool_sidecar.replay.run import x\n")
    monkeypatch.setitem(PACKAGES, "kvpool_sidecar", package)
    monkeypatch.delitem(PACKAGES, "kvpool_operator")
    assert unreached() == ["kvpool_sidecar.replay.demo"]
