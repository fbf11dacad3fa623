"""`ingero query` on local databases: output formats, filters, and one-line errors for bad input."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ingero.cli.main import main
from tests.conftest import ROOT, SEED_QUERY, write_db

T0 = 1_775_218_723_000_000_000


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def db(tmp_path: Path) -> Path:
    events = []
    for i in range(100):
        events.append((T0 + i * 10**9, 10 + i % 2, 10, 1, 1, 1000 + i, 0, 4096, 0, 0, 0, 0))  # cudaMalloc
        events.append((T0 + i * 10**9 + 5, 10, 10, 3, 1, 50_000, 0, 0, 0, 0, 0, 0))  # sched_switch
    return write_db(tmp_path / "q.db", events, node="gpu-node-04")


def test_seed_query_on_sample_cluster(capsys: pytest.CaptureFixture[str], samples: Path) -> None:
    code, out, err = run_cli(capsys, "query", "--db", str(samples / "sample-cluster.db"), "--json", SEED_QUERY)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["columns"] == ["node", "source", "cnt", "avg_us"]
    assert len(doc["rows"]) == 8 and doc["truncated"] is False
    assert doc["rows"][3][:3] == ["gpu-node-02", 4, 40]


def test_table_and_csv(capsys: pytest.CaptureFixture[str], db: Path) -> None:
    code, out, err = run_cli(capsys, "query", "--db", str(db), SEED_QUERY)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["node", "source", "cnt", "avg_us"]
    assert lines[2].split()[:3] == ["gpu-node-04", "1", "100"]
    assert "2 row(s)" in err
    code, out, _ = run_cli(capsys, "query", "--db", str(db), "--csv", SEED_QUERY)
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["node", "source", "cnt", "avg_us"] and rows[1][:3] == ["gpu-node-04", "1", "100"]


def test_filters_restrict_events(capsys: pytest.CaptureFixture[str], db: Path) -> None:
    q = "SELECT count(*) AS n FROM events"
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--json", "--op", "cudaMalloc", q)
    assert json.loads(out)["rows"] == [[100]]
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--json", "--op", "cudaMalloc", "--pid", "11", q)
    assert json.loads(out)["rows"] == [[50]]
    # not live: --since counts back from the recording's last event, and says so
    code, out, err = run_cli(capsys, "query", "--db", str(db), "--json", "--since", "10s", q)
    assert code == 0 and json.loads(out)["rows"] == [[21]]
    assert "not a live recording" in err
    # joins see the filtered view too
    join = "SELECT o.name, count(*) FROM events e JOIN ops o ON e.source = o.source_id AND e.op = o.op_id GROUP BY 1"
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--json", "--op", "sched_switch", join)
    assert json.loads(out)["rows"] == [["sched_switch", 100]]


def test_default_query_and_limit(capsys: pytest.CaptureFixture[str], db: Path) -> None:
    code, out, err = run_cli(capsys, "query", "--db", str(db), "--json", "--limit", "5")
    doc = json.loads(out)
    assert code == 0 and len(doc["rows"]) == 5 and doc["truncated"] is True
    assert "truncated" in err
    assert doc["columns"][:4] == ["id", "timestamp", "source", "op"]
    assert doc["rows"][0][0] == "gpu-node-04:200"  # newest first


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--db", "/nonexistent/x.db", "SELECT 1"], "no such database file"),
        (["--db", "{notdb}", "SELECT 1"], "not a SQLite database"),
        (["--db", "{db}", "DELETE FROM events"], "not allowed"),
        (["--db", "{db}", "SELECT * FROM events; DROP TABLE events"], "exactly one SQL statement"),
        (["--db", "{db}", "SELEKT 1"], "SQL error"),
        (["--db", "{db}", "SELECT nope FROM events"], "no such column"),
        (["--db", "{db}", "--op", "cudaMallocc", "SELECT 1"], "unknown op"),
        (["--db", "{db}", "--since", "soon", "SELECT 1"], "cannot parse duration"),
        (["--db", "{db}", "--limit", "0", "SELECT 1"], "limit"),
        (["--db", "{db}", "--nodes", "a:1", "SELECT 1"], "--db and --nodes"),
        (["SELECT 1"], "ingero.db: no such database"),  # the default database, said by its path
    ],
)
def test_bad_input_is_one_line_error(
    capsys: pytest.CaptureFixture[str],
    db: Path,
    tmp_path: Path,
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("INGERO_CONFIG", raising=False)
    notdb = tmp_path / "junk.db"
    notdb.write_text("hello, not sqlite\n" * 50)
    argv = ["query"] + [a.format(db=db, notdb=notdb) for a in args]
    code, out, err = run_cli(capsys, *argv)
    assert code != 0
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ingero: error: ") and message in lines[0]
    assert "Traceback" not in err


def test_subprocess_entry_point_and_help(db: Path) -> None:
    exe = Path(sys.executable).parent / "ingero"
    proc = subprocess.run([str(exe), "query", "--db", str(db), "DROP TABLE events"], capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stderr.startswith("ingero: error:") and "Traceback" not in proc.stderr
    helps = subprocess.run([str(exe), "query", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert helps.returncode == 0 and "examples:" in helps.stdout and "--nodes" in helps.stdout


def test_tsv_nl_no_headers_and_sql_from_file_or_stdin(
    capsys: pytest.CaptureFixture[str], db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sql = "SELECT source, count(*) AS n FROM events GROUP BY source ORDER BY source"
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--tsv", sql)
    assert out.splitlines() == ["source\tn", "1\t100", "3\t100"]
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--tsv", "--no-headers", sql)
    assert out.splitlines() == ["1\t100", "3\t100"]
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--nl", sql)
    assert [json.loads(line) for line in out.splitlines()] == [{"source": 1, "n": 100}, {"source": 3, "n": 100}]
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--no-headers", sql)
    assert [line.split() for line in out.splitlines()] == [["1", "100"], ["3", "100"]]
    f = tmp_path / "q.sql"
    f.write_text(sql + "\n")
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--csv", "-f", str(f))
    assert out.splitlines() == ["source,n", "1,100", "3,100"]
    monkeypatch.setattr("sys.stdin", io.StringIO(sql))
    _, out, _ = run_cli(capsys, "query", "--db", str(db), "--csv", "-")
    assert out.splitlines() == ["source,n", "1,100", "3,100"]
    code, out, err = run_cli(capsys, "query", "--db", str(db), "-f", str(tmp_path / "missing.sql"))
    assert code == 2 and out == "" and "--file" in err and "cannot read" in err


def test_bad_sql_is_exit_2_locally_too(capsys: pytest.CaptureFixture[str], db: Path) -> None:
    code, out, err = run_cli(capsys, "query", "--db", str(db), "SELEC 1")
    assert code == 2 and out == "" and err.count("ingero: error:") == 1


def test_tables_fit_the_terminal_width_and_pipes_get_everything() -> None:
    from ingero.texttable import render_table

    cols = ["node", "summary", "n"]
    rows = [["gpu-node-01", "cuLaunchKernel p99 63x p50 — CPU preemption " * 3, 12], ["gpu-node-02", "short", 7]]
    full = render_table(cols, rows)
    assert max(len(line) for line in full.splitlines()) > 100
    fitted = render_table(cols, rows, width=60)
    lines = fitted.splitlines()
    assert max(len(line) for line in lines) <= 60, fitted
    assert "…" in lines[2] and lines[2].startswith("gpu-node-01") and lines[2].rstrip().endswith("12")
    assert "short" in lines[3]
