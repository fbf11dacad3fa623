"""What ``ingero trace`` prints: a live per-op table (terminal), JSON lines (``--json``), a summary.

The tracer reports to this view (:class:`~ingero.agent.trace.livemode.LiveView`); only the CLI prints.

* ``table`` on a terminal: redrawn every second — events, rate, stored, drops, then one line per op
  with count, rate, p50/p95/p99/max and flags (errors, heavy tail). Not on a terminal (a pipe, a log
  file) it prints only the start banner and the final summary.
* ``json``: one object per line — ``{"type": "start", ...}``, one ``{"type": "tick", ...}`` per
  second, ``{"type": "summary", ...}`` at the end.
* ``quiet``: the summary only.
Notes (new libraries probed, the server address) go to stderr.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, TextIO

from ingero.agent.trace.livemode import LiveTick
from ingero.agent.trace.livestats import OpLine
from ingero.timeutil import fmt_latency

if TYPE_CHECKING:
    from ingero.agent.trace.tracer import TraceOptions, TraceReady, TraceSummary

CLEAR = "\x1b[H\x1b[2J"


def _fmt_count(n: float) -> str:
    return f"{int(n):,}"


def _fmt_elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def render_ops(lines: list[OpLine]) -> list[str]:
    head = f"{'op':<22}{'count':>12}{'rate/s':>10}{'p50':>11}{'p95':>11}{'p99':>11}{'max':>11}  flags"
    out = [head, "-" * len(head)]
    for ln in lines:
        timed = ln.p50_ns or ln.max_ns
        cells = [fmt_latency(v) if timed else "-" for v in (ln.p50_ns, ln.p95_ns, ln.p99_ns, ln.max_ns)]
        out.append(
            f"{ln.name:<22}{_fmt_count(ln.count):>12}{_fmt_count(ln.rate):>10}"
            f"{cells[0]:>11}{cells[1]:>11}{cells[2]:>11}{cells[3]:>11}  {', '.join(ln.flags)}"
        )
    if not lines:
        out.append("(no events yet: waiting for GPU API calls and host events of traced processes)")
    return out


def summary_lines(summary: TraceSummary) -> list[str]:
    """The final summary in words: what was seen, stored, and every way something was lost."""
    st = summary.stats
    lines = [
        f"ingero trace: {summary.reason} after {summary.elapsed_s:.1f}s; session {summary.session_id} in {summary.db_path}",
        f"  events seen {_fmt_count(st.get('events_seen', 0))}, stored {_fmt_count(st.get('events_stored', 0))}, "
        f"aggregated only {_fmt_count(st.get('events_aggregated_only', 0))}",
        f"  dropped: kernel ring full {_fmt_count(st.get('events_dropped_ring', 0))}, "
        f"stack errors {_fmt_count(st.get('stack_errors', 0))}, nested too deep {_fmt_count(st.get('nest_overflow', 0))}",
        f"  unpaired: calls whose return never came {_fmt_count(st.get('frames_discarded', 0))}, "
        f"returns without their entry {_fmt_count(st.get('orphan_returns', 0))}",
    ]
    if st.get("disk_full_errors", 0):
        lines.append(
            f"  disk full {_fmt_count(st['disk_full_errors'])} time(s): oldest events pruned "
            f"{_fmt_count(st.get('rows_pruned_disk_full', 0))}, events not stored "
            f"{_fmt_count(st.get('events_lost_disk_full', 0))} (still counted in event_aggregates)"
        )
    return lines


class TraceView:
    """The CLI's :class:`~ingero.agent.trace.livemode.LiveView`: writes to ``out`` (and notes to stderr)."""

    def __init__(self, opts: TraceOptions, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.opts = opts
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.mode = opts.output
        self.tty = opts.output == "table" and self.out.isatty()
        self.wants_ticks = self.mode == "json" or self.tty
        self._notes: list[str] = []

    def _emit_json(self, doc: dict[str, Any]) -> None:
        self.out.write(json.dumps(doc, separators=(",", ":"), default=str) + "\n")
        self.out.flush()

    def _say(self, message: str) -> None:
        print(f"ingero trace: {message}", file=self.err, flush=True)

    def note(self, message: str) -> None:
        self._notes = [*self._notes[-4:], message]
        if self.mode == "json":
            self._emit_json({"type": "note", "message": message})
        elif not self.tty:
            self._say(message)

    def started(self, ready: TraceReady) -> None:
        libs = [a for a in ready.libraries if a.probes]
        bound = ready.server
        if self.mode == "json":
            self._emit_json(
                {
                    "type": "start",
                    "node": self.opts.identity.node,
                    "db": str(self.opts.db_path),
                    "libraries": [{"kind": a.kind, "path": a.path, "functions": len(a.probes)} for a in libs],
                    "listen": bound.url if bound else None,
                }
            )
            return
        where = f", serving {bound.url} (tls={bound.tls_mode})" if bound else ""
        probed = "; ".join(f"{a.kind} {a.path} ({len(a.probes)})" for a in libs) or "no GPU libraries found yet"
        self._say(f"recording to {self.opts.db_path} as node {self.opts.identity.node}{where}")
        self._say(f"probing {probed}")
        if bound and bound.fingerprint_sha256:
            self._say(f"TLS fingerprint SHA256:{bound.fingerprint_sha256}")

    def tick(self, tick: LiveTick) -> None:
        if self.mode == "json":
            self._emit_json({"type": "tick", **tick.as_dict()})
            return
        st = tick.stats
        header = (
            f"ingero trace  node {self.opts.identity.node}  {_fmt_elapsed(tick.elapsed_s)}  "
            f"events {_fmt_count(st.get('events_seen', 0))} ({_fmt_count(tick.events_per_s)}/s)  "
            f"stored {_fmt_count(st.get('events_stored', 0))}  "
            f"dropped {_fmt_count(st.get('events_dropped_ring', 0))}  db {self.opts.db_path}"
        )
        text = "\n".join([header, "", *render_ops(tick.ops), "", *self._notes[-3:]])
        self.out.write(CLEAR + text + "\n")
        self.out.flush()

    def finished(self, summary: TraceSummary) -> None:
        if self.mode == "json":
            self._emit_json(
                {
                    "type": "summary",
                    "reason": summary.reason,
                    "session_id": summary.session_id,
                    "db": str(summary.db_path),
                    "elapsed_s": round(summary.elapsed_s, 3),
                    "stats": summary.stats,
                    "ops": summary.ops,
                    "libraries": summary.libraries,
                }
            )
            return
        per_s = 1 / summary.elapsed_s if summary.elapsed_s > 0 else 0.0
        ops = [
            OpLine(
                0,
                0,
                o["op"],
                o["count"],
                o["count"] * per_s,
                o["p50_us"] * 1000,
                o["p95_us"] * 1000,
                o["p99_us"] * 1000,
                o["max_us"] * 1000,
                o["errors"],
            )
            for o in summary.ops
        ]
        body = render_ops(ops) if ops else []
        self.out.write("\n".join([*summary_lines(summary), "", *body]) + "\n")
        self.out.flush()
