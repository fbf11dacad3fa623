"""The collectives join on recorded arrays: who arrives last, by how much, and when not to say."""

from __future__ import annotations

import numpy as np
import pytest

from ingero.fleet.collectives import NodeCalls, analyze, comm_hex
from ingero.store.nccl import CALL_COLUMNS
from tests.collective_sim import Job, Rank, simulate

NODES = ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]


def four(**kw: Rank) -> list[Rank]:
    return [kw.get(n.replace("-", "_"), Rank(n)) for n in NODES]


def test_delayed_rank_is_named_with_its_lag() -> None:
    v = analyze(simulate(Job(four(gpu_node_03=Rank("gpu-node-03", extra_ms=12.0)))))
    assert v.kind == "straggler"
    assert (v.node, v.rank) == ("gpu-node-03", 2)
    assert v.lag_ms == pytest.approx(12.0, abs=1.0)
    assert v.last_calls >= 0.95 * v.calls
    assert v.line.startswith("gpu-node-03 (rank 2) arrived last at")
    assert v.headline() == "straggler: " + v.line
    assert "after the others" in v.line and "peers waited" in v.line
    # the peers each waited ~12 ms a step of ~33 ms
    peers = [r for r in v.ranks if r.rank != 2]
    assert all(0.25 < r.wait_share < 0.45 for r in peers)
    assert next(r for r in v.ranks if r.rank == 2).wait_share < 0.02


def test_shifted_clock_is_corrected_and_not_blamed() -> None:
    job = Job(
        four(
            gpu_node_01=Rank("gpu-node-01", extra_ms=8.0),
            gpu_node_04=Rank("gpu-node-04", clock_ms=-250.0, measured_ms=-250.3, uncertainty_ms=0.5),
        )
    )
    v = analyze(simulate(job))
    assert v.kind == "straggler" and v.node == "gpu-node-01"
    assert v.lag_ms == pytest.approx(8.0, abs=1.0)
    # uncorrected, the node whose clock is behind would look like the first to arrive every time,
    # and with a clock ahead the last: check the latter is not blamed either
    job.ranks[3] = Rank("gpu-node-04", clock_ms=+40.0, measured_ms=+40.2, uncertainty_ms=0.5)
    v = analyze(simulate(job))
    assert v.node == "gpu-node-01"


def test_uncorrected_shift_would_blame_the_shifted_node() -> None:
    """The correction matters: told nothing about the clock, the analysis blames the ahead node. (An
    error beyond half a step would be taken for a counter that started late: offsets are trusted
    within their stated uncertainty.)"""
    job = Job(four(gpu_node_04=Rank("gpu-node-04", clock_ms=+8.0, measured_ms=0.0)))
    assert analyze(simulate(job)).node == "gpu-node-04"


def test_equal_ranks_give_no_straggler() -> None:
    v = analyze(simulate(Job(four())))
    assert v.kind == "no-straggler"
    assert v.outlier is None
    assert v.line.startswith("no straggler")


def test_two_ranks_name_the_late_one_not_the_waiter() -> None:
    job = Job([Rank("a"), Rank("b", extra_ms=5.0)])
    v = analyze(simulate(job))
    assert v.kind == "straggler" and v.node == "b"
    by_node = {r.node: r for r in v.ranks}
    assert by_node["a"].wait_s > 10 * by_node["b"].wait_s  # the waiter waits; it is not the straggler


def test_clock_uncertainty_larger_than_the_lag_is_inconclusive() -> None:
    job = Job(
        four(
            gpu_node_02=Rank("gpu-node-02", extra_ms=2.0, uncertainty_ms=3.0),
            gpu_node_01=Rank("gpu-node-01", uncertainty_ms=3.0),
            gpu_node_03=Rank("gpu-node-03", uncertainty_ms=3.0),
            gpu_node_04=Rank("gpu-node-04", uncertainty_ms=3.0),
        ),
        jitter_ms=0.1,
    )
    v = analyze(simulate(job))
    assert v.kind == "inconclusive"
    assert v.outlier is None
    assert "within the clock uncertainty" in v.line


def test_missing_calls_after_a_restart_are_left_out_and_seq_rebased() -> None:
    job = Job(
        four(gpu_node_03=Rank("gpu-node-03", extra_ms=6.0)),
        steps=600,
        drop={1: (200, 260)},  # gpu-node-02's agent was down for 60 calls...
        restart_seq_at={1: 260},  # ...and its seq counter restarted from 0
    )
    v = analyze(simulate(job))
    assert v.kind == "straggler" and v.node == "gpu-node-03"
    assert v.lag_ms == pytest.approx(6.0, abs=1.0)
    (comm,) = v.comms
    assert comm.complete == 540
    assert comm.incomplete == 60  # the others' calls with no gpu-node-02 counterpart


def test_restart_without_rebase_would_misalign() -> None:
    """Control for the test above: with every call kept but the counter restarted, calls join only
    after re-basing (the complete count proves it)."""
    job = Job(four(), steps=300, restart_seq_at={2: 100})
    v = analyze(simulate(job))
    assert v.comms[0].complete == 300 and v.comms[0].incomplete == 0


def test_hung_rank_is_named() -> None:
    job = Job(four(gpu_node_04=Rank("gpu-node-04", hang_at=250)), steps=300)
    calls = simulate(job)
    last_end = max(int((c.entry_ns[c.duration_ns >= 0] + c.duration_ns[c.duration_ns >= 0]).max()) for c in calls)
    v = analyze(calls, as_of_ns=last_end + 30_000 * 1_000_000)  # 30 s later
    assert v.kind == "hung" and v.outlier == "gpu-node-04" and v.rank == 3
    assert "never entered ncclAllReduce #250" in v.line
    assert v.peers_wait_s == pytest.approx(3 * 30.0, rel=0.05)
    assert v.comms[0].in_flight == 1


def test_slow_collective_names_bytes_and_bandwidth() -> None:
    v = analyze(simulate(Job(four(), transfer_ms=30.0, nbytes=256 << 20)))
    assert v.kind == "slow-collective" and v.outlier is None
    assert "256.0 MiB" in v.line and "GB/s" in v.line
    assert v.comms[0].bandwidth_gbps == pytest.approx((256 << 20) / 30e6, rel=0.02)


def test_several_communicators_pick_the_one_with_the_straggler() -> None:
    a = simulate(Job(four(), comm=0x1111, seed=3))
    b = simulate(Job(four(gpu_node_02=Rank("gpu-node-02", extra_ms=10.0)), comm=0x2222, seed=4, op=4))
    nodes = []
    for x, y in zip(a, b, strict=True):
        nodes.append(
            NodeCalls(
                x.node,
                np.concatenate([x.comm, y.comm]),
                np.concatenate([x.seq, y.seq]),
                np.concatenate([x.op, y.op]),
                np.concatenate([x.bytes, y.bytes]),
                np.concatenate([x.entry_ns, y.entry_ns + 10**12]),
                np.concatenate([x.duration_ns, y.duration_ns]),
                np.concatenate([x.rank, y.rank]),
                {**x.nranks, **y.nranks},
            )
        )
    v = analyze(nodes)
    assert v.kind == "straggler" and v.node == "gpu-node-02" and v.comm == comm_hex(0x2222)
    assert "ncclAllGather" in v.line
    assert len(v.comms) == 2


def test_from_body_roundtrip_and_malformed_answers() -> None:
    (x, *_) = simulate(Job(four(), steps=5))
    body = {
        "comms": [{"id": comm_hex(int(x.comm[0])), "nranks": 4}],
        "calls": {
            "comm": [0] * 5,
            "seq": x.seq.tolist(),
            "op": x.op.tolist(),
            "bytes": x.bytes.tolist(),
            "entry_ns": x.entry_ns.tolist(),
            "duration_ns": x.duration_ns.tolist(),
            "rank": x.rank.tolist(),
        },
    }
    assert set(body["calls"]) == set(CALL_COLUMNS)
    y = NodeCalls.from_body("n", body, offset_ns=5.0, uncertainty_ns=2.0)
    assert y.comm.tolist() == x.comm.tolist() and y.nranks == x.nranks and y.offset_ns == 5.0
    with pytest.raises(ValueError):
        NodeCalls.from_body("n", {"comms": [], "calls": {}})
    body["calls"]["comm"] = [1] * 5
    with pytest.raises(ValueError):
        NodeCalls.from_body("n", body)


def test_no_calls() -> None:
    assert analyze([]).kind == "no-collectives"


# --- the host-figures verdict (no collectives): noise never names a node --------------------------


def test_host_verdict_ignores_low_value_noise_and_reports_lows() -> None:
    from ingero.fleet.straggler import NodeFigures, verdict

    def fig(node: str, events: int, avg: float, p99: float) -> NodeFigures:
        return NodeFigures(node=node, host_events=events, host_avg_ms=avg, op_p99_ms={"ncclAllReduce": p99})

    # the noise: ncclAllReduce p99 257 µs vs peers ~61 µs, near-identical host figures
    v = verdict(
        [fig("a", 400, 1.0, 0.257), fig("b", 402, 1.0, 0.061), fig("c", 399, 1.01, 0.060), fig("d", 401, 1.0, 0.062)]
    )
    assert v.outlier is None and v.line.startswith("no straggler")
    # a real high still names its node
    v = verdict(
        [fig("a", 2400, 9.0, 0.06), fig("b", 402, 1.0, 0.061), fig("c", 399, 1.01, 0.060), fig("d", 401, 1.0, 0.062)]
    )
    assert v.outlier == "a"
    # a node far below its peers is reported as unusual, never as the straggler
    v = verdict(
        [fig("a", 20, 1.0, 0.06), fig("b", 2402, 1.0, 0.061), fig("c", 2399, 1.01, 0.060), fig("d", 2401, 1.0, 0.062)]
    )
    assert v.outlier is None
    assert "also unusual: a (low: 20 host events vs peers ~2,401)" in v.line
    assert [f.direction for f in v.findings] == ["low"]


def test_send_recv_do_not_join() -> None:
    """Point-to-point calls (numbered apart by the tracer, different on every rank) stay out of the join."""
    nodes = simulate(Job(four(gpu_node_02=Rank("gpu-node-02", extra_ms=9.0)), steps=100))
    x = nodes[0]
    extra = 30  # rank 0 alone also sent 30 times (ncclSend, op 6), seq 0..29 of its p2p counter
    nodes[0] = NodeCalls(
        x.node,
        np.concatenate([x.comm, x.comm[:extra]]),
        np.concatenate([x.seq, np.arange(extra)]),
        np.concatenate([x.op, np.full(extra, 6)]),
        np.concatenate([x.bytes, x.bytes[:extra]]),
        np.concatenate([x.entry_ns, x.entry_ns[:extra] + 1_000_000]),
        np.concatenate([x.duration_ns, np.full(extra, 1000)]),
        np.concatenate([x.rank, x.rank[:extra]]),
        x.nranks,
    )
    v = analyze(nodes)
    assert v.kind == "straggler" and v.node == "gpu-node-02"
    assert v.comms[0].complete == 100 and v.comms[0].incomplete == 0


def test_agent_started_late_is_aligned() -> None:
    """gpu-node-04's agent started 150 calls into the job: its seq counts from 0 there."""
    job = Job(
        four(gpu_node_02=Rank("gpu-node-02", extra_ms=7.0)), steps=400, drop={3: (0, 150)}, restart_seq_at={3: 150}
    )
    v = analyze(simulate(job))
    assert v.kind == "straggler" and v.node == "gpu-node-02"
    assert v.comms[0].complete == 250 and v.comms[0].incomplete == 150
