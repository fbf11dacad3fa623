"""``ingero trace`` flags into TraceOptions (no kernel needed), and the terminal rendering."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from ingero.agent.api.server import serve_api
from ingero.agent.trace.livestats import OpLine
from ingero.agent.trace.tracer import parse_size
from ingero.cli.main import build_parser
from ingero.cli.trace import options_from
from ingero.cli.trace_view import render_ops
from ingero.errors import UsageError


def _opts(*argv: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["trace", *argv])
    return options_from(args)


def test_defaults(tmp_path: Path) -> None:
    o = _opts("--db", str(tmp_path / "t.db"), "--node", "gpu-7")
    assert o.db_path == tmp_path / "t.db" and o.identity.node == "gpu-7"
    assert (o.stack_mode, o.store_mode, o.budget_per_s, o.ring_mb) == ("site", "selective", 1000, 16)
    assert o.max_db_bytes == 10 << 30 and o.duration_s is None and o.serve is None
    assert o.follow and o.system_search and o.host and o.io and o.output == "table"
    assert o.overrides == {"cudart": [], "cuda": [], "nccl": []}


def test_every_flag(tmp_path: Path) -> None:
    o = _opts(
        "--db", str(tmp_path / "t.db"), "--duration", "1m30s", "--pid", "7", "--pid", "3", "--pid", "7",
        "--cuda-lib", "/a/libcudart.so.12", "--nccl-lib", "/b/libnccl.so.2", "--no-stack", "--store", "all",
        "--sample-budget", "50", "--max-db", "512m", "--ring-mb", "64", "--no-host", "--no-io", "--no-follow",
        "--no-system-search", "--json",
    )  # fmt: skip
    assert o.duration_s == 90 and o.pids == [3, 7]
    assert o.overrides == {"cudart": ["/a/libcudart.so.12"], "cuda": [], "nccl": ["/b/libnccl.so.2"]}
    assert (o.stack_mode, o.store_mode, o.budget_per_s, o.max_db_bytes, o.ring_mb) == ("off", "all", 50, 512 << 20, 64)
    assert not (o.host or o.io or o.follow or o.system_search) and o.output == "json"
    assert _opts("--db", "x.db", "--max-db", "0").max_db_bytes == 0


def test_listen_uses_the_serve_settings(tmp_path: Path) -> None:
    o = _opts("--db", str(tmp_path / "t.db"), "--listen", "127.0.0.1:0", "--no-tls", "--token", "s3cret")
    assert isinstance(o.serve, functools.partial) and o.serve.func is serve_api
    (settings,) = o.serve.args
    assert (settings.host, settings.port, settings.no_tls, settings.token) == ("127.0.0.1", 0, True, "s3cret")
    assert settings.db_path == tmp_path / "t.db"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--duration", "soon"], "cannot parse duration"),
        (["--max-db", "lots"], "cannot parse size"),
        (["--sample-budget", "0"], "--sample-budget"),
        (["--ring-mb", "4096"], "--ring-mb"),
        (["--token", "x"], "need --listen"),
        (["--listen", "nowhere:port"], "--listen"),
    ],
)
def test_bad_flags_are_usage_errors(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        _opts("--db", str(tmp_path / "t.db"), *argv)


def test_parse_size() -> None:
    assert parse_size("10g") == 10 << 30
    assert parse_size("500MB") == 500 << 20
    assert parse_size("1.5k") == 1536
    assert parse_size("4096") == 4096
    for bad in ("", "-1g", "g", "1x"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_live_table_rendering() -> None:
    lines = render_ops(
        [
            OpLine(4, 1, "cuLaunchKernel", 4111, 1234.0, 450, 600, 9_000, 12_000, 0),
            OpLine(1, 1, "cudaMalloc", 1244, 10.0, 600, 700, 800, 32_000, 7),
            OpLine(3, 5, "process_exec", 3, 0.0, 0, 0, 0, 0, 0),
        ]
    )
    text = "\n".join(lines)
    assert lines[0].split()[:4] == ["op", "count", "rate/s", "p50"]
    assert "cuLaunchKernel" in text and "4,111" in text and "tail p99 20x p50" in text
    assert "7 errors" in text
    exec_line = next(ln for ln in lines if ln.startswith("process_exec"))
    assert exec_line.split()[2:6] == ["0", "-", "-", "-"]  # no durations for instant events
    assert "waiting" in "\n".join(render_ops([]))
