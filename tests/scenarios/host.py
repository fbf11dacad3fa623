"""Families where the GPU waits on its thread's own pace, or where the thread's work overlaps the GPU's.

* ``cpu-bound-loop`` — a serving/training loop CPU-bound at *every* step: after each sync its thread
  runs its own Python (sampling, detokenising, building the next batch) for the loop's 1 ms turnaround
  plus ``x`` before it launches again, never sleeping. ``x`` per step is the magnitude's share of the
  step: no incident, the GPU simply waits for the host at every step.
* ``loader-overlap`` — a trainer that launches a step asynchronously and, while the GPU runs it (20 ms
  queued), reads the next batch from disk itself (asleep in D state) before its sync. An ordinary read
  hides under the queued work (the sync returns that much sooner); now and then a read outlasts it, and
  only the excess is lost: the sync returns at once and the GPU idled for the rest of the read.
* ``healthy-overlap`` — the same trainer whose reads (some nearly as long as the queued work) and
  ordinary preemptions in its host work always hide under the GPU's queue: nothing is lost.

The GPU is modelled as a queue: a sync after asynchronous launches returns when the queued work is done
(``max(floor, queued - time since the launches)``), so every row is what a real loop would leave.
"""

from __future__ import annotations

from ingero.demo.realistic import KWORKER, _launches
from ingero.demo.synth import MEMCPY_ASYNC, STREAM_SYNC, SyntheticNode
from ingero.timeutil import NS_PER_MS, NS_PER_S, NS_PER_US
from tests.scenarios.base import SECONDS, Loop, Params, fleet, lost_budget, split, spread_steps, steps_in

TURNAROUND_S = 0.95e-3  # a loop's ordinary host code after its sync (with the sync's own 50 µs tail: 1 ms)
QUEUED_MS = 20.0  # GPU work one overlapped step queues
PYTHON_MS = 2.0  # the overlapped step's own host code before its read
SYNC_FLOOR_NS = 30 * NS_PER_US  # a sync on a drained queue
READ_MS = (4.0, 12.0)  # an ordinary read: hidden under the queued work
NEAR_MISS_MS = (14.0, 17.5)  # a long read that still hides (the queue has 18 ms left after the Python)


def _cpu_bound(loop: Loop, share: float) -> None:
    """Steps of copy + launches + sync, then own host code: the turnaround, plus ``share`` / (1 - share)
    of the step (jittered) — what the GPU loses at every step."""
    rec = loop.rec
    while loop.healthy_s < SECONDS:
        t0 = loop.t
        loop.work()
        loop.sync()
        loop.host_code(rec.jitter(TURNAROUND_S * NS_PER_S, 0.03) / NS_PER_S)
        x = share / (1.0 - share) * (loop.t - t0) * float(rec.rng.uniform(0.8, 1.2))
        loop.host_code(x)
        loop.lost += x
        loop.steps += 1


def cpu_bound_loop(p: Params) -> list[SyntheticNode]:
    return fleet(
        p,
        lambda loop, p: _cpu_bound(loop, p.magnitude),
        cmd="python3 serve.py --model llama",
        healthy=lambda loop: _cpu_bound(loop, 0.0),
    )


def _read(lp: Loop, ms: float) -> None:
    """The thread reads ``ms`` of the next batch from disk, asleep in D state."""
    ns = ms * NS_PER_MS
    lp.rec.block_io(lp.t + ns / 2e9, lp.pid, False, ns * 0.9, 1024)
    lp.rec.sched(lp.t, lp.pid, ns, state=2)
    lp.t += ns / 1e9


def _overlapped_step(lp: Loop, read_ms: float, preempt_ms: float = 0.0) -> float:
    """One step: the batch's async copy and the launches (``QUEUED_MS`` of GPU work queued), own host
    code, a preemption of ``preempt_ms`` in it, the read, then the sync: it returns when the queue is
    done. Returns the seconds the GPU idled waiting for the thread."""
    rec, pid = lp.rec, lp.pid
    rec.ev(lp.t, pid, *MEMCPY_ASYNC, rec.jitter(15 * NS_PER_US), arg0=8 << 20, arg1=1)
    lp.t += 30e-6
    lp.t = _launches(rec, lp.t, pid, lp.seen, n=lp.launches)
    queued_until = lp.t + rec.jitter(QUEUED_MS * NS_PER_MS, 0.04) / NS_PER_S
    lp.host_code(rec.jitter(PYTHON_MS * NS_PER_MS, 0.1) / NS_PER_S)
    if preempt_ms:
        rec.sched(lp.t, pid, preempt_ms * NS_PER_MS, by=KWORKER)
        lp.t += preempt_ms / 1e3
    _read(lp, read_ms)
    idle = max(0.0, lp.t - queued_until)
    sync = max(SYNC_FLOOR_NS, (queued_until - lp.t) * NS_PER_S + rec.jitter(SYNC_FLOOR_NS, 0.2))
    rec.ev(lp.t, pid, *STREAM_SYNC, sync)
    if sync > 0.3 * NS_PER_MS:  # blocking sync: asleep until the GPU's interrupt
        rec.sleep(lp.t + 50e-6, pid, sync - 100 * NS_PER_US, waker=0)
    lp.t += sync / NS_PER_S + rec.jitter(0.3 * NS_PER_MS, 0.2) / NS_PER_S
    lp.steps += 1
    return idle


def _overlapping(loop: Loop, late: dict[int, float]) -> None:
    """The overlapped loop until ``SECONDS`` of its own work; ``late[step]``: that step's read outlasts
    the queued work by this many seconds (lost). Ordinary reads, near misses and short preemptions hide."""
    rng = loop.rec.rng
    while loop.healthy_s < SECONDS:
        extra = late.pop(loop.steps, None)
        near = rng.random() < 0.08
        read = float(rng.uniform(*(NEAR_MISS_MS if near else READ_MS)))
        if extra is not None:  # the read ends ``extra`` after the queue drained
            read = QUEUED_MS - PYTHON_MS + extra * 1e3
        preempt = float(rng.uniform(0.3, 2.0)) if rng.random() < 0.05 else 0.0
        loop.lost += _overlapped_step(loop, read, 0.0 if extra is not None else preempt)
    assert not late, "every late read falls inside the run"


def loader_overlap(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        rng = loop.rec.rng
        budget = lost_budget(p.magnitude)
        k = max(3, min(40, int(budget / 0.03)))  # late reads of ~30 ms each
        steps = sorted(spread_steps(rng, steps_in(SECONDS, 0.03), k))
        _overlapping(loop, dict(zip(steps, split(rng, budget, k), strict=True)))

    return fleet(p, disturbed, cmd="python3 train.py --num-workers 0", healthy=lambda loop: _overlapping(loop, {}))


def healthy_overlap(p: Params) -> list[SyntheticNode]:
    return fleet(p, lambda loop, p: _overlapping(loop, {}), healthy=lambda loop: _overlapping(loop, {}))


FAMILIES = {
    "cpu-bound-loop": cpu_bound_loop,
    "loader-overlap": loader_overlap,
    "healthy-overlap": healthy_overlap,
}
