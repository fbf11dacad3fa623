"""Families where the GPU runs out of work: its thread is somewhere else between GPU calls.

* ``loader-fork`` — input starvation: forked DataLoader workers are slow; before some steps the
  trainer sleeps until a worker wakes it (``sched_wakeup`` arg0 = the worker).
* ``loader-inline`` — loading in the thread itself (``num_workers=0``): it decodes the batch on-CPU
  (plus a short read from the page cache) while the GPU waits.
* ``loader-disk`` — the thread reads each slow batch from disk itself, asleep in D state.
* ``serving-host-bound`` — serving's CPU bottleneck: the thread runs ~1.5 s of its own Python
  (detokenising, sampling) between GPU calls, a few times.
* ``tool-call`` — an agent server busy with user requests (each read from the user's connection and
  answered on it) sends a tool call on another connection in the middle of some requests and sleeps
  until the reply: the user's request stays open meanwhile (the socket rows carry each connection's fd).
* ``checkpoint`` — every few seconds the thread copies the weights out and writes them with
  ``torch.save``: asleep in D state on its own block writes.

Every lost second sits in a gap between GPU calls of the disturbed thread, and the evidence sits in
that gap, on that thread.
"""

from __future__ import annotations

from ingero.demo.realistic import _fork_workers
from ingero.demo.synth import MEMCPY, SyntheticNode
from ingero.store.catalog import op_id
from ingero.timeutil import NS_PER_MS, NS_PER_S, NS_PER_US
from tests.scenarios.base import (
    SECONDS,
    Gap,
    Loop,
    Params,
    disturb,
    fleet,
    incidents,
    lost_budget,
    split,
    spread_steps,
    steps_in,
)

NET_SEND, NET_RECV = op_id("net_send"), op_id("net_recv")
USER_FD, TOOL_FD = 7, 9  # an agent server's connections: the user's (requests in, replies out), the tool's
SLOW_BATCH_S, MOST_SLOW_BATCHES = 0.02, 60  # a chronic disturbance: slow batches of ~20 ms, 60 at most


def _batches(p: Params) -> int:
    return incidents(p.magnitude, SLOW_BATCH_S, MOST_SLOW_BATCHES)


def loader_fork(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        kids = _fork_workers(loop.rec, loop.pid, 4, 0.1)

        def wait(lp: Loop, s: float) -> None:
            lp.rec.sleep(lp.t, lp.pid, s * NS_PER_S, waker=kids[lp.steps % len(kids)])
            lp.t += s + 50e-6

        for k in kids:  # the workers decode and augment: busy, preempting each other now and then
            loop.rec.background(0.2, SECONDS, k, 20, 0.3 * NS_PER_MS, by=kids[0] if k != kids[0] else kids[1])
        disturb(loop, p.magnitude, _batches(p), wait)

    return fleet(p, disturbed, cmd="python3 train.py --num-workers 4")


def loader_inline(p: Params) -> list[SyntheticNode]:
    def decode(lp: Loop, s: float) -> None:
        read = min(2 * NS_PER_MS, s * NS_PER_S * 0.05)  # a short read, mostly from the page cache
        lp.rec.block_io(lp.t + read / 2e9, lp.pid, False, read * 0.8, 64)
        lp.rec.sched(lp.t, lp.pid, read, state=2)
        lp.t += read / 1e9
        lp.host_code(s - read / 1e9)

    return fleet(
        p, lambda loop, p: disturb(loop, p.magnitude, _batches(p), decode), cmd="python3 train.py --num-workers 0"
    )


def _read(lp: Loop, s: float) -> None:
    """A read of ``s`` seconds from disk by the thread itself, asleep in D state all along."""
    ns = s * NS_PER_S
    for part in split(lp.rec.rng, ns, max(1, int(ns // (25 * NS_PER_MS)))):
        lp.rec.block_io(lp.t + part / 2e9, lp.pid, False, part * 0.9, 2048)
        lp.rec.sched(lp.t, lp.pid, part, state=2)
        lp.t += part / 1e9 + 20e-6


def loader_disk(p: Params) -> list[SyntheticNode]:
    return fleet(
        p, lambda loop, p: disturb(loop, p.magnitude, _batches(p), _read), cmd="python3 train.py --num-workers 0"
    )


def serving_host_bound(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        k = 2 if p.magnitude >= 0.1 else 3
        disturb(loop, p.magnitude, k, lambda lp, s: lp.host_code(s))

    return fleet(p, disturbed, cmd="python3 serve.py --model llama")


def _net(lp: Loop, op: tuple[int, int], fd: int, nbytes: int, dur_ns: float) -> None:
    """A socket call of the loop's thread, written as ingero's tracer does (arg0 = bytes, arg1 = the fd)."""
    lp.rec.ev(lp.t, lp.pid, *op, dur_ns, arg0=nbytes, arg1=fd)
    lp.t += dur_ns / 1e9 + 10e-6


def serve(loop: Loop, incidents: dict[int, float], gap: Gap) -> None:
    """An agent server busy with one user request after another until it has done ``SECONDS`` of its own
    work: it reads the request from the user's connection (already queued: no wait), runs the prefill
    and decode steps, and writes the reply back; ``incidents[k]`` seconds of ``gap`` before step k, inside
    the request then open (the time they take is lost)."""
    rng = loop.rec.rng
    while loop.healthy_s < SECONDS:
        _net(loop, NET_RECV, USER_FD, int(rng.integers(300, 4000)), float(rng.uniform(15, 40)) * NS_PER_US)
        for _ in range(int(rng.integers(8, 24))):
            if loop.healthy_s >= SECONDS:
                break
            hit = incidents.pop(loop.steps, None)
            if hit is not None:
                t0 = loop.t
                gap(loop, hit)
                loop.lost += loop.t - t0
            loop.step()
        _net(loop, NET_SEND, USER_FD, int(rng.integers(200, 8000)), float(rng.uniform(20, 60)) * NS_PER_US)
    assert not incidents, "every tool call falls inside the run"


def tool_call(p: Params) -> list[SyntheticNode]:
    def call(lp: Loop, s: float) -> None:
        """The tool call: its request written to the tool's connection, asleep until the reply comes."""
        rec = lp.rec
        _net(lp, NET_SEND, TOOL_FD, 1800, 40_000)
        wait = s * NS_PER_S - 100_000
        rec.sleep(lp.t, lp.pid, wait, waker=0)  # woken from softirq when the reply arrives
        rec.ev(lp.t, lp.pid, *NET_RECV, wait + 30_000, arg0=int(rec.rng.integers(2_000, 40_000)), arg1=TOOL_FD)
        lp.t += (wait + 40_000) / 1e9

    def disturbed(loop: Loop, p: Params) -> None:
        k = 12
        parts = split(loop.rec.rng, lost_budget(p.magnitude), k)
        steps = sorted(spread_steps(loop.rec.rng, steps_in(SECONDS), k))
        serve(loop, dict(zip(steps, parts, strict=True)), call)

    return fleet(p, disturbed, cmd="python3 agent_server.py", healthy=lambda loop: serve(loop, {}, call))


def checkpoint(p: Params) -> list[SyntheticNode]:
    def save(lp: Loop, s: float) -> None:
        rec = lp.rec
        d2h = min(0.2 * s, 0.05) * NS_PER_S
        rec.ev(lp.t, lp.pid, *MEMCPY, d2h, arg0=512 << 20, arg1=2)  # weights device → host
        lp.t += d2h / 1e9
        left = s * NS_PER_S - d2h
        for part in split(rec.rng, left, max(1, int(left // (30 * NS_PER_MS)))):
            rec.block_io(lp.t + part / 2e9, lp.pid, True, part * 0.9, 4096)
            rec.sched(lp.t, lp.pid, part, state=2)
            lp.t += part / 1e9 + 20e-6

    return fleet(p, lambda loop, p: disturb(loop, p.magnitude, 3, save))


FAMILIES = {
    "loader-fork": loader_fork,
    "loader-inline": loader_inline,
    "loader-disk": loader_disk,
    "serving-host-bound": serving_host_bound,
    "tool-call": tool_call,
    "checkpoint": checkpoint,
}
