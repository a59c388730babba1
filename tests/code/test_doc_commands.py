"""Docs name only what exists: every command in README and docs/ parses, every metric and setting is real.

* Commands: each line of a code block, and each inline code span, that runs ``kvpool-sidecar``,
  ``kvpool-operator``, a ``bench/`` or ``scripts/`` script, or ``make``, is parsed by that program's own
  argument parser (stopped right after parsing: nothing runs), or checked against the Makefile's targets
  (an inline span only when it carries an option: prose names subcommands alone).
* Metrics: every ``kvpool_...`` name is one the code defines (a counter's ``_total``, a histogram's
  ``_bucket``/``_sum``/``_count`` included).
* Settings: every dotted policy setting (``pinning.autoPin.minPromptTokens``) is a field of the spec.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvpool_sidecar.config import KVCachePolicySpec
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md")])
BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.S)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
PROGRAM = re.compile(r"^(?:\$ )?(?:\.venv/bin/)?(kvpool-sidecar|kvpool-operator|python3?|make)(?=\s|$)")
METRIC = re.compile(r"\bkvpool_[a-z0-9_]+\b")
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")
NOT_METRICS = {"kvpool_sidecar", "kvpool_operator"}  # the packages


class Captured(Exception):
    """Raised where a program would parse its arguments, carrying its parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def commands(text: str) -> Iterator[tuple[str, bool]]:
    """(command, whole) for a doc: code block lines (continuations joined), whole; inline code spans
    that start with a program and carry an option (prose names subcommands alone), a usage synopsis
    with placeholders (``TRACE --pods N``), so only their options are checked."""
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if PROGRAM.match(line.strip()):
                yield line.strip(), True
    for span in SPAN.findall(BLOCK.sub("", text)):
        if PROGRAM.match(span.strip()) and " -" in span:
            yield span.strip(), False


def words(command: str) -> list[str]:
    try:
        argv = shlex.split(command, comments=True)
    except ValueError:
        argv = command.split()
    for stop in (">", "|", "&&", ";", "2>&1"):
        if stop in argv:
            argv = argv[: argv.index(stop)]
    return [a.removeprefix("$") for a in argv if a != "$"]


def _main_of(script: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_doc_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(script.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(script.parent))
    return module.main


def parser_of(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser | str:
    """The parser the program builds (caught where it would parse: nothing runs), or what is wrong."""
    program = Path(argv[0]).name
    if program.startswith("python"):
        script = ROOT / argv[1]
        if not script.exists():
            return f"no script {argv[1]}"
        main: Any = _main_of(script)
    elif program == "kvpool-sidecar":
        from kvpool_sidecar.cli import main
    else:
        from kvpool_operator.cli import main

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(sys, "argv", argv[1:] if program.startswith("python") else argv)
    try:
        main([]) if program.startswith("kvpool") else main()
    except Captured as caught:
        return caught.parser
    finally:
        monkeypatch.undo()
    return "it ran without parsing arguments"


def _options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The option strings of ``parser``, or of its subcommand named in ``argv``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = next((a for a in argv if a in action.choices), None)
            if sub is not None:
                return _options(action.choices[sub], argv[argv.index(sub) + 1:])
    return {s for action in parser._actions for s in action.option_strings}


def check(command: str, whole: bool, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None when the command is right; else what is wrong."""
    argv = words(command)
    program = Path(argv[0]).name
    if program == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        unknown = [t for t in argv[1:] if "=" not in t and t not in targets]
        return f"no make target {unknown}" if unknown else None
    if program.startswith("python") and (len(argv) < 2 or argv[1] in ("-m", "-c")):
        return None  # a module or a snippet: not one of ours
    parser = parser_of(argv, monkeypatch)
    if isinstance(parser, str):
        return parser
    args = argv[2:] if program.startswith("python") else argv[1:]
    if not whole:
        known = _options(parser, args)
        unknown = [a.split("=")[0] for a in re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", command)
                   if a.split("=")[0] not in known]
        return f"no option {unknown}" if unknown else None
    try:
        parser.parse_args(args)
    except SystemExit as exc:
        return f"its parser refused it (exit {exc.code})"
    return None


def defined_metrics() -> set[str]:
    names = set()
    packages = (ROOT / "sidecar" / "kvpool_sidecar", ROOT / "operator" / "kvpool_operator")
    for path in (path for package in packages for path in package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and METRIC.fullmatch(node.value):
                names.add(node.value)
    return names


def unknown_metrics(text: str, defined: set[str]) -> list[str]:
    out = set()
    for name in METRIC.findall(text):
        if name in NOT_METRICS or name in defined:
            continue
        if not any(name.endswith(s) and name.removesuffix(s) in defined for s in SUFFIXES):
            out.add(name)
    return sorted(out)


def spec_paths(model: type[BaseModel] = KVCachePolicySpec, prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        out.add(prefix + name)
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out |= spec_paths(kind, f"{prefix}{name}.")
    return out


def unknown_settings(text: str) -> list[str]:
    paths = spec_paths()
    tops = {p for p in paths if "." not in p}
    setting = re.compile(rf"`((?:{'|'.join(sorted(tops))})(?:\.[a-z][A-Za-z]*)+)`")
    return sorted({m for m in setting.findall(text) if m not in paths})


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_a_doc_shows_parses(doc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = {cmd: problem for cmd, whole in commands(doc.read_text())
             if (problem := check(cmd, whole, monkeypatch)) is not None}
    assert wrong == {}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_and_setting_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text()
    assert unknown_metrics(text, defined_metrics()) == []
    assert unknown_settings(text) == []


def test_a_made_up_flag_metric_or_setting_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (ROOT / "README.md").read_text()
    made_up = readme + ("\n```\n.venv/bin/kvpool-sidecar serve --pages 64 --turbo-mode\nmake deploy\n```\n"
                        "Run `kvpool-sidecar tune TRACE --capacity C --fast`, watch `kvpool_magic_hits_total`, "
                        "set `pinning.autoPin.maxMagic`.\n")
    bad = [cmd for cmd, whole in commands(made_up) if check(cmd, whole, monkeypatch) is not None]
    assert bad == [".venv/bin/kvpool-sidecar serve --pages 64 --turbo-mode", "make deploy",
                   "kvpool-sidecar tune TRACE --capacity C --fast"]
    assert unknown_metrics(made_up, defined_metrics()) == ["kvpool_magic_hits_total"]
    assert unknown_settings(made_up) == ["pinning.autoPin.maxMagic"]
