"""``explain --nodes`` tells the late rank across nodes where no node recorded NCCL calls (Ingero's layout).

Real agents (mTLS on 127.0.0.1), one per node, each over its own database rewritten to Ingero's layout
(no ``nccl_calls``, ``sched_switch`` arg0 = 0): each agent sends its step-gap summary, the client moves
it onto its own clock and judges the late rank as a database holding every node is judged. The late
rank is never the first node; one node's clock runs :data:`SKEW_NS` ahead (its recording and its agent
alike), far more than a step, so the overlap only holds once the summary is corrected. The merged
database and ``--nodes`` must name the same node with the same lost time; a healthy fleet gets no HIGH
or MEDIUM; an agent that sends no summary is one line and every node's own answer stands.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ingero.agent.api import endpoints
from ingero.cli.main import main
from ingero.explain import rules_ranks
from ingero.explain.rules_ranks_fleet import MAX_GAPS, late_ranks
from ingero.fleet.late_ranks import STEPS, node_summaries
from ingero.fleet.operations import explain_sync
from tests.fleet_agents import (
    AgentSpec,
    Pki,
    agents_in_thread,
    client_settings,
    make_pki,
    node_specs,
    shift_clock,
)
from tests.scenarios import FAMILIES
from tests.scenarios.base import Params
from tests.scenarios.ingero_layout import rewrite
from tests.scenarios.judge import explain_file

MS = 1_000_000
SKEW_NS = 250 * MS  # twenty steps: uncorrected, no late gap overlaps its peers' waits
LOST_REL = 0.02  # the --nodes lost time against the merged database's (the clocks agree within ~1 ms)
TIME_COLUMNS = {"events": ("timestamp",), "system_snapshots": ("timestamp",), "sessions": ("started_at", "stopped_at")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class Fleet:
    p: Params
    merged: Path  # every node in one database (Ingero's layout): one clock
    dbs: list[Path]  # one per node, in node order (Ingero's layout); node ``skewed``'s clock ahead
    skewed: int


def _shift(db: Path, ns: int) -> None:
    """The node's clock ``ns`` ahead while it recorded: every time it wrote."""
    conn = sqlite3.connect(db)
    try:
        for table, cols in TIME_COLUMNS.items():
            conn.execute(f"UPDATE {table} SET " + ", ".join(f"{c} = {c} + ?" for c in cols), (ns,) * len(cols))
        conn.commit()
    finally:
        conn.close()


def build(tmp: Path, family: str, p: Params, skewed: int) -> Fleet:
    nodes = FAMILIES[family](p)
    for n in nodes:
        n.write(tmp / "merged.db")
        n.write(tmp / f"{n.node}.db")
    dbs = [rewrite(tmp / f"{n.node}.db", tmp / f"{n.node}-ingero.db") for n in nodes]
    _shift(dbs[skewed], SKEW_NS)
    return Fleet(p, rewrite(tmp / "merged.db", tmp / "merged-ingero.db"), dbs, skewed)


def _agents(f: Fleet, nodes: range | list[int]) -> list[AgentSpec]:
    """An agent for each of ``nodes``; the skewed node's agent reads the clock its recording was made on."""
    return [
        AgentSpec(f.dbs[i], f.p.node_name(i), wrapper=shift_clock(SKEW_NS) if i == f.skewed else None) for i in nodes
    ]


def _tls(pki: Pki) -> list[str]:
    return ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]


def _explain_nodes(servers: Any, pki: Pki, capsys: pytest.CaptureFixture[str], tmp: Path) -> tuple[dict[str, Any], str]:
    """``ingero explain --nodes ... --json`` as a user runs it: the document and the notes on stderr."""
    empty = tmp / "empty.yaml"
    empty.write_text("")
    nodes = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    rc = main(["explain", "--config", str(empty), "--nodes", nodes, *_tls(pki), "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return json.loads(cap.out), cap.err


def _late(chains: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in chains if c["family"] == "late-rank"]


# (seed, nodes, the late rank, the node whose clock is ahead, magnitude): never the first node late,
# the skewed clock on the late rank itself or on a peer (the first node too), each severity
CASES = [
    (11, 3, 2, 2, 0.16),
    (12, 4, 1, 3, 0.065),
    pytest.param(13, 3, 1, 0, 0.3, marks=pytest.mark.slow),
    pytest.param(14, 2, 1, 1, 0.03, marks=pytest.mark.slow),
    pytest.param(15, 4, 3, 0, 0.16, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("seed", "n", "outlier", "skewed", "magnitude"), CASES)
def test_nodes_name_the_late_rank_the_merged_database_names(
    tmp_path: Path, pki: Pki, capsys: pytest.CaptureFixture[str], seed: int, n: int, outlier: int, skewed: int,
    magnitude: float,
) -> None:  # fmt: skip
    p = Params(seed=seed, magnitude=magnitude, n_nodes=n, outlier=outlier)
    f = build(tmp_path, "late-rank", p, skewed)
    merged = _late([c.as_dict() for c in explain_file(f.merged).chains])
    assert [c["node"] for c in merged] == [p.outlier_node]
    with agents_in_thread(pki, _agents(f, range(f.p.n_nodes))) as servers:
        doc, err = _explain_nodes(servers, pki, capsys, tmp_path)
        fleet = explain_sync(node_specs(servers), client_settings(pki))
    assert doc["answered"] == n and "late rank across nodes" not in err, err
    (told,) = _late(doc["chains"])
    want, got = merged[0], told
    assert got["node"] == p.outlier_node and got["severity"] == want["severity"]
    assert got["evidence"]["lost_ms"] == pytest.approx(want["evidence"]["lost_ms"], rel=LOST_REL)
    assert abs(got["evidence"]["late_entries"] - want["evidence"]["late_entries"]) <= 1
    assert got["evidence"]["late_entries"] >= rules_ranks.MIN_LATE and got["evidence"]["peers"] == n - 1
    assert 0 < got["evidence"]["lost_share"] <= 1 and got["evidence"]["missing_signal"] == "nccl_calls"
    assert doc["straggler"]["outlier"] == p.outlier_node and "is the late rank" in doc["straggler"]["line"]
    # one chain per lost time: the late rank's own host-code chain is folded into it, as on the merged database
    assert not [c for c in doc["chains"] if c["node"] == p.outlier_node and c["family"] == "idle/host_code"]
    # the chain's time is on the late rank's own clock (its recording's), as every chain its agent sends
    ahead = SKEW_NS if skewed == outlier else 0
    assert abs(got["detected_at"] - (want["detected_at"] + ahead)) <= 5 * MS

    # the same summaries on the nodes' own clocks: the skewed node's waits (or lateness) no longer line up
    summaries, older, unclocked = node_summaries(fleet.outcomes)
    assert not older and not unclocked and [s.node for s in summaries] == [p.node_name(i) for i in range(n)]
    own_clock = [s.on_clock(-s.threads[0].offset_ns) if s.threads else s for s in summaries]
    assert [c.node for c in late_ranks(summaries, []) if c.family == "late-rank"] == [p.outlier_node]
    if skewed == outlier or n == 2:  # at most the lateness that fell on peers' waits by chance: a fraction of it
        wrong = [c.evidence["lost_ms"] for c in late_ranks(own_clock, []) if c.family == "late-rank"]
        assert sum(wrong) < 0.5 * got["evidence"]["lost_ms"], wrong


@pytest.mark.parametrize("seed", [21, pytest.param(22, marks=pytest.mark.slow)])
def test_a_healthy_fleet_gets_no_late_rank_nor_high_or_medium(
    tmp_path: Path, pki: Pki, capsys: pytest.CaptureFixture[str], seed: int
) -> None:
    p = Params(seed=seed, magnitude=0.065, n_nodes=3, outlier=1)
    f = build(tmp_path, "healthy-collective", p, skewed=1)
    assert not [c for c in explain_file(f.merged).chains if c.severity in ("HIGH", "MEDIUM") or c.family == "late-rank"]
    with agents_in_thread(pki, _agents(f, range(f.p.n_nodes))) as servers:
        doc, err = _explain_nodes(servers, pki, capsys, tmp_path)
    assert doc["answered"] == 3 and "late rank across nodes" not in err
    said = [(c["node"], c["family"], c["severity"]) for c in doc["chains"]]
    assert not [s for s in said if s[2] in ("HIGH", "MEDIUM") or s[1] == "late-rank"], said
    assert "late rank" not in doc["straggler"]["line"]


@pytest.mark.parametrize("old", [0, 2])  # a peer's agent, then the late rank's own
def test_an_agent_without_the_summary_is_one_line_and_every_answer_stands(
    tmp_path: Path, pki: Pki, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, old: int
) -> None:
    """Node ``old``'s agent predates the summary: it refuses ``steps`` (400, an unknown parameter) and is
    asked again without it; the others are judged without it, and one line says so."""
    p = Params(seed=11, magnitude=0.16, n_nodes=3, outlier=2)
    f = build(tmp_path, "late-rank", p, skewed=2)
    with monkeypatch.context() as m:
        m.setattr(endpoints, "CHAINS_PARAMS", tuple(k for k in endpoints.CHAINS_PARAMS if k != STEPS))
        older = agents_in_thread(pki, _agents(f, [old]))
        old_server = older.__enter__()
    try:
        with agents_in_thread(pki, _agents(f, [i for i in range(3) if i != old])) as servers:
            doc, err = _explain_nodes([*servers, *old_server], pki, capsys, tmp_path)
    finally:
        older.__exit__(None, None, None)
    lines = [x for x in err.splitlines() if "late rank across nodes" in x]
    assert len(lines) == 1 and p.node_name(old) in lines[0] and "older agent" in lines[0], err
    assert doc["answered"] == 3 and len(doc["notes"]) == 1 and doc["notes"][0] in lines[0]
    told = [c["node"] for c in _late(doc["chains"])]
    if old == p.outlier:  # its lateness is seen by its agent alone: host code, as that node's own answer says
        assert told == [] and [c for c in doc["chains"] if c["node"] == p.outlier_node]
    else:  # the late rank and the peer that still sends its summary
        assert told == [p.outlier_node]


def test_the_summary_is_bounded_and_keeps_the_long_host_code_first(tmp_path: Path) -> None:
    """A node's summary holds only the gaps that can matter, at most MAX_GAPS a thread: with more, the
    long host-code gaps first, then the longest waits."""
    import numpy as np

    from ingero.explain.rules_ranks_fleet import _summary

    rng = np.random.default_rng(3)
    n = 6 * MAX_GAPS
    a = np.cumsum(rng.integers(10 * MS, 12 * MS, n)).astype(np.int64)
    host = rng.normal(400_000, 20_000, n).astype(np.int64)
    off = np.where(rng.random(n) < 0.4, rng.integers(2 * MS, 9 * MS, n), rng.integers(0, 50_000, n)).astype(np.int64)
    late = rng.choice(n, 300, replace=False)
    host[late] += 8 * MS
    t = _summary("gpu-node-00", 1, 1, None, (a, a + host + off, host, off, int(a[-1] - a[0])))
    assert t.truncated and t.start.size == MAX_GAPS and t.gaps == n and bool(np.all(np.diff(t.start) > 0))
    assert int(t.late.sum()) == 300 and t.base == pytest.approx(400_000, rel=0.02)
    kept_waits = t.off[~t.late] - t.usual_off
    assert int(kept_waits.min()) >= int(np.sort(off - t.usual_off)[-(MAX_GAPS - 300) - 300 :].min())
    back = type(t).from_dict(t.node, json.loads(json.dumps(t.as_dict())))
    assert all(np.array_equal(getattr(back, k), getattr(t, k)) for k in ("start", "end", "host", "off", "late"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["late-rank", "healthy-collective"])
def test_per_node_summaries_judge_as_the_merged_database_over_seeds(tmp_path: Path, family: str) -> None:
    """Many seeds, the late rank anywhere but first, magnitudes both sides of each severity threshold, a
    clock anywhere ahead by up to a second and measured within ±1 ms: the nodes' own summaries (what each
    agent sends) judged on one clock name what the merged database names, with the same lost time."""
    import numpy as np

    from ingero.explain.engine import explain
    from ingero.store.db import open_readonly

    rng = np.random.default_rng(20)
    for seed in range(12):
        n = 2 + seed % 3
        magnitude = [0.3, 0.16, 0.065, 0.04, 0.015][seed % 5]
        p = Params(seed=100 + seed, magnitude=magnitude, n_nodes=n, outlier=1 + seed % (n - 1))
        skewed, skew = int(rng.integers(n)), int(rng.integers(-1000, 1000)) * MS
        (tmp_path / str(seed)).mkdir()
        f = build(tmp_path / str(seed), family, p, skewed)
        _shift(f.dbs[skewed], skew - SKEW_NS)  # this seed's own clock error
        merged = [c for c in explain_file(f.merged).chains if c.family == "late-rank"]
        summaries = []
        for i, db in enumerate(f.dbs):
            conn = open_readonly(db)
            try:
                (mine,) = explain(conn, steps=True).steps
            finally:
                conn.close()
            measured = (skew if i == skewed else 0) + int(rng.integers(-MS, MS))  # the offset, measured within 1 ms
            summaries.append(mine.on_clock(measured))
        told = [c for c in late_ranks(summaries, []) if c.family == "late-rank"]
        said = [(c.node, c.severity) for c in told]
        assert said == [(c.node, c.severity) for c in merged], (seed, said)
        if family != "late-rank":
            assert not said, seed
            continue
        assert [c.node for c in told] == [p.outlier_node], (seed, said)
        assert told[0].evidence["lost_ms"] == pytest.approx(merged[0].evidence["lost_ms"], rel=LOST_REL), seed
