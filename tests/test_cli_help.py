"""Every command is installed and its --help shows real examples; `ingero` alone lists them all."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from ingero.cli.main import COMMAND_MODULES, build_parser, main
from ingero.cli.main import COMMANDS as COMMAND_TABLE

COMMANDS = list(COMMAND_TABLE)  # command names (a module may register a command named otherwise: clickhouse-schema)


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_every_command_module_is_present(module: str) -> None:
    assert hasattr(importlib.import_module(module), "register")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    assert f"ingero {command}" in out.split("examples:", 1)[1]


def test_top_level_help_lists_every_command() -> None:
    text = build_parser().format_help()
    for command in COMMANDS:
        assert command in text


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_top_level_summaries_are_what_each_command_registers() -> None:
    """`ingero --help` lists the commands without importing them: its one-liners must be theirs."""
    import argparse

    full = build_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    registered = {a.dest: a.help for a in sub._choices_actions}
    assert registered == {name: summary for name, (_, summary) in COMMAND_TABLE.items()}
    lazy = build_parser(None, lazy=True).format_help()
    for summary in registered.values():
        assert str(summary)[:40] in lazy


def test_unknown_command_suggests_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["qurey", "SELECT 1"]) == 2
    assert capsys.readouterr().err.strip() == "ingero: error: unknown command 'qurey' (did you mean 'query'?)"


def test_help_is_fast_to_import() -> None:
    """--help and a fleet query's set-up must not import the heavy machinery (bcc, hypercorn, numpy,
    trio, httpx, mcp): the top-level help lists commands without importing them."""
    code = (
        "import sys; from ingero.cli.main import build_parser; build_parser(None, lazy=True).format_help(); "
        "build_parser('query', lazy=True); "
        "heavy = [m for m in ('bcc', 'hypercorn', 'httpx', 'trio', 'numpy', 'mcp', 'perfetto') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout.strip()
    assert out == ""
