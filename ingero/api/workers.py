"""Worker threads for the agent's blocking work (SQL, explain, statistics), kept off the trio loop.

``/time`` and ``/health`` never touch a thread, so they answer while every worker is busy. Each
:class:`Workers` pool bounds how many threads it has alive (admission), and gives every job:

* a ``threading.Event`` that is set when the request goes away or the server stops — the SQL guard's
  progress handler watches it, so a cancelled query stops within a few thousand VM instructions;
* a hard deadline after which the request is answered with a timeout and the thread is abandoned
  (it still counts against the pool until it really ends, so runaway work cannot pile up threads);
* a bounded wait for a free slot: when all workers stay busy, the request is told so.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import trio

from ingero.errors import QueryTimeoutError

T = TypeVar("T")


class Workers:
    def __init__(self, size: int, name: str = "query") -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one thread")
        self.size = size
        self.name = name
        self._slots = trio.Semaphore(size)
        self._limiter = trio.CapacityLimiter(size)

    @property
    def busy(self) -> int:
        return self.size - self._slots.value

    async def run(self, fn: Callable[[threading.Event], T], *, wait_s: float, hard_s: float) -> T:
        """Run ``fn(cancel_event)`` in a thread; raise QueryTimeoutError when no slot frees up within
        ``wait_s`` or the job is still running after ``hard_s``."""
        acquired = False
        with trio.move_on_after(wait_s):
            await self._slots.acquire()
            acquired = True
        if acquired:
            return await self._run_holding_slot(fn, hard_s)
        raise QueryTimeoutError(
            f"agent busy: all {self.size} {self.name} workers stayed taken for {wait_s:.1f} s",
            hint="retry shortly, or ask for less work (smaller window, cheaper SQL)",
        )

    async def _run_holding_slot(self, fn: Callable[[threading.Event], T], hard_s: float) -> T:
        cancel = threading.Event()
        lock = threading.Lock()
        started = False
        skipped = False
        token = trio.lowlevel.current_trio_token()
        slots = self._slots

        def job() -> T:
            nonlocal started
            with lock:
                if skipped:
                    raise RuntimeError("job skipped: its request went away before it started")
                started = True
            try:
                return fn(cancel)
            finally:
                with contextlib.suppress(trio.RunFinishedError):  # non-blocking: the result is not delayed
                    token.run_sync_soon(slots.release)

        try:
            with trio.fail_after(hard_s):
                return await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=self._limiter)
        except trio.TooSlowError:
            raise QueryTimeoutError(
                f"work did not finish within {hard_s:.1f} s and was abandoned",
                hint="narrow the request (a shorter window, a cheaper query)",
            ) from None
        finally:
            cancel.set()
            with lock:
                if not started:
                    skipped = True
                    slots.release()
