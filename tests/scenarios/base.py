"""What every scenario family shares: its parameters, a steady GPU loop, background noise, the lost-time
budget a magnitude asks for, and writing the nodes of one run into one merged database.

A scenario is one run of one family: ``Params(seed, magnitude, n_nodes, outlier)``. ``magnitude`` is
the share of the disturbed GPU thread's wall time (first to last GPU call) that the disturbance costs,
the figure explain's severity is graded on (HIGH ≥ 20 %, MEDIUM ≥ 5 %, LOW ≥ 1 %). A family converts
it into its own knob (seconds of host code, bytes copied at pageable speed, run-queue delay inside
syncs ...) with :func:`lost_budget`, and ties every lost second to the calls or gaps it slows: a sync
returns late by exactly the run-queue delay its sched rows say, a gap lasts exactly as long as the
read that fills it. ``n_nodes`` nodes are written into one database (each analysed apart by explain);
node ``outlier`` carries the disturbance, the others run the same job healthy.

Rows are written the way ingero's tracer writes them (see :mod:`ingero.explain.offcpu` for the
scheduler rows), through the real :class:`~ingero.store.writer.StoreWriter` (via
:class:`~ingero.demo.synth.SyntheticNode`), with the noise of :mod:`ingero.demo.realistic`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ingero.demo.realistic import KWORKER, _copy, _launches, _noise
from ingero.demo.synth import SCHED_WAKEUP, SESSION, STREAM_SYNC, SyntheticNode
from ingero.timeutil import NS_PER_MS, NS_PER_US

BASE_NS = 1_776_000_000_000_000_000
SECONDS = 4.0  # healthy work per node: long enough for a steady level, short enough for CI
PID = 5000
HOG = 6200  # a CPU hog's pid, where a family has one


@dataclass(frozen=True)
class Params:
    seed: int
    magnitude: float  # lost time / the disturbed thread's wall time
    n_nodes: int = 1
    outlier: int = 0  # index of the disturbed node in node order

    def node_name(self, i: int) -> str:
        return f"gpu-node-{i:02d}"

    @property
    def outlier_node(self) -> str:
        return self.node_name(self.outlier)


class Node(SyntheticNode):
    """A node's rows, plus what is written after them into the same database (cgroup metadata, NCCL
    communicators and calls: tables the event rows do not carry)."""

    def __init__(self, node: str, seed: int) -> None:
        super().__init__(node, BASE_NS, seed)
        self.session = dict(SESSION)
        self.after: list[Callable[[Path], None]] = []

    def write(self, path: str | Path, *, chains: list[dict[str, object]] | None = None) -> int:
        n = super().write(path, chains=chains)
        for hook in self.after:
            hook(Path(path))
        return n


def lost_budget(magnitude: float, healthy_s: float = SECONDS) -> float:
    """Seconds a disturbance must cost so that it is ``magnitude`` of the wall time it lengthens:
    lost / (healthy + lost) = magnitude."""
    return magnitude * healthy_s / (1.0 - magnitude)


def split(rng: np.random.Generator, total: float, k: int, rel: float = 0.3) -> list[float]:
    """``total`` split into ``k`` jittered parts that add up to it exactly."""
    w = np.clip(rng.normal(1.0, rel, k), 0.2, None)
    return [float(x) for x in total * w / w.sum()]


@dataclass
class Loop:
    """One GPU thread's steady training/serving loop on one node; ``t`` is its clock in seconds."""

    rec: SyntheticNode
    pid: int = PID
    gpu_ms: float = 8.0
    launches: int = 6
    t: float = 0.2
    seen: set[int] = field(default_factory=set)
    steps: int = 0
    lost: float = 0.0  # seconds the disturbance has cost so far (gaps it made, calls it slowed)
    extra_gpu_ms: float = 0.0  # the next step's sync: the GPU takes this much longer (shared, slower)
    runqueue_ns: float = 0.0  # the next step's sync: woken, then this long in the run queue ...
    by: int = 0  # ... while this task runs in its place

    def sync(self, gpu_ms: float | None = None, *, runqueue_ns: float = 0.0, by: int = 0) -> None:
        """cudaStreamSynchronize with blocking sync: asleep inside it until the GPU is done (woken by the
        driver's interrupt, pid 0); ``runqueue_ns`` more waiting for a CPU after the wakeup while ``by``
        runs (involuntary), so the call returns that much later."""
        rec, pid = self.rec, self.pid
        gpu = rec.jitter((gpu_ms or self.gpu_ms) * NS_PER_MS, 0.04)
        rec.ev(self.t, pid, *STREAM_SYNC, gpu + runqueue_ns)
        asleep = gpu - 150 * NS_PER_US
        t_sleep = self.t + 100e-6
        rec.ev(t_sleep + asleep / 1e9, pid, *SCHED_WAKEUP, asleep, arg0=0, arg1=0)
        rec.sched(t_sleep, pid, asleep + runqueue_ns, state=1, by=by if runqueue_ns else 0)
        self.t += (gpu + runqueue_ns) / 1e9 + 50e-6

    def work(self, *, copy: bool = True) -> None:
        """Copy the batch in, launch the step's kernels (a kernel's first launch is slow: lazy loading)."""
        if copy:
            self.t = _copy(self.rec, self.t, self.pid)
        self.t = _launches(self.rec, self.t, self.pid, self.seen, n=self.launches)

    def pause(self, ms: float = 1.0) -> None:
        """The usleep / futex wait between steps (a timer wakes it), and now and then an ordinary short
        preemption in host code: what healthy loops look like."""
        rec = self.rec
        if rec.rng.random() < 0.02:
            rec.sched(self.t + 1e-4, self.pid, float(rec.rng.uniform(0.1, 0.4)) * NS_PER_MS, by=KWORKER)
            self.t += 0.6e-3
        d = rec.jitter(ms * NS_PER_MS, 0.1)
        rec.sleep(self.t, self.pid, d)
        self.t += d / 1e9 + 0.1e-3

    @property
    def healthy_s(self) -> float:
        """Seconds of the loop's own work so far: its clock less what the disturbance cost."""
        return self.t - 0.2 - self.lost

    def step(self) -> None:
        self.work()
        self.sync(self.gpu_ms + self.extra_gpu_ms, runqueue_ns=self.runqueue_ns, by=self.by)
        self.lost += self.extra_gpu_ms / 1e3 + self.runqueue_ns / 1e9
        self.extra_gpu_ms = self.runqueue_ns = 0.0
        self.pause()
        self.steps += 1

    def host_code(self, seconds: float) -> None:
        """The thread runs its own code for ``seconds`` (on-CPU: no scheduler row but the odd tick)."""
        n = int(seconds * 4)
        for t in sorted(self.rec.rng.uniform(self.t, self.t + seconds, n)):
            self.rec.sched(float(t), self.pid, self.rec.jitter(60 * NS_PER_US, 0.3), by=KWORKER)
        self.t += seconds


Disturb = Callable[[Loop, Params], None]


def trainer(p: Params, i: int, cmd: str = "python3 train.py") -> Loop:
    rec = Node(p.node_name(i), p.seed * 1009 + i)
    rec.process(PID, cmd, 0.0, exec_event=False)
    return Loop(rec)


def healthy_run(loop: Loop, seconds: float = SECONDS) -> None:
    run_with(loop, {}, seconds)


def finish(loop: Loop) -> SyntheticNode:
    _noise(loop.rec, loop.pid, loop.t)
    return loop.rec


def fleet(
    p: Params, disturbed: Disturb, *, cmd: str = "python3 train.py", healthy: Callable[[Loop], None] = healthy_run
) -> list[SyntheticNode]:
    """``p.n_nodes`` nodes of the same job; node ``p.outlier`` runs ``disturbed``, the others ``healthy``."""
    out = []
    for i in range(p.n_nodes):
        loop = trainer(p, i, cmd)
        if i == p.outlier:
            disturbed(loop, p)
        else:
            healthy(loop)
        out.append(finish(loop))
    return out


def spread_steps(rng: np.random.Generator, n_steps: int, k: int, lo: float = 0.1, hi: float = 1.0) -> set[int]:
    """``k`` distinct step numbers spread over ``[lo, hi)`` of the run (start-up stays apart)."""
    first, last = max(1, int(n_steps * lo)), max(2, int(n_steps * hi))
    k = min(k, last - first)
    return {int(x) for x in rng.choice(np.arange(first, last), k, replace=False)}


def steps_in(seconds: float, step_s: float = 0.012) -> int:
    """How many healthy steps (10-11 ms each) surely fit in ``seconds``."""
    return max(1, int(seconds / step_s))


def run_with(loop: Loop, incidents: dict[int, Callable[[Loop], None]], seconds: float = SECONDS) -> None:
    """The loop until it has done ``seconds`` of its own work, with ``incidents[k]`` run before step k
    (the time an incident takes is lost; so is what it adds to the step's sync)."""
    while loop.healthy_s < seconds:
        hit = incidents.get(loop.steps)
        if hit is not None:
            t0 = loop.t
            hit(loop)
            loop.lost += loop.t - t0
        loop.step()


Gap = Callable[[Loop, float], None]


def _at(gap: Gap, seconds: float) -> Callable[[Loop], None]:
    return lambda lp: gap(lp, seconds)


def incidents(magnitude: float, each_s: float, most: int) -> int:
    """How many incidents carry a magnitude's budget when each lasts about ``each_s`` (a slow batch, a
    delayed sync are tens of milliseconds, not a sliver), between 3 and ``most``."""
    return max(3, min(most, int(lost_budget(magnitude) / each_s)))


def disturb(
    loop: Loop, magnitude: float, k: int, gap: Gap, *, lo: float = 0.1, hi: float = 1.0, rel: float = 0.3
) -> None:
    """The healthy loop with ``k`` incidents spread over ``[lo, hi)`` of it (``gap(loop, s)`` makes one
    of ``s`` seconds at the loop's clock, or slows the next step's sync by that), whose durations add up
    to the magnitude's budget."""
    rng = loop.rec.rng
    parts = split(rng, lost_budget(magnitude), k, rel)
    steps = sorted(spread_steps(rng, steps_in(SECONDS), k, lo, hi))
    run_with(loop, {st: _at(gap, s) for st, s in zip(steps, parts, strict=True)})


def write(nodes: Sequence[SyntheticNode], path: Path) -> Path:
    for rec in nodes:
        rec.write(path)
    return path
