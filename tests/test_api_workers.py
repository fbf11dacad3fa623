"""The agent's admission: lanes with bounded slots, hard deadlines that abandon a stuck thread without
freeing its slot early, cancellation reaching the SQL guard, the move of a long job to the heavy lane,
round-robin per client, and 503 (AgentBusyError) — never a time-limit error — when saturated."""

from __future__ import annotations

import threading

import pytest
import trio

from ingero.agent.api.workers import HEAVY, SHORT, Admission, AdmissionLimits, FairQueue, Job, _Waiter
from ingero.errors import AgentBusyError, QueryTimeoutError
from ingero.store import guard
from tests.agent_servers import RUNAWAY
from tests.conftest import SAMPLES


async def _until(predicate: object) -> None:
    with trio.fail_after(30):
        while not predicate():  # type: ignore[operator]
            await trio.sleep(0.002)


def test_stuck_job_is_abandoned_but_keeps_its_slot_until_it_ends() -> None:
    gate = threading.Event()
    pool = Admission(AdmissionLimits(short_slots=1, max_waiting=1, max_wait_s=0.05))

    def stuck(job: Job) -> str:
        gate.wait(30)  # ignores its job, like one uninterruptible SQLite step
        return "late"

    async def main() -> None:
        with pytest.raises(QueryTimeoutError, match="abandoned"):
            await pool.run(stuck, client="a", hard_s=0.05)
        assert pool.busy == 1  # the thread still runs: its slot is still taken
        with pytest.raises(AgentBusyError, match="agent busy") as caught:
            await pool.run(lambda job: "never", client="a", hard_s=1)
        assert caught.value.http_status == 503 and caught.value.retry_after_s >= 1
        gate.set()
        await _until(lambda: pool.busy == 0)  # the thread gives its slot back when it really ends
        assert await pool.run(lambda job: "ok", client="a", hard_s=5) == "ok"

    trio.run(main)


def test_a_full_wait_queue_is_answered_busy_at_once() -> None:
    gate = threading.Event()
    pool = Admission(AdmissionLimits(short_slots=1, max_waiting=2, max_wait_s=30))
    outcomes: list[str] = []

    async def one(fn: object) -> None:
        try:
            outcomes.append(await pool.run(fn, client="a", hard_s=30))  # type: ignore[arg-type]
        except AgentBusyError:
            outcomes.append("busy")

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(one, lambda job: gate.wait(30) and "first")
            await _until(lambda: pool.busy == 1)
            for _ in range(2):
                n.start_soon(one, lambda job: "queued")
            await _until(lambda: pool.waiting == 2)
            await one(lambda job: "never")  # the queue is full: refused without waiting
            assert outcomes == ["busy"]
            gate.set()
        assert sorted(outcomes) == ["busy", "first", "queued", "queued"]

    trio.run(main)


def test_cancelling_the_request_stops_the_query() -> None:
    """A cancelled request sets the job; the guard's progress handler stops the statement."""
    pool = Admission(AdmissionLimits(short_slots=2))
    db = SAMPLES / "sample-gpu-node-01.db"
    outcome: list[BaseException] = []
    started = threading.Event()

    def runaway(job: Job) -> object:
        started.set()
        try:
            return guard.run_query(db, RUNAWAY, timeout_ms=60_000, cancel=job, checkpoint=job.checkpoint)
        except BaseException as e:
            outcome.append(e)
            raise

    async def main() -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(lambda: pool.run(runaway, client="a", hard_s=120))
                await trio.to_thread.run_sync(started.wait)
                scope.cancel()
        await _until(lambda: pool.busy == 0)

    trio.run(main)
    assert len(outcome) == 1 and isinstance(outcome[0], QueryTimeoutError) and "cancelled" in str(outcome[0])


def test_jobs_run_in_parallel_up_to_the_lane_size() -> None:
    pool = Admission(AdmissionLimits(short_slots=3))
    barrier = threading.Barrier(3, timeout=20)

    def meet(job: Job) -> int:
        return barrier.wait()  # only returns when three jobs run at once

    async def main() -> None:
        results: list[int] = []

        async def one() -> None:
            results.append(await pool.run(meet, client="a", hard_s=30))

        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(one)
        assert sorted(results) == [0, 1, 2]

    trio.run(main)


def test_a_long_query_moves_to_the_heavy_lane_and_frees_the_short_one() -> None:
    """One short slot: a runaway query leaves it after its quantum, so a cheap query runs while the
    runaway still runs (in the heavy lane); the runaway's own limit is unchanged by the move."""
    pool = Admission(AdmissionLimits(short_slots=1, heavy_slots=1, quantum_ms=20))
    db = SAMPLES / "sample-gpu-node-01.db"
    seen: dict[str, object] = {}

    def runaway(job: Job) -> object:
        return guard.run_query(db, RUNAWAY, timeout_ms=60_000, cancel=job, checkpoint=job.checkpoint)

    def cheap(job: Job) -> object:
        seen["heavy_busy"] = pool.lanes[HEAVY].slots - pool.lanes[HEAVY].free
        return guard.run_query(db, "SELECT count(*) FROM events", cancel=job, checkpoint=job.checkpoint).rows

    async def main() -> None:
        with trio.CancelScope() as heavy_side:
            async with trio.open_nursery() as n:
                n.start_soon(lambda: pool.run(runaway, client="a", hard_s=120))
                await _until(lambda: pool.demoted == 1 and pool.lanes[SHORT].free == 1)
                seen["rows"] = await pool.run(cheap, client="a", hard_s=30)
                heavy_side.cancel()
        await _until(lambda: pool.busy == 0)

    trio.run(main)
    assert seen == {"heavy_busy": 1, "rows": [[200]]}


def test_a_demoted_job_that_finds_the_heavy_lane_full_is_answered_busy() -> None:
    pool = Admission(AdmissionLimits(short_slots=2, heavy_slots=1, quantum_ms=10, max_waiting=1, max_wait_s=0.05))
    db = SAMPLES / "sample-gpu-node-01.db"
    outcomes: list[str] = []

    def runaway(job: Job) -> object:
        return guard.run_query(db, RUNAWAY, timeout_ms=60_000, cancel=job, checkpoint=job.checkpoint)

    async def one() -> None:
        try:
            await pool.run(runaway, client="a", hard_s=120)
        except AgentBusyError:
            outcomes.append("busy")

    async def main() -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(one)
                await _until(lambda: pool.lanes[HEAVY].free == 0)  # the first runaway holds the heavy slot
                n.start_soon(one)
                await _until(lambda: outcomes == ["busy"])  # the second waited 50 ms for it, then gave up
                scope.cancel()
        await _until(lambda: pool.busy == 0)

    trio.run(main)
    assert outcomes == ["busy"]


def test_waiters_are_served_round_robin_per_client() -> None:
    q = FairQueue()
    waiters = {f"{c}{i}": _Waiter() for c, n in (("a", 4), ("b", 2), ("c", 1)) for i in range(n)}
    for name, w in waiters.items():
        q.push(name[0], w)
    q.remove("a", waiters["a1"])
    order = []
    while (w := q.pop()) is not None:
        order.append(next(k for k, v in waiters.items() if v is w))
    assert order == ["a0", "b0", "c0", "a2", "b1", "a3"] and len(q) == 0
