"""The fleet's clock skew on numpy (:mod:`ingero.fleet.fleet_skew`) against plain-Python references:
lowest-delay selection, offset ± bound around the true offset under asymmetric delays, MAD outliers
wherever the odd node sits, drift in ppm (a known drift recovered within its uncertainty; None under
3 samples), numpy kept off the wire path, and ``fleet status --samples`` end to end."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import trio

from ingero.cli.main import main
from ingero.fleet import local_agents
from ingero.fleet.fleet_skew import MAX_DELAY_RATIO, MIN_DRIFT_SAMPLES, SIGMA_FLOOR_NS, fleet_estimates, t95
from ingero.fleet.outliers import Z_THRESHOLD
from ingero.fleet.skew import SkewEstimate, TimeSample, estimate, refine
from tests.conftest import ROOT
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, make_pki, shift_clock

US, MS, S = 1_000, 1_000_000, 1_000_000_000
BASE = 1_780_000_000 * S
FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def synth(
    rng: random.Random,
    offset_ns: float,
    n: int,
    *,
    drift_ppm: float = 0.0,
    span_s: float = 5.0,
    delay_us: tuple[float, float] = (40, 600),
    start: int = BASE,
) -> list[TimeSample]:
    """``n`` round trips over ``span_s`` to an agent whose clock is ``offset_ns`` ahead at ``start`` and
    runs ``drift_ppm`` fast; each leg's delay drawn on its own (asymmetric), 20 µs in the agent."""
    out = []
    for i in range(n):
        t1 = start + int(i * span_s * S / max(n - 1, 1)) + rng.randrange(0, 1000 * US)
        arrive = t1 + rng.uniform(*delay_us) * US  # this host's clock
        t2 = arrive + offset_ns + drift_ppm * 1e-6 * (arrive - start)  # the agent's
        t3 = t2 + 20 * US
        t4 = arrive + 20 * US + rng.uniform(*delay_us) * US
        out.append(TimeSample(t1, round(t2), round(t3), round(t4)))
    return out


def true_offset_at(s: TimeSample, offset_ns: float, drift_ppm: float, start: int = BASE) -> float:
    return offset_ns + drift_ppm * 1e-6 * ((s.t1 + s.t4) / 2 - start)


def reference_drift(samples: list[TimeSample]) -> float | None:
    """The drift rule written out per node, with numpy.polyfit doing the regression."""
    valid = sorted((s for s in samples if s.plausible), key=lambda s: s.delay_ns)
    if len(valid) < MIN_DRIFT_SAMPLES:
        return None
    keep = [
        s for i, s in enumerate(valid) if i < MIN_DRIFT_SAMPLES or s.delay_ns <= MAX_DELAY_RATIO * valid[0].delay_ns + SIGMA_FLOOR_NS
    ]  # fmt: skip
    x = np.array([((s.t1 - BASE) + (s.t4 - BASE)) / 2 / S for s in keep])
    y = np.array([s.offset_ns for s in keep])
    sigma = np.array([max(s.delay_ns / math.sqrt(12), SIGMA_FLOOR_NS) for s in keep])
    slope, _ = np.polyfit(x, y, 1, w=1 / sigma)  # polyfit weights residuals by w: w = 1/σ
    return float(slope) / 1e3  # ns per s -> ppm


def reference_outliers(est: list[SkewEstimate]) -> set[int]:
    """Median / MAD with the statistics module; the same rule as fleet_skew's."""
    offs = [e.offset_ns for e in est]
    med = statistics.median(offs)
    mad = statistics.median(abs(x - med) for x in offs)
    typical = statistics.median(e.uncertainty_ns for e in est)
    out = set()
    for i, e in enumerate(est):
        dev = e.offset_ns - med
        z = math.inf if mad == 0 and dev else (0.6745 * dev / mad if mad else 0.0)
        if abs(z) >= Z_THRESHOLD and abs(dev) > e.uncertainty_ns + typical:
            out.add(i)
    return out


def fleet_of(per_node: list[list[TimeSample]], failed: int = 0) -> list[SkewEstimate | None]:
    return fleet_estimates([estimate(s, failed=failed) for s in per_node])


# --- lowest-delay selection and the bound ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_numpy_selection_matches_the_python_reference(seed: int) -> None:
    rng = random.Random(seed)
    per_node = []
    for _ in range(rng.randint(1, 12)):
        samples = synth(rng, rng.uniform(-2, 2) * S, rng.randint(0, 6))
        if samples and rng.random() < 0.3:  # a broken sample: the agent claims longer than the round trip
            s = samples[0]
            samples.insert(rng.randrange(len(samples) + 1), TimeSample(s.t1, s.t2, s.t2 + 50 * MS, s.t1 + MS))
        if len(samples) > 1 and rng.random() < 0.3:  # a tie on the lowest delay: the first one wins
            samples.append(samples[int(np.argmin([x.delay_ns for x in samples]))])
        per_node.append(samples)
    ref = [estimate(s, failed=1) for s in per_node]
    got = fleet_estimates(ref)
    assert len(got) == len(ref)
    for r, g in zip(ref, got, strict=True):
        assert (r is None) == (g is None)
        if r is None or g is None:
            continue
        assert (g.offset_ns, g.delay_ns, g.samples, g.failed) == (r.offset_ns, r.delay_ns, r.samples, r.failed)
        assert (g.drift_ppm is None) == (r.samples < MIN_DRIFT_SAMPLES)


@pytest.mark.parametrize("seed", range(6))
def test_bound_contains_the_true_offset_under_asymmetric_delays(seed: int) -> None:
    rng = random.Random(100 + seed)
    offsets = [rng.uniform(-1, 1) * S for _ in range(10)]
    # One leg much slower than the other on some nodes: the midpoint estimate is off, the bound is not.
    per_node = [synth(rng, off, 5, delay_us=(30, 3000 if i % 2 else 200)) for i, off in enumerate(offsets)]
    for est, off, samples in zip(fleet_of(per_node), offsets, per_node, strict=True):
        assert est is not None
        assert est.contains(off), (est, off)
        assert est.uncertainty_ns == min(s.delay_ns for s in samples) / 2
        for s in samples:  # causality: every sample's interval holds the truth, not only the winner's
            assert abs(s.offset_ns - off) <= s.delay_ns / 2


def test_a_node_without_samples_keeps_its_estimate_and_none_stays_none() -> None:
    hand = SkewEstimate(offset_ns=3 * MS, delay_ns=MS, samples=2)  # no points: built by hand
    got = fleet_estimates([None, hand])
    assert got[0] is None
    assert got[1] is not None and (got[1].offset_ns, got[1].delay_ns, got[1].drift_ppm) == (3 * MS, MS, None)
    assert fleet_estimates([]) == []


def test_a_fast_agent_clock_stretching_its_hold_past_the_round_trip_keeps_the_sample() -> None:
    """An agent clock 1 % fast that holds a request 5 ms (its reading: 5.05 ms) over a 30 µs network:
    the delay comes out −20 µs — its drift, not a broken sample (kept, delay 0, in both passes). A delay
    negative beyond 2 % of the hold is a stepped or broken clock: discarded (counted failed)."""
    t1 = BASE
    drifting = TimeSample(t1, t1 + 15_000, t1 + 15_000 + 5_050_000, t1 + 5_030_000)
    stepped = TimeSample(t1 + MS * 10, t1 + MS * 10, t1 + MS * 20, t1 + MS * 15)  # hold 10 ms in 5 ms
    assert drifting.plausible and drifting.delay_ns == 0.0
    assert not stepped.plausible
    one = estimate([drifting, stepped])
    assert one is not None and (one.samples, one.failed, one.delay_ns) == (1, 1, 0.0)
    again = fleet_estimates([one])[0]
    assert again is not None and (again.samples, again.delay_ns, again.offset_ns) == (1, 0.0, drifting.offset_ns)


# --- fleet median and MAD outliers ----------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 4, 7, 12])
@pytest.mark.parametrize("shift_ms", [5.0, -40.0])
def test_mad_outlier_wherever_it_sits(n: int, shift_ms: float) -> None:
    rng = random.Random(n)
    for pos in range(n):
        offsets = [rng.uniform(-30, 30) * US for _ in range(n)]
        offsets[pos] += shift_ms * MS
        got = fleet_of([synth(rng, off, 3, delay_us=(20, 60)) for off in offsets])
        assert all(e is not None for e in got)
        est = [e for e in got if e is not None]
        flagged = {i for i, e in enumerate(est) if e.outlier}
        assert flagged == {pos} == reference_outliers(est), (n, pos, [e.short() for e in est])
        z = est[pos].z
        assert z is None or math.copysign(1, z) == math.copysign(1, shift_ms)  # None: ±inf (MAD of 0)
        assert est[pos].short().endswith("(outlier)") and est[pos].as_dict()["outlier"] is True
        median = statistics.median(e.offset_ns for e in est)
        assert all(e.fleet_median_ns == pytest.approx(median) for e in est)


def test_near_identical_clocks_make_no_outlier() -> None:
    """Offsets apart by less than their uncertainty: whatever the z-score (MAD can be tiny), no outlier."""
    rng = random.Random(7)
    per_node = [synth(rng, rng.uniform(-5, 5) * US, 2, delay_us=(100, 400)) for _ in range(9)]
    got = fleet_of(per_node)
    assert not any(e is not None and e.outlier for e in got)
    assert not reference_outliers([e for e in got if e is not None])


def test_under_three_nodes_there_is_no_median_to_stand_out_from() -> None:
    rng = random.Random(3)
    got = fleet_of([synth(rng, 0, 2), synth(rng, 500 * MS, 2)])
    assert all(e is not None and e.fleet_median_ns is None and e.z is None and not e.outlier for e in got)


def test_only_answering_nodes_make_the_median() -> None:
    """A node listed twice (a duplicate, not answered) must not pull the median its way."""
    rng = random.Random(4)
    offs = [0.0, 10 * US, -10 * US, 80 * MS, 80 * MS, 80 * MS]
    ests = [estimate(synth(rng, o, 2, delay_us=(20, 40))) for o in offs]
    answered = [True, True, True, True, False, False]
    got = fleet_estimates(ests, answered)
    assert got[0] is not None and got[0].fleet_median_ns == pytest.approx(statistics.median(offs[:4]), abs=50 * US)
    assert got[4] is not None and got[4].z is None and not got[4].outlier  # not a member: no score


# --- drift ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drift_ppm", [50.0, -20.0, 0.0, 500.0])
def test_known_drift_is_recovered_within_its_uncertainty(drift_ppm: float) -> None:
    rng = random.Random(int(drift_ppm) + 11)
    samples = synth(rng, 25 * MS, 20, drift_ppm=drift_ppm, span_s=10.0, delay_us=(40, 150))
    (est,) = fleet_of([samples])
    assert est is not None and est.drift_ppm is not None and est.drift_uncertainty_ppm is not None
    assert abs(est.drift_ppm - drift_ppm) <= est.drift_uncertainty_ppm, est
    assert est.drift_uncertainty_ppm < 25, est  # tight enough to tell 50 ppm from none
    ref = reference_drift(samples)
    assert ref is not None and est.drift_ppm == pytest.approx(ref, rel=1e-6, abs=1e-6)
    assert est.drift_short().startswith("+" if est.drift_ppm >= 0 else "-")
    # the offset is still the lowest-delay sample's, and holds the truth at that sample's time
    best = min(samples, key=lambda s: s.delay_ns)
    assert est.contains(true_offset_at(best, 25 * MS, drift_ppm))


def test_drift_interval_covers_the_truth_about_95_percent_of_the_time() -> None:
    """The stated uncertainty is an honest 95 % interval: over many fleets it holds the true drift at
    about that rate (never claimed narrower than the scatter allows)."""
    rng = random.Random(2026)
    per_node = [synth(rng, 0, rng.randint(3, 15), drift_ppm=50.0, span_s=4.0) for _ in range(400)]
    got = fleet_of(per_node)
    held = [
        abs(e.drift_ppm - 50.0) <= e.drift_uncertainty_ppm
        for e in got
        if e is not None and e.drift_ppm is not None and e.drift_uncertainty_ppm is not None
    ]
    assert len(held) == 400
    assert 0.92 <= sum(held) / len(held) <= 0.99  # neither too narrow nor padded out


def test_slow_samples_stay_out_of_the_drift_fit() -> None:
    """A round trip far slower than the node's fastest (its offset off by milliseconds) does not bend
    the slope — chrony's maxdelayratio."""
    rng = random.Random(5)
    samples = synth(rng, 0, 10, drift_ppm=50.0, span_s=10.0, delay_us=(40, 60))
    s = samples[4]
    samples[4] = TimeSample(s.t1, s.t2 + 8 * MS, s.t3 + 8 * MS, s.t4 + 20 * MS)  # 28 ms round trip, lopsided
    est, without = fleet_of([samples, samples[:4] + samples[5:]])
    assert est is not None and est.drift_ppm is not None and est.drift_uncertainty_ppm is not None
    assert without is not None and (est.drift_ppm, est.drift_uncertainty_ppm) == (
        without.drift_ppm,
        without.drift_uncertainty_ppm,
    )
    assert abs(est.drift_ppm - 50.0) <= 2 * est.drift_uncertainty_ppm < 10


@pytest.mark.parametrize("n", [0, 1, 2])
def test_drift_is_none_under_three_samples(n: int) -> None:
    samples = synth(random.Random(n), 5 * MS, n, drift_ppm=50.0)
    got = fleet_of([samples])
    assert (got[0] is None) == (n == 0)
    if got[0] is not None:
        assert got[0].drift_ppm is None and got[0].drift_uncertainty_ppm is None and got[0].drift_short() == ""
        assert got[0].as_dict()["drift_ppm"] is None


def test_drift_is_none_when_every_sample_is_at_one_instant() -> None:
    s = synth(random.Random(1), 0, 1)[0]
    (est,) = fleet_of([[s, s, s]])
    assert est is not None and est.drift_ppm is None


def test_student_t_quantiles() -> None:
    assert t95(np.array([1, 2, 10, 11, 30, 1000])).tolist() == pytest.approx(
        [12.706, 4.303, 2.228, 2.201, 2.042, 1.962], abs=0.015
    )


# --- the fleet pass over outcomes ----------------------------------------------------------------------


@dataclass
class _Outcome:
    skew: SkewEstimate | None
    answered: bool = True


def test_refine_replaces_every_estimate_and_skips_numpy_without_samples() -> None:
    rng = random.Random(9)
    outs = [_Outcome(estimate(synth(rng, off, 4, drift_ppm=30.0))) for off in (0, 1 * US, -2 * US, 300 * MS)]
    outs.append(_Outcome(None, answered=False))
    assert trio.run(refine, outs) is outs
    assert [o.skew is not None and o.skew.drift_ppm is not None for o in outs] == [True] * 4 + [False]
    assert [o.skew is not None and o.skew.outlier for o in outs] == [False, False, False, True, False]
    none = [_Outcome(None, answered=False)]
    assert trio.run(refine, none) == none


# --- numpy stays off the wire path -----------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_fleet_client_import_does_not_import_numpy() -> None:
    out = _python(
        "import sys\nimport ingero.fleet.client, ingero.fleet.operations, ingero.fleet.skew\n"
        "print(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('numpy.')))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_numpy_only_for_the_fleet_pass_and_only_once_the_answers_are_in(tmp_path: Path, samples: Path) -> None:
    """In a process of its own (the agent too, so nothing else brings numpy in): a query never imports
    numpy, nor does a status of a refused node (no sample); a status of a live agent has neither sent its
    first request nor received its answers (its outcome is complete) with numpy imported, and its drift
    (3 samples) comes from the numpy pass."""
    ready = tmp_path / "ready.json"
    agent = subprocess.Popen(
        [sys.executable, "-m", "ingero", "serve", "--db", str(samples / "sample-gpu-node-02.db"), "--node", "live",
         "--listen", "127.0.0.1:0", "--no-tls", "--ready-file", str(ready)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _, info = local_agents.wait_ready(agent, ready, "live")
        script = f"""
import socket, sys, trio
from functools import partial
from ingero.config import NodeSpec
from ingero.fleet import client
from ingero.fleet.operations import fleet_query, fleet_status
from ingero.fleet.settings import ClientSettings

s = socket.socket(); s.bind(("127.0.0.1", 0)); dead = s.getsockname()[1]; s.close()
live = [NodeSpec("{info["host"]}", {info["port"]})]
settings = ClientSettings(plaintext=True, timeout_s=20)
seen = []
send = client.NodeClient.send

async def watched_send(self, *a, **kw):
    seen.append("numpy" in sys.modules)  # before each request goes out
    return await send(self, *a, **kw)

client.NodeClient.send = watched_send

def done(outcome):
    seen.append("numpy" in sys.modules)  # this node's answers and samples are all in

q = trio.run(partial(fleet_query, live, settings, "SELECT count(*) AS n FROM events"))
print("query", len(q.answered), q.outcomes[0].skew is not None, "numpy" in sys.modules)
refused = trio.run(partial(fleet_status, [NodeSpec("127.0.0.1", dead)], settings))
print("refused", refused.outcomes[0].kind, "numpy" in sys.modules)
st = trio.run(partial(fleet_status, live, settings, samples=3, interval_s=0.01, on_outcome=done))
est = st.outcomes[0].skew
print("status", st.outcomes[0].kind, seen, "numpy" in sys.modules, est.samples, est.drift_ppm is not None)
"""
        out = _python(script)
    finally:
        local_agents.stop([agent])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "query 1 True False"
    assert lines[1] == "refused refused False"
    assert lines[2] == "status ok [False, False, False, False] True 3 True"  # query, refused, /info; done


# --- fleet status end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: Pki) -> list[str]:
    return ["--ca-cert", str(pki.ca), "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]


def test_fleet_status_samples_give_drift_and_flag_the_odd_clock(
    pki: Pki, samples: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four real agents, one 50 ms ahead: ``--samples 4`` gives every node a drift with its uncertainty
    (table column and --json), the fleet's median and the outlier; the default (2 samples) gives none."""
    dbs = [samples / f"sample-gpu-node-0{i}.db" for i in (1, 2, 3)] + [samples / "sample-cluster.db"]
    specs = [AgentSpec(db, f"n{i}") for i, db in enumerate(dbs)]
    specs[2] = AgentSpec(dbs[2], "n2", wrapper=shift_clock(50 * MS))
    with agents_in_thread(pki, specs) as servers:
        nodes = ",".join(f"{s.host}:{s.port}" for s in servers)
        base = ["fleet", "status", "--nodes", nodes, *_tls(pki)]
        assert main([*base, "--samples", "4", "--sample-interval", "20ms", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert main([*base, "--samples", "4", "--sample-interval", "20ms"]) == 0
        table = capsys.readouterr().out
        assert main([*base, "--json"]) == 0
        plain = json.loads(capsys.readouterr().out)
    by_node = {n["node"]: n["skew"] for n in doc["nodes"]}
    assert set(by_node) == {"n0", "n1", "n2", "n3"}
    for skew in by_node.values():
        assert skew["samples"] >= 4
        assert isinstance(skew["drift_ppm"], float) and skew["drift_uncertainty_ppm"] > 0
    assert doc["skew"]["outliers"] == ["n2"] and by_node["n2"]["outlier"] is True
    assert abs(doc["skew"]["fleet_median_ms"]) < 10
    header = table.splitlines()[0].split()
    assert header[header.index("skew") + 1] == "drift_ppm"
    assert "(outlier)" in next(line for line in table.splitlines() if " n2 " in line)
    assert all(n["skew"]["drift_ppm"] is None and n["skew"]["samples"] == 2 for n in plain["nodes"])


def test_fleet_status_rejects_bad_sample_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "status", "--nodes", "127.0.0.1:1", "--plaintext", "--samples", "0"]) == 2
    assert "--samples 0: must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not FAKETIME_LIB.exists(), reason="libfaketime (Debian 'faketime') not installed")
def test_real_agent_with_a_fast_clock_shows_its_drift(samples: Path, tmp_path: Path) -> None:
    """A real ``ingero serve`` whose clock runs 1 % fast (libfaketime ``x1.01``): ``fleet status
    --samples 10`` finds that drift within (twice) its stated uncertainty, and tells it from none."""
    ready = tmp_path / "ready.json"
    env = {**os.environ, "LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": "+0 x1.01", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "ingero", "serve", "--db", str(samples / "sample-gpu-node-01.db"), "--node", "fast",
         "--listen", "127.0.0.1:0", "--no-tls", "--ready-file", str(ready)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _, info = local_agents.wait_ready(agent, ready, "fast")
        out = subprocess.run(
            [sys.executable, "-m", "ingero", "fleet", "status", "--json", "--plaintext", "--samples", "10",
             "--sample-interval", "250ms", "--nodes", f"{info['host']}:{info['port']}"],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        local_agents.stop([agent])
    assert out.returncode == 0, out.stderr
    skew = json.loads(out.stdout)["nodes"][0]["skew"]
    assert skew["samples"] == 10
    assert abs(skew["drift_ppm"] - 10_000) <= 2 * skew["drift_uncertainty_ppm"], skew
    assert skew["drift_uncertainty_ppm"] < 5000, skew  # told from none (this host is busy: wide margins)
