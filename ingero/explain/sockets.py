"""A thread's socket calls, in either layout, and the requests they show it serving.

The rows (source NET: ``net_send``, ``net_recv``) differ by tracer:

* ingero's (``ingero trace``: libc uprobes, ``agent/trace/bpf/net_probes.c``): ``timestamp`` = the
  call's entry, ``arg0`` = bytes moved, ``arg1`` = the socket's file descriptor;
* Ingero's (its ``bpf/net_trace.bpf.c`` and ``internal/ebpf/net``: the ``sendto``/``recvfrom`` syscall
  tracepoints): ``timestamp`` = the call's *return*, ``arg0`` = the file descriptor, ``arg1`` = bytes.
  After its first 10 s Ingero stores only the socket calls slower than 3x their op's median (the rest
  are counted in ``event_aggregates``), so the short sends that answer requests may be missing there.

Its databases are told, as for wakeups, by their ``sched_switch`` rows without ``prev_state``
(:func:`ingero.explain.offcpu.without_prev_state`).

**Requests.** A file descriptor is one connection. Walking a thread's calls in time order, with
consecutive calls in one direction on one connection taken as one message (a request or a reply may
take several reads or writes):

* a message *received* on a connection where the thread sent nothing it awaits an answer to is a
  request: it is **open** from the end of its last read until the start of the last write of the reply
  on the same connection (a streamed reply keeps it open until its last chunk);
* a message *sent* on a connection with no open request is a call of the thread's own (a tool call,
  remote data); the next message received there is its answer.

A thread that sleeps on the network while a request it received is still unanswered is waiting on a
dependency (a tool call, a remote store): the request's caller waits too, and the GPU has no work —
lost time. A thread asleep between a reply and the next request is a server idle at low load: no work,
nothing lost. A sleep with no request open on any connection (a client loop, a recording without
file descriptors — fd 0 —, or one whose replies were not stored) cannot be told apart from either, by
these rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingero.explain.frame import I64, ArgRows
from ingero.explain.offcpu import union, without_prev_state
from ingero.store.catalog import NET, op_id

NET_SEND = op_id("net_send")


@dataclass(frozen=True)
class Sockets:
    """Socket calls (one row each, any order): thread, [start, end), connection, bytes, direction."""

    tid: I64
    start: I64
    end: I64
    fd: I64
    nbytes: I64
    send: np.ndarray

    def of(self, tid: int) -> Sockets:
        """Thread ``tid``'s calls in time order."""
        m = np.flatnonzero(self.tid == tid)
        m = m[np.argsort(self.start[m], kind="stable")]
        return Sockets(self.tid[m], self.start[m], self.end[m], self.fd[m], self.nbytes[m], self.send[m])


def socket_calls(args: ArgRows) -> Sockets:
    """Every socket call of a node's argument rows, read in its recording's layout."""
    m = args.source == NET
    dur = np.maximum(args.dur[m], 0)
    send = args.op[m] == NET_SEND[1]
    if without_prev_state(args):  # Ingero: stamped at the return, fd first
        end = args.ts_ns[m]
        return Sockets(args.tid[m], end - dur, end, args.arg0[m], args.arg1[m], send)
    start = args.ts_ns[m]
    return Sockets(args.tid[m], start, start + dur, args.arg1[m], args.arg0[m], send)


@dataclass(frozen=True)
class Requests:
    """What one thread's socket calls show: its open requests and its own calls (round trips)."""

    open_start: I64  # [open_start, open_end): a request received and not yet answered (sorted, disjoint)
    open_end: I64
    served: int  # requests seen answered
    calls: list[tuple[int, int, int, int, int]]  # own calls: (fd, sent at, answered at, bytes out, bytes in)

    def inside(self, s: I64, e: I64) -> I64:
        """Per interval [s, e), the ns of it inside an open request."""
        a, b = self.open_start, self.open_end
        if a.size == 0:
            return np.zeros(s.size, dtype=np.int64)
        before = np.concatenate(([0], np.cumsum(b - a)))  # open time before each request's start

        def upto(x: I64) -> I64:
            k = np.searchsorted(a, x, side="right")  # requests that started by x
            kk = np.maximum(k - 1, 0)
            part = np.where(k > 0, np.clip(np.minimum(x, b[kk]) - a[kk], 0, None), 0)
            got: I64 = before[kk] * (k > 0) + part
            return got

        out: I64 = np.maximum(upto(e) - upto(s), 0)
        return out


def requests(calls: Sockets) -> Requests:
    """The requests one thread served and the calls it made (``calls``: :meth:`Sockets.of`); none where
    the rows do not name their connection (fd 0: recordings from before it was recorded)."""
    if calls.fd.size == 0 or bool((calls.fd <= 0).any()):
        return Requests(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0, [])
    last_send: dict[int, bool] = {}  # per connection: was its last call a send
    awaiting: dict[int, list[int]] = {}  # connection -> [sent at, bytes out] of the thread's own call
    answering: dict[int, int] = {}  # connection -> index in ``own`` of the call whose answer is being read
    opened: dict[int, int] = {}  # connection -> end of the request's last read
    closing: dict[int, int] = {}  # connection -> start of the reply's last write so far
    starts: list[int] = []
    ends: list[int] = []
    own: list[tuple[int, int, int, int, int]] = []
    served = 0
    cols = (calls.fd, calls.start, calls.end, calls.nbytes, calls.send)
    for fd, s, e, n, snd in zip(*(c.tolist() for c in cols), strict=True):
        same = last_send.get(fd) == snd  # the same message goes on
        last_send[fd] = snd
        if snd:
            answering.pop(fd, None)
            if fd in opened:
                closing[fd] = s  # (a further chunk of) the reply
            elif same and fd in awaiting:
                awaiting[fd][1] += n  # the call's next write
            else:
                awaiting[fd] = [s, n]  # a call of its own
        elif fd in awaiting:
            sent, out = awaiting.pop(fd)
            answering[fd] = len(own)
            own.append((fd, sent, e, out, n))
        elif same and fd in answering:
            k = answering[fd]
            own[k] = (*own[k][:2], e, own[k][3], own[k][4] + n)  # the answer's next read
        elif same and fd in opened:
            opened[fd] = e  # the request's next read
        else:
            if fd in closing:
                starts.append(opened.pop(fd))
                ends.append(closing.pop(fd))
                served += 1
            opened[fd] = e  # a request arrives
    for fd, at in closing.items():
        starts.append(opened[fd])
        ends.append(at)
        served += 1
    a, b = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    keep = b > a
    a, b = union(a[keep], b[keep])
    return Requests(a, b, served, own)
