"""explain v2 on recordings that look like real ones: must-name and must-not-name.

The builders (:mod:`ingero.demo.realistic`) write what real traces contain — voluntary sleeps inside
syncs and between steps, forked DataLoader workers, per-kernel first launches, mixed copy sizes,
selective storage, softirq retransmits, the agent's own writes — through the real StoreWriter.
The per-thread interval arithmetic (:mod:`ingero.explain.offcpu`) is checked on hand-made rows.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from ingero.demo.realistic import AGENT
from ingero.demo.scenarios import SCENARIOS
from ingero.demo.synth import SyntheticNode
from ingero.explain.engine import ExplainReport
from ingero.explain.frame import ArgRows
from ingero.explain.model import SEVERITY_RANK
from ingero.explain.offcpu import INVOL, UNKNOWN, VOL, OffCpu, union
from ingero.store.catalog import HOST, op_id
from tests.conftest import SharedDbs
from tests.scenarios.expectations import REALISTIC
from tests.scenarios.judge import explain_file as _explain

BASE = 1_776_000_000_000_000_000
SAMPLES = Path(__file__).parent / "data" / "ingero-samples"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ExplainReport]:
    out = {}
    for name, exp in REALISTIC.items():
        path = tmp_path_factory.mktemp(name) / "trace.db"
        exp.builder(BASE, 11).write(path)
        out[name] = _explain(path)
    return out


def _shown(r: ExplainReport) -> list[tuple[str, str, str]]:
    return [(c.severity, c.family, c.cuda_op) for c in r.chains]


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_must_name_and_must_not_name(name: str, reports: dict[str, ExplainReport]) -> None:
    exp, r = REALISTIC[name], reports[name]
    for family, least in exp.must_name:
        hit = [c for c in r.chains if c.family == family and SEVERITY_RANK[c.severity] <= SEVERITY_RANK[least]]
        assert hit, (family, least, _shown(r))
    for prefix in exp.must_not_name:
        bad = [c for c in r.chains if c.family.startswith(prefix)]  # at any severity, LOW included
        assert not bad, (prefix, _shown(r))
    if exp.no_high_or_medium:
        assert all(c.severity == "LOW" for c in r.chains), _shown(r)
    assert len([c for c in r.chains if c.node == r.nodes[0]]) <= 6


def test_healthy_job_with_sleeps_makes_no_chain_and_says_the_noise_is_context(
    reports: dict[str, ExplainReport],
) -> None:
    r = reports["healthy"]
    assert r.chains == [], _shown(r)
    assert any("150 TCP retransmits with no owner" in n for n in r.notes)
    assert any("block I/O ops by processes outside" in n for n in r.notes)


def test_the_agents_own_writes_never_appear_as_evidence(reports: dict[str, ExplainReport]) -> None:
    for r in reports.values():
        for c in r.chains:
            text = " ".join([c.summary, c.root_cause, c.explanation, *(t.detail for t in c.timeline)])
            assert f"pid {AGENT}" not in text and "ingero trace" not in text, c.summary


def test_input_starvation_names_the_workers_and_the_time_lost(reports: dict[str, ExplainReport]) -> None:
    c = next(c for c in reports["dataloader-starved"].chains if c.family == "idle/input")
    ev = c.evidence
    assert ev["workers"] and set(ev["workers"]) <= {5101, 5102, 5103, 5104}
    assert 0.6 <= ev["lost_share"] <= 0.9, ev  # ~35 ms of each ~47 ms step
    assert any("num_workers" in x for x in c.recommendations)
    assert "pt_data_worker" in c.root_cause


def test_ranks_waiting_inside_collectives_are_not_cpu_contention(reports: dict[str, ExplainReport]) -> None:
    r = reports["collective-wait"]
    assert not [c for c in r.chains if c.family in ("tail/cpu", "drop/cpu", "tail/offcpu")], _shown(r)


def test_demo_incident_still_measures_the_overlap(tmp_path: Path) -> None:
    path = tmp_path / "incident.db"
    SCENARIOS["incident"].build(BASE, 7).write(path)
    r = _explain(path)
    c = next(c for c in r.chains if c.family == "tail/cpu")
    assert c.severity == "HIGH" and c.evidence["overlap_involuntary"] > 0.4
    assert "stress-ng" in c.root_cause and "taskset" in c.recommendations[0]


@pytest.mark.parametrize("name", ["sample-gpu-node-02.db", "sample-cluster.db"])
def test_ingero_databases_say_unknown_rather_than_guess(name: str) -> None:
    r = _explain(SAMPLES / name)
    assert r.nodes and r.ops
    assert any("no prev_state" in n for n in r.notes)
    assert all(c.family != "tail/cpu" and c.family != "drop/cpu" for c in r.chains), _shown(r)
    assert all(c.severity == "LOW" for c in r.chains if "offcpu" in c.family)


# --- the interval arithmetic -------------------------------------------------------------------


def _rows(rows: list[tuple[int, int, int, int, int, int]]) -> ArgRows:
    """(op, tid, ts, dur, arg0, arg1) scheduler rows of pid 1."""
    a = np.asarray(rows, dtype=np.int64).reshape(-1, 6)
    n = a.shape[0]
    return ArgRows(
        source=np.full(n, HOST, dtype=np.int64),
        op=a[:, 0],
        pid=np.ones(n, dtype=np.int64),
        ts_ns=a[:, 2],
        arg0=a[:, 4],
        arg1=a[:, 5],
        tid=a[:, 1],
        dur=a[:, 3],
    )


def test_offcpu_kinds_and_overlap() -> None:
    u = 1000  # µs: a run-queue wait under WAKE_LATENCY_NS is the wakeup's own latency
    off = OffCpu(
        _rows(
            [
                (1, 7, 200 * u, 100 * u, 0, 99),  # preempted by tid 99 over [100, 200) µs
                (1, 7, 600 * u, 300 * u, 1, 55),  # asleep over [300, 600) ...
                (
                    2,
                    7,
                    500 * u,
                    200 * u,
                    42,
                    42,
                ),  # ... woken at 500 by tgid 42: run queue [500, 600), tid 55 on the CPU
                (1, 8, 50 * u, 40 * u, 0, 8),  # Ingero-style row (arg1 = itself): unknown, [10, 50)
            ]
        )
    )
    calls = np.array([7, 7, 8]), np.array([150, 400, 0]) * u, np.array([550, 700, 100]) * u
    assert off.covered(INVOL, *calls).tolist() == [(50 + 50) * u, 100 * u, 0]
    assert off.covered(VOL, *calls).tolist() == [200 * u, 100 * u, 0]
    assert off.covered(UNKNOWN, *calls).tolist() == [0, 0, 40 * u]
    assert off.by_who(INVOL, np.array([7]), np.array([0]), np.array([1000 * u])) == {99: 100 * u, 55: 100 * u}
    assert off.by_who(VOL, np.array([7]), np.array([0]), np.array([1000 * u])) == {42: 200 * u}
    edges = np.array([0, 150, 1000]) * u
    assert off.per_bucket(INVOL, np.array([7]), edges).tolist() == [50.0 * u, 150.0 * u]
    assert off.has_state


def test_a_wakeups_own_latency_is_part_of_the_sleep() -> None:
    """From a wakeup to the CPU: a wait under WAKE_LATENCY_NS (the IPI, an idle exit, the switch), or
    any wait for a CPU that was idle (nobody in the way), is part of the sleep — thousands of short
    reads must not add up to CPU contention. A longer wait behind another task is the run queue."""
    u = 1000
    rows = []
    for k in range(100):  # 100 sleeps of 500 µs, each woken by tgid 42 and back on the CPU 40 µs later
        t = k * 1000 * u
        rows += [(1, 7, t + 540 * u, 540 * u, 1, 55), (2, 7, t + 500 * u, 500 * u, 42, 42)]
    rows += [(1, 7, 200_000 * u, 1000 * u, 1, 0), (2, 7, 199_500 * u, 500 * u, 42, 42)]  # 500 µs, CPU idle
    rows += [(1, 7, 300_000 * u, 1000 * u, 1, 99), (2, 7, 299_500 * u, 500 * u, 42, 42)]  # 500 µs behind 99
    off = OffCpu(_rows(rows))
    everything = np.array([7]), np.array([0]), np.array([400_000 * u])
    assert off.covered(INVOL, *everything).tolist() == [500 * u]
    assert off.by_who(INVOL, *everything) == {99: 500 * u}
    assert off.covered(VOL, *everything).tolist() == [(100 * 540 + 1000 + 500) * u]


def test_union_merges_overlapping_calls() -> None:
    s, e = union(np.array([5, 0, 20, 8]), np.array([12, 6, 30, 9]))
    assert s.tolist() == [0, 20] and e.tolist() == [12, 30]


def test_selective_storage_counts_come_from_aggregates(reports: dict[str, ExplainReport]) -> None:
    r = reports["healthy"]
    launch = next(o for o in r.ops if o.name == "cudaLaunchKernel")
    assert launch.stored is not None and launch.stored < launch.count / 2, launch
    d = launch.as_dict()
    assert d["sampled"] is True and d["stored"] == launch.stored
    assert any("selective storage" in n and "cudaLaunchKernel" in n for n in r.notes), r.notes
    # the eval pause (the thread asleep by choice) is not a throughput drop
    assert not any("ops/s fell" in n for n in r.notes), r.notes


def test_copies_are_judged_in_bytes_per_second(reports: dict[str, ExplainReport]) -> None:
    """Copies of 256 KB, 4 MB and 16 MB at one bandwidth: a latency spread, not a tail."""
    r = reports["healthy"]
    copy = next(o for o in r.ops if o.name == "cudaMemcpy")
    assert copy.tail_ratio >= 3  # in raw latency it looks like a tail...
    assert not any("cudaMemcpy" in n for n in r.notes), r.notes  # ...but the bandwidth never changed
    assert not any(c.cuda_op == "cudaMemcpy" for c in r.chains)


def test_first_launches_are_said_and_never_called_contention(reports: dict[str, ExplainReport]) -> None:
    r = reports["healthy"]
    assert any("6 kernels' first launches" in n and "not contention" in n for n in r.notes), r.notes


def test_new_kernels_mid_run_are_recompilation(reports: dict[str, ExplainReport]) -> None:
    r = reports["recompiling"]
    c = next(c for c in r.chains if c.family == "recompile")
    assert c.evidence["kernels"] >= 20 and c.evidence["lost_share"] > 0.05, c.evidence
    assert any("torch.compile" in x or "mark_dynamic" in x for x in c.recommendations)
    # the same slow first launches are not also a periodic spike or a tail
    assert not [x for x in r.chains if x.family in ("periodic",) or x.family.startswith("tail/")], _shown(r)


def test_empty_cache_at_irregular_steps_is_allocator_churn(tmp_path: Path) -> None:
    """Bursts of cudaFree (the cache handed back) followed by slow cudaMallocs, at irregular steps:
    no period to find, but the churn itself is measured."""
    from ingero.demo.synth import SyntheticNode
    from ingero.store.catalog import CUDA

    rec = SyntheticNode("churn-node", BASE, 5)
    pid = 5400
    rec.process(pid, "python3 train.py", 0.0, exec_event=False)
    t, step = 0.2, 0
    releases = {int(x) for x in rec.rng.choice(np.arange(20, 1500), 14, replace=False)}
    while t < 25.0:
        if step in releases:
            for k in range(10):
                rec.ev(t, pid, CUDA, 2, rec.jitter(400_000, 0.2), arg0=0x7F00_0000 + k)
                t += 0.45e-3
            for _ in range(5):
                d = float(rec.rng.uniform(20, 40)) * 1e6
                rec.ev(t, pid, CUDA, 1, d, arg0=256 << 20)
                t += d / 1e9
        rec.ev(t, pid, CUDA, 1, rec.jitter(80_000, 0.1), arg0=32 << 20)
        for k in range(4):
            rec.ev(t + 1e-4 + k * 2e-5, pid, CUDA, 3, rec.jitter(8000, 0.1))
        sync = rec.jitter(12e6, 0.05)
        rec.ev(t + 2e-4, pid, CUDA, 5, sync)
        t += 2e-4 + sync / 1e9 + 1e-3
        step += 1
    path = tmp_path / "churn.db"
    rec.write(path)
    r = _explain(path)
    c = next((c for c in r.chains if c.family == "alloc-churn"), None)
    assert c is not None, _shown(r)
    assert c.evidence["releases"] >= 12 and c.evidence["frees_in_releases"] >= 120, c.evidence
    assert c.severity in ("HIGH", "MEDIUM") and any("empty_cache" in x for x in c.recommendations)


def test_workers_oversubscribing_the_cores_are_said(tmp_path: Path) -> None:
    rec = REALISTIC["dataloader-starved"].builder(BASE, 3)
    rec.session["cpu_cores"] = 4  # 4 forked workers + the trainer on 4 cores
    path = tmp_path / "over.db"
    rec.write(path)
    r = _explain(path)
    assert any("forked 4 processes on 4 cores" in n for n in r.notes), r.notes
    c = next(c for c in r.chains if c.family == "idle/input")
    assert c.evidence["cores"] == 4 and "oversubscribe" in c.recommendations[0]


def test_run_queue_delay_after_a_wakeup_is_contention(reports: dict[str, ExplainReport]) -> None:
    """The thread slept inside its sync by itself (voluntary), then waited runnable for a CPU: only the
    wakeup → switch delay is counted, and the job that had the CPU is named."""
    c = next(c for c in reports["runqueue-contention"].chains if c.family == "tail/cpu")
    ev = c.evidence
    assert ev["overlap_voluntary"] > 0.15 and ev["overlap_involuntary"] > 0.4, ev
    assert ev["preempted_by"] == ["pid 6200 (python3 preprocess.py --workers 16)"], ev


def test_healthy_four_node_job_has_no_high_or_medium_chain(tmp_path: Path) -> None:
    """Four healthy ranks in one merged database (each node analysed apart): v1 printed 5-12 HIGH chains
    on such a job (voluntary sleeps as "sched_switch storms", softirq retransmits, the agent's writes)."""
    from ingero.demo.realistic import healthy

    path = tmp_path / "cluster.db"
    for i in range(4):
        rec = healthy(BASE, 20 + i)
        rec.node = f"gpu-node-{i:02d}"
        rec.write(path)
    r = _explain(path)
    assert sorted(r.nodes) == [f"gpu-node-{i:02d}" for i in range(4)]
    assert all(c.severity == "LOW" for c in r.chains), _shown(r)


def test_shared_databases_are_built_once_and_a_write_to_one_is_caught(tmp_path: Path) -> None:
    """The session's shared databases (conftest ``shared_dbs``): one build per key, reads leave them as
    built, and a test that writes to one fails the session's check."""
    dbs = SharedDbs(tmp_path)
    built: list[Path] = []

    def make(d: Path) -> Path:
        built.append(d)
        conn = sqlite3.connect(d / "x.db")
        conn.executescript("PRAGMA journal_mode = WAL; CREATE TABLE t (x); INSERT INTO t VALUES (1);")
        conn.close()
        return d / "x.db"

    path = dbs.get("x", make)
    assert dbs.get("x", make) == path and len(built) == 1 and dbs.get("y", make) != path
    conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)  # as open_readonly reads it
    assert conn.execute("SELECT x FROM t").fetchall() == [(1,)]
    conn.close()
    dbs.check_untouched()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE t SET x = 2")  # same size, same page: only the contents tell
    conn.commit()
    conn.close()
    with pytest.raises(AssertionError, match="wrote to shared databases"):
        dbs.check_untouched()


def test_a_sampled_loop_that_sleeps_in_every_gap_is_explained(tmp_path: Path) -> None:
    """Selective storage (some launches only counted in event_aggregates) and a thread asleep in each
    gap between its syncs: the ledger still adds up, its sleeps are the timer's."""
    rec = SyntheticNode("n", BASE, 1)
    rec.process(100, "python3 train.py", 0.0, exec_event=False)
    sync, launch = op_id("cudaStreamSync"), op_id("cudaLaunchKernel")
    t = 0.1
    for i in range(400):
        rec.ev(t, 100, *sync, 5e6)
        rec.sleep(t + 5.1e-3, 100, 3e6)
        if i % 10 == 0:
            rec.ev(t + 8.2e-3, 100, *launch, 8000, store=False)
        t += 8.5e-3
    rec.write(tmp_path / "s.db")
    r = _explain(tmp_path / "s.db")
    row = r.ledger[0]
    assert sum(row.buckets.values()) == row.wall_ns and row.buckets["asleep_timer"] >= 0.3 * row.wall_ns
    assert not [c for c in r.chains if c.severity != "LOW"], _shown(r)
