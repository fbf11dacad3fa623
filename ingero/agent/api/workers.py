"""Admission and worker threads for the agent's blocking work (SQL, explain, statistics).

``/time`` and ``/health`` never touch a thread, so they answer while every worker is busy. Everything
else is admitted by :class:`Admission` into one of three lanes, each with a fixed number of slots:

* **short** — every query and analysis starts here. A job that has *executed* for more than
  ``quantum_ms`` (measured on its thread, by the SQLite progress handler) leaves this lane for the
  heavy one: its statement pauses inside the progress handler until a heavy slot is free, and its
  short slot goes at once to the next waiter. So the cost that decides the lane is the query's own
  measured cost (no estimate to fool), and a cheap query never waits behind more than
  ``short_slots`` quanta of heavy work, however many heavy queries arrive.
* **heavy** — the long jobs, at most ``heavy_slots`` at once.
* **meta** — ``/info``'s own small lane.

Waiting is never charged to a job: its SQL deadline starts when it starts running, and a pause in
the heavy lane's queue is added to it (:class:`~ingero.store.budget.Deadline`). Waiters are served
round-robin per client identity (:func:`client_identity`), so one client's flood does not delay
another client by more than one turn per slot. When ``max_waiting`` requests already wait, or a
request has waited ``max_wait_s``, it is answered 503 with ``Retry-After``
(:class:`~ingero.errors.AgentBusyError`) — never a time-limit error.

Each job also gets a hard deadline (its budget × 1.25 + 1 s, plus its pauses) after which the request
is answered with a timeout and the thread abandoned; an abandoned thread keeps its slot until it
really ends, so runaway work cannot pile up threads. A job's :class:`Job` is a ``threading.Event``
set when the request goes away or the server stops: the guard's progress handler watches it.
"""

from __future__ import annotations

import contextlib
import contextvars
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from ingero.errors import AgentBusyError, QueryTimeoutError, UsageError

T = TypeVar("T")

SHORT, HEAVY, META = "short", "heavy", "meta"


@dataclass(frozen=True)
class AdmissionLimits:
    """How many jobs run at once per lane, and how long and how many may wait (one declaration)."""

    short_slots: int = 4
    heavy_slots: int = 2
    meta_slots: int = 2
    quantum_ms: int = 250  # execution time after which a job moves from the short to the heavy lane
    max_waiting: int = 64  # requests waiting over all lanes before new ones are answered 503
    max_wait_s: float = 3.0  # longest a request waits for a slot before it is answered 503 (below
    # the fleet client's 5 s per-node timeout, so a waiting client hears 503 rather than timing out)

    def __post_init__(self) -> None:
        for name in ("short_slots", "heavy_slots", "meta_slots", "quantum_ms", "max_waiting"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_wait_s <= 0:
            raise UsageError(f"max-wait must be positive, got {self.max_wait_s}")

    @classmethod
    def for_workers(cls, workers: int) -> AdmissionLimits:
        """``--workers N``: N short slots, half as many heavy ones (at least one)."""
        return cls(short_slots=workers, heavy_slots=max(1, workers // 2))


# The verified client certificate's subject of the connection this task serves (mTLS): set during
# the TLS handshake, in the connection's task, by :class:`PeerRecordingSSLObject`; the request tasks
# hypercorn spawns from it inherit it.
PEER_SUBJECT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ingero_peer_subject", default=None)


class PeerRecordingSSLObject(ssl.SSLObject):
    """``SSLContext.sslobject_class`` for the agent: remembers the client certificate's subject."""

    def do_handshake(self) -> None:
        super().do_handshake()
        cert = self.getpeercert()
        if cert:
            rdns: Any = cert.get("subject", ())  # ((("commonName", "tester"),), ...)
            PEER_SUBJECT.set(",".join(f"{k}={v}" for rdn in rdns for k, v in rdn))


def client_identity(scope: Mapping[str, Any]) -> str:
    """Who is asking, for fair admission: the mTLS client certificate's subject when there is one,
    else the peer address (the port aside: one host, one turn). One bearer token is shared by every
    client of a node, so it does not tell clients apart."""
    subject = PEER_SUBJECT.get()
    if subject:
        return f"cert:{subject}"
    client = scope.get("client")
    return f"peer:{client[0]}" if client else "peer:unknown"


class _Waiter:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.granted = False


class FairQueue:
    """Waiters by client, served round-robin (first come, first served within one client)."""

    def __init__(self) -> None:
        self._by_client: dict[str, deque[_Waiter]] = {}
        self._turns: deque[str] = deque()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, client: str, w: _Waiter) -> None:
        q = self._by_client.get(client)
        if q is None:
            q = self._by_client[client] = deque()
            self._turns.append(client)
        q.append(w)
        self._len += 1

    def pop(self) -> _Waiter | None:
        if not self._turns:
            return None
        client = self._turns.popleft()
        q = self._by_client[client]
        w = q.popleft()
        self._len -= 1
        if q:
            self._turns.append(client)
        else:
            del self._by_client[client]
        return w

    def remove(self, client: str, w: _Waiter) -> None:
        q = self._by_client.get(client)
        if q is None or w not in q:
            return
        q.remove(w)
        self._len -= 1
        if not q:
            del self._by_client[client]
            self._turns.remove(client)


class _Lane:
    def __init__(self, name: str, slots: int) -> None:
        self.name = name
        self.slots = slots
        self.free = slots
        self.queue = FairQueue()


class Job(threading.Event):
    """A running job as its thread sees it: set when it must stop; :meth:`checkpoint` for the guard."""

    def __init__(self, admission: Admission, lane: _Lane, client: str, quantum_s: float | None) -> None:
        super().__init__()
        self.client = client
        self.lane: _Lane | None = lane  # the slot it holds (trio side)
        self.busy: AgentBusyError | None = None
        self.scope: trio.CancelScope | None = None  # the hard deadline
        self.waiting_scope: trio.CancelScope | None = None  # a pause in the heavy lane's queue
        self._admission = admission
        self._quantum_s = quantum_s
        self._demote_at: float | None = None
        self._token = trio.lowlevel.current_trio_token()

    def started(self) -> None:
        if self._quantum_s is not None:
            self._demote_at = time.monotonic() + self._quantum_s

    def checkpoint(self) -> float:
        """Run on the job's thread at each progress check: free until the quantum has passed, then
        move to the heavy lane (pausing until a slot is free). Returns the seconds paused."""
        if self._demote_at is None or time.monotonic() < self._demote_at:
            return 0.0
        self._demote_at = None
        paused_from = time.monotonic()
        try:
            trio.from_thread.run(self._admission._demote, self, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled):  # the server is stopping
            self.set()
        return time.monotonic() - paused_from


class Admission:
    """The agent's lanes of worker threads (see the module notes)."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        lim = self.limits
        self.lanes = {SHORT: _Lane(SHORT, lim.short_slots), HEAVY: _Lane(HEAVY, lim.heavy_slots)}
        self.lanes[META] = _Lane(META, lim.meta_slots)
        # threads: every slot, plus a paused (demoted, waiting) job per waiting place
        self._threads = trio.CapacityLimiter(lim.short_slots + lim.heavy_slots + lim.meta_slots + lim.max_waiting)
        self.demoted = 0  # jobs moved to the heavy lane so far (for tests and /info)

    @property
    def busy(self) -> int:
        """Slots taken over all lanes (a running or abandoned-but-still-running job holds one)."""
        return sum(lane.slots - lane.free for lane in self.lanes.values())

    @property
    def waiting(self) -> int:
        return sum(len(lane.queue) for lane in self.lanes.values())

    async def run(self, fn: Callable[[Job], T], *, client: str, hard_s: float, lane: str = SHORT) -> T:
        """Run ``fn(job)`` in a thread once admitted to ``lane``. Raises AgentBusyError (503) when the
        agent is saturated, QueryTimeoutError when the job is still running after ``hard_s`` of its
        own time."""
        first = self.lanes[lane]
        await self._acquire(first, client)
        job = Job(self, first, client, self.limits.quantum_ms / 1000 if lane == SHORT else None)
        lock = threading.Lock()
        started = skipped = False
        token = trio.lowlevel.current_trio_token()

        def work() -> T:
            nonlocal started
            with lock:
                if skipped:
                    raise RuntimeError("job skipped: its request went away before it started")
                started = True
            job.started()
            try:
                return fn(job)
            finally:
                with contextlib.suppress(trio.RunFinishedError):  # non-blocking: the result is not delayed
                    token.run_sync_soon(self._finish, job)

        try:
            with trio.CancelScope(deadline=trio.current_time() + hard_s) as scope:
                job.scope = scope
                result = await trio.to_thread.run_sync(work, abandon_on_cancel=True, limiter=self._threads)
        except Exception:
            if job.busy is not None:
                raise job.busy from None
            raise
        finally:
            job.set()
            if job.waiting_scope is not None:
                job.waiting_scope.cancel()
            with lock:
                if not started:
                    skipped = True
                    self._finish(job)
        if job.busy is not None:
            raise job.busy
        if scope.cancelled_caught:
            raise QueryTimeoutError(
                f"work did not finish within {hard_s:.1f} s and was abandoned",
                hint="narrow the request (a shorter window, a cheaper query)",
            )
        return result

    async def _acquire(self, lane: _Lane, client: str) -> None:
        if lane.free > 0 and not lane.queue:
            lane.free -= 1
            return
        if self.waiting >= self.limits.max_waiting:
            raise self._busy(lane, "its wait queue is full")
        w = _Waiter()
        lane.queue.push(client, w)
        admitted = False
        try:
            with trio.move_on_after(self.limits.max_wait_s):
                await w.event.wait()
            admitted = w.granted
        finally:
            if not admitted:
                if w.granted:  # granted as we were cancelled: pass the slot on
                    self._release(lane)
                else:
                    lane.queue.remove(client, w)
        if not admitted:
            raise self._busy(lane, f"no worker freed up within {self.limits.max_wait_s:g} s")

    def _busy(self, lane: _Lane, why: str) -> AgentBusyError:
        return AgentBusyError(
            f"agent busy: all {lane.slots} {lane.name} workers are taken and {why}",
            hint=f"retry after {AgentBusyError.retry_after_s} s",
        )

    def _release(self, lane: _Lane) -> None:
        w = lane.queue.pop()
        if w is None:
            lane.free += 1
        else:
            w.granted = True
            w.event.set()

    def _finish(self, job: Job) -> None:
        if job.lane is not None:
            self._release(job.lane)
            job.lane = None

    async def _demote(self, job: Job) -> None:
        """(On the trio thread, for a job's thread.) Give its short slot back, wait for a heavy one."""
        if job.is_set() or job.lane is None:
            return
        paused_from = trio.current_time()
        self._release(job.lane)
        job.lane = None
        self.demoted += 1
        with trio.CancelScope() as job.waiting_scope:
            try:
                await self._acquire(self.lanes[HEAVY], job.client)
                job.lane = self.lanes[HEAVY]
            except AgentBusyError as e:
                job.busy = e
                job.set()
        if job.waiting_scope.cancelled_caught:  # the request went away while it waited
            job.set()
        job.waiting_scope = None
        if job.scope is not None:
            job.scope.deadline += trio.current_time() - paused_from
