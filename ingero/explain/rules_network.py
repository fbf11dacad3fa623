"""The ledger's network chain: GPU idle while its thread sleeps on the network — lost, or a server idle.

The ledger's ``asleep_network`` bucket holds a GPU thread's sleeps around its own socket calls. Who
waits on whom is in the calls' connections (:mod:`ingero.explain.sockets`):

* a thread that serves requests (a request received on one connection, answered on it) and sleeps on
  the network *while a request is open* waits on a dependency — a tool call, a remote store — while its
  caller waits too: that idle time is lost, graded by its share of wall time like any other;
* its sleeps *between requests* (after a reply, until the next request arrives) are a server idle at
  low load: no work, not lost — no chain;
* a thread with no request seen (a client loop, socket rows without file descriptors, or an Ingero
  recording whose short replies were not stored) cannot be told from either by these rows: the chain
  stays at most LOW and says both.

Lost time inside requests is the ``asleep_network`` idle time (gaps after a synchronizing call, less
the loop's turnaround: :mod:`ingero.explain.ledger`) in proportion to the network sleeps of those gaps
that fall inside open requests — never more than the bucket's idle figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.context import Context
from ingero.explain.ledger import ASLEEP_NETWORK, LedgerRow, children, thread_evidence
from ingero.explain.ledger_gaps import gap_classes
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.rules_idle import ledger_chain, ms
from ingero.explain.sockets import Requests, requests, socket_calls

MOST_CALLS_SHOWN = 3


@dataclass(frozen=True)
class NetworkWaits:
    """How a GPU thread's idle network sleeps split by the requests it was serving."""

    idle_ns: int  # the bucket's idle figure
    in_requests: int  # the part inside open requests (lost)
    served: int  # requests seen answered (0: the thread serves none the rows show)
    reqs: Requests

    @property
    def between(self) -> int:
        return self.idle_ns - self.in_requests


def network_waits(ctx: Context, row: LedgerRow) -> NetworkWaits:
    """Split ``row``'s idle ``asleep_network`` time into inside / outside the requests it served."""
    idle = int(row.idle_ns.get(ASLEEP_NETWORK, 0))
    tid, pid = int(row.tid or 0), int(row.pid or 0)
    reqs = requests(socket_calls(ctx.frame.args).of(tid))
    if reqs.served == 0 or idle <= 0 or row.gap_start.size == 0:
        return NetworkWaits(idle, 0, reqs.served, reqs)
    s, e = gap_classes(thread_evidence(ctx.frame, ctx.off), tid, set(children(ctx.frame.args, pid)))[ASLEEP_NETWORK]
    # the network sleeps inside the gaps the GPU idled in, cut at the gaps' edges
    k = np.searchsorted(row.gap_start, s, side="right") - 1
    kk = np.maximum(k, 0)
    a = np.maximum(s, row.gap_start[kk])
    b = np.minimum(e, row.gap_end[kk])
    keep = (k >= 0) & (b > a) & (row.gap_idle[kk] > 0)
    a, b = a[keep], b[keep]
    total = int((b - a).sum())
    inside = int(reqs.inside(a, b).sum())
    return NetworkWaits(idle, round(idle * inside / total) if total > 0 else 0, reqs.served, reqs)


def network_chain(ctx: Context, row: LedgerRow, sev: str, base: dict[str, Any], net: NetworkWaits | None) -> Chain:
    lost = row.idle_ns[ASLEEP_NETWORK]
    proc = ctx.proc(int(row.pid or 0))
    recs = [
        cz.SOCKET,
        "Overlap remote calls with GPU work: issue them asynchronously, batch them, or prefetch the next input "
        "while the GPU runs",
    ]
    if net is None or net.served == 0:
        return ledger_chain(
            ctx,
            row,
            "idle/asleep_network",
            f"GPU idle {100 * lost / row.wall_ns:.0f}% of wall time while its thread waited on the network ({ms(lost)})",
            f"waiting on a network peer — the GPU thread of {proc} slept {ms(lost)} around its own socket calls with "
            "no GPU work queued: a remote call (a tool call, remote data, a parameter server) — or, in a server idle "
            "between requests, no work at all (not lost time). No request was seen open meanwhile (missing: a "
            "request received and answered on a connection — socket rows with their file descriptors)",
            recs,
            [TimelineEntry("NET", "socket", f"asleep {ms(lost)} around its own send/recv calls", lost // 1000)],
            base,
            sev,
        )
    lost = net.in_requests
    calls = _calls_in_requests(net.reqs)
    shown = "; ".join(
        f"fd {fd}: {n} call(s), {out / 1e3:.1f} kB out, {got / 1e3:.1f} kB back, waited {ms(w)}"
        for fd, (n, out, got, w) in sorted(calls.items(), key=lambda x: -x[1][3])[:MOST_CALLS_SHOWN]
    )
    pct = 100 * lost / row.wall_ns
    return ledger_chain(
        ctx,
        row,
        "idle/asleep_network",
        f"GPU idle {pct:.0f}% of wall time while its thread waited on a remote call inside open requests ({ms(lost)})",
        f"waiting on a dependency — the GPU thread of {proc} slept {ms(lost)} ({pct:.0f}% of its wall time) on the "
        "network while a request it had received was still unanswered: its own call to another service (a tool "
        "call, a remote store) held the request and the GPU" + (f" ({shown})" if shown else ""),
        recs,
        [
            TimelineEntry("NET", "socket", f"asleep {ms(lost)} inside {net.served} request(s) served", lost // 1000),
            TimelineEntry("NET", "context", f"asleep {ms(max(0, net.between))} between requests (idle, not lost)"),
        ],
        {
            **base,
            "lost_ms": round(lost / 1e6, 1),
            "lost_share": round(lost / row.wall_ns, 4),
            "score": round(lost / row.wall_ns, 4),
            "requests_served": net.served,
            "between_requests_ms": round(max(0, net.between) / 1e6, 1),
            "calls_in_requests": {str(fd): v[0] for fd, v in calls.items()},
        },
        sev,
    )


def _calls_in_requests(reqs: Requests) -> dict[int, tuple[int, int, int, int]]:
    """Per connection, the thread's own calls made inside open requests: (calls, bytes out, bytes back,
    time from send to answer)."""
    out: dict[int, tuple[int, int, int, int]] = {}
    for fd, sent, answered, n_out, n_in in reqs.calls:
        within = int(reqs.inside(np.asarray([sent]), np.asarray([answered]))[0])
        if within <= 0:
            continue
        c, o, i, w = out.get(fd, (0, 0, 0, 0))
        out[fd] = (c + 1, o + n_out, i + n_in, w + answered - sent)
    return out
