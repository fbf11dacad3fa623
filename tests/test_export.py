"""ingero export --format perfetto: Chrome Trace Event JSON that Perfetto's trace processor loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from ingero.cli.main import main
from ingero.export.perfetto import TID_STRIDE
from ingero.store.db import open_readonly
from ingero.store.merge import merge_databases
from tests.conftest import INVESTIGATIONS, write_db

NODES = ("sample-gpu-node-01.db", "sample-gpu-node-02.db", "sample-gpu-node-03.db")
TRACE_EVENT_SCHEMA = Path(__file__).parent / "data" / "trace_event_format.schema.json"


def export(db: Path, out: Path, *extra: str) -> dict[str, Any]:
    assert main(["export", "--db", str(db), "-o", str(out), *extra]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    check_trace_invariants(doc)
    return doc


def check_trace_invariants(doc: dict[str, Any]) -> None:
    """What Perfetto's JSON importer relies on: named processes/threads, globally unique thread ids,
    non-negative durations, and properly nested slices on every thread."""
    events = doc["traceEvents"]
    proc_names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    thread_names = {e["tid"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    by_thread: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "M":
            continue
        assert e["pid"] in proc_names, e
        if e["ph"] == "C":  # a counter track: on its process, one numeric arg
            assert e["ts"] >= 0 and [type(v) for v in e["args"].values()] == [float], e
            continue
        assert thread_names.get(e["tid"]) == e["pid"], e  # every thread named, under its own process
        assert isinstance(e["ts"], int | float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        else:
            assert e["ph"] == "i" and e["s"] == "t"
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[float] = []
        for start, end in spans:
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], "slices on one thread must nest"
            stack.append(end)


def slices(doc: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] in ("X", "i") and all(e.get(k) == v for k, v in match.items())]


def test_cluster_sample_exports_one_track_per_node(tmp_path: Path, samples: Path) -> None:
    doc = export(samples / "sample-cluster.db", tmp_path / "t.json")
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert procs == {1: "gpu-node-01", 2: "gpu-node-02", 3: "gpu-node-03"}
    events = [e for e in doc["traceEvents"] if e["ph"] in ("X", "i") and e["cat"] != "causal_chain"]
    assert len(events) == 600  # every event, nothing dropped
    per_node = Counter((e["pid"], e["cat"]) for e in events)
    assert per_node == {
        (1, "HOST"): 99,
        (1, "IO"): 101,
        (2, "HOST"): 62,
        (2, "DRIVER"): 40,
        (2, "IO"): 98,
        (3, "HOST"): 58,
        (3, "DRIVER"): 36,
        (3, "IO"): 106,
    }
    # exact placement: a cuMemAlloc is stamped at entry, an off-CPU period at its end
    base = doc["metadata"]["base_unix_ns"]
    conn = open_readonly(samples / "sample-cluster.db")
    ts, dur, tid = conn.execute(
        "SELECT timestamp, duration, tid FROM events WHERE node = 'gpu-node-02' AND source = 4 ORDER BY timestamp LIMIT 1"
    ).fetchone()
    alloc = min(slices(doc, pid=2, name="cuMemAlloc"), key=lambda e: e["ts"])
    assert (alloc["ts"], alloc["dur"], alloc["tid"]) == ((ts - base) / 1000, dur / 1000, 2 * TID_STRIDE + tid)
    assert alloc["args"]["bytes"] > 0
    ts, dur = conn.execute(
        "SELECT timestamp, duration FROM events WHERE node = 'gpu-node-02' AND source = 3 ORDER BY timestamp LIMIT 1"
    ).fetchone()
    off = min(slices(doc, pid=2, name="off-CPU"), key=lambda e: e["ts"])
    assert (off["ts"], off["dur"]) == ((ts - dur - base) / 1000, dur / 1000)
    # threads carry the process name; block I/O sits on lanes
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert "python3 4599/4599" in names and "block I/O #1" in names
    # causal chains: markers on per-severity lanes, coloured by severity
    chains = slices(doc, cat="causal_chain")
    assert len(chains) == 6
    assert Counter((c["pid"], c["args"]["severity"], c["cname"]) for c in chains) == {
        (1, "HIGH", "terrible"): 2,
        (1, "MEDIUM", "bad"): 2,
        (2, "MEDIUM", "bad"): 1,
        (3, "MEDIUM", "bad"): 1,
    }
    assert all(c["name"].startswith(c["args"]["severity"]) and c["args"]["recommendations"] for c in chains)
    assert "causal chains: HIGH" in names
    assert [n["node"] for n in doc["metadata"]["nodes"]] == ["gpu-node-01", "gpu-node-02", "gpu-node-03"]
    assert doc["metadata"]["base_unix_ns"] % 1_000_000_000 == 0


def test_merged_nodes_export_like_ingero_cluster(tmp_path: Path, samples: Path) -> None:
    merged = tmp_path / "cluster.db"
    merge_databases([samples / n for n in NODES], merged)
    mine = export(merged, tmp_path / "mine.json")
    theirs = export(samples / "sample-cluster.db", tmp_path / "theirs.json")
    strip = [
        (e["ph"], e["pid"], e["tid"], e["ts"], e.get("dur"), e["name"]) for e in mine["traceEvents"] if e["ph"] != "M"
    ]
    assert sorted(strip) == sorted(
        (e["ph"], e["pid"], e["tid"], e["ts"], e.get("dur"), e["name"]) for e in theirs["traceEvents"] if e["ph"] != "M"
    )
    # merged databases carry per-node process names: pid 96 (it issues block I/O) differs on nodes 01 and 02
    issuers = {(e["pid"], e["args"].get("process")) for e in slices(mine, cat="IO") if e["args"]["pid"] == 96}
    assert issuers == {(1, "jbd2/nvme1n1p1-8"), (2, "jbd2/nvme0n1p1-8")}


def test_window_and_single_node(tmp_path: Path, samples: Path) -> None:
    doc = export(samples / NODES[2], tmp_path / "t.json", "--since", "1s")
    conn = open_readonly(samples / NODES[2])
    last = conn.execute("SELECT max(timestamp) FROM events").fetchone()[0]
    want = conn.execute("SELECT count(*) FROM events WHERE timestamp >= ?", (last - 1_000_000_000,)).fetchone()[0]
    assert 0 < want < 200
    assert len([e for e in doc["traceEvents"] if e["ph"] in ("X", "i") and e["cat"] != "causal_chain"]) == want
    assert doc["metadata"]["window"]["start_ns"] == last - 1_000_000_000


def test_overlaps_become_instants_and_io_gets_lanes(tmp_path: Path) -> None:
    t0 = 1_775_218_723_000_000_000
    rows = [
        (t0, 50, 51, 1, 5, 10_000, 0, 0, 0, 0, 0, 0),  # cudaStreamSync [t0, t0+10us] (entry-stamped)
        (t0 + 2_000, 50, 51, 1, 3, 1_000, 0, 0xABC, 0, 0, 0, 0),  # launch nested inside
        (t0 + 8_000, 50, 51, 4, 1, 5_000, 0, 0, 0, 0, 0, 0),  # cuLaunchKernel [8us, 13us]: crosses the end
        (t0 + 20_000, 50, 51, 3, 1, 4_000, 0, 0, 0, 0, 0, 0),  # off-CPU [16us, 20us]
        (t0 + 30_000, 50, 52, 5, 1, 20_000, 0, 4096, 0, 0, 0, 0),  # three overlapping block reads
        (t0 + 31_000, 50, 52, 5, 1, 20_000, 0, 4096, 0, 0, 0, 0),
        (t0 + 32_000, 50, 53, 5, 2, 5_000, 0, 8192, 0, 0, 0, 0),
        (t0 + 60_000, 50, 52, 5, 1, 1_000, 0, 4096, 0, 0, 0, 0),  # after all three: back on lane 1
        (t0 + 40_000, 50, 51, 3, 5, 0, 0, 0, 0, 0, 0, 0),  # process_exec: an instant
    ]
    db = write_db(tmp_path / "n.db", rows, node="gpu-x", rank=2, world_size=4)
    doc = export(db, tmp_path / "t.json")
    procs = [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"]
    assert procs == ["gpu-x (rank 2)"]
    crossing = slices(doc, name="cuLaunchKernel")
    assert len(crossing) == 1 and crossing[0]["ph"] == "i" and crossing[0]["args"]["overlaps_enclosing_slice"]
    assert slices(doc, name="cudaLaunchKernel")[0]["args"]["func"] == "0xabc"
    assert slices(doc, name="process_exec")[0]["ph"] == "i"
    lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    io = slices(doc, cat="IO")
    assert len(io) == 4 and all(e["ph"] == "X" for e in io)
    assert sorted(lanes[e["tid"]] for e in io) == ["block I/O #1", "block I/O #1", "block I/O #2", "block I/O #3"]


def test_ingero_08_and_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_merge import _make_ingero_08

    old = tmp_path / "old-node.db"
    _make_ingero_08(old)
    doc = export(old, tmp_path / "t.json")
    assert [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"] == ["old-node"]
    assert len(slices(doc, cat="DRIVER")) == 4
    capsys.readouterr()
    assert main(["export", "--db", str(old), "-o", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"]["source"] == "database"
    assert main(["export", "--db", str(tmp_path / "nope.db"), "-o", str(tmp_path / "x.json")]) == 1
    assert "no such database" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


# --- Perfetto's own trace processor -------------------------------------------------------------


def _trace_processor_shell() -> str | None:
    """The trace_processor_shell binary: $INGERO_TRACE_PROCESSOR, PATH, or the perfetto package's
    pinned prebuilt (cached under ~/.local/share/perfetto, downloaded on first use when reachable)."""
    env = os.environ.get("INGERO_TRACE_PROCESSOR")
    if env:
        return env
    found = shutil.which("trace_processor_shell")
    if found:
        return found
    try:
        from perfetto.prebuilts.manifests.trace_processor_shell import TRACE_PROCESSOR_SHELL_MANIFEST
        from perfetto.prebuilts.perfetto_prebuilts import get_perfetto_prebuilt

        cache = Path.home() / ".local" / "share" / "perfetto" / "prebuilts"
        before = set(cache.glob("*.tmp")) if cache.is_dir() else set()
        try:  # soft_fail: None when no prebuilt exists for this platform
            path = get_perfetto_prebuilt(TRACE_PROCESSOR_SHELL_MANIFEST, soft_fail=True)
        finally:
            for leftover in set(cache.glob("*.tmp")) - before if cache.is_dir() else ():
                leftover.unlink(missing_ok=True)
    except (subprocess.CalledProcessError, FileNotFoundError):  # the download (curl) failed, or there is no curl
        return None
    return None if path is None else str(path)


def test_trace_processor_loads_the_export(tmp_path: Path, samples: Path) -> None:
    shell = _trace_processor_shell()
    if shell is None:
        pytest.skip(
            "Perfetto's trace_processor_shell is not installed and cannot be downloaded here "
            "(set INGERO_TRACE_PROCESSOR=/path/to/trace_processor_shell)"
        )
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    out = tmp_path / "cluster.json"
    export(samples / "sample-cluster.db", out)
    tp = TraceProcessor(trace=str(out), config=TraceProcessorConfig(bin_path=shell))
    try:

        def q(sql: str) -> list[Any]:
            return list(tp.query(sql))

        procs = q("SELECT upid, name FROM process WHERE name LIKE 'gpu-node-%' ORDER BY name")
        assert [p.name for p in procs] == ["gpu-node-01", "gpu-node-02", "gpu-node-03"]
        per_node = {
            r.pname: r.n
            for r in q(
                "SELECT p.name AS pname, count(*) AS n FROM slice s JOIN thread_track tt ON s.track_id = tt.id "
                "JOIN thread USING (utid) JOIN process p USING (upid) WHERE s.category != 'causal_chain' "
                "GROUP BY p.name"
            )
        }
        assert per_node == {"gpu-node-01": 200, "gpu-node-02": 200, "gpu-node-03": 200}
        markers = q(
            "SELECT s.name, s.dur, EXTRACT_ARG(s.arg_set_id, 'args.severity') AS sev FROM slice s "
            "WHERE s.category = 'causal_chain'"
        )
        assert len(markers) == 6 and all(m.dur == 0 for m in markers)
        assert Counter(m.sev for m in markers) == {"HIGH": 2, "MEDIUM": 4}
        alloc = q("SELECT count(*) AS n, min(dur) AS lo FROM slice WHERE name = 'cuMemAlloc'")[0]
        assert alloc.n == 76 and alloc.lo > 0
        errors = q("SELECT name, value FROM stats WHERE severity IN ('error', 'data_loss') AND value > 0")
        assert errors == [], [(e.name, e.value) for e in errors]
    finally:
        tp.close()


# --- the Trace Event Format, checked by a JSON Schema written from its specification ---------------


def trace_event_format_errors(doc: dict[str, Any]) -> list[str]:
    """Where ``doc`` breaks the Trace Event Format (``data/trace_event_format.schema.json``, validated by
    the jsonschema package: nothing of ingero's exporter is involved)."""
    from jsonschema import Draft202012Validator

    schema = json.loads(TRACE_EVENT_SCHEMA.read_text())
    Draft202012Validator.check_schema(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in Draft202012Validator(schema).iter_errors(doc)]


def test_exports_are_valid_trace_event_format(tmp_path: Path, samples: Path) -> None:
    """Ingero's own sample node (durations, instants, chain markers, every metadata kind) and a serving
    node's engine series (counters): each export is valid against the format's schema."""
    from tests.engine_standin import recording

    docs = {
        "node": export(samples / NODES[0], tmp_path / "node.json"),
        "counters": export(
            recording(tmp_path / "serve.db", "serve-node-01", [(4242, "vllm", "kv_pressure")], 12),
            tmp_path / "serve.json",
        ),
    }
    phases = {name: Counter(e["ph"] for e in doc["traceEvents"]) for name, doc in docs.items()}
    assert {"M", "X", "i"} <= set(phases["node"]) and "C" in phases["counters"], phases  # what was checked
    for name, doc in docs.items():
        assert trace_event_format_errors(doc) == [], name


@pytest.mark.parametrize(
    "event",
    [
        {"ph": "X", "name": "a", "ts": 1, "pid": 1, "tid": 1},  # a complete event without its duration
        {"ph": "X", "name": "a", "ts": 1, "dur": -1, "pid": 1, "tid": 1},
        {"ph": "i", "name": "a", "ts": 1, "pid": 1, "s": "t"},  # a thread-scoped instant without its thread
        {"ph": "i", "name": "a", "ts": 1, "pid": 1, "tid": 1, "s": "x"},
        {"ph": "C", "name": "a", "ts": 1, "pid": 1, "args": {"value": "3"}},  # counter values are numbers
        {"ph": "M", "name": "process_title", "pid": 1, "args": {"name": "x"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "args": {"name": "x"}},  # whose thread?
        {"ph": "M", "name": "process_sort_index", "pid": 1, "args": {"sort_index": "1"}},
        {"ph": "Q", "name": "a", "ts": 1, "pid": 1, "tid": 1},
        {"ph": "X", "name": "a", "ts": 1, "dur": 1, "pid": "1", "tid": 1},
    ],
)
def test_the_trace_event_schema_refuses_what_the_format_forbids(event: dict[str, Any]) -> None:
    assert trace_event_format_errors({"traceEvents": [event]})


def test_the_trace_event_schema_takes_the_formats_own_kinds_of_event() -> None:
    valid = [
        {"ph": "B", "name": "a", "cat": "c", "ts": 1, "pid": 1, "tid": 2},
        {"ph": "E", "ts": 2, "pid": 1, "tid": 2},
        {"ph": "X", "name": "a", "ts": 1.5, "dur": 0, "pid": 1, "tid": 2, "args": {"k": [1]}},
        {"ph": "i", "name": "a", "ts": 1, "pid": 1, "s": "g"},
        {"ph": "i", "name": "a", "ts": 1, "pid": 1, "tid": 2},
        {"ph": "C", "name": "a", "ts": 1, "pid": 1, "args": {"cats": 0, "dogs": 2.5}},
        {"ph": "b", "name": "a", "cat": "c", "ts": 1, "pid": 1, "id": "0x1"},
        {"ph": "e", "name": "a", "cat": "c", "ts": 2, "pid": 1, "id": "0x1"},
        {"ph": "s", "name": "a", "cat": "c", "ts": 1, "pid": 1, "tid": 2, "id": 7},
        {"ph": "f", "name": "a", "cat": "c", "ts": 2, "pid": 1, "tid": 3, "id": 7, "bp": "e"},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "p"}},
        {"ph": "M", "name": "process_labels", "pid": 1, "args": {"labels": "l"}},
        {"ph": "M", "name": "process_sort_index", "pid": 1, "args": {"sort_index": 2}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "t"}},
        {"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": 2, "args": {"sort_index": -1}},
    ]
    assert trace_event_format_errors({"traceEvents": valid, "displayTimeUnit": "ns", "otherData": {}}) == []
    assert trace_event_format_errors({"traceEvents": {"ph": "X"}})
    assert trace_event_format_errors({"traceEvents": [], "displayTimeUnit": "s"})


@pytest.mark.skipif(
    not (INVESTIGATIONS / "sample-cluster.db").exists(), reason="investigations/ not generated (make investigations)"
)
def test_investigations_cluster_exports(tmp_path: Path) -> None:
    db = INVESTIGATIONS / "sample-cluster.db"
    doc = export(db, tmp_path / "t.json")
    procs = [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"]
    assert procs == ["gpu-node-01 (rank 0)", "gpu-node-02 (rank 1)", "gpu-node-03 (rank 2)"]
    total = open_readonly(db).execute("SELECT count(*) FROM events").fetchone()[0]
    assert len([e for e in doc["traceEvents"] if e["ph"] in ("X", "i") and e["cat"] != "causal_chain"]) == total
    chains = slices(doc, cat="causal_chain")
    assert chains and all(c["pid"] == 1 for c in chains)  # the straggler, gpu-node-01, alone has a chain


def test_engine_series_are_counter_tracks(tmp_path: Path) -> None:
    """A serving node's recording (trace --inference): each engine process and metric is a counter track
    on the node's process holding the recorded values; a histogram is its mean per scrape interval; its
    buckets and the _created start times are not tracks."""
    from ingero.store.engine_metrics import load_rows, series
    from tests.engine_standin import recording

    db = recording(tmp_path / "serve.db", "serve-node-01", [(4242, "vllm", "kv_pressure")], 12)
    doc = export(db, tmp_path / "t.json")
    counters: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "C":
            counters[e["name"]].append((e["ts"], e["args"]["value"]))
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert list(procs.values()) == ["serve-node-01"]
    assert not [n for n in counters if n.endswith("_bucket") or n.endswith("_created") or "_sum" in n]
    conn = open_readonly(db)
    try:
        recorded = series(load_rows(conn))
    finally:
        conn.close()
    for metric in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
        s = recorded[("serve-node-01", 4242, "vllm", metric)]
        points = counters[f"vllm 4242: {metric}"]
        assert [v for _, v in points] == s.values  # every recorded change, in order
        assert [t for t, _ in points] == sorted(t for t, _ in points)
    assert counters["vllm 4242: vllm:kv_cache_usage_perc"][-1][1] == 0.985
    ttft = counters["vllm 4242: vllm:time_to_first_token_seconds (mean)"]
    assert len(ttft) >= 10 and all(v == pytest.approx(0.09) for _, v in ttft)  # kv_pressure: 90 ms throughout


def counter_values(doc: dict[str, Any]) -> dict[tuple[int, str], list[float]]:
    out: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "C":
            out[(e["pid"], e["name"])].append(e["args"]["value"])
    return dict(out)


def test_fleet_export_carries_the_engine_series(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`export --nodes`: an agent's engine series arrive as the same counter tracks a local export draws,
    paged through the query API (pages of 100 rows here: the fetch goes on past the first)."""
    from ingero.export import fleet_source
    from tests.engine_standin import recording
    from tests.fleet_agents import AgentSpec, agents_in_thread, make_pki

    engines = [(4242, "vllm", "kv_pressure"), (5151, "sglang", "queue_growth")]
    db = recording(tmp_path / "serve.db", "serve-node-02", engines, 12, full=True)
    local = counter_values(export(db, tmp_path / "local.json"))
    conn = open_readonly(db)
    try:
        (rows,) = conn.execute("SELECT count(*) FROM engine_metrics WHERE metric NOT LIKE '%bucket'").fetchone()
    finally:
        conn.close()
    monkeypatch.setattr(fleet_source, "PAGE_ROWS", 100)
    assert rows > 3 * fleet_source.PAGE_ROWS
    pki = make_pki(tmp_path / "pki")
    out = tmp_path / "fleet.json"
    with agents_in_thread(pki, [AgentSpec(db, "serve-node-02")]) as servers:
        tls = ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]
        empty = tmp_path / "empty.yaml"
        empty.write_text("")
        code = main(["export", "--config", str(empty), "--nodes", f"127.0.0.1:{servers[0].port}", *tls, "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    check_trace_invariants(doc)
    assert counter_values(doc) == local and len(local) > 20


def test_a_summary_is_its_mean_track_and_its_quantiles_are_not_tracks(tmp_path: Path) -> None:
    """TGI's summaries (quantile labels) would add up to nonsense summed over their quantiles: only the
    mean per scrape (Δsum / Δcount) is drawn, beside the engine's gauges."""
    from ingero.identity import Identity
    from ingero.store.writer import StoreWriter

    s, t0 = 1_000_000_000, 1_790_000_000_000_000_000
    rows = []
    for k in range(5):
        ts = t0 + k * s
        rows += [
            (ts, 9, "tgi", "tgi_request_duration", '{"quantile":"0.5"}', 0.1 + k),
            (ts, 9, "tgi", "tgi_request_duration", '{"quantile":"0.99"}', 0.2 + k),
            (ts, 9, "tgi", "tgi_request_duration_sum", "", 0.25 * 4 * k),
            (ts, 9, "tgi", "tgi_request_duration_count", "", 4.0 * k),
            (ts, 9, "tgi", "tgi_queue_size", "", float(k)),
        ]
    db = tmp_path / "tgi.db"
    with StoreWriter(db, Identity("serve-node-04")) as w:
        w.write_batch(engine_metrics=rows)
    got = {n: vs for (_, n), vs in counter_values(export(db, tmp_path / "t.json")).items()}
    assert got == {"tgi 9: tgi_queue_size": [0.0, 1.0, 2.0, 3.0, 4.0], "tgi 9: tgi_request_duration (mean)": [0.25] * 4}
