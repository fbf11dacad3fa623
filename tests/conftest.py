"""Shared fixtures. Marked suites (bpf, netns) need root; they run in CI, which is root."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ingero.identity import Identity
from ingero.store.writer import EventRow, StoreWriter

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "tests" / "data" / "ingero-samples"
INVESTIGATIONS = ROOT / "investigations"
SEED_QUERY = "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (eBPF / network namespaces); CI runs these as root")
    for item in items:
        if "bpf" in item.keywords or "netns" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _samples_stay_untouched() -> Iterator[None]:
    """The vendored Ingero samples must never change or grow -wal/-shm files (open them read-only:
    ``ingero.store.db.open_readonly`` or ``file:...?mode=ro&immutable=1``)."""

    def snapshot() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(SAMPLES.iterdir())}

    before = snapshot()
    yield
    after = snapshot()
    assert after == before, f"tests modified {SAMPLES}: {sorted(set(after) ^ set(before)) or 'contents changed'}"


@pytest.fixture
def samples() -> Path:
    """Read-only Ingero sample databases (copies of ../shared/ingero-samples)."""
    return SAMPLES


@pytest.fixture
def sample_copy(tmp_path: Path) -> Iterator[Path]:
    """A writable copy of the sample directory."""
    dst = tmp_path / "samples"
    shutil.copytree(SAMPLES, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    yield dst


INGERO_08_DDL = """
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, timestamp INTEGER NOT NULL,
    pid INTEGER NOT NULL, tid INTEGER NOT NULL, source INTEGER NOT NULL, op INTEGER NOT NULL,
    duration INTEGER NOT NULL, gpu_id INTEGER NOT NULL DEFAULT 0, arg0 INTEGER NOT NULL DEFAULT 0,
    arg1 INTEGER NOT NULL DEFAULT 0, ret_code INTEGER NOT NULL DEFAULT 0,
    stack_hash INTEGER NOT NULL DEFAULT 0);
CREATE TABLE sessions (id INTEGER PRIMARY KEY AUTOINCREMENT, started_at INTEGER NOT NULL,
    stopped_at INTEGER NOT NULL DEFAULT 0, gpu_model TEXT NOT NULL DEFAULT '');
CREATE TABLE causal_chains (id TEXT PRIMARY KEY, detected_at INTEGER NOT NULL, severity TEXT NOT NULL,
    summary TEXT NOT NULL, root_cause TEXT NOT NULL, explanation TEXT NOT NULL);
CREATE TABLE stack_traces (hash INTEGER PRIMARY KEY, ips TEXT NOT NULL, frames TEXT NOT NULL DEFAULT '');
CREATE TABLE schema_info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO schema_info VALUES ('version', '0.8');
"""


def make_ingero_08(
    path: Path,
    events: Sequence[tuple[int, ...]],
    *,
    sessions: Sequence[tuple[int, int, str]] = (),
    chains: Sequence[tuple[int | str, ...]] = (),
    stacks: Sequence[tuple[int, str, str]] = (),
) -> Path:
    """An Ingero 0.8-layout database (integer ids, no node/rank columns).

    ``events``: (timestamp, pid, tid, source, op, duration, ret_code, stack_hash); ``sessions``:
    (started_at, stopped_at, gpu_model); ``chains``: (id, detected_at, severity, summary, root_cause,
    explanation); ``stacks``: (hash, ips, frames).
    """
    conn = sqlite3.connect(path)
    conn.executescript(INGERO_08_DDL)
    conn.executemany(
        "INSERT INTO events(timestamp, pid, tid, source, op, duration, ret_code, stack_hash) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        events,
    )
    conn.executemany("INSERT INTO sessions(started_at, stopped_at, gpu_model) VALUES (?, ?, ?)", sessions)
    conn.executemany("INSERT INTO causal_chains VALUES (?, ?, ?, ?, ?, ?)", chains)
    conn.executemany("INSERT INTO stack_traces VALUES (?, ?, ?)", stacks)
    conn.commit()
    conn.close()
    return path


def write_db(
    path: Path,
    events: list[EventRow],
    node: str = "test-node",
    *,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
) -> Path:
    """Write events into a fresh ingero database through the real writer."""
    with StoreWriter(path, Identity(node, rank, local_rank, world_size)) as w:
        sid = w.start_session({"flags": "test"})
        w.write_batch(events)
        w.end_session(sid, {"events_seen": len(events)})
    return path


def python_interpreter(version: str) -> str | None:
    """An interpreter of CPython ``version`` that runs (this one, one on PATH, or pyenv's beside this
    one's prefix; a pyenv shim for a version not installed does not run), or None."""
    if sys.version_info[:2] == tuple(int(x) for x in version.split(".")):
        return sys.executable
    found = shutil.which(f"python{version}")
    candidates = [found] if found else []
    candidates += [str(p) for p in sorted(Path(sys.base_prefix).parent.glob(f"{version}*/bin/python{version}"))]
    for exe in candidates:
        if subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
            return exe
    return None
