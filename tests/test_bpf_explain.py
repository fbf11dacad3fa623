"""explain v2 on real recordings: ``ingero trace`` (in this process, real bcc uprobes and tracepoints)
of small training-loop programs (``bpf_fixtures/trainer_explain.c``) against the CUDA-shaped test
libraries, then explain on each program's pid:

(a) forked workers slow to produce batches → input starvation named, not CPU contention;
(b) a trainer pinned to one core with a higher-priority CPU hog on the same core → CPU contention with
    measured overlap, the hog named from sched_switch's preemptor;
(c) a healthy trainer that sleeps between steps → no HIGH/MEDIUM chain;
(d) the agent's own database writes (this process) never appear as evidence.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ingero.agent.trace.tracer import TraceReady
from ingero.explain.engine import ExplainReport, explain
from ingero.identity import Identity
from ingero.store import catalog
from ingero.store.db import open_readonly
from tests.bpf_support import Built, build, build_program, record, run_beside_cpu_hog, trace_options

pytestmark = pytest.mark.bpf

HOG_CPU = max(os.sched_getaffinity(0))


@dataclass
class Recorded:
    db: Path
    starved: int
    workers: list[int]
    healthy: int
    contended: int
    hog: int
    agent: int

    def explain(self, pid: int) -> ExplainReport:
        conn = open_readonly(self.db)
        try:
            return explain(conn, pid=pid)
        finally:
            conn.close()


def _run(exe: Path, *args: str) -> int:
    p = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120, check=True)
    lines = p.stdout.split()
    assert lines[-1] == "end", p.stdout
    return int(lines[1])


def _phases(exe: Path, built: Built, ready: TraceReady) -> dict[str, int]:
    out: dict[str, int] = {}
    lib = str(built.dir)
    # (a) 2 workers x 12 ms of CPU per batch for a loop that needs ~2 ms per step
    out["starved"] = _run(exe, "starved", lib, "120", "2", "12000")
    # (c) 2 ms syncs and 3 ms usleep between steps: asleep most of the time, all of it voluntary
    out["healthy"] = _run(exe, "healthy", lib, "250", "3000")
    # (b) baseline steps, then a higher-priority hog on the trainer's core
    work = subprocess.Popen(
        [str(exe), "contended", lib, "400", "120", "1000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert work.stdout is not None and work.stdin is not None
    os.sched_setaffinity(work.pid, {HOG_CPU})
    assert work.stdout.readline().split() == ["pid", str(work.pid)]
    assert work.stdout.readline().strip() == "ready"
    out["contended"], out["hog"] = work.pid, run_beside_cpu_hog(work, built.hog, HOG_CPU)
    return out


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    built = build(tmp_path_factory.mktemp("bpf-build"))
    exe = build_program("trainer_explain.c", tmp_path_factory.mktemp("bpf-trainer"))
    # on the disk the tests run from (not a tmpfs): the agent's own writes become block I/O rows; a
    # directory of this run's own, so that two runs at once never share (or delete) each other's database
    shared = Path(__file__).resolve().parents[1] / ".pytest_cache" / "bpf-explain"
    shared.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=shared))
    try:
        db = work / "trace.db"
        _summary, out = record(
            trace_options(db, Identity("bpf-explain"), built.overrides()), lambda ready: _phases(exe, built, ready)
        )
        conn = open_readonly(db)
        try:
            q = "SELECT arg1 FROM events WHERE source = 3 AND op = 7 AND pid = ?"
            workers = [int(r[0]) for r in conn.execute(q, (out["starved"],))]
        finally:
            conn.close()
        yield Recorded(db, out["starved"], workers, out["healthy"], out["contended"], out["hog"], os.getpid())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _shown(r: ExplainReport) -> list[tuple[str, str, str, str]]:
    return [(c.severity, c.family, c.cuda_op, c.summary) for c in r.chains]


def test_a_slow_forked_workers_are_input_starvation(rec: Recorded) -> None:
    assert len(rec.workers) == 2, "the trainer's forks were not recorded"
    r = rec.explain(rec.starved)
    starved = [c for c in r.chains if c.family == "idle/input"]
    assert starved and starved[0].severity in ("HIGH", "MEDIUM"), _shown(r)
    ev = starved[0].evidence
    assert set(ev["workers"]) <= set(rec.workers) and ev["workers"], ev
    assert ev["lost_share"] >= 0.3, ev  # ~12 ms per batch / 2 workers vs a ~2 ms step
    assert not [c for c in r.chains if "cpu" in c.family and c.severity != "LOW"], _shown(r)


def test_b_cpu_hog_on_the_trainers_core_is_measured_contention(rec: Recorded) -> None:
    r = rec.explain(rec.contended)
    cpu = [c for c in r.chains if c.family == "tail/cpu" and c.cuda_op == "cudaLaunchKernel"]
    assert cpu, _shown(r)
    c = cpu[0]
    assert c.severity in ("HIGH", "MEDIUM") and c.evidence["overlap_involuntary"] >= 0.3, c.evidence
    assert c.evidence["prev_state"] == "recorded"
    assert any(f"pid {rec.hog}" in who for who in c.evidence["preempted_by"]), c.evidence
    assert "cpu_hog" in c.root_cause and any("taskset" in x for x in c.recommendations)


def test_c_healthy_trainer_that_sleeps_has_no_high_or_medium_chain(rec: Recorded) -> None:
    r = rec.explain(rec.healthy)
    assert r.ops and any(o.name == "cudaStreamSync" for o in r.ops)
    assert all(c.severity == "LOW" for c in r.chains), _shown(r)


def test_d_the_agents_own_writes_never_appear_as_evidence(rec: Recorded) -> None:
    conn = open_readonly(rec.db)
    try:
        own_io = conn.execute(
            "SELECT count(*) FROM events WHERE source = ? AND pid = ?", (catalog.IO, rec.agent)
        ).fetchone()[0]
    finally:
        conn.close()
    # the premise: the agent's database writes (on a real disk, not a tmpfs) were recorded as block I/O
    assert own_io > 0, "no block I/O row of the agent's own writes: the check below would test nothing"
    for pid in (rec.starved, rec.healthy, rec.contended):
        r = rec.explain(pid)
        for c in r.chains:
            assert "io" not in c.family.split("/")[-1], _shown(r)
            text = " ".join([c.summary, c.root_cause, c.explanation, *(t.detail for t in c.timeline)])
            assert f"pid {rec.agent}" not in text, c.summary
            assert rec.agent not in c.evidence.get("workers", []) and rec.agent not in c.evidence.get("forked", [])
        assert any("block I/O ops by processes outside" in n for n in r.notes), r.notes
