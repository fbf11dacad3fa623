"""Behaviour users expect of every command (issue 13): a busy port in one line that touches no
certificate, a bare ``--listen PORT``, no prefix abbreviations, ``ingero version``, one default
database rule, Ctrl-C → one line and exit 130, bash completion from the parser, --timeout with units."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ingero
from ingero.cli import common
from ingero.cli.main import build_parser, main
from ingero.cli.serve import parse_listen
from ingero.store.schema import SCHEMA_VERSION
from ingero.tls.context import AUTO_CERT, AUTO_KEY
from tests.conftest import ROOT, SAMPLES

SAMPLE = SAMPLES / "sample-gpu-node-01.db"
GARBAGE = b"-----BEGIN CERTIFICATE-----\nnot a certificate: a start that fails must leave me alone\n"


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME and the working directory in tmp_path; no config, database or token from the environment."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for var in ("INGERO_CONFIG", "INGERO_DB", "INGERO_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port that another socket is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _unusable_cert(tls_dir: Path) -> None:
    """A certificate the auto-cert logic would replace (it cannot be loaded) if it ran."""
    tls_dir.mkdir(parents=True)
    (tls_dir / AUTO_CERT).write_bytes(GARBAGE)
    (tls_dir / AUTO_KEY).write_bytes(GARBAGE)


# --- 1. a busy port ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--db", str(SAMPLE), "--listen", "127.0.0.1:{port}"],
        ["serve", "--db", str(SAMPLE), "--listen", "{port}"],
        ["dashboard", "--db", str(SAMPLE), "--listen", "{port}"],
        ["mcp", "--db", str(SAMPLE), "--http", "127.0.0.1:{port}"],
    ],
    ids=["serve", "serve-bare-port", "dashboard-bare-port", "mcp-http"],
)
def test_a_busy_port_is_one_line_and_no_certificate_is_rewritten(
    argv: list[str], isolated: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    tls_dir = isolated / "tls"
    _unusable_cert(tls_dir)
    code = main([a.format(port=busy_port) for a in argv] + ["--tls-dir", str(tls_dir)])
    err = capsys.readouterr().err
    assert code != 0
    assert err.splitlines() == [
        f"ingero: error: port {busy_port} is in use (pick another --listen port or stop what holds it)"
    ]
    assert (tls_dir / AUTO_CERT).read_bytes() == GARBAGE and (tls_dir / AUTO_KEY).read_bytes() == GARBAGE


def test_a_busy_port_makes_no_certificate(isolated: Path, busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    tls_dir = isolated / "fresh-tls"
    assert main(["serve", "--db", str(SAMPLE), "--listen", str(busy_port), "--tls-dir", str(tls_dir)]) == 1
    assert f"port {busy_port} is in use" in capsys.readouterr().err
    assert not (tls_dir / AUTO_CERT).exists()


@pytest.mark.bpf
def test_trace_listen_on_a_busy_port_fails_before_attaching(
    isolated: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    db = isolated / "trace.db"
    assert main(["trace", "--db", str(db), "--listen", str(busy_port), "--duration", "1s"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"ingero: error: port {busy_port} is in use (pick another --listen port or stop what holds it)"
    ]
    assert not db.exists()  # nothing recorded, nothing attached


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8470", ("127.0.0.1", 8470)), ("0", ("127.0.0.1", 0)), ("0.0.0.0:8443", ("0.0.0.0", 8443))],
)
def test_listen_accepts_a_bare_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


# --- 2. no prefix abbreviations ----------------------------------------------------------------------


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _all_parsers(child)


def test_no_parser_allows_abbreviations() -> None:
    parsers = list(_all_parsers(build_parser()))
    assert len(parsers) > 20  # every command and sub-command was walked
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.parametrize(
    "argv",
    [["trace", "--dur", "5s"], ["query", "--js", "SELECT 1"], ["explain", "--sinc", "5m"], ["--vers"]],
)
def test_an_abbreviated_option_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


# --- 3. ingero version -------------------------------------------------------------------------------


def test_version_json_has_the_build_details(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == ingero.__version__
    assert doc["python"] == ".".join(map(str, sys.version_info[:3]))
    assert doc["schema_version"] == SCHEMA_VERSION and doc["api_version"] == ingero.API_VERSION
    assert isinstance(doc["bcc"], bool) and doc["bcc_detail"] and doc["platform"]


def test_version_flag_and_command_say_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    text = capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == text
    assert text.startswith(f"ingero {ingero.__version__}\n")
    assert f"schema:   {SCHEMA_VERSION}\n" in text and f"api:      v{ingero.API_VERSION}\n" in text


# --- 4. one default database -------------------------------------------------------------------------


def _db_of(argv: list[str]) -> Path:
    return common.db_path_from(build_parser("query", lazy=True).parse_args(argv))


def test_database_rule_flag_then_env_then_config_then_default(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = isolated / "ingero.yaml"
    config.write_text("agent:\n  db: /from/config.db\n")
    empty = isolated / "empty.yaml"
    empty.write_text("{}\n")
    assert _db_of(["--config", str(empty), "query", "SELECT 1"]) == isolated / ".ingero" / "ingero.db"
    assert _db_of(["--config", str(config), "query", "SELECT 1"]) == Path("/from/config.db")
    monkeypatch.setenv("INGERO_DB", "/from/env.db")
    assert _db_of(["--config", str(config), "query", "SELECT 1"]) == Path("/from/env.db")
    assert _db_of(["--config", str(config), "query", "--db", "/from/flag.db", "SELECT 1"]) == Path("/from/flag.db")


def test_query_reads_the_database_named_by_ingero_db(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("INGERO_DB", str(SAMPLE))
    assert main(["query", "--json", "SELECT count(*) AS n FROM events"]) == 0
    with sqlite3.connect(f"file:{SAMPLE}?mode=ro&immutable=1", uri=True) as conn:
        expected = conn.execute("SELECT count(*) FROM events").fetchone()[0]
    assert str(expected) in capsys.readouterr().out


def test_the_default_database_is_said_when_missing(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "SELECT 1"]) != 0
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(isolated / ".ingero" / "ingero.db") in err


# --- 5. Ctrl-C → one line, exit 130 ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--db", str(SAMPLE), "--listen", "127.0.0.1:0"],
        ["dashboard", "--db", str(SAMPLE), "--listen", "0", "--no-tls", "--ready-file", "{tmp}/ready.json"],
        ["mcp", "--db", str(SAMPLE), "--http", "127.0.0.1:0", "--no-tls"],
    ],
    ids=["serve", "dashboard", "mcp-http"],
)
def test_ctrl_c_is_one_line_and_exit_130(argv: list[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("INGERO_TOKEN", "INGERO_DB", "INGERO_CONFIG")}
    env["HOME"] = str(tmp_path)
    argv = [a.format(tmp=tmp_path) for a in argv]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ingero", *argv], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # readiness is the 'listening on' line: no sleeping
            seen.append(line)
            if "listening on" in line:
                break
        else:
            raise AssertionError("exited before listening: " + "".join(seen))
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "Traceback" not in rest
    assert len(rest.splitlines()) == 1 and "interrupted (Ctrl-C)" in rest
    assert not (tmp_path / "ready.json").exists()  # nothing left behind that says it still runs


def test_ctrl_c_on_the_mcp_stdio_server_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """The stdio server waits on stdin in a thread; Ctrl-C must not wait for the next request."""
    env = {k: v for k, v in os.environ.items() if k not in ("INGERO_TOKEN", "INGERO_DB", "INGERO_CONFIG")}
    env["HOME"] = str(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ingero", "mcp", "--db", str(SAMPLE)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        hello = {"clientInfo": {"name": "test", "version": "1"}, "capabilities": {}, "protocolVersion": "2025-06-18"}
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["id"] == 1  # serving, now waiting on stdin
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert proc.stderr.read() == "ingero: interrupted (Ctrl-C)\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --- 6. shell completion, --timeout with units -------------------------------------------------------

COMPLETE = """source "$1"; shift
COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=(); _ingero
printf '%s\\n' "${COMPREPLY[@]}"
"""


@pytest.fixture(scope="module")
def completion_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "ingero", "completion", "bash"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    path = tmp_path_factory.mktemp("completion") / "ingero.bash"
    path.write_text(proc.stdout)
    return path


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["ingero", "qu"], ["query"]),
        (["ingero", "ver"], ["version"]),
        (["ingero", "trace", "--dur"], ["--duration"]),
        (["ingero", "cert", ""], ["ca", "client", "node", "show"]),
        (["ingero", "--config", "x.yaml", "fleet", "st"], ["status", "stragglers"]),  # a value is no command
        (["ingero", "query", "--db", ""], []),  # a value: left to the shell's file names
    ],
)
def test_bash_completion_comes_from_the_parser(completion_script: Path, words: list[str], expected: list[str]) -> None:
    proc = subprocess.run(
        ["bash", "-c", COMPLETE, "complete", str(completion_script), *words], capture_output=True, text=True, check=True
    )
    assert [w for w in proc.stdout.splitlines() if w] == expected


def test_bash_completion_offers_every_option_of_a_command(completion_script: Path) -> None:
    proc = subprocess.run(
        ["bash", "-c", COMPLETE, "complete", str(completion_script), "ingero", "explain", "--"],
        capture_output=True,
        text=True,
        check=True,
    )
    parser = _all_parsers(build_parser())
    explain = next(p for p in parser if p.prog == "ingero explain")
    wanted = {o for a in explain._actions for o in a.option_strings if o.startswith("--")}
    assert set(proc.stdout.split()) == wanted


@pytest.mark.parametrize(("text", "seconds"), [("500ms", 0.5), ("5s", 5.0), ("2m", 120.0)])
def test_timeout_takes_units(text: str, seconds: float, isolated: Path) -> None:
    from ingero.cli.fleet_cmds import settings_from_args

    args = build_parser("query", lazy=True).parse_args(["query", "--nodes", "a:1", "--timeout", text, "SELECT 1"])
    assert settings_from_args(args).timeout_s == pytest.approx(seconds)


def test_every_output_option_is_spelled_dash_o_and_out() -> None:
    """One spelling across commands: whatever writes a file or directory takes -o/--out."""
    outs = [
        (p.prog, set(a.option_strings))
        for p in _all_parsers(build_parser())
        for a in p._actions
        if a.dest in ("out", "output") and a.nargs != 0  # (trace's --json/--quiet set an output *mode*)
    ]
    assert len(outs) >= 5  # export, merge, investigations, cert ca/node/client
    assert [prog for prog, flags in outs if not {"-o", "--out"} <= flags] == []


def test_one_default_agent_port() -> None:
    """What an agent listens on by default is what --nodes HOST (no port) asks."""
    from ingero.cli.serve import DEFAULT_LISTEN
    from ingero.config import parse_node_list

    assert parse_listen(DEFAULT_LISTEN) == ("127.0.0.1", parse_node_list("gpu-node-01")[0].port)
