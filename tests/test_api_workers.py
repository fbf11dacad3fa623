"""The agent's worker pool: bounded admission, hard deadlines that abandon a stuck thread without
freeing its slot early, and cancellation reaching the SQL guard."""

from __future__ import annotations

import threading

import pytest
import trio

from ingero.api.workers import Workers
from ingero.errors import QueryTimeoutError
from ingero.store import guard
from tests.agent_servers import RUNAWAY
from tests.conftest import SAMPLES


def test_stuck_job_is_abandoned_but_keeps_its_slot_until_it_ends() -> None:
    gate = threading.Event()
    pool = Workers(1, "test")

    def stuck(cancel: threading.Event) -> str:
        gate.wait(30)  # ignores cancel, like one uninterruptible SQLite step
        return "late"

    async def main() -> None:
        with pytest.raises(QueryTimeoutError, match="abandoned"):
            await pool.run(stuck, wait_s=1, hard_s=0.05)
        assert pool.busy == 1  # the thread still runs: its slot is still taken
        with pytest.raises(QueryTimeoutError, match="agent busy"):
            await pool.run(lambda c: "never", wait_s=0.05, hard_s=1)
        gate.set()
        with trio.fail_after(10):
            while pool.busy:  # the thread gives its slot back when it really ends
                await trio.sleep(0.005)
        assert await pool.run(lambda c: "ok", wait_s=1, hard_s=5) == "ok"

    trio.run(main)


def test_cancelling_the_request_stops_the_query() -> None:
    """A cancelled request sets the job's event; the guard's progress handler stops the statement."""
    pool = Workers(2, "test")
    db = SAMPLES / "sample-gpu-node-01.db"
    outcome: list[BaseException] = []
    started = threading.Event()

    def runaway(cancel: threading.Event) -> object:
        started.set()
        try:
            return guard.run_query(db, RUNAWAY, timeout_ms=60_000, cancel=cancel)
        except BaseException as e:
            outcome.append(e)
            raise

    async def main() -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(lambda: pool.run(runaway, wait_s=1, hard_s=120))
                await trio.to_thread.run_sync(started.wait)
                scope.cancel()
        with trio.fail_after(30):
            while pool.busy:
                await trio.sleep(0.005)

    trio.run(main)
    assert len(outcome) == 1 and isinstance(outcome[0], QueryTimeoutError) and "cancelled" in str(outcome[0])


def test_jobs_run_in_parallel_up_to_the_pool_size() -> None:
    pool = Workers(3, "test")
    barrier = threading.Barrier(3, timeout=20)

    def meet(cancel: threading.Event) -> int:
        return barrier.wait()  # only returns when three jobs run at once

    async def main() -> None:
        results: list[int] = []

        async def one() -> None:
            results.append(await pool.run(meet, wait_s=20, hard_s=30))

        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(one)
        assert sorted(results) == [0, 1, 2]

    trio.run(main)
