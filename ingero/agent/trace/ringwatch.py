"""Watches the ring buffer for the resting drain: a plain thread instead of a trio timer.

At rest (an idle host: a few records a second) the pipeline's drain does not poll: the housekeeping
tick takes the trickle once a second. What it must still catch is a burst from rest before it fills
the kernel's ring buffer, which a drain every ``interval`` did (300 k events/s fill 75 k of the 16 MiB
ring's 262 k records in 0.25 s). :class:`RingWatch` keeps that bound: every ``interval`` it reads
how much the ring holds (two words of the mapped ring, no system call) and, once ``threshold``
records wait, wakes the drain through the trio token; below that it calls ``look`` (the pipeline reads
the names of processes that just exec'd, before a short-lived one is gone), which wakes the drain too
when it returns True (records of a traced process wait: their stacks are read while it lives). A thread's timed wait
costs the kernel's wakeup alone; a trio loop iteration costs several times that in Python, four times
a second on every node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import trio


class RingWatch(threading.Thread):
    """Every ``interval`` seconds, while armed: ``pending()`` >= ``threshold`` -> ``wake()`` in trio, once;
    else ``look()`` (in this thread), and ``wake()`` when it returns True."""

    def __init__(
        self, pending: Callable[[], int], threshold: int, interval: float, look: Callable[[], bool] | None = None
    ) -> None:
        super().__init__(name="ingero-ringwatch", daemon=True)
        self._pending = pending
        self._look = look
        self._threshold = threshold
        self._interval = interval
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._armed: tuple[trio.lowlevel.TrioToken, Callable[[], None]] | None = None
        self.wakes = 0

    def arm(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (in the calling trio run) when the ring holds ``threshold`` records; once."""
        with self._lock:
            self._armed = (trio.lowlevel.current_trio_token(), wake)

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def run(self) -> None:
        while not self._halt.wait(self._interval):
            with self._lock:
                armed = self._armed
                if armed is None:
                    continue
                full = self._pending() >= self._threshold
                if full:
                    self._armed = None
            if not full:
                if self._look is None or not self._look():
                    continue
                with self._lock:
                    if self._armed is not armed:
                        continue  # woken or disarmed meanwhile
                    self._armed = None
            self.wakes += 1
            try:
                armed[0].run_sync_soon(armed[1])
            except trio.RunFinishedError:
                return

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5)
