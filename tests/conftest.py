"""Shared fixtures. Marked suites (bpf, netns) need root; they run in CI, which is root."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import zlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from ingero.identity import Identity
from ingero.store.writer import EventRow, StoreWriter

if TYPE_CHECKING:
    from tests.scenarios.base import Params

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "tests" / "data" / "ingero-samples"
INVESTIGATIONS = ROOT / "investigations"
T = TypeVar("T")
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


class SharedDbs:
    """Databases built once per test session (per xdist worker) for the tests that only read them.

    ``get(key, make)`` runs ``make(directory)`` the first time ``key`` is asked for — it writes into a
    fresh directory and returns what the tests read: paths, and the figures the build measured — and
    returns that value again after. Every test still runs explain on the database and asserts on its
    own report; only the writing is shared (a scenario's two layouts are one build). At the end of the
    session every file must be as it was built (size and contents): a test that wrote to one (or left a -wal/-journal
    beside it) fails there.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._made: dict[Hashable, Any] = {}
        self._files: dict[Path, tuple[int, int]] = {}

    def get(self, key: Hashable, make: Callable[[Path], T]) -> T:
        if key not in self._made:
            d = self._root / f"b{len(self._made)}"
            d.mkdir()
            self._made[key] = make(d)
            self._files.update(self._stat(d))
        value: T = self._made[key]
        return value

    def scenario(self, family: str, p: Params) -> dict[str, Path]:
        """A catalog scenario's database in both layouts (:func:`tests.scenarios.judge.build`)."""
        from tests.scenarios.judge import build

        return dict(self.get(("scenario", family, p), lambda d: build(family, p, d)))

    def in_layout(self, key: Hashable, recorded: Path, layout: str) -> Path:
        """``recorded`` (built under ``key``) as it is, or, for ``layout`` "ingero", rewritten once to
        Ingero's layout (:func:`tests.scenarios.ingero_layout.rewrite`)."""
        if layout != "ingero":
            return recorded
        from tests.scenarios.ingero_layout import rewrite

        return self.get((key, "ingero"), lambda d: rewrite(recorded, d / f"{recorded.stem}.ingero.db"))

    @staticmethod
    def _stat(d: Path) -> dict[Path, tuple[int, int]]:
        """Each file's size and checksum (its contents: a timestamp may not move within a clock tick)."""
        return {f: (f.stat().st_size, zlib.crc32(f.read_bytes())) for f in sorted(d.rglob("*")) if f.is_file()}

    def check_untouched(self) -> None:
        now = self._stat(self._root)
        changed = sorted(str(f) for f in set(now) | set(self._files) if now.get(f) != self._files.get(f))
        assert not changed, f"tests wrote to shared databases (use a tmp_path copy): {changed}"


@pytest.fixture(scope="session")
def shared_dbs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDbs]:
    """Read-only databases built once per session: :class:`SharedDbs`."""
    dbs = SharedDbs(tmp_path_factory.mktemp("shared-dbs"))
    yield dbs
    dbs.check_untouched()
