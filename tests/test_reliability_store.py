"""The store under an unlucky operator: two writers on one database, a disk that fills up.

* Two tracers on one database (issue 17.3): the second writer fails at once with a one-line error
  naming the first one's pid; readers are never blocked; a holder killed with SIGKILL leaves no stale
  lock. Real processes, real ``flock``.
* Disk full (issue 17.6): a real tracer records a busy job into a database on a small tmpfs (root,
  bpf suite): when SQLite says SQLITE_FULL the oldest events are pruned and recording goes on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.errors import WriterLockedError
from ingero.identity import Identity
from ingero.store.db import open_readonly
from ingero.store.writer import StoreWriter
from ingero.store.writer_lock import lock_path

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[1]
HOLDER = """
import sys
from ingero.identity import Identity
from ingero.store.writer import StoreWriter
with StoreWriter(sys.argv[1], Identity("first-node")) as w:
    w.write_batch([(1_775_218_723_000_000_000, 1, 1, 1, 1, 1000, 0, 0, 0, 0, 0, 0)])
    print("holding", flush=True)
    sys.stdin.readline()
"""


def _ev(i: int) -> tuple[int, int, int, int, int, int, int, int, int, int, int, int]:
    return (1_775_218_723_000_000_000 + i, 7, 7, 1, 1, 1000, 0, i, 0, 0, 0, 0)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    db = tmp_path / "shared.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(db)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        yield proc, db
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_second_writer_fails_at_once_naming_the_holder(holder: tuple[subprocess.Popen[str], Path]) -> None:
    proc, db = holder
    with pytest.raises(WriterLockedError) as err:
        StoreWriter(db, Identity("second-node"))
    assert f"pid {proc.pid}" in str(err.value) and "\n" not in str(err.value)
    # Readers are not blocked while the writer holds the lock.
    assert open_readonly(db).execute("SELECT node FROM events").fetchall() == [("first-node",)]
    # Nothing of the second writer reached the database.
    assert open_readonly(db).execute("SELECT count(*) FROM sessions").fetchone()[0] == 0


def test_the_lock_is_released_on_close_and_on_kill(holder: tuple[subprocess.Popen[str], Path]) -> None:
    proc, db = holder
    proc.send_signal(signal.SIGKILL)  # no clean-up at all: the kernel drops the flock
    proc.wait(timeout=30)
    with StoreWriter(db, Identity("second-node")) as w:
        w.write_batch([_ev(1)])
        assert lock_path(db).read_text().strip() == str(os.getpid())
    assert not lock_path(db).exists()  # removed by a clean close
    with StoreWriter(db, Identity("third-node")) as w:
        w.write_batch([_ev(2)])
    nodes = [r[0] for r in open_readonly(db).execute("SELECT node FROM events ORDER BY rowid")]
    assert nodes == ["first-node", "second-node", "third-node"]


def test_one_process_cannot_open_two_writers_either(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with StoreWriter(db, Identity("n1")), pytest.raises(WriterLockedError, match=f"pid {os.getpid()}"):
        StoreWriter(db, Identity("n2"))


# --- disk full (bpf: a real tracer, a real tmpfs) -------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_MB}m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


SMALL_DISK_MB = 32


@pytest.mark.bpf
def test_a_full_disk_prunes_the_oldest_events_and_recording_goes_on(
    small_disk: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import sqlite3
    import time

    from tests.bpf_support import BusyJob, build_busy_cudart, build_program, record, trace_options

    cudart = build_busy_cudart(tmp_path_factory.mktemp("bpf-busy-lib"))
    job = BusyJob(build_program("busy_threads.c", tmp_path_factory.mktemp("bpf-busy")), cudart.parent, "busy", 2)
    db = small_disk / "full.db"
    opts = trace_options(
        db,
        Identity("full-node"),
        {"cudart": [str(cudart)], "cuda": [], "nccl": []},
        stack_mode="off",
        store_mode="all",  # every call a row: the disk fills within a second or two
        host=False,
        io=False,
    )
    reserve = db.with_name(db.name + ".reserve")  # given back to the file system at the first SQLITE_FULL

    def until_full_and_beyond(ready: object) -> int:
        deadline = time.monotonic() + 120  # bounded: a machine too slow to fill 32 MiB fails below
        while reserve.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        full_at = time.time_ns()
        time.sleep(2.5)  # keep recording on the full disk
        return full_at

    try:
        summary, full_at = record(opts, until_full_and_beyond)
    finally:
        job.close()
    st = summary.stats
    assert st["disk_full_errors"] >= 1, st
    assert st["rows_pruned_disk_full"] > 0, st
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        started, stopped = c.execute("SELECT started_at, stopped_at FROM sessions").fetchone()
        assert stopped > started  # the session was closed with its counters despite the full disk
        saved = dict(c.execute("SELECT key, value FROM session_stats"))
        assert saved["rows_pruned_disk_full"] == st["rows_pruned_disk_full"]
        # Recording went on after the disk filled: calls made well after it are stored.
        newest, oldest = c.execute("SELECT max(timestamp), min(timestamp) FROM events").fetchone()
        assert newest > full_at + 1_000_000_000
        assert oldest > started  # the oldest events were pruned to make room
        # Aggregates still count every call seen, stored or not.
        counted, stored_agg = c.execute("SELECT sum(count), sum(stored) FROM event_aggregates").fetchone()
        stored = c.execute("SELECT count(*) FROM events").fetchone()[0]
    assert counted == st["events_seen"] > stored
    # ...and count as stored only rows that were written: those still there plus those pruned for room
    # (rows the full disk could not take are in count, not in stored)
    assert stored_agg == st["events_stored"] == stored + st["rows_pruned_disk_full"] + st["rows_pruned"], st


@pytest.mark.reliability
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_every_writer_says_disk_full_not_a_plain_store_error(tmp_path: Path) -> None:
    """A merge (not the tracer's writer) into a full disk fails as DiskFullError, in one line."""
    from ingero.errors import DiskFullError
    from ingero.store.merge import merge_databases
    from tests.conftest import INVESTIGATIONS

    mnt = tmp_path / "tiny-disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        inputs = sorted(INVESTIGATIONS.glob("sample-gpu-node-0*.db"))
        with pytest.raises(DiskFullError, match="is full") as full:
            merge_databases(inputs, mnt / "cluster.db")
        assert full.value.hint and "free some space" in full.value.hint
        assert not list(mnt.iterdir())  # the half-written merge is gone
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
