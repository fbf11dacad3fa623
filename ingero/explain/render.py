"""Text rendering of explain reports and chains (the CLI's default output; the demo prints the same)."""

from __future__ import annotations

import textwrap

from ingero.explain.engine import ExplainReport
from ingero.explain.ledger import LedgerRow, describe
from ingero.explain.model import Chain
from ingero.explain.stats import HostSummary, OpStats
from ingero.texttable import render_table
from ingero.timeutil import fmt_duration, fmt_latency, fmt_ts

WIDTH = 100
SEVERITY_MARK = {"HIGH": "[HIGH]  ", "MEDIUM": "[MEDIUM]", "LOW": "[LOW]   "}


def _ops_table(ops: list[OpStats], limit: int) -> list[str]:
    rows = [
        [
            o.name,
            o.source_name,
            o.count,
            fmt_latency(o.p50_ns),
            fmt_latency(o.p95_ns),
            fmt_latency(o.p99_ns),
            fmt_latency(o.max_ns),
            f"{o.tail_ratio:.1f}x",
            *([o.pid] if o.pid is not None else []),
        ]
        for o in ops[:limit]
    ]
    cols = ["op", "source", "count", "p50", "p95", "p99", "max", "p99/p50"]
    if ops and ops[0].pid is not None:
        cols.append("pid")
    text = render_table(cols, rows).splitlines()
    if len(ops) > limit:
        text.append(f"... {len(ops) - limit} more op(s) (--json shows all)")
    return ["  " + line for line in text]


def _host_line(h: HostSummary) -> str:
    parts = [f"{h.sched_switch} sched_switch ({fmt_duration(round(h.offcpu_ns / 1e6) * 1e6)} off-CPU)"]
    parts.append(f"{h.block_io} block I/O ({h.block_reads} reads, {h.block_writes} writes)")
    if h.tcp_retransmits:
        parts.append(f"{h.tcp_retransmits} TCP retransmits")
    parts.append(f"host events avg {fmt_latency(h.host_avg_ns)}")
    return "  host: " + ", ".join(parts)


def ledger_lines(rows: list[LedgerRow], limit: int = 8) -> list[str]:
    """One line per GPU thread, the longest first: where its wall time went (the ledger's buckets)."""
    rows = sorted(rows, key=lambda r: -r.wall_ns)
    out = []
    for r in rows[:limit]:
        who = f"GPU thread {r.tid}" + (f" ({r.name})" if r.name else f" (pid {r.pid})")
        out += _wrap(f"{who}: {describe(r)}", "  ")
    if len(rows) > limit:
        out.append(f"  ... {len(rows) - limit} more GPU thread(s) (--json shows the whole ledger)")
    return out


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ") or [indent]


def render_chain(c: Chain, *, index: int | None = None, verbose: bool = True) -> list[str]:
    head = f"{SEVERITY_MARK.get(c.severity, c.severity)} {c.node}  {c.summary}"
    if index is not None:
        head = f"{index}. {head}"
    lines = _wrap(head, "")
    lines += _wrap(f"root cause: {c.root_cause}", "    ")
    if c.timeline:
        lines.append("    timeline:")
        for t in c.timeline:
            lines += _wrap(f"{t.layer:<7} {t.op:<16} {t.detail}", "      ")
    if verbose and c.explanation:
        lines += _wrap(f"why: {c.explanation}", "    ")
    if c.recommendations:
        lines.append("    fix:")
        for i, r in enumerate(c.recommendations, 1):
            lines += _wrap(f"{i}. {r}", "      ")
    origin = f"stored, detected {fmt_ts(c.detected_at)}" if c.origin == "stored" else f"{c.family}; id {c.id}"
    lines.append(f"    ({origin})")
    return lines


def render_chains(chains: list[Chain], *, verbose: bool = True) -> str:
    out: list[str] = []
    for i, c in enumerate(chains, 1):
        out += render_chain(c, index=i, verbose=verbose)
        out.append("")
    return "\n".join(out).rstrip() + "\n" if out else ""


def render_report(report: ExplainReport, *, source: str = "", op_limit: int = 12, stored: int = 0) -> str:
    out: list[str] = []
    span = f"{fmt_ts(report.first_ns)} → {fmt_ts(report.last_ns)}" if report.first_ns else "no events"
    where = f"{source}: " if source else ""
    out.append(f"{where}{report.events:,} events, {len(report.nodes)} node(s), {span}")
    for node in report.nodes:
        ops = [o for o in report.ops if o.node == node]
        out.append("")
        out.append(f"{node}")
        if ops:
            out += _ops_table(ops, op_limit)
        host = report.hosts.get(node)
        if host is not None:
            out.append(_host_line(host))
        out += ledger_lines([r for r in report.ledger if r.node == node])
    out.append("")
    if report.chains:
        out.append(f"causal chains ({len(report.chains)})")
        out.append("")
        out.append(render_chains(report.chains).rstrip())
    else:
        msg = "no causal chains: no GPU op shows a tail, drop or contention that host evidence explains"
        if stored:
            msg += (
                f" — the database stores {stored} chain(s) recorded while tracing (ingero explain --chains shows them)"
            )
        out.append(msg)
    return "\n".join(out).rstrip() + "\n"
