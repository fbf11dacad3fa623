"""``ingero annotate`` marks reach explain (text and JSON) and the Perfetto timeline."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from ingero.cli.main import main
from ingero.identity import Identity
from ingero.store.annotations import add_annotation, list_annotations
from ingero.store.writer import StoreWriter

S = 1_000_000_000
T0 = 1_700_000_000 * S


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "marks.db"
    with StoreWriter(path, Identity("node-a")) as w:
        # cudaMalloc calls of pid 7, one per 10 ms for a second
        w.write_batch([(T0 + i * 10_000_000, 7, 7, 1, 1, 20_000, 0, 4096, 0, 0, 0, 0) for i in range(100)])
        add_annotation(path, "deploy v2.3", node="node-a", timestamp=T0 + S // 2, author="ops@a")
        add_annotation(path, "before the window", node="node-a", timestamp=T0 - 3600 * S, author="ops@a")
    return path


def test_explain_lists_the_annotations_of_its_window(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frm, to = str(T0 // S), str((T0 + 2 * S) // S)
    assert main(["explain", "--db", str(db), "--from", frm, "--to", to, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(a["message"], a["timestamp"], a["author"]) for a in doc["annotations"]] == [
        ("deploy v2.3", T0 + S // 2, "ops@a")
    ]
    assert main(["explain", "--db", str(db), "--from", frm, "--to", to]) == 0
    text = capsys.readouterr().out
    assert "annotations (ingero annotate):" in text and "deploy v2.3" in text
    assert "before the window" not in text


def test_export_shows_annotations_on_the_timeline(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert main(["export", "--db", str(db), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    marks = [e for e in events if e.get("cat") == "annotation"]
    assert sorted(m["name"] for m in marks) == ["annotation: before the window", "annotation: deploy v2.3"]
    deploy = next(m for m in marks if m["args"]["message"] == "deploy v2.3")
    first_launch = min(e["ts"] for e in events if e.get("ph") == "X")
    assert deploy["ph"] == "i" and deploy["s"] == "p"
    assert deploy["ts"] - first_launch == pytest.approx(500_000, abs=1)  # 0.5 s after the first call, in µs


def test_ingero_written_annotations_read_and_their_sql_runs(tmp_path: Path) -> None:
    """The table has Ingero's layout: its INSERT and SELECT run here, and its label rows read as text."""
    db = tmp_path / "mixed.db"
    add_annotation(db, "deploy v2.3", node="n1", timestamp=1_000, author="ops@host")
    conn = sqlite3.connect(db)
    try:
        conn.execute(  # Ingero's RecordAnnotation statement
            "INSERT INTO annotations (timestamp, labels, pid, start_time, span_start, span_end, "
            "peer_uid, peer_gid, peer_pid) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (2_000, '{"epoch":"3","step":"1200"}', 42, 7, 0, 0, 1000, 1000, 99),
        )
        conn.commit()
        marks = list_annotations(conn)
        assert [(m.timestamp, m.node, m.message, m.author) for m in marks] == [
            (1_000, "n1", "deploy v2.3", "ops@host"),
            (2_000, "", "epoch=3, step=1200", "uid 1000"),
        ]
        ingero_query = conn.execute(  # Ingero's QueryAnnotations
            "SELECT timestamp, labels, pid, start_time, span_start, span_end, peer_uid, peer_gid, peer_pid "
            "FROM annotations WHERE 1=1 AND timestamp >= ? ORDER BY timestamp DESC LIMIT ?",
            (0, 10),
        ).fetchall()
        assert [r[0] for r in ingero_query] == [2_000, 1_000]
    finally:
        conn.close()
