"""Every module of hearth imports on its own, and every command of the `hearth` table resolves.

The CLI loads a command's module only when that command runs (``cli/main.py: COMMANDS``), so a
broken import there would otherwise show only when a user runs it."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from hearth.cli.main import COMMANDS, build_parser, load_command

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"engine": "hearth.engine", "serving": "hearth.serving", "cluster": "hearth.cluster", "cli": "hearth.cli",
           "proto": "hearth.proto"}


def _modules() -> list[str]:
    names = []
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue
            names.append(".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_module_imports(name: str) -> None:
    importlib.import_module(name)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_resolves(command: str) -> None:
    assert callable(load_command(command))


def test_every_parsed_command_is_in_the_table() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
