"""``ingero serve``'s metrics from a recording (:class:`ingero.metrics.dbfeed.DatabaseFeed`): the event and
byte totals of ``event_aggregates`` labelled with the node of their rows, read back from the Prometheus
text the exporter renders.

A merged recording (the committed three-node ``sample-cluster.db``) served by an agent of another name
exports each node's totals under that node and none under the agent's; served as one of its nodes,
that node keeps the agent's labels (its rank among them); every op's total over the nodes is the
table's, so no event counts twice. A recording before schema 6 (no ``node`` column) is all the agent's.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections import defaultdict
from pathlib import Path

import pytest

from ingero.identity import Identity
from ingero.metrics.dbfeed import DatabaseFeed
from ingero.metrics.state import MetricState, op_labels
from tests.test_metrics_state import series
from tests.test_store_aggregates import as_schema_5

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "investigations" / "sample-cluster.db"
NODE_02 = ROOT / "investigations" / "sample-gpu-node-02.db"
NAMES = ("ingero_events_total", "ingero_bytes_total")
Totals = dict[tuple[str, str, str, str, str], float]  # (metric, node, rank, source, op) -> value


def expected(db: Path) -> dict[str, dict[tuple[str, str], tuple[int, int]]]:
    """node -> (source, op) -> (events, bytes), straight from the table."""
    conn = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    try:
        rows = conn.execute(
            "SELECT node, source, op, sum(count), sum(sum_arg0) FROM event_aggregates GROUP BY 1, 2, 3"
        ).fetchall()
    finally:
        conn.close()
    out: dict[str, dict[tuple[str, str], tuple[int, int]]] = defaultdict(dict)
    for node, s, o, n, b in rows:
        out[node][op_labels(int(s) << 8 | int(o))] = (int(n), int(b))
    return dict(out)


def served(db: Path, identity: Identity) -> Totals:
    st = MetricState(identity, "serve")
    DatabaseFeed(st, db).refresh(force=True)
    got: Totals = {}
    for (name, labels), value in series(st).items():
        if name in NAMES:
            d = dict(labels)
            got[(name, d["node"], d["rank"], d["source"], d["op"])] = value
    return got


def test_a_merged_recording_exports_each_nodes_totals_under_that_node() -> None:
    want = expected(CLUSTER)
    assert sorted(want) == ["gpu-node-01", "gpu-node-02", "gpu-node-03"]
    got = served(CLUSTER, Identity("laptop", rank=5))
    events = {(node, src, op): v for (name, node, rank, src, op), v in got.items() if name == NAMES[0]}
    assert events == {(node, *op): n for node, ops in want.items() for op, (n, _) in ops.items()}
    assert {rank for (_, node, rank, _, _) in got if node != "laptop"} == {""}  # the recording does not say it
    for (name, node, _, src, op), v in got.items():
        if name == "ingero_bytes_total":
            assert v == (want[node][(src, op)][1] if node in want else 0), (node, src, op)
    assert any(v for (name, node, *_), v in got.items() if name == NAMES[1] and node != "laptop")
    assert not any(v for (_, node, *_), v in got.items() if node == "laptop")  # the agent recorded nothing


@pytest.mark.parametrize("node", ["gpu-node-01", "gpu-node-02", "gpu-node-03"])
def test_served_as_one_of_its_nodes_that_node_keeps_the_agents_labels(node: str) -> None:
    want = expected(CLUSTER)
    got = served(CLUSTER, Identity(node, rank=1))
    for nd, ops in want.items():
        rank = "1" if nd == node else ""
        for (src, op), (n, _) in ops.items():
            assert got[(NAMES[0], nd, rank, src, op)] == n
    totals: dict[tuple[str, str], float] = defaultdict(float)
    for (name, _, _, src, op), v in got.items():
        if name == NAMES[0]:
            totals[(src, op)] += v
    assert dict(totals) == {
        op: sum(ops[op][0] for ops in want.values() if op in ops) for op in {o for ops in want.values() for o in ops}
    }


def test_a_recording_before_schema_6_is_the_agents(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    shutil.copyfile(NODE_02, db)
    (ops,) = expected(db).values()
    as_schema_5(db)
    got = served(db, Identity("renamed", rank=2))
    assert {(src, op): v for (name, node, rank, src, op), v in got.items() if name == NAMES[0]} == {
        op: n for op, (n, _) in ops.items()
    }
    assert {(node, rank) for (_, node, rank, _, _) in got} == {("renamed", "2")}
