"""``ingero trace`` as a command: SIGINT under heavy load, serving the API while tracing, --pid."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from ingero.agent.trace.tracer import TraceOptions, TraceReady
from ingero.identity import Identity
from tests.bpf_support import Built, build, record, trace_options

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("bpf-build"))


def _start_trace(built: Built, db: Path, *extra: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``ingero trace``; return once its --ready-file says the probes are attached (readiness
    is never scraped from its output), with the start banner it printed then."""
    ready = Path(extra[extra.index("--ready-file") + 1]) if "--ready-file" in extra else db.with_suffix(".ready")
    cmd = [
        sys.executable,
        "-m",
        "ingero",
        "trace",
        "--db",
        str(db),
        "--cuda-lib",
        str(built.cudart),
        "--driver-lib",
        str(built.cuda),
        "--nccl-lib",  # not discovered: another process on the machine may map some libnccl
        str(built.nccl),
        "--no-system-search",
        "--no-follow",
        "--quiet",
        "--node",
        "cli-node",
        *extra,
        *(() if "--ready-file" in extra else ("--ready-file", str(ready))),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "timed out")
            raise AssertionError("ingero trace did not start: " + err)
        time.sleep(0.02)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # the banner, printed once the ready file is written
        lines.append(line)
        if line.startswith("ingero trace: probing"):
            break
    return proc, lines


@pytest.fixture
def cleanup() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sigint_under_heavy_load_leaves_a_closed_consistent_database(
    built: Built, tmp_path: Path, cleanup: list[subprocess.Popen[str]]
) -> None:
    db = tmp_path / "stress.db"
    tracer, _ = _start_trace(built, db)
    cleanup.append(tracer)
    stress = subprocess.Popen([str(built.workload), "stress", str(built.dir), "4"], stdout=subprocess.PIPE, text=True)
    cleanup.append(stress)
    assert stress.stdout is not None
    for _ in range(3):  # under way: 300k calls through the probes
        assert stress.stdout.readline().startswith("progress")
    tracer.send_signal(signal.SIGINT)
    out, err = tracer.communicate(timeout=120)
    assert tracer.returncode == 130, err  # Ctrl-C: exit 130, as every command (the recording is kept)
    assert "SIGINT" in out and "Traceback" not in err
    stress.communicate(timeout=60)
    assert stress.returncode == 0  # the workload is unharmed by the detach
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        sid, started, stopped = conn.execute("SELECT id, started_at, stopped_at FROM sessions").fetchone()
        assert stopped > started
        stats = dict(conn.execute("SELECT key, value FROM session_stats WHERE session_id = ?", (sid,)).fetchall())
        launches = conn.execute("SELECT sum(count) FROM event_aggregates WHERE source = 4 AND op = 1").fetchone()[0]
        assert launches >= 300_000
        assert stats["events_seen"] >= launches
        assert stats["events_stored"] == conn.execute("SELECT count(*) FROM events").fetchone()[0]
        # Selective storage: launches sampled, allocations all kept.
        stored_launches = conn.execute("SELECT count(*) FROM events WHERE source = 4 AND op = 1").fetchone()[0]
        assert stored_launches < launches
        mallocs = conn.execute("SELECT count(*) FROM events WHERE source = 1 AND op = 1").fetchone()[0]
        counted = conn.execute("SELECT sum(count) FROM event_aggregates WHERE source = 1 AND op = 1").fetchone()[0]
        assert mallocs == counted > 0
        for key in ("events_dropped_ring", "stack_errors", "drain_deferred"):
            assert key in stats
    assert f"events seen {stats['events_seen']:,}" in out


def test_trace_serves_the_agent_api_while_recording(
    built: Built, tmp_path: Path, cleanup: list[subprocess.Popen[str]]
) -> None:
    db = tmp_path / "live.db"
    ready = tmp_path / "ready.json"
    tracer, lines = _start_trace(built, db, "--listen", "127.0.0.1:0", "--no-tls", "--ready-file", str(ready))
    cleanup.append(tracer)
    doc = json.loads(ready.read_text())
    assert doc["pid"] == tracer.pid and doc["probes"] == 26 + 16 + 10  # fake libcudart, libcuda, libnccl
    url = doc["url"]
    assert url.startswith("http://127.0.0.1:") and any(url in line for line in lines)
    subprocess.run([str(built.workload), "loop", str(built.dir), "5000"], check=True, capture_output=True)
    count_sql = "SELECT sum(count) FROM event_aggregates WHERE source = 4 AND op = 1"  # every call, stored or not
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/api/v1/health").status_code == 200
        deadline = time.monotonic() + 30
        rows: list[list[object]] = []
        while time.monotonic() < deadline:  # the writer commits within a drain interval or two
            r = client.post("/api/v1/query", json={"sql": count_sql})
            assert r.status_code == 200, r.text
            rows = r.json()["rows"]
            if rows == [[5000]]:
                break
            time.sleep(0.05)
        assert rows == [[5000]]
        r = client.post("/api/v1/query", json={"sql": "SELECT DISTINCT node FROM events WHERE source = 4"})
        assert r.json()["rows"] == [["cli-node"]]
    tracer.send_signal(signal.SIGTERM)
    out, err = tracer.communicate(timeout=120)
    assert tracer.returncode == 0, err
    assert "SIGTERM" in out
    assert not ready.exists()  # removed on exit


def test_pid_filter_traces_only_the_target(built: Built, tmp_path: Path) -> None:
    target = subprocess.Popen(
        [str(built.workload), "contention", str(built.dir), "0", "300", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert target.stdout is not None and target.stdin is not None
        assert target.stdout.readline().strip() == "ready"
        opts = trace_options(
            tmp_path / "pid.db",
            Identity("pid-node"),
            built.overrides(),
            pids=[target.pid],
        )

        def action(_ready: object) -> int:
            other = subprocess.run(
                [str(built.workload), "loop", str(built.dir), "777"], check=True, capture_output=True
            )
            assert other.returncode == 0
            target.stdin.write("go\n")  # type: ignore[union-attr]
            target.stdin.flush()  # type: ignore[union-attr]
            assert target.stdout.readline().strip() == "done"  # type: ignore[union-attr]
            return target.wait(timeout=60)

        summary, rc = record(opts, action)
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
    assert rc == 0
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as conn:
        gpu = conn.execute("SELECT pid, count(*) FROM events WHERE source IN (1, 4, 8) GROUP BY pid").fetchall()
        assert gpu == [(target.pid, 300)]
        assert conn.execute("SELECT pid_filter FROM sessions").fetchone() == (str(target.pid),)
    assert summary.stats["events_dropped_ring"] == 0
    assert os.path.exists(opts.db_path)


def test_follow_mode_probes_a_library_first_seen_in_a_new_process(built: Built, tmp_path: Path) -> None:
    opts = TraceOptions(
        db_path=tmp_path / "follow.db",
        identity=Identity("follow-node"),
        system_search=False,  # no library known at start: only what processes map
        follow=True,
        output="quiet",
    )

    def action(ready: TraceReady) -> int:
        assert not any(lib.path == str(built.cudart) for lib in ready.libraries)
        proc = subprocess.Popen(
            [str(built.workload), "contention", str(built.dir), "0", "321", "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"  # it has mapped libcudart.so.12 now
        trio.from_thread.run(ready.control.rescan)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        assert proc.wait(timeout=60) == 0
        return proc.pid

    summary, pid = record(opts, action)
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as conn:
        n = conn.execute(
            "SELECT sum(count) FROM event_aggregates WHERE pid = ? AND source = 1 AND op = 3", (pid,)
        ).fetchone()
    assert n == (321,)
    assert summary.stats["probes_attached"] >= 8


def test_max_db_prunes_the_oldest_events(built: Built, tmp_path: Path) -> None:
    opts = trace_options(
        tmp_path / "small.db",
        Identity("prune-node"),
        built.overrides(),
        store_mode="all",  # every launch becomes a row: the database outgrows its cap quickly
        max_db_bytes=1 << 20,
    )

    def action(_ready: TraceReady) -> str:
        return subprocess.run(
            [str(built.workload), "paced", str(built.dir), "40000", "3"], check=True, capture_output=True, text=True
        ).stdout

    summary, out = record(opts, action)
    calls = int(out.split()[0])
    assert summary.stats["events_dropped_ring"] == 0
    assert summary.stats["rows_pruned"] > 0
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT count(*) FROM events WHERE source = 4").fetchone()[0]
        counted = conn.execute("SELECT sum(count) FROM event_aggregates WHERE source = 4").fetchone()[0]
        oldest = conn.execute("SELECT min(timestamp) FROM events").fetchone()[0]
        first_bucket = conn.execute("SELECT min(bucket) FROM event_aggregates").fetchone()[0]
    assert counted == calls  # aggregates keep counting what was pruned
    assert rows < calls
    assert oldest > first_bucket  # the oldest rows went first


def test_a_second_tracer_on_the_same_database_fails_at_once(
    built: Built, tmp_path: Path, cleanup: list[subprocess.Popen[str]]
) -> None:
    db = tmp_path / "shared.db"
    first, _ = _start_trace(built, db)
    cleanup.append(first)
    second = subprocess.run(
        [sys.executable, "-m", "ingero", "trace", "--db", str(db), "--quiet", "--no-system-search"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode != 0
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pid {first.pid}" in lines[0], second.stderr
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 0
