"""``fleet status`` shows how far each node's ClickHouse shipping is behind (issue 24: the lag is visible),
from the progress the shipper keeps in the recording, read by the agent's ``/info``."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.cli.main import main
from ingero.clickhouse.progress import PROGRESS_DDL, PROGRESS_TABLE
from tests.conftest import write_db
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, make_pki, straggler_events


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _shipped(db: Path, upto: int | None) -> None:
    """The shipper's progress: events shipped up to rowid ``upto`` (None: all of them)."""
    with sqlite3.connect(db) as conn:
        conn.execute(PROGRESS_DDL)
        last = conn.execute("SELECT max(rowid) FROM events").fetchone()[0]
        conn.execute(
            f"INSERT INTO {PROGRESS_TABLE}(target, tbl, shipped, rows) VALUES ('default', 'events', ?, ?)",
            (last if upto is None else upto, last if upto is None else upto),
        )


@pytest.fixture(scope="module")
def fleet(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    d = tmp_path_factory.mktemp("ship")
    dbs = {name: write_db(d / f"{name}.db", straggler_events(100, 2.0, i), node=name) for i, name in enumerate("abc")}
    _shipped(dbs["a"], None)  # caught up
    _shipped(dbs["b"], 100)  # behind
    with agents_in_thread(pki, [AgentSpec(db, name) for name, db in dbs.items()]) as servers:
        yield {name: f"{s.host}:{s.port}" for name, s in zip(dbs, servers, strict=True)}


def test_fleet_status_shows_each_nodes_shipping_lag(
    fleet: dict[str, str], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    tls = ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]
    assert main(["fleet", "status", "--nodes", ",".join(fleet.values()), *tls, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    info = {n["node"]: n["info"] for n in doc["nodes"]}
    assert info["a"]["shipping"] == {"default": {"unshipped_rows": 0, "lag_s": 0.0}}
    behind = info["b"]["shipping"]["default"]
    events = sum(1 for _ in straggler_events(100, 2.0, 1))
    assert behind["unshipped_rows"] == events - 100 and behind["lag_s"] > 0
    assert info["c"]["shipping"] is None  # never shipped
    assert main(["fleet", "status", "--nodes", ",".join(fleet.values()), *tls]) == 0
    out = capsys.readouterr().out
    assert "shipping" in out.splitlines()[0]
    rows = {line.split()[1]: line for line in out.splitlines()[2:] if line.startswith("yes")}
    assert "caught up" in rows["a"] and f"{events - 100:,} rows," in rows["b"] and "behind" in rows["b"]
