"""Serving's CPU bottleneck (:mod:`ingero.explain.serving_host`): the ledger's host-code chain of a serving
engine's loop told as serving's — the engine named, its own gauges as evidence, a serving fix — and a
server idle at low load never called a CPU bottleneck.

The recordings are the catalog's serving scenarios (:mod:`tests.scenarios.serving`: a GPU loop written
as the tracer writes it, the engine's series as the scraper stores them), varied here one knob at a
time: where the engine's series are, whether requests waited, what the process is called.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ingero.demo.synth import PROCESS_FORK, SyntheticNode
from ingero.explain.engine import ExplainReport
from ingero.explain.model import Chain
from ingero.explain.serving_host import FAMILY, engine_of_name
from tests.scenarios.base import Params, finish, trainer, write
from tests.scenarios.host import _cpu_bound
from tests.scenarios.ingero_layout import rewrite
from tests.scenarios.judge import conservation, explain_file
from tests.scenarios.serving import PROCESS, busy, healthy_engine_low_load, low_load, scraped, serving_engine_cpu_bound

TRAINING = ("idle/host_code", "idle/host_bound")
HALF_S = 2.7  # about half of a CPU-bound loop's run at 26 % (4 s of its own work, 5.4 s in all)
TRAINING_FIXES = ("DataLoader", "non_blocking", "torch.compile")  # the training chain's wording


def report(nodes: list[SyntheticNode], tmp: Path, *, ingero: bool = False) -> ExplainReport:
    db = write(nodes, tmp / "r.db")
    return explain_file(rewrite(db, tmp / "i.db") if ingero else db)


def serving(r: ExplainReport) -> list[Chain]:
    return [c for c in r.chains if c.family == FAMILY]


def text(c: Chain) -> str:
    return " ".join([c.summary, c.root_cause, c.explanation, *c.recommendations])


def cpu_bound_engine(
    share: float,
    *,
    seed: int,
    engine: str = "vllm",
    name: str | None = None,
    state: str = "busy",
    child: bool = False,
    fork: bool = True,
) -> list[SyntheticNode]:
    """One engine node whose loop is CPU-bound at every step by ``share``. ``state``: its gauges (busy with a
    queue, busy without one, idle, or none recorded); ``child``: the loop runs in a child of the engine's
    top process, whose fork is recorded unless not ``fork``, and the series are the parent's; ``name``: the
    loop's process name."""
    p = Params(seed, share)
    loop = trainer(p, 0, name or PROCESS[engine])
    _cpu_bound(loop, share)
    parent = loop.pid - 1
    if child:
        loop.rec.process(parent, "python3", 0.0, exec_event=False)
        if fork:
            loop.rec.ev(0.05, parent, *PROCESS_FORK, 0, arg1=loop.pid)
    gauges = {
        "busy": busy(seed),
        "running only": busy(seed, waiting=(0, 1)),
        "idle": lambda t: {"running": 0.0, "waiting": 0.0, "kv": 0.0, "done": 0.0},
        # busy with a queue for the first half of the run (the loop starts at 0.2 s), then no request at all
        "half": lambda t: (
            busy(seed)(t) if t < 0.2 + HALF_S else {"running": 0.0, "waiting": 0.0, "kv": 0.0, "done": 0.0}
        ),
    }
    if state in gauges:
        scraped(loop, engine, gauges[state], pid=parent if child else None)
    return [finish(loop)]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(("share", "severity"), [(0.26, "HIGH"), (0.065, "MEDIUM"), (0.04, "LOW")])
def test_a_cpu_bound_engine_is_told_as_serving(tmp_path: Path, engine: str, share: float, severity: str) -> None:
    """Requests waited while the loop ran host code at every step: serving's chain at the ledger's severity,
    the engine and its gauges named, a serving fix — and no training chain or training fix anywhere."""
    r = report(cpu_bound_engine(share, seed=11, engine=engine), tmp_path)
    assert not [c for c in r.chains if c.family.startswith(TRAINING)], r.chains
    (c,) = serving(r)
    assert c.severity == severity
    assert c.evidence["engine"] == engine and c.evidence["ledger_family"] == "idle/host_bound"
    assert f"{engine} (pid 5000)" in c.summary
    waiting = "vllm:num_requests_waiting" if engine == "vllm" else "sglang:num_queue_reqs"
    assert waiting in c.root_cause and "waiting" in c.root_cause and c.evidence["waiting_max"] >= 2
    fix = "--num-scheduler-steps" if engine == "vllm" else "--disable-overlap-schedule"
    assert any(fix in rec for rec in c.recommendations), c.recommendations
    assert not any(w in text(c) for w in TRAINING_FIXES), c.recommendations
    # the figures: the ledger's host code, all of it under load here; lost ≤ host code ≤ wall
    assert c.evidence["lost_ms"] == c.evidence["host_code_ms"] <= c.evidence["wall_ms"]
    assert abs(c.evidence["lost_share"] - share) <= 0.2 * share
    assert conservation(r)[1] == []


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("share", [0.26, 0.065])
def test_the_same_loop_without_requests_is_no_cpu_bottleneck(tmp_path: Path, seed: int, share: float) -> None:
    """The same CPU-bound loop, the engine's gauges saying no request ran or waited: not a CPU bottleneck
    (nothing to serve), at any severity; a note says what it was."""
    r = report(cpu_bound_engine(share, seed=seed, state="idle"), tmp_path)
    assert not serving(r) and not [c for c in r.chains if c.family.startswith(TRAINING)], r.chains
    assert any("idle at low load, not a CPU bottleneck" in n for n in r.notes), r.notes


@pytest.mark.parametrize("share", [0.26, 0.065])
def test_running_without_a_queue_counts_only_for_every_step_host_code(tmp_path: Path, share: float) -> None:
    """Requests running, none waiting: the loop's host code at every step still held them up (steps mean
    work): named at its severity, the gauges saying 0 waiting."""
    (c,) = serving(report(cpu_bound_engine(share, seed=5, state="running only"), tmp_path))
    assert c.severity == ("HIGH" if share > 0.2 else "MEDIUM") and c.evidence["waiting_max"] == 0


def test_the_engine_loop_in_a_child_process_takes_its_parents_series(tmp_path: Path) -> None:
    """vLLM's engine core: the GPU loop is a child of the process the series were scraped from."""
    (c,) = serving(report(cpu_bound_engine(0.26, seed=4, child=True, name="python3"), tmp_path))
    assert c.evidence["engine_pid"] == 4999 and c.evidence["pid"] == 5000 and c.evidence["load_recorded"]


def test_a_loop_named_as_an_engine_core_takes_its_nodes_engine(tmp_path: Path) -> None:
    """No fork recorded (the engine started before the recording), the loop named VLLM::EngineCor (comm is
    cut at 15 characters): the node's one vLLM's series judge it."""
    (c,) = serving(report(cpu_bound_engine(0.26, seed=6, name="VLLM::EngineCor", child=True, fork=False), tmp_path))
    assert c.evidence["engine_pid"] == 4999 and c.evidence["load_recorded"] and c.severity == "HIGH"


def test_without_the_engines_series_every_step_host_code_keeps_its_severity(tmp_path: Path) -> None:
    """Named as an engine, no series: steps at every gap mean there was work, so the severity stands,
    and the chain says which signal would tell more."""
    (c,) = serving(report(cpu_bound_engine(0.26, seed=8, state="none"), tmp_path))
    assert c.severity == "HIGH" and not c.evidence["load_recorded"]
    assert any("--inference" in rec for rec in c.recommendations)


def test_a_training_loop_keeps_the_training_chain(tmp_path: Path) -> None:
    """Not an engine (no series, not named as one): the ledger's chain as it was."""
    r = report(cpu_bound_engine(0.26, seed=9, name="python3 train.py", state="none"), tmp_path)
    assert not serving(r) and [c.family for c in r.chains if c.family.startswith(TRAINING)] == ["idle/host_bound"]


@pytest.mark.parametrize("seed", [0, 6])  # vLLM, SGLang
def test_low_load_polling_is_not_a_cpu_bottleneck_in_either_layout(tmp_path: Path, seed: int) -> None:
    """An engine polling on-CPU between rare requests. Recorded: its gauges say no request was there — no
    chain of host code at all, a note instead. Ingero's layout keeps no engine_metrics: at most LOW,
    saying the load is not recorded and how to record it — never the training chain."""
    p = Params(seed, 0.0, n_nodes=2)
    recorded = report(healthy_engine_low_load(p), tmp_path)
    assert not serving(recorded) and not [c for c in recorded.chains if c.family.startswith(TRAINING)]
    assert sum("idle at low load" in n for n in recorded.notes) == 2
    (tmp_path / "ingero").mkdir()
    ingero = report(healthy_engine_low_load(p), tmp_path / "ingero", ingero=True)
    assert not [c for c in ingero.chains if c.family.startswith(TRAINING)]
    chains = serving(ingero)
    assert len(chains) == 2 and {c.severity for c in chains} == {"LOW"}
    for c in chains:
        assert "not recorded" in c.summary and any("--inference" in rec for rec in c.recommendations)


def test_a_cpu_bound_engine_among_busy_peers_is_the_only_one_named(tmp_path: Path) -> None:
    """Three busy engines, the middle one CPU-bound: only its node gets the chain."""
    r = report(serving_engine_cpu_bound(Params(3, 0.16, n_nodes=3, outlier=1)), tmp_path)
    assert [(c.node, c.severity) for c in serving(r)] == [("gpu-node-01", "MEDIUM")]


def test_low_load_requests_are_served_between_the_polls() -> None:
    """The low-load loop's premise: requests are rare (most of the time none runs)."""
    loop = trainer(Params(1, 0.0), 0, PROCESS["vllm"])
    served = low_load(loop)
    busy_s = sum(b - a for a, b in served)
    assert len(served) >= 10 and busy_s < 0.5 * loop.t


@pytest.mark.parametrize(
    ("name", "engine"),
    [
        ("vllm", "vllm"),
        ("VLLM::EngineCor", "vllm"),
        ("vllm serve meta-llama/Llama-3-8B", "vllm"),
        ("sglang::schedul", "sglang"),
        ("text-generation", "tgi"),
        ("/opt/tritonserver/bin/tritonserver --model-repository=/m", "triton"),
        ("vllm, container 3f2a", "vllm"),
        ("python3", None),
        ("python3 train.py", None),
        ("", None),
    ],
)
def test_engine_process_names(name: str, engine: str | None) -> None:
    assert engine_of_name(name) == engine


def test_a_window_after_the_gauges_last_change_is_judged_by_the_values_in_force(tmp_path: Path) -> None:
    """The scraper stores a gauge when it changes: an idle engine's 0s are written at the first scrape only.
    A window opened seconds later still sees them (the last row before it), so it is still no bottleneck."""
    from ingero.explain.engine import explain
    from ingero.store.db import open_readonly
    from ingero.store.window import Window

    nodes = cpu_bound_engine(0.26, seed=3, state="idle")
    db = write(nodes, tmp_path / "r.db")
    conn = open_readonly(db)
    try:
        (first,) = conn.execute("SELECT min(ts) FROM engine_metrics").fetchone()
        assert conn.execute("SELECT count(DISTINCT ts) FROM engine_metrics").fetchone() == (1,)  # stored once
        r = explain(conn, Window(first + 1_500_000_000, None))
    finally:
        conn.close()
    assert not serving(r) and not [c for c in r.chains if c.family.startswith(TRAINING)], r.chains


@pytest.mark.parametrize("seed", [1, 2])
def test_only_the_host_code_under_load_is_lost(tmp_path: Path, seed: int) -> None:
    """Busy with a queue for half the run, no request after: about half of the host code is lost, the rest
    is low load; lost + low load = the ledger's host code ≤ wall."""
    (c,) = serving(report(cpu_bound_engine(0.26, seed=seed, state="half"), tmp_path))
    ev = c.evidence
    assert abs(ev["lost_ms"] + ev["low_load_ms"] - ev["host_code_ms"]) <= 0.2 <= ev["host_code_ms"] <= ev["wall_ms"]
    assert 0.35 <= ev["lost_ms"] / ev["host_code_ms"] <= 0.65, ev
    assert c.severity == "MEDIUM"  # ~13 % of the wall time: not the 26 % the whole host code is
    assert "low load: not counted" in c.root_cause
