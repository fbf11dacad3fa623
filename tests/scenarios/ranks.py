"""Multi-rank families (ranks in lock step through NCCL all-reduces) and the healthy shapes.

* ``hung-rank`` — one rank stops entering all-reduces (stuck on a lock); the others sit in the call
  it never entered, entered and never returned, for the last ``magnitude`` of the recording.
* ``late-rank`` — one rank (``outlier``, anywhere in node order) runs extra host code before some of
  its all-reduces; the others wait inside the collective for it (asleep: waiting, not contention).
  The time it costs is ``magnitude`` of the late rank's wall time, and about as much on every peer.
* ``healthy-sleeps`` — a trainer that sleeps by choice: usleep between steps and two evaluation
  pauses (a timer wakes it).
* ``healthy-collective`` — equal ranks whose all-reduce waits come from ordinary jitter.
* ``healthy-idle-server`` — an inference server at low load, asleep between requests (in epoll or in
  the read), streaming each reply back on the request's connection.

These must never get a HIGH or MEDIUM chain (the healthy ones), nor CPU contention at any severity.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ingero.demo.realistic import AGENT
from ingero.demo.synth import ALL_REDUCE, SyntheticNode
from ingero.store.catalog import as_sqlite_int, op_id
from ingero.store.nccl import IN_FLIGHT
from ingero.store.writer import StoreWriter
from ingero.timeutil import NS_PER_MS, NS_PER_S
from tests.scenarios.base import PID, SECONDS, Loop, Node, Params, finish, lost_budget, split, spread_steps, trainer

NET_SEND, NET_RECV = op_id("net_send"), op_id("net_recv")
COMM_PTR, COMM_ID = 0x7F80_0000_1000, 0x5EED_0000_C0FF_EE01
NBYTES = 64 << 20
TRANSFER_MS = 1.5
FLOAT32 = 7


def _nccl_rows(db: Path, node: Node, rank: int, nranks: int, calls: list[tuple[int, int, int]]) -> None:
    """The communicator and its calls (entry ns, duration ns, seq) into ``nccl_comms``/``nccl_calls``."""
    pid = PID
    rows = [
        (pid, pid, COMM_PTR, seq, ALL_REDUCE[1], ts, dur, FLOAT32, 0, NBYTES // 4, NBYTES, -1, 0)
        for ts, dur, seq in calls
    ]
    with StoreWriter(db, node.identity()) as w:
        w.write_batch(nccl_comms=[(COMM_PTR, pid, rank, nranks, node.base_ns, as_sqlite_int(COMM_ID))], nccl_calls=rows)


def lockstep(
    p: Params,
    extra: dict[int, float],
    *,
    jitter_ms: float = 0.3,
    seconds: float = SECONDS,
    hang_s: float = 0.0,
) -> list[Loop]:
    """Ranks (one per node) that compute, enter an all-reduce, and leave together once the last is in;
    ``extra[step]``: seconds of host code rank ``p.outlier`` runs before entering that step's call.
    With ``hang_s``, rank ``p.outlier`` never enters the call after ``seconds`` (stuck, asleep on a lock):
    the others wait in it — entered, never returned (``nccl_calls`` duration −1, no event row) — for
    the ``hang_s`` the recording goes on."""
    n = max(2, p.n_nodes)
    loops = [trainer(p, i, f"python3 train.py --rank {i}") for i in range(n)]
    calls: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    t, step = 0.2, 0
    while t < 0.2 + seconds + sum(extra.values()):
        entry = []
        for i, lp in enumerate(loops):
            lp.t = t
            lp.work(copy=False)
            lp.sync(lp.gpu_ms + float(lp.rec.rng.normal(0.0, jitter_ms)))
            lp.t += 0.4e-3  # the optimizer's host code
            if i == p.outlier % n and step in extra:
                lp.host_code(extra[step])
                lp.lost += extra[step]
            entry.append(lp.t)
        leave = max(entry) + TRANSFER_MS / 1e3
        for i, lp in enumerate(loops):
            rec, dur = lp.rec, (leave - entry[i]) * NS_PER_S
            rec.ev(entry[i], lp.pid, *ALL_REDUCE, dur, arg0=NBYTES, arg1=COMM_PTR)
            wait = dur - TRANSFER_MS * NS_PER_MS
            if wait > 0.2 * NS_PER_MS:  # asleep in the collective until the proxy thread wakes it
                rec.sleep(entry[i] + 100e-6, lp.pid, wait - 100_000, waker=0)
            calls[i].append((rec.ts(entry[i]), round(dur), step))
            lp.t = leave
            lp.pause(0.5)
        t = max(lp.t for lp in loops)
        step += 1
    if hang_s:
        for i, lp in enumerate(loops):
            lp.work(copy=False)
            lp.sync()
            if i != p.outlier % n:
                calls[i].append((lp.rec.ts(lp.t), IN_FLIGHT, step))
            lp.t = t + hang_s  # nothing more from these threads; the node's recording goes on ...
            lp.rec.block_io(lp.t, AGENT, True, 1.2 * NS_PER_MS, 64)  # ... to here: the agent's last write
    for i, lp in enumerate(loops):
        assert isinstance(lp.rec, Node)
        lp.rec.after.append(partial(_nccl_rows, node=lp.rec, rank=i, nranks=n, calls=calls[i]))
    return loops


def late_rank(p: Params) -> list[SyntheticNode]:
    rng = Node("rng", p.seed).rng
    k = 40
    steps = sorted(spread_steps(rng, int(SECONDS / 0.0125), k))
    late = dict(zip(steps, split(rng, lost_budget(p.magnitude), k), strict=True))
    return [finish(lp) for lp in lockstep(p, late)]


def hung_rank(p: Params) -> list[SyntheticNode]:
    """The outlier stops entering collectives: ``magnitude`` of the recording passes after it hung."""
    return [finish(lp) for lp in lockstep(p, {}, hang_s=lost_budget(p.magnitude))]


def healthy_collective(p: Params) -> list[SyntheticNode]:
    return [finish(lp) for lp in lockstep(p, {}, jitter_ms=1.5)]


def healthy_sleeps(p: Params) -> list[SyntheticNode]:
    out = []
    for i in range(p.n_nodes):
        lp = trainer(p, i)
        pauses = {int(SECONDS * f): lost_budget(max(p.magnitude, 0.05)) / 2 for f in (0.3, 0.7)}
        while lp.t < 0.2 + SECONDS + sum(pauses.values()):
            lp.step()
            lp.pause(2.0)  # usleep between steps: the loop paces itself
            second = int(lp.t)
            if second in pauses:  # evaluation on the CPU side: asleep on a timer, nothing is wrong
                pause = pauses.pop(second)
                lp.rec.sleep(lp.t, lp.pid, pause * NS_PER_S)
                lp.t += pause
        out.append(finish(lp))
    return out


CLIENT_FDS = (11, 12, 13, 14)  # the idle server's client connections (kept alive between requests)


def healthy_idle_server(p: Params) -> list[SyntheticNode]:
    """Requests now and then on one of a few kept-alive connections: asleep until one arrives (in
    ``epoll_wait`` then a short read, or in a blocking read), prefill, decode steps streaming the reply
    back in chunks on the same connection (arg0 = bytes, arg1 = the fd, as ingero's tracer writes them)."""
    out = []
    for i in range(p.n_nodes):
        lp = trainer(p, i, "python3 serve.py --model llama")
        rec = lp.rec
        while lp.t < SECONDS * 2:
            fd = int(rec.rng.choice(CLIENT_FDS))
            idle = float(rec.rng.exponential(0.35)) * NS_PER_S  # low load: a request every ~0.35 s
            rec.sleep(lp.t, lp.pid, idle)  # asleep until the next request arrives
            if rec.rng.random() < 0.5:  # epoll_wait, then the read finds the request there
                lp.t += idle / 1e9 + 15e-6
                rec.ev(lp.t, lp.pid, *NET_RECV, 20_000, arg0=int(rec.rng.integers(500, 4000)), arg1=fd)
            else:  # asleep in the read itself
                rec.ev(lp.t, lp.pid, *NET_RECV, idle + 20_000, arg0=int(rec.rng.integers(500, 4000)), arg1=fd)
                lp.t += idle / 1e9
            lp.t += 30e-6
            for k in range(int(rec.rng.integers(8, 24))):  # prefill, then decode steps
                lp.work(copy=False)
                lp.sync(4.0)
                if k % 4 == 3:  # a chunk of the streamed reply
                    rec.ev(lp.t, lp.pid, *NET_SEND, 30_000, arg0=int(rec.rng.integers(50, 400)), arg1=fd)
                    lp.t += 40e-6
            rec.ev(lp.t, lp.pid, *NET_SEND, 50_000, arg0=int(rec.rng.integers(200, 8000)), arg1=fd)
            lp.t += 80e-6
        out.append(finish(lp))
    return out


FAMILIES = {
    "late-rank": late_rank,
    "hung-rank": hung_rank,
    "healthy-sleeps": healthy_sleeps,
    "healthy-collective": healthy_collective,
    "healthy-idle-server": healthy_idle_server,
}
