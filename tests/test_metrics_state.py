"""The metric state: per-batch numpy folding checked against per-event Python, labels, cardinality,
the database feed against SQL, and the Prometheus exposition parsed back by prometheus-client."""

from __future__ import annotations

import bisect
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ingero.agent.trace.recorder import BYTES_OPS, OP_NCCL_COMM_INIT
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.identity import Identity
from ingero.metrics import registry as r
from ingero.metrics.dbfeed import DatabaseFeed, database_provider, db_size
from ingero.metrics.prometheus import families, parse_prometheus_addr
from ingero.metrics.state import MetricState, duration_buckets, op_labels
from ingero.store import catalog
from tests.conftest import INVESTIGATIONS

MS = 1_000_000


def events(rows: list[dict[str, int]]) -> np.ndarray:
    ev = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for i, row in enumerate(rows):
        for k, v in row.items():
            ev[k][i] = v
    ev["stack_id"] = -1
    return ev


def state() -> MetricState:
    return MetricState(Identity("gpu-node-07", rank=3), "trace")


def series(st: MetricState) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """name + sorted labels -> value, from the Prometheus text the state renders."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from ingero.metrics.prometheus import IngeroCollector

    reg = CollectorRegistry(auto_describe=False)
    reg.register(IngeroCollector(st.snapshot))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def lab(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"node": "gpu-node-07", "rank": "3", **kw}.items()))


def test_histogram_counts_and_sums_match_per_event_python() -> None:
    rng = np.random.default_rng(7)
    st = state()
    n = 20_000
    ref_buckets: dict[tuple[int, int], list[int]] = {}
    ref_sum: dict[tuple[int, int], int] = {}
    bounds = [round(b * 1e9) for b in r.DURATION_BUCKETS_S]
    ops = [(catalog.CUDA, 3), (catalog.DRIVER, 1), (catalog.CUDA, 5), (catalog.IO, 2)]
    for _ in range(4):  # several batches, as the pipeline drains them
        batch = np.zeros(n, dtype=EVENT_DTYPE)
        which = rng.integers(0, len(ops), n)
        batch["source"] = [ops[w][0] for w in which]
        batch["op"] = [ops[w][1] for w in which]
        batch["duration"] = np.exp(rng.uniform(np.log(200), np.log(30e9), n)).astype(np.uint64)
        batch["duration"][:5] = bounds[3]  # exactly on a bound: counted in that bucket (le)
        batch["pid"] = rng.integers(1, 5000, n)  # many pids: never labels
        batch["ts"] = np.arange(n) * 10
        st.observe(batch)
        for s, o, d in zip(batch["source"].tolist(), batch["op"].tolist(), batch["duration"].tolist(), strict=True):
            b = ref_buckets.setdefault((s, o), [0] * (len(bounds) + 1))
            b[bisect.bisect_left(bounds, d)] += 1
            ref_sum[(s, o)] = ref_sum.get((s, o), 0) + d
    got = series(st)
    for (s, o), b in ref_buckets.items():
        src, op = next(x[1] for x in catalog.SOURCES if x[0] == s), catalog.op_name(s, o)
        cum = 0
        for le, count in zip([*r.DURATION_BUCKETS_S, float("inf")], b, strict=True):
            cum += count
            le_s = "+Inf" if le == float("inf") else repr(float(le))
            assert got[("ingero_call_duration_seconds_bucket", lab(source=src, op=op, le=le_s))] == cum
        assert got[("ingero_call_duration_seconds_count", lab(source=src, op=op))] == sum(b)
        assert got[("ingero_events_total", lab(source=src, op=op))] == sum(b)
        assert got[("ingero_call_duration_seconds_sum", lab(source=src, op=op))] == pytest.approx(ref_sum[(s, o)] / 1e9)
    # Bounded cardinality: 5000 pids, four ops -> no label holds a pid.
    label_values = {v for _, labels in got for _, v in labels}
    assert not any(v.isdigit() and int(v) > 10 for v in label_values)


def test_bytes_offcpu_states_and_host_events() -> None:
    st = state()
    st.observe(
        events(
            [
                {"source": catalog.CUDA, "op": 7, "arg0": 4096, "duration": 1000},  # cudaMemcpyAsync bytes
                {"source": catalog.CUDA, "op": 7, "arg0": 1 << 20, "duration": 1000},
                {"source": catalog.CUDA, "op": 2, "arg0": 0xDEADBEEF, "duration": 1000},  # cudaFree: a pointer
                {"source": catalog.HOST, "op": 1, "arg0": 0, "duration": 3 * MS},  # preempted
                {"source": catalog.HOST, "op": 1, "arg0": 256, "duration": 2 * MS},  # preempted (TASK_REPORT_MAX)
                {"source": catalog.HOST, "op": 1, "arg0": 1, "duration": 7 * MS},  # sleeping
                {"source": catalog.HOST, "op": 1, "arg0": 2, "duration": 11 * MS},  # uninterruptible (I/O)
                {"source": catalog.HOST, "op": 5, "duration": 0},  # process_exec
            ]
        )
    )
    got = series(st)
    assert got[("ingero_bytes_total", lab(source="CUDA", op="cudaMemcpyAsync"))] == 4096 + (1 << 20)
    assert ("ingero_bytes_total", lab(source="CUDA", op="cudaFree")) not in got  # arg0 is not bytes there
    assert got[("ingero_offcpu_seconds_total", lab(state="preempted"))] == pytest.approx(0.005)
    assert got[("ingero_offcpu_seconds_total", lab(state="sleep"))] == pytest.approx(0.007)
    assert got[("ingero_offcpu_seconds_total", lab(state="io"))] == pytest.approx(0.011)
    assert got[("ingero_events_total", lab(source="HOST", op="process_exec"))] == 1
    assert ("ingero_call_duration_seconds_count", lab(source="HOST", op="sched_switch")) not in got


def test_gpu_idle_counts_gaps_across_threads_and_batches() -> None:
    st = state()
    pid = 4242
    # Two threads overlap (no idle between them), then a 5 ms gap, then a 0.5 ms gap (too short).
    st.observe(
        events(
            [
                {"source": catalog.CUDA, "op": 5, "pid": pid, "tid": 1, "ts": 100 * MS, "duration": 4 * MS},
                {"source": catalog.DRIVER, "op": 1, "pid": pid, "tid": 2, "ts": 101 * MS, "duration": 1 * MS},
                {"source": catalog.CUDA, "op": 5, "pid": pid, "tid": 1, "ts": 109 * MS, "duration": 1 * MS},
                {"source": catalog.CUDA, "op": 5, "pid": pid, "tid": 1, "ts": 110 * MS + MS // 2, "duration": MS},
                {"source": catalog.HOST, "op": 1, "pid": pid, "tid": 1, "ts": 105 * MS, "duration": 4 * MS},
            ]
        )
    )
    # The next batch continues where the last call ended (111.5 ms): 20 ms later.
    st.observe(events([{"source": catalog.CUDA, "op": 3, "pid": pid, "tid": 1, "ts": 131_500_000, "duration": 10}]))
    # Another process's calls never fill this one's gaps, and its own first call is no gap.
    st.observe(events([{"source": catalog.CUDA, "op": 3, "pid": 99, "tid": 9, "ts": 120 * MS, "duration": 10}]))
    got = series(st)
    assert got[("ingero_gpu_idle_seconds_total", lab())] == pytest.approx(0.025)
    assert got[("ingero_gpu_processes", lab())] == 2
    st.observe(events([{"source": catalog.CUDA, "op": 3, "pid": 99, "tid": 9, "ts": 200_000 * MS, "duration": 10}]))
    assert series(st)[("ingero_gpu_processes", lab())] == 1  # pid 4242 made no call in the last minute


def comm_init(pid: int, comm: int, rank: int, size: int) -> dict[str, int]:
    return {"source": catalog.NCCL, "op": OP_NCCL_COMM_INIT, "pid": pid, "arg0": comm, "arg1": size << 32 | rank}


def test_collectives_per_communicator_and_rank_without_pointer_labels() -> None:
    st = state()
    a, b = 0x7F00_1234_5000, 0x7F00_1234_9000
    st.observe(events([comm_init(10, a, 3, 8), comm_init(10, b, 1, 2)]))
    calls = [{"source": catalog.NCCL, "op": 1, "pid": 10, "arg1": a, "arg0": 1 << 20, "duration": 2 * MS}] * 5
    calls += [{"source": catalog.NCCL, "op": 6, "pid": 10, "arg1": b, "arg0": 64, "duration": 7 * MS}] * 2
    calls += [{"source": catalog.NCCL, "op": 1, "pid": 11, "arg1": a, "arg0": 8, "duration": MS}]  # no init seen
    st.observe(events(calls))
    got = series(st)
    first = lab(comm="c0/8", comm_rank="3", comm_size="8")
    second = lab(comm="c1/2", comm_rank="1", comm_size="2")
    unknown = lab(comm="unknown", comm_rank="-1", comm_size="0")
    assert got[("ingero_collectives_total", first)] == 5
    assert got[("ingero_collective_wait_seconds_total", first)] == pytest.approx(0.010)
    assert got[("ingero_collectives_total", second)] == 2
    assert got[("ingero_collective_wait_seconds_total", second)] == pytest.approx(0.014)
    assert got[("ingero_collectives_total", unknown)] == 1
    assert got[("ingero_bytes_total", lab(source="NCCL", op="ncclAllReduce"))] == 5 * (1 << 20) + 8
    assert not any(str(a) in v or hex(a) in v for _, labels in got for _, v in labels)


def test_communicator_labels_are_capped() -> None:
    st = state()
    st.observe(events([comm_init(1, 0x1000 + i, 0, 2) for i in range(r.MAX_COMMS + 30)]))
    st.observe(
        events([{"source": catalog.NCCL, "op": 1, "pid": 1, "arg1": 0x1000 + i} for i in range(r.MAX_COMMS + 30)])
    )
    comms = {dict(k[1])["comm"] for k in series(st) if k[0] == "ingero_collectives_total"}
    assert len(comms) == r.MAX_COMMS + 1 and "other" in comms


def test_database_feed_matches_sql() -> None:
    db = INVESTIGATIONS / "sample-gpu-node-01.db"
    st = MetricState(Identity("gpu-node-01", rank=0), "serve")
    st.add_provider(database_provider(st, db))
    DatabaseFeed(st, db).refresh(force=True)
    got = series(st)
    conn = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    names = {(s, o): n for s, o, n, _ in catalog.OPS}
    srcs = {s: n for s, n, _ in catalog.SOURCES}
    lab0 = {"node": "gpu-node-01", "rank": "0"}
    for s, o, total, nbytes in conn.execute(
        "SELECT source, op, sum(count), sum(sum_arg0) FROM event_aggregates GROUP BY 1, 2"
    ):
        key = tuple(sorted({**lab0, "source": srcs[s], "op": names[(s, o)]}.items()))
        assert got[("ingero_events_total", key)] == total
        if ("ingero_bytes_total", key) in got:
            assert got[("ingero_bytes_total", key)] == nbytes
    for s, o, n, total_ns in conn.execute(
        "SELECT source, op, count(*), sum(duration) FROM events WHERE source IN (1, 4, 5) GROUP BY 1, 2"
    ):
        key = tuple(sorted({**lab0, "source": srcs[s], "op": names[(s, o)]}.items()))
        assert got[("ingero_call_duration_seconds_count", key)] == n
        assert got[("ingero_call_duration_seconds_sum", key)] == pytest.approx(total_ns / 1e9)
    offcpu = conn.execute("SELECT sum(duration) FROM events WHERE source = 3 AND op = 1").fetchone()[0]
    assert sum(v for (name, _), v in got.items() if name == "ingero_offcpu_seconds_total") == pytest.approx(
        offcpu / 1e9
    )
    chains = dict(conn.execute("SELECT upper(severity), count(*) FROM causal_chains GROUP BY 1").fetchall())
    for sev in r.SEVERITIES:
        assert got[("ingero_causal_chains", tuple(sorted({**lab0, "severity": sev}.items())))] == chains.get(sev, 0)
    assert got[("ingero_db_size_bytes", tuple(sorted(lab0.items())))] == db_size(db) == db.stat().st_size
    conn.close()


def test_database_feed_reads_only_new_rows(tmp_path: Path) -> None:
    from tests.conftest import write_db

    db = write_db(tmp_path / "t.db", [])
    st = MetricState(Identity("n"), "serve")
    feed = DatabaseFeed(st, db)
    feed.refresh(force=True)
    assert not st.snapshot().histograms
    conn = sqlite3.connect(db)
    conn.execute(
        "INSERT INTO events (id, timestamp, pid, tid, source, op, duration) VALUES ('n:1', 1, 1, 1, 1, 5, 2000000)"
    )
    conn.commit()
    conn.close()
    feed.refresh()  # within the refresh interval: nothing read
    assert not st.snapshot().histograms
    feed.refresh(force=True)
    feed.refresh(force=True)  # the same row is never counted twice
    (h,) = st.snapshot().histograms
    assert h.count == 1 and h.sum == pytest.approx(0.002)


def test_every_declared_metric_has_one_family_and_help() -> None:
    st = state()
    st.observe(events([{"source": catalog.CUDA, "op": 5, "duration": 10}]))
    fams = {f.name for f in families(st.snapshot())}
    assert {"ingero_agent_info", "ingero_events", "ingero_call_duration_seconds"} <= fams
    assert len({m.name for m in r.METRICS}) == len(r.METRICS)
    assert all(m.help and m.kind in ("counter", "gauge", "histogram") for m in r.METRICS)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("9464", ("0.0.0.0", 9464)),
        (":9464", ("0.0.0.0", 9464)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:9", ("::1", 9)),
    ],
)
def test_prometheus_addr(text: str, want: tuple[str, int]) -> None:
    assert parse_prometheus_addr(text) == want


@pytest.mark.parametrize("text", ["abc", "host:99999", ":"])
def test_prometheus_addr_errors(text: str) -> None:
    from ingero.errors import UsageError

    with pytest.raises(UsageError):
        parse_prometheus_addr(text)


def test_the_cluster_wide_communicator_id_names_the_communicator() -> None:
    st = state()
    init = comm_init(10, 0x5000, 2, 4)
    init["cgroup_id"] = 0x9E3779B97F4A7C15  # the control record carries the comm id there
    st.observe(events([init, {"source": catalog.NCCL, "op": 1, "pid": 10, "arg1": 0x5000, "duration": MS}]))
    got = series(st)
    assert got[("ingero_collectives_total", lab(comm="9e3779b97f4a7c15", comm_rank="2", comm_size="4"))] == 1


def reference_snapshot(
    batches: list[np.ndarray],
) -> tuple[dict[tuple[str, tuple[str, ...]], float], dict[tuple[str, ...], tuple[object, ...]], dict[int, int]]:
    """Every exported total of ``batches``, computed per event in plain Python (the definitions, not
    the vectorised code): samples, histograms and the carried last GPU end per pid."""
    bounds = [round(b * 1e9) for b in r.DURATION_BUCKETS_S]
    rel_mask = (1 << 40) - 1
    base_labels = ("gpu-node-07", "3")
    count: dict[tuple[int, int], int] = {}
    nbytes: dict[tuple[int, int], float] = {}
    hist: dict[tuple[int, int], list[int]] = {}
    hsum: dict[tuple[int, int], float] = {}
    hmin: dict[tuple[int, int], int] = {}
    hmax: dict[tuple[int, int], int] = {}
    offcpu = [0, 0, 0]
    idle = 0
    last_end: dict[int, int] = {}
    comm_label: dict[tuple[int, int], tuple[str, int, int]] = {}
    comm_seq: dict[int, int] = {}
    comm_tot: dict[tuple[int, int], list[int]] = {}
    for batch in batches:
        rows = batch.tolist()  # (ts, duration, arg0, arg1, cgroup_id, pid, tid, ret, stack_id, source, op, ...)
        for _ts, _dur, arg0, arg1, cgroup, pid, *_, _src, op, _cpu, _flags in rows:
            if op == OP_NCCL_COMM_INIT and arg0 and (pid, arg0) not in comm_label:
                k = comm_seq.get(pid, 0)
                comm_seq[pid] = k + 1
                label = f"{cgroup:016x}" if cgroup else f"c{k}/{arg1 >> 32}"
                comm_label[(pid, arg0)] = (
                    "other" if len(comm_label) >= r.MAX_COMMS else label,
                    arg1 & 0xFFFFFFFF,
                    arg1 >> 32,
                )
        rows = [e for e in rows if e[10] < OP_NCCL_COMM_INIT]
        gpu: dict[int, list[tuple[int, int]]] = {}
        wait: dict[tuple[int, int], float] = {}
        batch_bytes: dict[tuple[int, int], float] = {}  # float sums per batch, in event order, then totalled
        batch_sum: dict[tuple[int, int], float] = {}
        for ts, dur, arg0, arg1, _cg, pid, *_, src, op, _cpu, _flags in rows:
            c = (src, op)
            count[c] = count.get(c, 0) + 1
            if c in BYTES_OPS:
                batch_bytes[c] = batch_bytes.get(c, 0.0) + float(arg0)
            if src in (catalog.CUDA, catalog.DRIVER, catalog.NCCL, catalog.IO, catalog.NET):
                hist.setdefault(c, [0] * (len(bounds) + 1))[bisect.bisect_left(bounds, dur)] += 1
                batch_sum[c] = batch_sum.get(c, 0.0) + float(dur)
                hmin[c] = min(hmin.get(c, dur), dur)
                hmax[c] = max(hmax.get(c, dur), dur)
            if c == catalog.op_id("sched_switch"):
                offcpu[0 if arg0 in (0, 256) else 2 if arg0 & 2 else 1] += dur
            if src in (catalog.CUDA, catalog.DRIVER, catalog.NCCL):
                gpu.setdefault(pid, []).append((ts, dur))
            if src == catalog.NCCL:
                comm_label.setdefault((pid, arg1), ("unknown", -1, 0))  # calls before (or without) its init
                comm_tot.setdefault((pid, arg1), [0, 0])[0] += 1
                wait[(pid, arg1)] = wait.get((pid, arg1), 0.0) + float(dur)
        for c, b in batch_bytes.items():
            nbytes[c] = nbytes.get(c, 0.0) + b
        for c, b in batch_sum.items():
            hsum[c] = hsum.get(c, 0.0) + b
        for pk, w in wait.items():
            comm_tot[pk][1] += int(w)
        if gpu:  # times relative to the batch's first GPU call, capped at 2^40 ns like observe's
            base = min(ts for calls in gpu.values() for ts, _ in calls)
            for pid, calls in gpu.items():
                reach = -1
                for ts, dur in sorted(calls):
                    start = min(ts - base, rel_mask)
                    end = min(start + min(dur, rel_mask), rel_mask)
                    prev = reach if reach >= 0 else (last_end[pid] - base if pid in last_end else start)
                    if start - prev >= r.GPU_IDLE_MIN_GAP_NS:
                        idle += start - prev
                    if reach < 0 and pid in last_end:  # a call of an earlier batch may still be running
                        reach = min(max(last_end[pid] - base, 0), rel_mask)
                    reach = max(reach, end)
                last_end[pid] = max(reach + base, last_end.get(pid, 0))
    src_names = {s: n for s, n, _ in catalog.SOURCES}
    samples: dict[tuple[str, tuple[str, ...]], float] = {}
    for (s, o), n in count.items():
        samples[("ingero_events", (*base_labels, src_names[s], catalog.op_name(s, o)))] = float(n)
    for (s, o), b in nbytes.items():
        samples[("ingero_bytes", (*base_labels, src_names[s], catalog.op_name(s, o)))] = b
    for state_name, ns in zip(r.OFFCPU_STATES, offcpu, strict=True):
        samples[("ingero_offcpu_seconds", (*base_labels, state_name))] = ns / 1e9
    samples[("ingero_gpu_idle_seconds", base_labels)] = idle / 1e9
    latest = max(last_end.values(), default=0)
    active = sum(1 for t in last_end.values() if t >= latest - r.GPU_ACTIVE_WINDOW_NS)
    samples[("ingero_gpu_processes", base_labels)] = float(active)
    per_label: dict[tuple[str, int, int], list[int]] = {}
    for pk, labels in comm_label.items():  # registered communicators are exported before their first call
        calls, wait_ns = comm_tot.get(pk, (0, 0))
        t = per_label.setdefault(labels, [0, 0])
        t[0] += calls
        t[1] += wait_ns
    for (label, rank, size), (calls, wait_ns) in per_label.items():
        samples[("ingero_collectives", (*base_labels, label, str(rank), str(size)))] = float(calls)
        samples[("ingero_collective_wait_seconds", (*base_labels, label, str(rank), str(size)))] = wait_ns / 1e9
    hists = {
        (*base_labels, src_names[s], catalog.op_name(s, o)): (
            tuple(b),
            hsum[(s, o)] / 1e9,
            hmin[(s, o)] / 1e9,
            hmax[(s, o)] / 1e9,
        )
        for (s, o), b in hist.items()
    }
    return samples, hists, last_end


def random_batch(rng: np.random.Generator, n: int, pids: int, sorted_ts: bool) -> np.ndarray:
    ops = [(catalog.CUDA, 3), (catalog.CUDA, 7), (catalog.DRIVER, 1), (catalog.NCCL, 1), (catalog.NCCL, 6)]
    ops += [(catalog.HOST, 1), (catalog.HOST, 1), (catalog.HOST, 5), (catalog.IO, 2), (catalog.NET, 1)]
    ops += [(catalog.NCCL, OP_NCCL_COMM_INIT), (catalog.NCCL, OP_NCCL_COMM_INIT + 1)]
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    which = rng.integers(0, len(ops), n)
    ev["source"] = [ops[w][0] for w in which]
    ev["op"] = [ops[w][1] for w in which]
    ev["pid"] = rng.integers(0, pids, n) * 4099 + 7  # pids above 65535 too
    ev["tid"] = ev["pid"] + 1
    span = int(rng.choice([2 * MS, 50 * MS, 10_000 * MS]))
    ev["ts"] = (1 << 60) + rng.integers(0, span, n)  # batches overlap in time: carried ends matter
    if sorted_ts:
        ev["ts"] = np.sort(ev["ts"])
    ev["duration"] = np.exp(rng.uniform(0, np.log(2e9), n)).astype(np.uint64)
    bounds = [round(b * 1e9) for b in r.DURATION_BUCKETS_S]
    edges = sorted(
        {0, 1, *(b + d for b in bounds for d in (-1, 0, 1)), *(2**k + d for k in range(1, 64) for d in (-1, 0))}
    )
    edge = rng.random(n) < 0.2  # bucket edges, powers of two, up to 2^64 - 1
    ev["duration"][edge] = rng.choice(np.array(edges, dtype=np.uint64), int(edge.sum()))
    ev["arg0"] = rng.integers(0, 1 << 40, n)
    host = ev["source"] == catalog.HOST
    ev["duration"][host] &= (1 << 50) - 1  # off-CPU totals are int64
    ev["arg0"][host] = rng.choice([0, 1, 2, 3, 256, 258, 0x402, 0x80], int(host.sum()))  # prev_state
    comms = np.array([0x7F00_0000_1000, 0x7F00_0000_2000, 0x7F00_0000_3000], dtype=np.uint64)
    ev["arg1"] = rng.choice(comms, n)
    init = ev["op"] == OP_NCCL_COMM_INIT
    ev["arg0"][init] = rng.choice(comms[:2], int(init.sum()))
    ev["arg1"][init] = 8 << 32 | 3
    ev["cgroup_id"][init] = rng.choice([0, 0x9E3779B97F4A7C15], int(init.sum()))
    return ev


@pytest.mark.parametrize("seed", range(6))
def test_observe_matches_a_per_event_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    work = [
        random_batch(rng, int(rng.choice([0, 1, 2, 40, 3000])), int(rng.choice([1, 3, 70])), bool(rng.random() < 0.5))
        for _ in range(14)
    ]
    work.insert(3, random_batch(rng, 500, 1, True))  # a single process
    work.insert(5, work[4][::-1])  # not contiguous, not in time order
    st = state()
    for batch in work:
        st.observe(batch)
    want, want_hists, want_ends = reference_snapshot(work)
    snap = st.snapshot()
    got = {(s.metric.name, s.labels): s.value for s in snap.samples if s.metric is not r.INFO}
    assert got == want
    assert {h.labels: (h.counts, h.sum, h.min, h.max) for h in snap.histograms} == want_hists
    assert dict(zip(st._gpu_pids.tolist(), st._gpu_ends.tolist(), strict=True)) == want_ends


def test_duration_buckets_match_searchsorted() -> None:
    bounds = np.array([round(b * 1e9) for b in r.DURATION_BUCKETS_S], dtype=np.uint64)
    edges = {
        0,
        1,
        2**64 - 1,
        *(int(b) + d for b in bounds for d in (-1, 0, 1)),
        *(2**k + d for k in range(64) for d in (-1, 0, 1)),
    }
    d = np.array(sorted(e for e in edges if 0 <= e < 2**64), dtype=np.uint64)
    d = np.concatenate((d, np.random.default_rng(0).integers(0, 2**63, 100_000, dtype=np.uint64)))
    assert (duration_buckets(d) == np.searchsorted(bounds, d, side="left")).all()


def test_batches_are_folded_late_but_every_read_sees_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import ingero.metrics.state as state_mod

    st = state()
    src, op = op_labels(catalog.CUDA << 8 | 3)
    launch = {"source": catalog.CUDA, "op": 3, "pid": 5, "tid": 5, "ts": MS, "duration": 10}
    st.observe(events([launch] * 3))
    assert st.batches == 0  # pending: folded with the next ones, or by a read
    assert series(st)[("ingero_events_total", lab(source=src, op=op))] == 3
    assert st.batches == 1 and st.read_fold_cpu_s > 0
    # Aggregates replace the rows' totals: the rows observed before them are folded first, not added after.
    st.observe(events([launch] * 4))
    st.set_counts({catalog.CUDA << 8 | 3: (100, 0)})
    assert series(st)[("ingero_events_total", lab(source=src, op=op))] == 100
    # Without a read: once FOLD_EVENTS events wait, or the oldest batch is FOLD_AFTER_S old.
    assert st.batches == 2
    monkeypatch.setattr(state_mod, "FOLD_EVENTS", 5)
    st.observe(events([launch] * 2))
    assert st.batches == 2
    st.observe(events([launch] * 3))
    assert st.batches == 4
    monkeypatch.setattr(state_mod, "FOLD_AFTER_S", 0.0)
    st.observe(events([launch]))
    assert st.batches == 5
    assert series(st)[("ingero_events_total", lab(source=src, op=op))] == 106
