"""`ingero serve` as a real process: ready file, the seed query over TLS, clean exit on SIGTERM/SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ingero.cli.main import main
from ingero.tls.context import client_ssl_context
from tests.conftest import ROOT, SAMPLES, SEED_QUERY


@contextmanager
def serve(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], str, dict[str, Any]]]:
    """Start `ingero serve ... --ready-file`; readiness is the line it prints on stderr (no sleeping)."""
    ready = tmp_path / "ready.json"
    full_env = {k: v for k, v in os.environ.items() if k != "INGERO_TOKEN"}
    full_env.update({"HOME": str(tmp_path / "home"), **(env or {})})
    proc = subprocess.Popen(
        [sys.executable, "-m", "ingero", "serve", "--listen", "127.0.0.1:0", "--ready-file", str(ready), *args],
        cwd=ROOT,
        env=full_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                break
        else:
            raise AssertionError("ingero serve exited before listening: " + "".join(lines))
        yield proc, "".join(lines), json.loads(ready.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_answers_the_seed_query_and_stops_cleanly(tmp_path: Path) -> None:
    db = SAMPLES / "sample-gpu-node-01.db"
    with serve(tmp_path, "--db", str(db), "--node", "gpu-node-01") as (proc, err, ready):
        assert ready["pid"] == proc.pid and ready["node"] == "gpu-node-01" and ready["tls"] == "tls"
        assert ready["url"] == f"https://127.0.0.1:{ready['port']}" and ready["port"] > 0
        line = err.strip().splitlines()[-1]
        assert ready["url"] in line and "node=gpu-node-01" in line and "tls=tls" in line
        assert f"fingerprint=SHA256:{ready['fingerprint_sha256']}" in line
        assert "created a self-signed certificate" in err
        cert = tmp_path / "home" / ".ingero" / "tls" / "server-cert.pem"
        with httpx.Client(verify=client_ssl_context(ca_cert=cert), base_url=ready["url"]) as c:
            doc = c.post("/api/v1/query", json={"sql": SEED_QUERY}).json()
            assert doc["node"] == "gpu-node-01" and doc["columns"] == ["node", "source", "cnt", "avg_us"]
            assert [r[:3] for r in doc["rows"]] == [["gpu-node-01", 3, 99], ["gpu-node-01", 5, 101]]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not (tmp_path / "ready.json").exists()


def test_serve_with_token_from_the_environment_and_sigint(tmp_path: Path) -> None:
    db = SAMPLES / "sample-cluster.db"
    with serve(tmp_path, "--db", str(db), "--no-tls", env={"INGERO_TOKEN": "from-env"}) as (proc, err, ready):
        assert ready["tls"] == "plaintext" and ready["fingerprint_sha256"] is None and "warning" in err
        with httpx.Client(base_url=ready["url"]) as c:
            assert c.get("/api/v1/health").status_code == 401
            r = c.get("/api/v1/info", headers={"Authorization": "Bearer from-env"})
            assert r.status_code == 200 and r.json()["auth"] == "token" and r.json()["events"] == 600
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # Ctrl-C: exit 130, as every command


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--db", "/nonexistent/trace.db"], 1, "no such database"),
        (["--db", "{db}", "--listen", "0.0.0.0:0", "--no-tls"], 2, "refusing plain HTTP"),
        (["--db", "{db}", "--listen", "nowhere:99999"], 2, "--listen"),
        (["--db", "{db}", "--tls-cert", "{db}"], 2, "go together"),
        (["--db", "{db}", "--tls-cert", "{db}", "--tls-key", "{db}"], 2, "cannot load"),
        (["--db", "{db}", "--allow-plaintext-remote"], 2, "only makes sense with --no-tls"),
        (["--db", "{db}", "--max-rows", "0"], 2, "--max-rows"),
        (["--db", "{db}", "--max-rows", "10001"], 2, "--max-rows is at most 10000"),
        (["--db", "{db}", "--max-timeout-ms", "60001"], 2, "--max-timeout-ms is at most 60000"),
        # safe auth defaults: beyond loopback, some authentication or the risk named
        (["--db", "{db}", "--listen", "0.0.0.0:0"], 2, "without authentication"),
        (["--db", "{db}", "--listen", "[::]:0"], 2, "--insecure-no-auth"),
        (["--db", "{db}", "--token", ""], 2, "--token is empty"),
        (["--db", "{db}", "--token-file", "{empty}"], 2, "is empty"),
        (["--db", "{db}", "--token-file", "/nonexistent/token"], 2, "No such file"),
        (["--db", "{db}", "--token-file", "{token}", "--token", "x"], 2, "conflict"),
        (["--db", "{db}", "--token-file", "{token}", "--insecure-no-auth"], 2, "conflicts"),
    ],
)
def test_serve_refuses_bad_settings_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    code: int,
    words: str,
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("INGERO_TOKEN", raising=False)
    db = str(SAMPLES / "sample-gpu-node-01.db")
    (tmp_path / "empty").write_text(" \n")
    (tmp_path / "token").write_text("s3cret\n")
    files = {"{db}": db, "{empty}": str(tmp_path / "empty"), "{token}": str(tmp_path / "token")}
    argv = [files.get(a, a) for a in args]
    listen = [] if "--listen" in argv else ["--listen", "127.0.0.1:0"]
    assert main(["serve", *listen, *argv]) == code
    err = capsys.readouterr().err
    assert err.startswith("ingero: error: ") and words in err and err.count("\n") == 1


def test_empty_token_from_the_environment_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("INGERO_TOKEN", "")
    assert main(["serve", "--db", str(SAMPLES / "sample-gpu-node-01.db"), "--listen", "127.0.0.1:0"]) == 2
    assert "$INGERO_TOKEN is empty" in capsys.readouterr().err


def test_token_file_keeps_the_token_out_of_ps_and_guards_a_wildcard_listener(tmp_path: Path) -> None:
    """--token-file: the token is required on every request, and the process's command line (what
    'ps' shows) never holds it; with a token, listening on 0.0.0.0 is allowed."""
    token = "tok-" + os.urandom(8).hex()
    (tmp_path / "token").write_text(token + "\n")
    db = SAMPLES / "sample-gpu-node-01.db"
    args = ("--db", str(db), "--token-file", str(tmp_path / "token"), "--listen", "0.0.0.0:0")
    with serve(tmp_path, *args) as (proc, err, ready):
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"--token-file" in cmdline and token.encode() not in cmdline
        assert "auth=token" in err and "warning" not in err
        cert = tmp_path / "home" / ".ingero" / "tls" / "server-cert.pem"
        url = f"https://127.0.0.1:{ready['port']}"
        with httpx.Client(verify=client_ssl_context(ca_cert=cert), base_url=url) as c:
            assert c.get("/api/v1/info").status_code == 401
            r = c.get("/api/v1/info", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and r.json()["auth"] == "token"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_insecure_no_auth_serves_a_wildcard_listener_with_a_warning(tmp_path: Path) -> None:
    db = SAMPLES / "sample-gpu-node-01.db"
    with serve(tmp_path, "--db", str(db), "--listen", "0.0.0.0:0", "--insecure-no-auth") as (proc, err, ready):
        assert "--insecure-no-auth" in err and "auth=none" in err
        cert = tmp_path / "home" / ".ingero" / "tls" / "server-cert.pem"
        with httpx.Client(verify=client_ssl_context(ca_cert=cert), base_url=f"https://127.0.0.1:{ready['port']}") as c:
            assert c.get("/api/v1/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_token_file_from_the_config_and_the_precedence_of_token_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--token-file > --token > $INGERO_TOKEN > agent.token_file > agent.token (paths relative to the file)."""
    from ingero.cli import serve as serve_cli
    from ingero.cli.main import build_parser

    (tmp_path / "cfg-token").write_text("from-config-file\n")
    (tmp_path / "flag-token").write_text("from-flag-file\n")
    cfg = tmp_path / "ingero.yaml"
    cfg.write_text("agent:\n  token_file: cfg-token\n  token: from-config\n")
    monkeypatch.delenv("INGERO_TOKEN", raising=False)
    base = ["--config", str(cfg), "serve", "--db", str(SAMPLES / "sample-gpu-node-01.db")]

    def token(*extra: str) -> str | None:
        args = build_parser().parse_args([*base, *extra])
        return serve_cli.settings_from(args).token

    assert token() == "from-config-file"
    monkeypatch.setenv("INGERO_TOKEN", "from-env")
    assert token() == "from-env"
    assert token("--token", "from-argv") == "from-argv"
    assert "visible to every local user in 'ps'" in capsys.readouterr().err
    assert token("--token-file", str(tmp_path / "flag-token")) == "from-flag-file"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ([], "without authentication"),
        (["--no-tls"], "refusing plain HTTP"),
        (["--token", ""], "--token is empty"),
    ],
)
def test_trace_listen_shares_the_refusals_before_attaching_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], words: str
) -> None:
    from ingero.cli import trace as trace_cli
    from ingero.cli.main import build_parser
    from ingero.errors import UsageError

    monkeypatch.delenv("INGERO_TOKEN", raising=False)
    args = build_parser().parse_args(["trace", "--db", str(tmp_path / "t.db"), "--listen", "0.0.0.0:0", *extra])
    with pytest.raises(UsageError, match=words):
        trace_cli.options_from(args)
    assert not (tmp_path / "t.db").exists()


def test_preflight_keeps_the_port_it_checked(tmp_path: Path) -> None:
    """The port is bound once and held from the check to the serving: no other process can take it."""
    import errno
    import socket

    from ingero.agent.api.server import ServerSettings, preflight
    from ingero.identity import Identity
    from ingero.store.db import open_writable

    db = tmp_path / "t.db"
    open_writable(db).close()
    setup = preflight(ServerSettings(db_path=db, identity=Identity("n"), port=0, no_tls=True))
    assert setup.sock is not None
    port = setup.sock.getsockname()[1]
    with socket.socket() as rival, pytest.raises(OSError) as taken:
        rival.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    setup.sock.close()


_LISTENING: list[list[str]] = []  # the list a test collects opened database files in (sqlite3's audit event)


def _count_opens(event: str, args: tuple[Any, ...]) -> None:
    if event == "sqlite3.connect" and _LISTENING:
        _LISTENING[-1].append(str(args[0]))


sys.addaudithook(_count_opens)


@pytest.mark.parametrize("named", [False, True])
def test_serve_start_up_opens_its_database_once(tmp_path: Path, named: bool) -> None:
    """`ingero serve`'s start-up (settings, preflight, the app) opens the recording once, read-only: its
    recorded node names the agent, the open checks it, and it says which database the instance id is of."""
    from ingero.agent.api.server import build_app, database_instance, preflight
    from ingero.cli.main import build_parser
    from ingero.cli.serve import settings_from

    db = tmp_path / "rec.db"
    db.write_bytes((SAMPLES / "sample-gpu-node-02.db").read_bytes())
    argv = ["serve", "--db", str(db), "--listen", "127.0.0.1:0", "--no-tls", *(["--node", "x"] if named else [])]
    args = build_parser("serve").parse_args(argv)
    opened: list[str] = []
    _LISTENING.append(opened)
    try:
        settings = settings_from(args)
        setup = preflight(settings)
        app = build_app(settings, setup.mode)
    finally:
        _LISTENING.remove(opened)
    assert setup.sock is not None
    setup.sock.close()
    assert len(opened) == 1 and "mode=ro" in opened[0] and opened[0].startswith(f"file:{db}")
    assert settings.identity.node == ("x" if named else "gpu-node-02")
    assert settings.identity.source == ("--node" if named else "recorded")
    # the same instance id as reading the database again would give
    assert app.ctx.instance == database_instance(db, settings.identity.node)
    assert not Path(f"{db}-wal").exists() and not Path(f"{db}-shm").exists()
