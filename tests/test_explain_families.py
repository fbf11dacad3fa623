"""The catalog families whose rules measure lost time from a trend, a bandwidth, a silence or a rank's
lateness (issue #20): each rule's core on arrays, then explain on the scenario generator's databases
(:mod:`tests.scenarios`) in both layouts, the chain's lost share against the magnitude built in, and
every figure against its invariant.

* kernel drift — a < 2x gradual slowdown: the trend of the op's block medians, lost vs the early level;
* allocator churn — each release's own refill and the sync spike after it, never counted twice;
* GPU contention — no ratio gate: a significant shift of the shared calls' median, mean excess lost;
* slow copies — bytes / time per copy against the process's fast copies (at least PCIe Gen3 x16);
* hung rank — the rank that never entered the collective the others wait in (NCCL's in-flight calls),
  its GPU's silence as the lost time; no hang claimed without that signal;
* late rank — host code before a collective that the rank then entered last (without NCCL rows: host
  code its peers slept through, told across the nodes).
"""

from __future__ import annotations

import numpy as np
import pytest

from ingero.explain import causes as cz
from ingero.explain import rules_drift, rules_hang, rules_memory, rules_ranks
from ingero.explain.engine import ExplainReport
from ingero.explain.frame_load import load_frames
from ingero.explain.model import Chain
from ingero.explain.rules_events import shared_loss
from ingero.store.db import open_readonly
from ingero.store.window import Window
from tests.conftest import SharedDbs
from tests.scenarios.base import Params
from tests.scenarios.expectations import INGERO, RECORDED, TOLERANCE
from tests.scenarios.ingero_layout import TEMPLATE
from tests.scenarios.judge import explain_file
from tests.test_explain_regimes import check_invariants

SEEDS = [1, 2, 3]
SAMPLES = TEMPLATE.parent
MS = 1_000_000


# --- the rules' cores on arrays ------------------------------------------------------------------


def _calls(seed: int, n: int = 1200, jitter: float = 0.04) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dur = rng.normal(8 * MS, 8 * MS * jitter, n)
    ts = np.cumsum(np.full(n, 10.7 * MS))
    return ts.astype(np.int64), dur


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rise", [0.04, 0.3, 0.9])
def test_a_gradual_slowdown_is_drift_with_its_lost_time(seed: int, rise: float) -> None:
    ts, dur = _calls(seed)
    t = (ts - ts[0]) / (ts[-1] - ts[0])
    slower = dur * (1 + rise * t)
    d = rules_drift.fit(ts, slower.astype(np.int64))
    assert d is not None
    injected = float((slower - dur).sum())
    assert d.lost_ns == pytest.approx(injected, rel=0.15)
    assert d.rise == pytest.approx(rise, rel=0.25, abs=0.01)
    assert 0 < d.lost_ns <= slower.sum() and 0 <= d.r2 <= 1 and d.early_ns == pytest.approx(8 * MS, rel=0.02)
    assert rules_drift.fit(ts[::-1], slower[::-1].astype(np.int64)) == d  # any order: sorted by time


@pytest.mark.parametrize("seed", SEEDS)
def test_noise_a_stretch_or_a_speed_up_is_no_drift(seed: int) -> None:
    ts, dur = _calls(seed, jitter=0.15)
    assert rules_drift.fit(ts, dur.astype(np.int64)) is None
    box = dur.copy()
    box[400:800] *= 1.5  # a slower stretch in the middle of the run: a regime's, not a trend
    assert rules_drift.fit(ts, box.astype(np.int64)) is None
    t = (ts - ts[0]) / (ts[-1] - ts[0])
    assert rules_drift.fit(ts, (dur * (1.5 - 0.4 * t)).astype(np.int64)) is None  # faster over time
    assert rules_drift.fit(ts[:40], dur[:40].astype(np.int64)) is None  # too few calls for a trend


def test_each_release_counts_its_own_refill_and_sync_spike_once() -> None:
    """Three releases in a row, 20 ms apart: each allocation and sync belongs to the release before it."""
    starts = np.array([0, 60, 120]) * MS
    f_ts = np.concatenate([s + np.arange(5) * MS for s in starts]).astype(np.int64)
    f_dur = np.full(f_ts.size, 200_000, dtype=np.int64)
    m_ts = np.concatenate([s + np.array([10, 20]) * MS for s in starts]).astype(np.int64)
    m_dur = np.full(m_ts.size, 3 * MS, dtype=np.int64)
    s_ts = np.concatenate([s + np.array([30, 45]) * MS for s in starts]).astype(np.int64)
    s_dur = np.tile(np.array([18, 8]) * MS, 3).astype(np.int64)  # a 10 ms spike after each refill
    bursts = rules_memory._bursts(f_ts, m_ts)
    assert [b[2] for b in bursts] == [5, 5, 5]
    eps, p50 = rules_memory._episodes(bursts, f_ts, f_dur, m_ts, m_dur, s_ts, s_dur, 8 * MS)
    assert p50 == 0.0  # no allocation outside a refill: a driver allocation is all excess
    assert [e[2] for e in eps] == [2, 2, 2]
    assert [e[3] for e in eps] == [5 * 200_000 + 2 * 3 * MS + 10 * MS] * 3
    assert sum(e[3] for e in eps) <= int(f_dur.sum() + m_dur.sum() + s_dur.sum())
    # an allocation between frees splits a run: here the first release into two runs too short to count
    assert len(rules_memory._bursts(f_ts, np.array([2 * MS + 500_000]))) == 2


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("slowdown", [0.0, 0.1, 0.6])
def test_gpu_sharing_loss_has_no_ratio_gate(seed: int, slowdown: float) -> None:
    rng = np.random.default_rng(seed)
    alone = rng.normal(8 * MS, 0.32 * MS, 300)
    shared = rng.normal(8 * MS, 0.32 * MS, 300) + slowdown * 8 * MS
    lost = shared_loss(shared, alone)
    if slowdown == 0:
        assert lost == 0
        return
    assert lost == pytest.approx(slowdown * 8 * MS * 300, rel=0.1)
    assert 0 < lost <= shared.sum()


@pytest.mark.parametrize("outlier", [0, 2])
def test_the_hung_rank_is_the_one_that_never_entered_the_call_the_others_wait_in(
    shared_dbs: SharedDbs, outlier: int
) -> None:
    p = Params(seed=4, magnitude=0.16, n_nodes=3, outlier=outlier)
    paths = shared_dbs.scenario("hung-rank", p)
    conn = open_readonly(paths[RECORDED])
    try:
        stuck = rules_hang.stuck_calls(conn, Window())
        frames = load_frames(conn)
    finally:
        conn.close()
    assert len(stuck) == 1
    st = stuck[0]
    assert [m[0] for m in st.missing] == [p.outlier_node] and st.nranks == 3
    assert sorted(w[0] for w in st.waiting) == sorted(p.node_name(i) for i in range(3) if i != outlier)
    assert all(m[3] == st.seq - 1 for m in st.missing)  # its calls stop right before the one it never entered
    last, quiet, wall = rules_hang.silence(frames[p.outlier_node], 5000)
    assert 0 < quiet <= wall and last + quiet == frames[p.outlier_node].last_ns
    assert quiet / wall == pytest.approx(0.16, rel=TOLERANCE)
    conn = open_readonly(paths[INGERO])  # no NCCL tables: nothing can tell a hang from a finished job
    try:
        assert rules_hang.stuck_calls(conn, Window()) == []
    finally:
        conn.close()


def test_a_finished_job_in_ingeros_samples_is_no_hang() -> None:
    """Ingero's sample jobs stop their GPU calls over a third of the recording before it ends: no hang."""
    for db in sorted(SAMPLES.glob("sample-*.db")):
        assert not [c for c in explain_file(db).chains if c.family.startswith("hang")], db.name


@pytest.mark.parametrize("seed", SEEDS)
def test_late_entries_are_the_long_host_code_before_short_collectives(seed: int) -> None:
    rng = np.random.default_rng(seed)
    host = rng.normal(450_000, 30_000, 200)
    coll = rng.normal(6 * MS, 1 * MS, 200)
    late = np.zeros(200, dtype=bool)
    late[rng.choice(200, 12, replace=False)] = True
    host[late] += 7 * MS
    coll[late] = 1.5 * MS  # arrived last: only the transfer
    found = rules_ranks.late_entries(host.astype(np.int64), coll.astype(np.int64))
    assert found is not None and (found[0] == late).all() and found[1] == pytest.approx(450_000, rel=0.05)
    waited = coll.copy()
    waited[late] = 12 * MS  # they waited inside those calls too: someone else was later
    assert rules_ranks.late_entries(host.astype(np.int64), waited.astype(np.int64)) is None
    assert rules_ranks.late_entries(rng.normal(450_000, 30_000, 200).astype(np.int64), coll.astype(np.int64)) is None


@pytest.mark.parametrize("seed", SEEDS)
def test_the_last_rank_pays_the_rendezvous_round_trip_and_is_still_late(seed: int) -> None:
    """A real recording (test_bpf_catalog): the collectives after the rank's 25 ms late entries took a
    median 140 µs against 84 µs for the others — the last rank to arrive pays the rendezvous round trip,
    not a wait. Only a difference of the order of the lateness says it waited too."""
    rng = np.random.default_rng(seed)
    host = rng.normal(450_000, 30_000, 200)
    coll = rng.normal(84_000, 5_000, 200)
    late = np.zeros(200, dtype=bool)
    late[rng.choice(200, 12, replace=False)] = True
    host[late] += 25 * MS
    coll[late] = rng.normal(140_000, 5_000, 12)
    found = rules_ranks.late_entries(host.astype(np.int64), coll.astype(np.int64))
    assert found is not None and (found[0] == late).all()
    coll[late] = 12 * MS  # waited inside: half its own lateness
    assert rules_ranks.late_entries(host.astype(np.int64), coll.astype(np.int64)) is None


# --- explain on the generator's scenarios, both layouts ----------------------------------------

FINDINGS = {  # family -> the chain family that measures its lost time
    "kernel-drift": "drift/gpu",
    "kv-pressure": "alloc-churn",
    "fragmentation": "alloc-churn",
    "noisy-neighbour": "gpu-contention",
    "pageable-copy": "transfer/pageable",
    "hung-rank": "hang/collective",
    "cpu-bound-loop": "idle/host_bound",  # own host code at every step, beyond the 1 ms turnaround
    "loader-overlap": "idle/io",  # only what outlasts the queued GPU work: the next sync's shrinkage
}


def _report(family: str, p: Params, dbs: SharedDbs, layout: str) -> ExplainReport:
    return explain_file(dbs.scenario(family, p)[layout])


def _one(r: ExplainReport, node: str, family: str) -> Chain:
    mine = [c for c in r.chains if c.node == node and c.family == family]
    assert len(mine) == 1, [(c.node, c.family, c.severity) for c in r.chains]
    return mine[0]


@pytest.mark.parametrize("layout", [RECORDED, INGERO])
@pytest.mark.parametrize("magnitude", [0.26, 0.065])
@pytest.mark.parametrize("family", sorted(FINDINGS))
def test_the_lost_share_is_the_magnitude_built_in(
    shared_dbs: SharedDbs, family: str, magnitude: float, layout: str
) -> None:
    p = Params(seed=31, magnitude=magnitude, n_nodes=2, outlier=1)
    r = _report(family, p, shared_dbs, layout)
    check_invariants(r)
    if family == "hung-rank" and layout == INGERO:  # the hang's signal (NCCL's in-flight calls) is missing
        assert not [c for c in r.chains if c.family.startswith("hang")]
        return
    c = _one(r, p.outlier_node, FINDINGS[family])
    share = float(c.evidence.get("lost_share", c.evidence["score"]))
    assert 0 < share <= 1
    slack = 0.35 if family == "kernel-drift" else TOLERANCE  # drift's magnitude is the generator's estimate
    assert share == pytest.approx(magnitude, rel=slack)
    assert c.severity == cz.severity_of_loss(share, 1.0)
    assert not [x for x in r.chains if x.node != p.outlier_node and x.family == FINDINGS[family]]


@pytest.mark.parametrize("layout", [RECORDED, INGERO])
def test_a_late_rank_is_named_in_both_layouts_and_peers_are_not(shared_dbs: SharedDbs, layout: str) -> None:
    p = Params(seed=5, magnitude=0.16, n_nodes=3, outlier=1)
    r = _report("late-rank", p, shared_dbs, layout)
    check_invariants(r)
    late = [c for c in r.chains if c.family == "late-rank"]
    assert [c.node for c in late] == [p.outlier_node], [(c.node, c.family, c.severity) for c in r.chains]
    assert late[0].evidence["lost_share"] == pytest.approx(0.16, rel=TOLERANCE)
    assert late[0].severity == "MEDIUM" and late[0].evidence["late_entries"] >= rules_ranks.MIN_LATE
    if layout == INGERO:  # no NCCL rows: told across the nodes, the missing signal named, one chain per loss
        assert late[0].evidence["missing_signal"] == "nccl_calls" and "NCCL" in late[0].root_cause
        assert not [c for c in r.chains if c.node == p.outlier_node and c.family == "idle/host_code"]


@pytest.mark.parametrize("seed", SEEDS)
def test_host_code_bursts_the_other_nodes_did_not_wait_for_are_no_late_rank(shared_dbs: SharedDbs, seed: int) -> None:
    """Independent servers (no lock step): the outlier's host-code bursts are its own (idle/host_code),
    never a late rank — its peers did not sleep through them."""
    p = Params(seed=seed, magnitude=0.16, n_nodes=3, outlier=2)
    r = _report("serving-host-bound", p, shared_dbs, INGERO)
    assert not [c for c in r.chains if c.family == "late-rank"]
    assert [c.node for c in r.chains if c.family == "idle/host_code"] == [p.outlier_node]


@pytest.mark.parametrize("family", ["healthy-sleeps", "healthy-collective", "healthy-idle-server", "healthy-overlap"])
def test_healthy_jobs_get_none_of_these_findings(shared_dbs: SharedDbs, family: str) -> None:
    p = Params(seed=8, magnitude=0.065, n_nodes=2, outlier=0)
    paths = shared_dbs.scenario(family, p)
    for layout in (RECORDED, INGERO):
        r = explain_file(paths[layout])
        check_invariants(r)
        said = [(c.family, c.severity) for c in r.chains]
        assert not [f for f, _ in said if f.startswith(("drift", "transfer", "late-rank", "alloc-churn", "hang"))], said


@pytest.mark.parametrize("layout", [RECORDED, INGERO])
def test_a_cpu_bound_loop_is_its_pace_not_an_incident(shared_dbs: SharedDbs, layout: str) -> None:
    """Own host code at every step: one idle/host_bound chain whose paced part holds the lost time (the
    incidents' part beside it), figures within the wall; its healthy twin gets no host finding."""
    p = Params(seed=12, magnitude=0.16, n_nodes=2, outlier=0)
    r = _report("cpu-bound-loop", p, shared_dbs, layout)
    check_invariants(r)
    c = _one(r, p.outlier_node, "idle/host_bound")
    ev = c.evidence
    assert ev["paced_ms"] + ev["incidents_ms"] == pytest.approx(ev["lost_ms"], abs=0.2)
    assert 0.5 * ev["lost_ms"] <= ev["paced_ms"] <= ev["lost_ms"] <= ev["wall_ms"]
    assert any("CUDA Graphs" in x for x in c.recommendations) and "every step" in c.summary
    assert not [x for x in r.chains if x.node != p.outlier_node and x.family.startswith("idle/host")]
