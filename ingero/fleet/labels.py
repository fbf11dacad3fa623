"""``explain --by KEY``, ``--annotation KEY=VALUE`` and ``--annotations`` over the fleet.

Each agent computes its own part where its data is, through ``GET /api/v1/chains``: ``by=KEY`` answers
its by-label ledger (:func:`ingero.explain.by_label.by_label`) alone, ``annotation=KEY=VALUE`` explains
that value's span(s) with the value's ledger line (``label``), ``annotations=1`` adds the window's label
summary (``labels``). The client merges per node, the ``node`` column first: one line per node and
label value for ``--by``, each node's span explained for ``--annotation``, each node's summary for
``--annotations``. A node that fails is its outcome, as everywhere in the fleet; an agent older than
these parameters refuses them (400) and is told apart in one line.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ingero.config import NodeSpec
from ingero.fleet.client import FleetClient, NodeClient, OutcomeCallback
from ingero.fleet.outcome import Kind, NodeFailure, NodeOutcome, Outcomes
from ingero.fleet.settings import ClientSettings

if TYPE_CHECKING:  # numpy and the explain engine load only where a ledger is read back
    from ingero.explain.by_label import ByLabel

CHAINS = "/api/v1/chains"
_REFUSED = 400  # what an agent answers to a parameter it does not know


def label_params(
    params: dict[str, str] | None, *, annotation: str | None = None, annotations: bool = False, by: str | None = None
) -> dict[str, str] | None:
    """The window parameters plus the label ones asked for (None when there are none at all); a key or
    selector no agent could take is refused here, in one line, before anything is sent."""
    from ingero.explain.by_label import check_key, parse_selector

    if by is not None:
        check_key(by)
    if annotation is not None:
        parse_selector(annotation)
    extra = {"by": by, "annotation": annotation, "annotations": "1" if annotations else None}
    out = {**(params or {}), **{k: v for k, v in extra.items() if v}}
    return out or None


def _flag(params: dict[str, str] | None) -> str | None:
    """The label flag these parameters carry (the one an older agent refuses), if any."""
    for name in ("by", "annotation", "annotations"):
        if params and name in params:
            return f"explain --{name}"
    return None


async def chains_with_labels(conn: NodeClient, params: dict[str, str] | None) -> dict[str, Any]:
    """``GET /chains`` with label parameters; an agent that refuses them is named as an older one."""
    try:
        return await conn.get(CHAINS, params)
    except NodeFailure as e:
        flag = _flag(params)
        if e.status != _REFUSED or flag is None:
            raise
        raise NodeFailure(
            Kind.SCHEMA,
            f"its agent cannot run {flag} (an older ingero: upgrade it, or run it on that node's database): {e.reason}",
            status=e.status,
            node=e.node,
        ) from None


async def label_job(
    conn: NodeClient,
    params: dict[str, str] | None,
    *,
    annotation: str | None,
    annotations: bool,
    missing: list[NodeSpec] | None = None,
) -> dict[str, Any]:
    """A fleet explain's ``/chains`` answer: with ``annotation``, the node's span explained (a node
    without that span fails with the agent's words, and is added to ``missing``); with ``annotations``,
    its label summary."""
    body = await chains_with_labels(conn, params)
    label = body.get("label")
    if annotation is not None and not (isinstance(label, dict) and isinstance(label.get("value"), dict)):
        if isinstance(label, dict) and label.get("missing"):
            if missing is not None:
                missing.append(conn.spec)
            raise NodeFailure(Kind.ERROR, str(label["missing"]), node=conn.node)
        raise NodeFailure(Kind.SCHEMA, "the /chains answer has no 'label' (the agent ignored annotation=)")
    if annotations and not isinstance(body.get("labels"), dict):
        raise NodeFailure(Kind.SCHEMA, "the /chains answer has no 'labels' (the agent ignored annotations=)")
    return body


def check_some_span(annotation: str | None, missing: list[NodeSpec], outcomes: Sequence[NodeOutcome]) -> None:
    """``--annotation`` that no node has a span of is the user's error (one line), not N node failures."""
    if annotation is not None and outcomes and len(missing) == len(outcomes):
        from ingero.errors import UsageError

        key = annotation.partition("=")[0].strip()
        raise UsageError(
            f"no span of {annotation} on any of the {len(outcomes)} node(s)",
            hint=f"list them: ingero explain --nodes ... --by {key}",
        )


def node_parts(outcomes: Sequence[NodeOutcome], name: str) -> dict[str, Any]:
    """Each answered node's ``label`` or ``labels`` part of its ``/chains`` answer, by node label."""
    out: dict[str, Any] = {}
    for o in outcomes:
        body = o.data.get("chains") if o.answered and isinstance(o.data, dict) else None
        if isinstance(body, dict) and isinstance(body.get(name), dict):
            out[o.label] = body[name]
    return out


@dataclass
class FleetByLabel(Outcomes):
    """``explain --by KEY --nodes``: every node's by-label ledger, merged with the node first."""

    key: str
    outcomes: list[NodeOutcome]
    by: dict[str, ByLabel] = field(default_factory=dict)  # node -> its values
    windows: dict[str, Any] = field(default_factory=dict)
    elapsed_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "values": [{"node": n, **v.as_dict()} for n, r in sorted(self.by.items()) for v in r.values],
            "by_node": {n: {"median_ns": r.median_ns, "notes": list(r.notes)} for n, r in sorted(self.by.items())},
            "answered": len(self.answered),
            "failed": len(self.failed),
            "elapsed_ms": round(self.elapsed_ms, 3),
            "nodes": [{**o.as_dict(), "window": self.windows.get(o.label)} for o in self.outcomes],
        }


async def fleet_by_label(
    nodes: Sequence[NodeSpec],
    settings: ClientSettings | None,
    key: str,
    *,
    params: dict[str, str] | None = None,
    node: str | None = None,
    client: FleetClient | None = None,
    on_outcome: OutcomeCallback | None = None,
) -> FleetByLabel:
    """``by=KEY`` on every node's ``/chains`` (``params``: the window); ``node`` keeps that node only."""
    from ingero.explain.by_label import ByLabel

    ask = label_params(params, by=key)

    async def job(conn: NodeClient) -> dict[str, Any]:
        body = await chains_with_labels(conn, ask)
        try:
            ByLabel.from_dict(body["by"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise NodeFailure(Kind.SCHEMA, "the /chains answer has no readable 'by' ledger") from None
        return body

    started = time.perf_counter()
    if client is not None:
        outcomes = await client.fan_out(job, on_outcome=on_outcome)
    else:
        async with FleetClient(nodes, settings) as fc:
            outcomes = await fc.fan_out(job, on_outcome=on_outcome)
    fleet = FleetByLabel(key, outcomes, elapsed_ms=(time.perf_counter() - started) * 1000)
    for o in outcomes:
        if o.answered and isinstance(o.data, dict) and (node is None or o.label == node):
            fleet.by[o.label] = ByLabel.from_dict(o.data["by"])
            fleet.windows[o.label] = o.data.get("window")
    return fleet


def by_label_sync(nodes: Sequence[NodeSpec], settings: ClientSettings | None, key: str, **kw: Any) -> FleetByLabel:
    return trio.run(partial(fleet_by_label, nodes, settings, key, **kw))


def render_by(fleet: FleetByLabel) -> str:
    """One line per node and value, the node first: 'gpu-b  step 12: 39.4 ms (4.2x the median) — ...'
    (each node's median is its own: a node is judged against its own steps)."""
    from ingero.explain.by_label import render_value

    rows = [(n, v) for n, r in sorted(fleet.by.items()) for v in r.values]
    width = max((len(n) for n in fleet.by), default=4)
    head = f"by {fleet.key} on {len(fleet.by)} node(s), {len(rows):,} value(s)"
    if rows:
        n, worst = max(rows, key=lambda nv: nv[1].median_ratio)
        head += f"; slowest: {fleet.key} {worst.value} on {n}, {worst.median_ratio:.1f}x its node's median"
    lines = [head + ":"]
    for n, r in sorted(fleet.by.items()):
        lines.append(f"  {n:<{width}}  median {_latency(r.median_ns)} over {len(r.values):,} value(s)")
        lines += [f"  {n:<{width}}  {msg}" for msg in r.notes]
        lines += [f"  {n:<{width}}  {render_value(fleet.key, v)}" for v in r.values]
    return "\n".join(lines) + "\n"


def render_label_lines(labels: dict[str, Any]) -> str:
    """``--annotation``: each node's ledger line of the value, the node first."""
    from ingero.explain.by_label import ValueLedger, render_value

    width = max((len(n) for n in labels), default=4)
    lines = [
        f"{n:<{width}}  {render_value(str(d['key']), ValueLedger.from_dict(d['value']))}"
        + (f" (pid {d['pid']})" if d.get("pid") is not None else "")
        for n, d in sorted(labels.items())
    ]
    return "\n".join(lines) + "\n" if lines else ""


def render_summaries(summaries: dict[str, Any]) -> str:
    """``--annotations``: each node's label summary under its name ('' when no node has labels)."""
    from ingero.store.annotation_join import render_label_summary

    parts = []
    for n, s in sorted(summaries.items()):
        text = render_label_summary(s)
        if text:
            parts.append(text.replace("\nlabels (", f"\n{n}: labels (", 1))
    return "".join(parts)


def label_doc(outcomes: Sequence[NodeOutcome], *, annotation: bool, annotations: bool) -> dict[str, Any]:
    """A fleet explain's ``--json`` additions: each node's ``label`` (``--annotation``) and ``labels``
    (``--annotations``), by node."""
    doc: dict[str, Any] = {}
    if annotation:
        doc["label"] = node_parts(outcomes, "label")
    if annotations:
        doc["labels"] = node_parts(outcomes, "labels")
    return doc


def label_text(outcomes: Sequence[NodeOutcome], diagnosis: str, *, annotation: bool, annotations: bool) -> str:
    """The fleet diagnosis with each node's value line on top (``--annotation``, as a local explain
    prints it) and each node's label summary after it (``--annotations``)."""
    parts = label_doc(outcomes, annotation=annotation, annotations=annotations)
    head = render_label_lines(parts["label"]) + "\n" if parts.get("label") else ""
    tail = render_summaries(parts["labels"]) if "labels" in parts else ""
    return head + diagnosis + (("\n" + tail.rstrip("\n")) if tail else "")


def _latency(ns: int) -> str:
    from ingero.timeutil import fmt_latency

    return fmt_latency(ns)


__all__ = [
    "FleetByLabel",
    "by_label_sync",
    "chains_with_labels",
    "check_some_span",
    "fleet_by_label",
    "label_doc",
    "label_job",
    "label_params",
    "label_text",
    "node_parts",
    "render_by",
    "render_label_lines",
    "render_summaries",
]
