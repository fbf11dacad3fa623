"""``explain --by step`` and ``explain --annotation step=12``: the wall-time ledger of each labelled span.

Real databases written by the StoreWriter (the ledger tests' steady GPU loop, :class:`Loop`), with the
steps labelled through the annotations table as the socket's writer stores them (pid-scoped spans, or
``point(step=N)`` instants). One step of 20 is slowed by a known disturbance placed in its own time —
before its first GPU call, as a DataLoader wait is — at a step drawn per seed; it must be the outlier
with that cause, and no healthy step may get a cause. Each runs as recorded and in Ingero's layout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ingero.annotate import AnnotationLine
from ingero.cli.main import main
from ingero.demo.synth import LAUNCH, STREAM_SYNC
from ingero.explain.by_label import ByLabel, ValueLedger, by_label, render, render_value
from ingero.explain.engine import explain
from ingero.explain.ledger import BUCKETS
from ingero.store.annotations import write_lines
from ingero.store.db import open_readonly
from ingero.timeutil import NS_PER_MS, NS_PER_S, NS_PER_US
from tests.test_explain_ledger import HOG, PID, Loop, disk, host_code, ingero_layout, preempted, workers

STEPS = 20


def slow_gpu(lp: Loop, s: float) -> None:
    """The step's GPU work runs ``s`` long: its synchronize returns late (no host evidence)."""
    jitter = lp.rec.jitter
    vars(lp.rec)["jitter"] = lambda mean, rel=0.1: jitter(mean, rel) + (s * NS_PER_S if mean == 8 * NS_PER_MS else 0)
    lp.step()
    del vars(lp.rec)["jitter"]


CASES: dict[str, tuple[Callable[[Loop, float], None], str, tuple[str, ...]]] = {
    # disturbance: (incident, the bucket named, buckets never named)
    "workers": (workers, "asleep_workers", ("preempted", "host_code", "asleep_disk")),
    "preempted": (preempted, "preempted", ("asleep_workers", "host_code", "asleep_disk")),
    "disk": (disk, "asleep_disk", ("preempted", "asleep_workers")),
    "host_code": (host_code, "host_code", ("preempted", "asleep_workers", "asleep_disk")),
    "slow_gpu": (slow_gpu, "gpu_slow", ("preempted", "asleep_workers", "host_code")),
}


def labelled_run(
    path: Path,
    seed: int,
    incident: Callable[[Loop, float], None] | None,
    slow_s: float,
    *,
    spans: bool = True,
    node: str | None = None,
    bad: int | None = None,
) -> int:
    """20 steps of the loop on ``node``, step ``bad`` (drawn from the seed unless given) preceded by
    ``incident`` of ``slow_s``."""
    lp = Loop(seed)
    if node is not None:
        lp.rec.node = node
    bad = int(np.random.default_rng(seed).integers(1, STEPS - 1)) if bad is None else bad
    edges = []
    for i in range(STEPS):
        t0 = lp.t
        if i == bad and incident is not None:
            incident(lp, slow_s)
        if not (i == bad and incident is slow_gpu):
            lp.step()
        edges.append((i, lp.rec.ts(t0), lp.rec.ts(lp.t)))
    lp.write(path)
    if spans:
        lines = [AnnotationLine(a, {"step": str(i)}, PID, 0, a, b) for i, a, b in edges]
    else:
        lines = [AnnotationLine(a, {"step": str(i)}, PID) for i, a, _ in edges]
    write_lines(path, lines, node=lp.rec.node)
    return bad


def result_of(path: Path) -> ByLabel:
    conn = open_readonly(path)
    try:
        return by_label(conn, "step")
    finally:
        conn.close()


def assert_conserved(r: ByLabel) -> None:
    for v in r.values:
        assert set(v.buckets) == set(BUCKETS)
        assert all(ns >= 0 for ns in v.buckets.values()), v.buckets
        assert sum(v.buckets.values()) == v.wall_ns > 0
        assert v.wall_ns <= v.elapsed_ns  # one thread: its part of the span
        assert 0 <= v.lost_ns <= v.wall_ns


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("layout", ["recorded", "ingero"])
def test_the_slow_step_is_the_outlier_with_its_cause(tmp_path: Path, case: str, seed: int, layout: str) -> None:
    incident, bucket, never = CASES[case]
    path = tmp_path / "run.db"
    bad = labelled_run(path, seed, incident, 0.03)  # a step is ~9.3 ms: this one ~4x the median
    if layout == "ingero":
        path = ingero_layout(path, tmp_path / "ingero.db", wakeups=True)
    r = result_of(path)
    assert_conserved(r)
    assert [v.value for v in r.values] == [str(i) for i in range(STEPS)]
    slow = r.values[bad]
    assert max(r.values, key=lambda v: v.elapsed_ns) is slow and slow.median_ratio > 3
    assert 25 * NS_PER_MS <= slow.lost_ns <= 35 * NS_PER_MS, slow.lost
    if layout == "ingero" and bucket in ("preempted", "asleep_disk", "host_code"):
        # no prev_state: preempted / disk wait / own code are off-CPU of unknown kind or on-CPU, never guessed
        assert slow.cause in (bucket, "offcpu_unknown")
    else:
        assert slow.cause == bucket
    assert slow.lost[slow.cause] >= 0.5 * slow.lost_ns
    assert slow.cause not in never
    healthy = [v for v in r.values if v is not slow]
    assert all(v.cause is None for v in healthy), [(v.value, v.cause, v.lost) for v in healthy if v.cause]
    text = render(r)
    assert f"step {bad}: " in text and text.count(" lost: ") == 1


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_healthy_steps_get_no_cause(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "run.db"
    labelled_run(path, seed, None, 0.0)
    r = result_of(path)
    assert_conserved(r)
    assert len(r.values) == STEPS and all(v.cause is None for v in r.values)
    assert all(0.8 < v.median_ratio < 1.25 for v in r.values)
    assert " lost: " not in render(r)


@pytest.mark.parametrize("magnitude", [0.002, 0.06])
def test_a_cause_is_named_only_past_the_ledgers_share(tmp_path: Path, magnitude: float) -> None:
    """2 ms of waiting on workers in a ~9 ms step is under the 10 ms floor; 60 ms is named."""
    path = tmp_path / "run.db"
    bad = labelled_run(path, 6, workers, magnitude)
    v = result_of(path).values[bad]
    assert (v.cause == "asleep_workers") is (magnitude > 0.01)


def test_instants_label_until_the_next_one(tmp_path: Path) -> None:
    """point(step=N) marks: step N holds until step N+1's mark; the last until the recording ends."""
    path = tmp_path / "run.db"
    bad = labelled_run(path, 7, workers, 0.03, spans=False)
    r = result_of(path)
    assert_conserved(r)
    assert r.values[bad].cause == "asleep_workers"
    assert all(v.cause is None for v in r.values if v.value != str(bad))


def test_cli_by_step_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.db"
    bad = labelled_run(path, 8, workers, 0.03)
    assert main(["explain", "--db", str(path), "--by", "step"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith(f"step {bad}:"))
    assert "x the median) — " in line and "asleep on forked workers (input starvation)" in line
    assert f"slowest: step {bad}," in out
    assert main(["explain", "--db", str(path), "--by", "step", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["by"]
    assert doc["key"] == "step" and len(doc["values"]) == STEPS
    slow = doc["values"][bad]
    assert slow["cause"] == "asleep_workers" and slow["cause_share"] >= 0.5
    assert sum(slow["buckets"].values()) == slow["wall_ns"]


def test_cli_annotation_explains_just_that_span(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.db"
    bad = labelled_run(path, 9, workers, 0.03)
    assert main(["explain", "--db", str(path), "--annotation", f"step={bad}", "--json"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["label"]["value"] == str(bad) and doc["label"]["cause"] == "asleep_workers"
    w = doc["window"]
    assert w["end_ns"] + 1 - w["start_ns"] == doc["label"]["elapsed_ns"]
    calls = sum(o["count"] for o in doc["ops"] if o["op"] == "cudaLaunchKernel")
    assert calls == 4  # one step's launches, not the run's
    assert f"pid {PID}" in cap.err
    assert main(["explain", "--db", str(path), "--annotation", f"step={bad}"]) == 0
    assert capsys.readouterr().out.startswith(f"step {bad}: ")


def test_cli_annotation_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.db"
    labelled_run(path, 10, None, 0.0)
    assert main(["explain", "--db", str(path), "--annotation", "step=99"]) != 0
    assert "no span of step=99" in capsys.readouterr().err
    assert main(["explain", "--db", str(path), "--annotation", "step"]) != 0
    assert "KEY=VALUE" in capsys.readouterr().err


def test_integer_values_read_with_thousands_separators() -> None:
    v = ValueLedger("4812", 0, 3_100_000_000, 1, 1, 3_100_000_000, median_ratio=3.0)
    assert render_value("step", v).startswith("step 4,812: 3.10 s (3.0x the median)")
    assert render_value("run", ValueLedger("007", 0, 1)).startswith("run 007: ")


# --- lost time is the ledger's: idle after asynchronous launches (sync shrinkage) ------------------


def async_run(path: Path, seed: int, preempted_ms: float) -> tuple[int, float]:
    """20 steps of a loop that queues 20 ms of GPU work, runs 5 ms of its own host code, then syncs (the
    sync waits out the rest: ~15 ms). In one step a CPU hog takes ``preempted_ms`` of the host code: the
    GPU worked through the first part of it (the sync returns sooner), then idled. Returns the step and
    the GPU's true idle time in it."""
    lp = Loop(seed)
    rec = lp.rec
    rec.process(HOG, "stress-ng --cpu 16", 0.0, exec_event=False)
    bad = int(np.random.default_rng(seed).integers(1, STEPS - 1))
    queued, truth, lines = 20 * NS_PER_MS, 0.0, []
    for i in range(STEPS):
        t0 = lp.t
        for _ in range(4):  # the launches queue the step's GPU work
            dur = rec.jitter(8 * NS_PER_US, 0.1)
            rec.ev(lp.t, PID, *LAUNCH, dur)
            lp.t += dur / 1e9 + 20e-6
        gap = rec.jitter(5 * NS_PER_MS, 0.04)
        if i == bad:  # the hog runs in the thread's place in the middle of its host code
            rec.sched(lp.t + 1e-3, PID, preempted_ms * NS_PER_MS, by=HOG)
            gap += preempted_ms * NS_PER_MS
            truth = max(0.0, gap - queued)
        lp.t += gap / 1e9
        left = max(30_000.0, queued - gap)  # the sync waits out what the GPU has left
        rec.ev(lp.t, PID, *STREAM_SYNC, left)
        lp.t += left / 1e9 + 50e-6
        lines.append(AnnotationLine(rec.ts(t0), {"step": str(i)}, PID, 0, rec.ts(t0), rec.ts(lp.t)))
    lp.write(path)
    write_lines(path, lines, node=rec.node)
    return bad, truth


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_idle_after_async_launches_is_lost_and_adds_up_to_the_ledger(tmp_path: Path, seed: int) -> None:
    """A step's loss is idle after asynchronous launches: measured as the ledger measures it (what the
    next sync did not shrink by), and the steps' lost times add up to the whole-run ledger's, bucket by
    bucket, over the same spans (the steps tile the thread's wall)."""
    path = tmp_path / "run.db"
    bad, truth = async_run(path, seed, 40.0)
    r = result_of(path)
    assert_conserved(r)
    conn = open_readonly(path)
    try:
        (row,) = explain(conn).ledger
    finally:
        conn.close()
    whole = {b: row.idle_ns.get(b, 0) for b in BUCKETS if b not in ("gpu_steady", "gpu_slow", "not_recorded")}
    whole["gpu_slow"] = row.buckets["gpu_slow"]
    steps = {b: sum(v.lost.get(b, 0) for v in r.values) for b in whole}
    assert steps == whole
    assert sum(v.wall_ns for v in r.values) == row.wall_ns
    slow = r.values[bad]
    assert slow.cause == "preempted" and slow.lost["preempted"] >= 0.5 * slow.lost_ns
    # the GPU worked through the first 15 ms of the 40 ms preemption: only the rest is lost
    assert truth - 2 * NS_PER_MS <= slow.lost["preempted"] <= truth + NS_PER_MS, (slow.lost, truth)
    assert all(v.cause is None for v in r.values if v is not slow), [(v.value, v.lost) for v in r.values]
