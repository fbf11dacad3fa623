"""CUDA Graph rules on synthetic databases (written by the real writer, source 8 as Ingero stores it).

Churn (a capture + instantiation per step) and launches delayed by the host must be named; a graph
captured once and replayed at a steady period, and replays that wait on the GPU, must not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ingero.demo.synth import SyntheticNode
from ingero.explain.engine import ExplainReport, explain
from ingero.store.catalog import CUDA, CUDA_GRAPH, lookup_op
from ingero.store.db import open_readonly
from ingero.timeutil import NS_PER_MS

BASE = 1_776_000_000_000_000_000
PID = 200
BEGIN, END, INST, LAUNCH = (
    lookup_op(n).op
    for n in ("cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate", "cudaGraphLaunch")
)
SYNC = lookup_op("cudaStreamSync").op
Step = Callable[[SyntheticNode, float, int], float]  # writes one step's rows at t, returns the step's length (s)


def build(path: Path, step: Step, seconds: float = 20.0) -> Path:
    rec = SyntheticNode("node-g", BASE, 3)
    rec.process(PID, "python3 serve.py", 0.0, exec_event=False)
    rec.ev(0.05, PID, CUDA_GRAPH, BEGIN, 20_000, arg0=0x77)
    rec.ev(0.06, PID, CUDA_GRAPH, END, 2 * NS_PER_MS, arg0=0x77, arg1=0x6000)
    rec.ev(0.07, PID, CUDA_GRAPH, INST, 8 * NS_PER_MS, arg0=0x6000, arg1=0x5000)
    t, i = 0.1, 0
    while t < seconds:
        t += step(rec, t, i)
        i += 1
    rec.write(path)
    return path


def replay(rec: SyntheticNode, t: float, i: int, *, gap_s: float = 0.0, wait_on_gpu: bool = False) -> float:
    """One steady step: a graph launch, 6 ms of GPU waited for, 2 ms of host work; ``gap_s`` more before it."""
    if gap_s and wait_on_gpu:
        rec.ev(t, PID, CUDA, SYNC, gap_s * 1e9)  # the thread waits on the GPU during the gap
    t += gap_s
    rec.ev(t, PID, CUDA_GRAPH, LAUNCH, rec.jitter(30_000, 0.1), arg0=0x5000, arg1=0x77)
    rec.ev(t + 1e-4, PID, CUDA, SYNC, rec.jitter(6 * NS_PER_MS, 0.05))
    return gap_s + 0.0081


def report(path: Path) -> ExplainReport:
    conn = open_readonly(path)
    try:
        return explain(conn)
    finally:
        conn.close()


def families(r: ExplainReport) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in r.chains:
        out.setdefault(c.family, []).append(c.severity)
    return out


def test_steady_replays_name_no_graph_chain(tmp_path: Path) -> None:
    r = report(build(tmp_path / "ok.db", replay))
    assert not {f for f in families(r) if f.startswith("graph-")}, families(r)


def test_capture_per_step_is_churn(tmp_path: Path) -> None:
    def step(rec: SyntheticNode, t: float, i: int) -> float:
        rec.ev(t, PID, CUDA_GRAPH, BEGIN, 50_000, arg0=0x77)
        rec.ev(t + 0.001, PID, CUDA_GRAPH, END, 3 * NS_PER_MS, arg0=0x77, arg1=0x6000 + i)
        rec.ev(t + 0.004, PID, CUDA_GRAPH, INST, 9 * NS_PER_MS, arg0=0x6000 + i, arg1=0x5000 + i)
        return 0.013 + replay(rec, t + 0.013, i)

    r = report(build(tmp_path / "churn.db", step))
    chains = [c for c in r.chains if c.family == "graph-churn"]
    assert len(chains) == 1, families(r)
    c = chains[0]
    assert c.evidence["pid"] == PID and c.evidence["launches"] == c.evidence["instantiations"] - 1  # the first graph
    assert c.severity == "HIGH"  # 12 ms of every 21 ms step rebuilds a graph
    assert "graph-late" not in families(r)


def test_replays_delayed_by_the_host_are_named(tmp_path: Path) -> None:
    r = report(build(tmp_path / "late.db", lambda rec, t, i: replay(rec, t, i, gap_s=0.06 if i % 25 == 24 else 0.0)))
    chains = [c for c in r.chains if c.family == "graph-late"]
    assert len(chains) == 1, families(r)
    c = chains[0]
    assert c.evidence["late_launches"] >= 50
    assert abs(c.evidence["host_lost_ms"] - c.evidence["late_launches"] * 60) < 0.1 * c.evidence["late_launches"] * 60
    assert "graph-churn" not in families(r)


def test_replays_late_because_waiting_on_the_gpu_are_not_host_delays(tmp_path: Path) -> None:
    step: Step = lambda rec, t, i: replay(rec, t, i, gap_s=0.06 if i % 25 == 24 else 0.0, wait_on_gpu=True)  # noqa: E731
    r = report(build(tmp_path / "gpu.db", step))
    assert "graph-late" not in families(r), families(r)
