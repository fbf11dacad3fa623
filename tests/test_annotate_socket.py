"""The annotation socket (Ingero's protocol) served on trio with real Unix sockets: limits, refusals that
keep the connection, SO_PEERCRED provenance, who may label a process, the socket directory's checks,
the home fallback and the Python helper's round trip."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import ingero.annotate as ann
from ingero.agent.trace.annotate_socket import AnnotateStats, prepare_dir, serve_annotations
from ingero.errors import UsageError
from ingero.store.annotations import AnnotationRow

NOBODY = 65534
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: another uid's process and chown")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another uid can traverse (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="ingero-annotate-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def serve_and(
    directory: Path, client: Callable[[Path], Any], *, gid: int | None = None
) -> tuple[Any, list[AnnotationRow], AnnotateStats]:
    """Serve on ``directory/sock`` while ``client(socket path)`` runs in a thread; its result, the rows, the counters."""
    rows: list[AnnotationRow] = []
    stats = AnnotateStats()

    def sink(batch: list[AnnotationRow]) -> bool:
        rows.extend(batch)
        return True

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            path = await nursery.start(
                lambda task_status: serve_annotations(
                    sink, gid=gid, directory=directory / "sock", task_status=task_status, stats=stats
                )
            )
            result = await trio.to_thread.run_sync(client, path)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main), rows, stats


def exchange(path: Path, lines: list[bytes]) -> list[dict[str, Any]]:
    """Send each line and read its reply on one connection."""
    replies = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        f = s.makefile("rb")
        for line in lines:
            s.sendall(line + b"\n")
            replies.append(json.loads(f.readline()))
    return replies


def good(**extra: Any) -> bytes:
    return json.dumps({"labels": {"step": "12"}, **extra}).encode()


REFUSALS: list[tuple[bytes, str]] = [
    (b"not json", "not a JSON object"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"ts": 5}', "labels are required"),
    (b'{"labels": {}}', "labels are required"),
    (json.dumps({"labels": {f"k{i}": "v" for i in range(ann.MAX_LABELS + 1)}}).encode(), f"at most {ann.MAX_LABELS}"),
    (json.dumps({"labels": {f"k{i}": "v" for i in range(10_000)}}).encode(), "line of"),  # 10,000 labels
    (b'{"labels": {"bad key": "v"}}', "label key"),
    (json.dumps({"labels": {"k" * (ann.MAX_KEY_BYTES + 1): "v"}}).encode(), "label key"),
    (json.dumps({"labels": {"k": "v" * (ann.MAX_VALUE_BYTES + 1)}}).encode(), f"at most {ann.MAX_VALUE_BYTES}"),
    (b'{"labels": {"k": "a\\u0007b"}}', "control characters"),
    (b'{"labels": {"k": "a\\nb"}}', "control characters"),
    (b'{"labels": {"k": {"nested": 1}}}', "must be a string"),
    (b'{"labels": {"k": "v"}, "span_start": 10, "span_end": 5}', "span_end (5) is before span_start (10)"),
    (b'{"labels": {"k": "v"}, "span_start": 10}', "both span_start and span_end"),
    (b'{"labels": {"k": "v"}, "pid": -3}', "pid"),
    (b'{"labels": {"k": "v"}, "v": 2}', "protocol version"),
    (b'{"labels": {"k": "v"}, "extra": 1}', "unknown field"),
]


def test_each_refusal_is_answered_and_the_connection_keeps_going(tmp_path: Path) -> None:
    lines = [good(ts=1)]
    for raw, _ in REFUSALS:
        lines += [raw, good(ts=len(lines) + 1)]  # a good line after every bad one, same connection
    replies, rows, stats = serve_and(tmp_path, lambda p: exchange(p, lines))
    assert replies[0] == {"ok": True}
    for i, (raw, reason) in enumerate(REFUSALS):
        bad, after = replies[1 + 2 * i], replies[2 + 2 * i]
        assert bad["ok"] is False and reason in bad["error"], (raw[:60], bad)
        assert after == {"ok": True}
    assert len(rows) == len(REFUSALS) + 1 and stats.rejected == len(REFUSALS) and stats.accepted == len(rows)
    assert [json.loads(r[1]) for r in rows] == [{"step": "12"}] * len(rows)


def test_a_10mb_line_is_skipped_to_its_newline_without_buffering_it(tmp_path: Path) -> None:
    def client(path: Path) -> list[dict[str, Any]]:
        huge = b'{"labels": {"k": "' + b"x" * 10_000_000 + b'"}}'
        return exchange(path, [huge, good(ts=7)])

    replies, rows, _ = serve_and(tmp_path, client)
    assert replies[0]["ok"] is False and f"at most {ann.MAX_LINE_BYTES}" in replies[0]["error"]
    assert replies[1] == {"ok": True} and [r[0] for r in rows] == [7]


def test_rows_carry_the_peers_credentials_and_the_protocol_fields(tmp_path: Path) -> None:
    line = {"ts": 1_000, "labels": {"step": 12, "phase": "train"}, "span_start": 1_000, "span_end": 2_000, "v": 1}
    _, rows, _ = serve_and(tmp_path, lambda p: exchange(p, [json.dumps(line).encode()]))
    ts, labels, pid, start_time, span_start, span_end, uid, gid, peer_pid = rows[0]
    assert (ts, json.loads(labels), pid, start_time, span_start, span_end) == (
        1_000,
        {"phase": "train", "step": "12"},  # numbers are kept as their JSON text
        0,
        0,
        1_000,
        2_000,
    )
    assert (uid, gid, peer_pid) == (os.geteuid(), os.getegid(), os.getpid())  # SO_PEERCRED of this process


def test_a_bare_pid_gets_its_running_incarnation(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _, rows, _ = serve_and(tmp_path, lambda p: exchange(p, [good(pid=child.pid)]))
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        assert rows[0][2:4] == (child.pid, int(stat[stat.rfind(")") + 2 :].split()[19]))
    finally:
        child.kill()
        child.wait()


CLIENT_AS_NOBODY = """
import json, os, socket, sys
os.setgroups([]); os.setgid({gid}); os.setuid({uid})
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(10); s.connect(sys.argv[1]); f = s.makefile("rb")
out = []
for pid in [os.getpid(), 1, int(sys.argv[2]), 999999999 % 4194304]:
    s.sendall(json.dumps({{"labels": {{"step": "1"}}, "pid": pid}}).encode() + b"\\n")
    out.append(json.loads(f.readline()))
print(json.dumps({{"me": os.getpid(), "replies": out}}))
"""


@ROOT_ONLY
def test_a_peer_labels_only_processes_it_may_speak_for(shared_dir: Path) -> None:
    """As uid 65534 (through --annotate-socket-gid): its own pid yes; pid 1 (root's), a root child and
    a pid that is not running, no; each refusal leaves the connection open."""
    root_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    def client(path: Path) -> dict[str, Any]:
        code = CLIENT_AS_NOBODY.format(uid=NOBODY, gid=NOBODY)
        out = subprocess.run(
            [sys.executable, "-c", code, str(path), str(root_child.pid)], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    try:
        result, rows, _ = serve_and(shared_dir, client, gid=NOBODY)
    finally:
        root_child.kill()
        root_child.wait()
    own, init, other, gone = result["replies"]
    assert own == {"ok": True}
    assert init["ok"] is False and "uid 65534 may not label pid 1 (a process of uid 0)" in init["error"]
    assert other["ok"] is False and f"may not label pid {root_child.pid}" in other["error"]
    assert gone["ok"] is False and "not running" in gone["error"]
    assert [(r[2], r[6], r[7], r[8]) for r in rows] == [(result["me"], NOBODY, NOBODY, result["me"])]
    sock_dir = shared_dir / "sock"
    assert (sock_dir.stat().st_mode & 0o777, sock_dir.stat().st_gid) == (0o750, NOBODY)
    assert not (sock_dir / ann.SOCKET_NAME).exists()  # removed when the server stopped


def test_root_may_label_any_process(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("root's rule")
    _, rows, _ = serve_and(tmp_path, lambda p: exchange(p, [good(pid=1, start_time=5)]))
    assert rows[0][2:4] == (1, 5)


@ROOT_ONLY
def test_a_directory_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "taken"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(UsageError, match=f"owned by uid {NOBODY}, not this agent"):
        prepare_dir(d)


def test_a_group_writable_directory_or_a_link_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "loose"
    d.mkdir()
    d.chmod(0o770)
    with pytest.raises(UsageError, match="group/other writable"):
        prepare_dir(d)
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(UsageError, match="not a directory"):
        prepare_dir(tmp_path / "link")
    ok = prepare_dir(tmp_path / "fresh")
    assert ok.stat().st_mode & 0o777 == 0o700


def test_a_live_socket_is_not_stolen(tmp_path: Path) -> None:
    def client(path: Path) -> str:
        try:
            prepare_dir(path.parent)
            from ingero.agent.trace.annotate_socket import bind_socket

            bind_socket(path.parent).close()
        except UsageError as e:
            return str(e)
        return "bound"

    result, _, _ = serve_and(tmp_path, client)
    assert "another agent is listening" in result


@ROOT_ONLY
def test_without_a_writable_run_the_directory_falls_back_under_the_home(shared_dir: Path) -> None:
    home = shared_dir / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    code = (
        "import os; from ingero.agent.trace.annotate_socket import prepare_dir; "  # imports first: nobody cannot read them
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); print(prepare_dir())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "HOME": str(home)}, timeout=30
    )
    assert out.returncode == 0, out.stderr
    d = Path(out.stdout.strip())
    assert d == home / ".ingero" / "run"
    assert (d.stat().st_uid, d.stat().st_mode & 0o777) == (NOBODY, 0o700)
    assert (d.parent.stat().st_mode & 0o777) == 0o700


def test_the_python_helper_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def client(path: Path) -> list[bool]:
        monkeypatch.setenv("INGERO_ANNOTATE_SOCKET", str(path))
        ann.disconnect()
        with ann.span(step=12, phase="train"):
            time.sleep(0.01)
        sent = [ann.point(epoch=3), ann.point(pid=0, run_id="r1")]
        ann.disconnect()
        time.sleep(0.2)  # the agent reads what was sent before the hang-up
        return sent

    t0 = time.time_ns()
    sent, rows, stats = serve_and(tmp_path, client)
    assert sent == [True, True] and stats.accepted == 3 and stats.rejected == 0
    step, epoch, run = sorted(rows, key=lambda r: r[0])
    assert json.loads(step[1]) == {"phase": "train", "step": "12"} and step[2] == os.getpid()
    assert t0 <= step[4] and step[5] - step[4] >= 10_000_000  # the span covers the block
    assert json.loads(epoch[1]) == {"epoch": "3"} and epoch[4:6] == (0, 0)
    assert json.loads(run[1]) == {"run_id": "r1"} and run[2] == 0  # pid=0: the whole node


def test_the_helper_without_an_agent_warns_once_and_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INGERO_ANNOTATE_SOCKET", str(tmp_path / "nobody.sock"))
    monkeypatch.setattr(ann, "SOCKET_DIR", tmp_path / "none")
    monkeypatch.setattr(ann, "FALLBACK_DIR", tmp_path / "none2")
    ann.disconnect()
    before = ann.dropped()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ann.span(step=1):
            pass
        assert ann.point(epoch=1) is False
    assert [str(w.message) for w in caught] == [
        "ingero.annotate: no agent is listening (run 'ingero trace --annotate'); labels are dropped"
    ]
    assert ann.dropped() == before + 2
    ann.disconnect()


def test_the_helper_imports_nothing_heavy() -> None:
    code = "import sys, ingero.annotate; print(sorted(m for m in ('numpy', 'trio', 'sqlite3', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_rate_limit_refuses_lines_past_it_and_keeps_the_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All lines inside one window (the agent's clock held still): the first RATE_PER_CONNECTION are taken."""
    import ingero.agent.trace.annotate_socket as server

    monkeypatch.setattr(server, "_clock", lambda: 1000.0)
    n = ann.RATE_PER_CONNECTION + 5
    replies, rows, _ = serve_and(tmp_path, lambda p: exchange(p, [good()] * n))
    assert [r["ok"] for r in replies] == [True] * ann.RATE_PER_CONNECTION + [False] * 5
    assert "rate limit" in replies[-1]["error"] and len(rows) == ann.RATE_PER_CONNECTION
