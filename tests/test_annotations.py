"""``ingero annotate`` marks reach explain (text and JSON) and the Perfetto timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ingero.cli.main import main
from ingero.identity import Identity
from ingero.store.annotations import add_annotation
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
