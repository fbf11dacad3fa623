"""Text for humans: query footers, the unanswered-nodes list, skew warnings, merged chains, progress.

Shared by the CLI (``query --nodes``, ``explain --nodes``, ``fleet status``) and anything else that
prints fleet results (MCP tools return these lines too).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO, Any

from ingero.fleet.merge import FleetChains, FleetResult
from ingero.fleet.outcome import NodeOutcome
from ingero.fleet.skew import warning as skew_warning

MAX_LEDGER_NODES = 32  # nodes whose GPU threads the text report lists (JSON carries every one)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def query_footer(result: FleetResult) -> str:
    """``12 rows from 3 node(s) in 41 ms``."""
    answered = len(result.answered)
    return f"{_plural(len(result.rows), 'row')} from {answered} node(s) in {result.elapsed_ms:.0f} ms"


def unanswered_lines(outcomes: Sequence[NodeOutcome]) -> list[str]:
    """One line per node that did not answer: ``gpu-node-04 (10.0.0.4:8080): timeout — no answer within 5s``."""
    return [f"{o.display}: {o.kind} — {o.reason}" for o in outcomes if not o.answered]


def folded_failure_lines(outcomes: Sequence[NodeOutcome], *, most: int = 6) -> list[str]:
    """Nodes that failed the same way on one line, like ``clush -b``, most common first:
    ``10.0.0.4:8080, 10.0.0.5:8080 and 3 more: refused — connection refused (...)``."""
    groups: dict[tuple[str, str], list[str]] = {}
    for o in outcomes:
        if not o.answered:
            groups.setdefault((str(o.kind), o.reason), []).append(o.display)
    lines = []
    for (kind, reason), names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
        lines.append(f"{shown}: {kind} — {reason}")
    return lines


def truncated_lines(outcomes: Sequence[NodeOutcome]) -> list[str]:
    return [
        f"{o.display}: rows capped ({o.reason}); raise --limit or narrow the query"
        for o in outcomes
        if o.answered and o.reason
    ]


def twin_warning(outcomes: Sequence[NodeOutcome]) -> str | None:
    """One line naming the instances that share a name, or None when there are none."""
    twins = [o for o in outcomes if o.twin and o.answered]
    if not twins:
        return None
    names = sorted({o.node or "" for o in twins})
    labels = ", ".join(o.label for o in sorted(twins, key=lambda o: (o.node or "", o.spec.addr)))
    return (
        f"{len(twins)} distinct agents answered with {len(names)} shared name(s) ({', '.join(names)}): all are kept, "
        f"as {labels} (give each agent its own --node or agent.node)"
    )


def skew_warnings(outcomes: Sequence[NodeOutcome], threshold_ms: float) -> list[str]:
    """``gpu-node-02 is ~47 ms ahead of this host (±1 ms); ...`` for every node past the threshold."""
    out = []
    for o in outcomes:
        line = skew_warning(o.label, o.skew, threshold_ms)
        if line:
            out.append(line)
    return out


def render_chains(fleet: FleetChains, *, verbose: bool = False) -> str:
    """The fleet diagnosis: every chain tagged with its node (as ``ingero explain`` prints chains),
    sorted by severity then node, then the straggler verdict."""
    from ingero.explain.render import render_chains as render_chain_list

    parts: list[str] = []
    n = len(fleet.answered)
    if fleet.chains:
        high = sum(1 for c in fleet.chains if c.severity == "HIGH")
        parts.append(
            f"FLEET DIAGNOSIS — {_plural(len(fleet.chains), 'causal chain')} across {n} node(s)"
            + (f", {high} HIGH" if high else "")
        )
        parts.append(render_chain_list(fleet.chains, verbose=verbose).rstrip())
    else:
        parts.append(f"FLEET DIAGNOSIS — no causal chains on any of {n} node(s)")
    ledger = ledger_lines(fleet.ledger)
    if ledger:
        parts.append("\n".join(ledger))
    parts.append(f"straggler: {fleet.verdict.line}")
    return "\n\n".join(parts)


def ledger_lines(rows: Sequence[dict[str, Any]], *, most_nodes: int = MAX_LEDGER_NODES) -> list[str]:
    """Where each node's GPU threads' wall time went: the node's name, then one line per GPU thread as
    ``ingero explain`` prints it (its formatter, over the agents' ledger rows). Past ``most_nodes``
    nodes, those whose threads spent the least of their time in GPU calls are shown."""
    from ingero.explain.ledger import LedgerRow
    from ingero.explain.render import ledger_lines as thread_lines

    by_node: dict[str, list[LedgerRow]] = {}
    for d in rows:
        r = LedgerRow.from_dict(d)
        by_node.setdefault(r.node, []).append(r)
    if not by_node:
        return []
    names = sorted(by_node)
    if len(names) > most_nodes:

        def gpu_share(node: str) -> float:
            return sum(r.gpu_ns for r in by_node[node]) / max(1, sum(r.wall_ns for r in by_node[node]))

        names = sorted(sorted(names, key=gpu_share)[:most_nodes])
    out = [f"WALL-TIME LEDGER — where each GPU thread's time went, on {_plural(len(names), 'node')}"]
    for node in names:
        out += [node, *thread_lines(by_node[node])]
    if len(by_node) > len(names):
        more = len(by_node) - len(names)
        out.append(f"... {_plural(more, 'more node')} with busier GPU threads (--json shows the whole ledger)")
    return out


class Progress:
    """``3/8 nodes done, 1 failed …`` redrawn in place on a terminal's stderr; silent elsewhere."""

    def __init__(self, total: int, stream: IO[str] | None = None, *, enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.done = 0
        self.failed = 0
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = is_tty if enabled is None else enabled
        self._drawn = False

    def __call__(self, outcome: NodeOutcome) -> None:
        self.done += 1
        if not outcome.answered:
            self.failed += 1
        if not self.enabled:
            return
        failed = f", {self.failed} failed" if self.failed else ""
        self.stream.write(f"\r\x1b[2Kingero: {self.done}/{self.total} nodes done{failed} …")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._drawn = False
