"""Shared fixtures. Marked suites (bpf, netns) need root; they run in CI, which is root."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
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


def write_db(path: Path, events: list[EventRow], node: str = "test-node", **ident: int) -> Path:
    """Write events into a fresh ingero database through the real writer."""
    with StoreWriter(path, Identity(node, **ident)) as w:
        sid = w.start_session({"flags": "test"})
        w.write_events(events)
        w.end_session(sid, {"events_seen": len(events)})
    return path
