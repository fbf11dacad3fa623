"""Merging the nodes' answers: query rows under a ``node`` column, causal chains across the fleet.

Rows: every answering node's result set must have the same columns; the reference is the column list
most nodes returned (ties: the first node by name), and a node that disagrees is reported as a
``schema`` outcome and skipped. The merged table's first column is ``node``, the agent's own identity
from its answer (not the address that was dialled; ``name@host:port`` for agents that share a name:
see :func:`ingero.fleet.client.flag_duplicates`). When the SQL itself selected a ``node`` column and
each node's values equal that node's identity (the usual ``SELECT node, ... GROUP BY node``), that
column is folded into the first one rather than repeated; when they differ (an agent serving a merged
multi-node database) it is kept, renamed ``db_node``.

Chains: every node's chains, tagged with their node, sorted by severity, then node, then most recent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ingero.fleet.outcome import Kind, NodeOutcome, Outcomes

if TYPE_CHECKING:  # imported where used: a fleet query needs neither the explain model nor numpy
    from ingero.explain.model import Chain
    from ingero.fleet.straggler import StragglerVerdict


def _order(outcomes: list[NodeOutcome]) -> list[NodeOutcome]:
    """Deterministic order for merged output: by node name, then address."""
    return sorted(outcomes, key=lambda o: (o.label, o.spec.host, o.spec.port))


@dataclass
class FleetResult(Outcomes):
    """A fleet query: merged rows plus every node's outcome."""

    columns: list[str]
    rows: list[list[Any]]
    outcomes: list[NodeOutcome]
    elapsed_ms: float = 0.0
    rows_by_node: dict[str, int] = field(default_factory=dict)

    @property
    def truncated(self) -> list[NodeOutcome]:
        return [o for o in self.outcomes if o.kind is Kind.TRUNCATED]

    def meta(self) -> dict[str, Any]:
        """Everything but columns/rows, for ``--json``."""
        nodes = []
        for o in self.outcomes:
            d = o.as_dict()
            d["rows"] = self.rows_by_node.get(o.label, 0) if o.answered else None
            nodes.append(d)
        return {
            "answered": len(self.answered),
            "failed": len(self.failed),
            "truncated": bool(self.truncated),
            "elapsed_ms": round(self.elapsed_ms, 3),
            "nodes": nodes,
        }


def _check_result(o: NodeOutcome) -> tuple[list[str], list[list[Any]]] | None:
    """Columns and rows of a /query answer, or None (the outcome becomes ``schema``)."""
    body = o.data
    cols = body.get("columns") if isinstance(body, dict) else None
    rows = body.get("rows") if isinstance(body, dict) else None
    if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols):
        o.kind, o.reason = Kind.SCHEMA, "the /query answer has no list of column names"
        return None
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == len(cols) for r in rows):
        o.kind, o.reason = Kind.SCHEMA, f"the /query answer's rows do not all have {len(cols)} values"
        return None
    return [str(c) for c in cols], rows


def merge_rows(outcomes: list[NodeOutcome], elapsed_ms: float = 0.0) -> FleetResult:
    """Merge /query answers (``outcome.data``) into one table; see the module docstring."""
    checked = [(o, r) for o in _order(outcomes) if o.answered and (r := _check_result(o)) is not None]
    if not checked:
        return FleetResult([], [], outcomes, elapsed_ms)
    counts = Counter(tuple(cols) for _, (cols, _) in checked)
    reference = max(counts, key=counts.__getitem__)  # ties: the first node's, in name order
    kept: list[tuple[NodeOutcome, list[list[Any]]]] = []
    for o, (cols, node_rows) in checked:
        if tuple(cols) == reference:
            kept.append((o, node_rows))
        else:
            o.kind = Kind.SCHEMA
            o.reason = f"columns ({', '.join(cols)}) differ from the other nodes' ({', '.join(reference)}); skipped"
            o.data = None

    columns = list(reference)
    node_idx = next((i for i, c in enumerate(columns) if c.lower() == "node"), None)
    fold_at: int | None = None  # the SQL's own node column, when it holds each agent's identity
    if node_idx is not None:
        if all(row[node_idx] in (o.label, o.node) for o, node_rows in kept for row in node_rows):
            fold_at = node_idx
            del columns[node_idx]
        else:
            columns[node_idx] = "db_node"

    rows: list[list[Any]] = []
    per_node: dict[str, int] = {}
    for o, node_rows in kept:
        per_node[o.label] = per_node.get(o.label, 0) + len(node_rows)
        if fold_at is None:
            rows.extend([o.label, *row] for row in node_rows)
        else:
            rows.extend([o.label, *row[:fold_at], *row[fold_at + 1 :]] for row in node_rows)
    return FleetResult(["node", *columns], rows, outcomes, elapsed_ms, per_node)


@dataclass
class FleetChains(Outcomes):
    """A fleet explain: every node's chains merged, and the straggler verdict."""

    chains: list[Chain]
    outcomes: list[NodeOutcome]
    verdict: StragglerVerdict
    windows: dict[str, Any] = field(default_factory=dict)  # node -> the window it used
    elapsed_ms: float = 0.0
    ledger: list[dict[str, Any]] = field(default_factory=list)  # every node's GPU-thread ledger rows
    notes: list[str] = field(default_factory=list)  # one line each, about the fleet's judgement (not a node's)

    def as_dict(self) -> dict[str, Any]:
        return {
            "chains": [c.as_dict() for c in self.chains],
            "notes": list(self.notes),
            "ledger": list(self.ledger),
            "straggler": self.verdict.as_dict(),
            "answered": len(self.answered),
            "failed": len(self.failed),
            "elapsed_ms": round(self.elapsed_ms, 3),
            "nodes": [{**o.as_dict(), "window": self.windows.get(o.label)} for o in self.outcomes],
        }


def _chains_of(o: NodeOutcome, key: str) -> list[Chain]:
    from ingero.explain.model import Chain

    body = o.data.get("chains") if isinstance(o.data, dict) else None
    raw = body.get(key) if isinstance(body, dict) else None
    chains: list[Chain] = []
    for d in raw if isinstance(raw, list) else []:
        if isinstance(d, dict):
            c = Chain.from_dict(d)
            # a twin's chains take its distinct label (name@host:port), like its rows
            c.node = o.label if not c.node or (o.twin and c.node == o.node) else c.node
            chains.append(c)
    return chains


def _readable_ledger_row(r: dict[str, Any]) -> bool:
    """Whether a node's ledger row reads back as a row (a malformed one is dropped, not fatal to the report)."""
    from ingero.explain.ledger import LedgerRow

    try:
        LedgerRow.from_dict(r)
    except (TypeError, ValueError, AttributeError):
        return False
    return True


def merge_chains(
    outcomes: list[NodeOutcome],
    elapsed_ms: float = 0.0,
    *,
    op: str | None = None,
    node: str | None = None,
    stored: bool = False,
) -> FleetChains:
    """Merge explain answers: ``outcome.data`` is ``{"chains": /chains body, "ops": /ops body}``.

    A node's computed chains are shown (every node runs the same explain engine); chains stored in
    its database (by the tracer or by Ingero) never stand in for them. ``stored`` shows only the
    stored chains, ``op`` only chains of that
    op, ``node`` only that node's chains (as ``ingero explain --chains/--op/--node`` does locally);
    the straggler verdict always compares every node that answered.
    """
    from ingero.explain.model import sort_chains
    from ingero.fleet.straggler import NodeFigures, verdict

    chains: list[Chain] = []
    figures: list[NodeFigures] = []
    windows: dict[str, Any] = {}
    ledger: list[dict[str, Any]] = []
    for o in _order(outcomes):
        if not o.answered or not isinstance(o.data, dict):
            continue
        # the same engine on every node: never fall back to chains stored in a database (Ingero's hold
        # hundreds of near-identical co-occurrence chains); stored chains only when asked (--chains)
        chains.extend(
            c
            for c in (_chains_of(o, "stored") if stored else _chains_of(o, "chains"))
            if (op is None or c.cuda_op == op) and (node is None or c.node == node)
        )
        ops = o.data.get("ops")
        if isinstance(ops, dict):
            figures.append(NodeFigures.from_ops_body(o.label, ops))
        body = o.data.get("chains")
        if isinstance(body, dict) and body.get("window") is not None:
            windows[o.label] = body.get("window")
        rows = body.get("ledger") if isinstance(body, dict) else None
        for r in rows if isinstance(rows, list) else []:  # node column filled as for chains
            if isinstance(r, dict) and (node is None or r.get("node") in (node, None)) and _readable_ledger_row(r):
                twin = not r.get("node") or (o.twin and r.get("node") == o.node)
                ledger.append({**r, "node": o.label if twin else r["node"]})
    return FleetChains(sort_chains(chains), outcomes, verdict(figures), windows, elapsed_ms, ledger)
