"""Every command is installed and its --help shows real examples; `ingero` alone lists them all."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from ingero.cli.main import COMMAND_MODULES, build_parser, main

COMMANDS = [m.rsplit(".", 1)[1] for m in COMMAND_MODULES]


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


def test_help_is_fast_to_import() -> None:
    """--help must not import the heavy machinery (bcc, hypercorn, httpx, mcp)."""
    code = (
        "import sys; from ingero.cli.main import build_parser; build_parser(); "
        "heavy = [m for m in ('bcc', 'hypercorn', 'httpx', 'mcp', 'perfetto') if m in sys.modules]; "
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
