"""Causal chains as data: the shape every producer (rules, stored rows) and consumer (CLI, API,
fleet merge, Perfetto export, MCP) shares.

A chain mirrors a ``causal_chains`` row (Ingero's columns), with JSON columns decoded.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from ingero.store.window import Window
from ingero.store.writer import CHAIN_FIELDS

SEVERITIES = ("HIGH", "MEDIUM", "LOW")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
LAYERS = ("SYSTEM", "HOST", "IO", "NET", "CUDA", "DRIVER")


@dataclass
class TimelineEntry:
    layer: str  # one of LAYERS (stored Ingero chains may also say INFRA)
    op: str
    detail: str
    dur_us: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layer": self.layer, "op": self.op, "detail": self.detail}
        if self.dur_us is not None:
            d["dur_us"] = self.dur_us
        return d


@dataclass
class Chain:
    id: str  # "{node}:{descriptor}"
    node: str
    detected_at: int  # unix ns
    severity: str  # HIGH | MEDIUM | LOW
    summary: str
    root_cause: str
    explanation: str
    recommendations: list[str] = field(default_factory=list)
    cuda_op: str = ""
    cuda_p99_us: int = 0
    cuda_p50_us: int = 0
    tail_ratio: float = 0.0
    timeline: list[TimelineEntry] = field(default_factory=list)
    origin: str = "computed"  # "computed" by our rules | "stored" in the database
    family: str = ""  # cause family used for de-duplication (e.g. "tail/sched", "drop/io")
    evidence: dict[str, Any] = field(default_factory=dict)  # numbers behind the chain

    @property
    def severity_rank(self) -> int:
        return SEVERITY_RANK.get(self.severity, len(SEVERITIES))

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "detected_at": self.detected_at,
            "severity": self.severity,
            "summary": self.summary,
            "root_cause": self.root_cause,
            "explanation": self.explanation,
            "recommendations": list(self.recommendations),
            "cuda_op": self.cuda_op,
            "cuda_p99_us": self.cuda_p99_us,
            "cuda_p50_us": self.cuda_p50_us,
            "tail_ratio": self.tail_ratio,
            "timeline": [t.as_dict() for t in self.timeline],
            "origin": self.origin,
            "family": self.family,
            "evidence": self.evidence,
        }

    def as_row(self) -> dict[str, Any]:
        """The ``causal_chains`` columns (for StoreWriter.save_chains)."""
        d = self.as_dict()
        return {k: d[k] for k in CHAIN_FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Chain:
        """Inverse of as_dict (used by the fleet client on API responses)."""
        return cls(
            id=str(d.get("id", "")),
            node=str(d.get("node", "")),
            detected_at=int(d.get("detected_at") or 0),
            severity=str(d.get("severity", "LOW")),
            summary=str(d.get("summary", "")),
            root_cause=str(d.get("root_cause", "")),
            explanation=str(d.get("explanation", "")),
            recommendations=[str(r) for r in d.get("recommendations") or []],
            cuda_op=str(d.get("cuda_op", "")),
            cuda_p99_us=int(d.get("cuda_p99_us") or 0),
            cuda_p50_us=int(d.get("cuda_p50_us") or 0),
            tail_ratio=float(d.get("tail_ratio") or 0.0),
            timeline=[
                TimelineEntry(str(t.get("layer", "")), str(t.get("op", "")), str(t.get("detail", "")), t.get("dur_us"))
                for t in d.get("timeline") or []
                if isinstance(t, dict)
            ],
            origin=str(d.get("origin", "computed")),
            family=str(d.get("family", "")),
            evidence=dict(d.get("evidence") or {}),
        )


def _json_list(text: str | None) -> list[Any]:
    if not text:
        return []
    try:
        value = json.loads(text)
    except (ValueError, TypeError):
        return [text]
    return value if isinstance(value, list) else [value]


def stored_chains(conn: sqlite3.Connection, window: Window | None = None) -> list[Chain]:
    """Chains stored in the database's ``causal_chains`` table (by Ingero or ``ingero trace``)."""
    where, params = (window or Window()).clause("detected_at")
    try:
        cur = conn.execute(
            "SELECT id, detected_at, severity, summary, root_cause, explanation, recommendations, cuda_op, "
            f"cuda_p99_us, cuda_p50_us, tail_ratio, timeline, node FROM causal_chains WHERE {where} "
            "ORDER BY detected_at",
            params,
        )
    except sqlite3.OperationalError:
        return []
    chains: list[Chain] = []
    for cid, det, sev, summ, root, expl, recs, op, p99, p50, ratio, tl, node in cur:
        node = node or (cid.split(":", 1)[0] if ":" in (cid or "") else "")
        chains.append(
            Chain(
                id=cid,
                node=node,
                detected_at=int(det or 0),
                severity=str(sev or "LOW").upper(),
                summary=summ or "",
                root_cause=root or "",
                explanation=expl or "",
                recommendations=[str(r) for r in _json_list(recs)],
                cuda_op=op or "",
                cuda_p99_us=int(p99 or 0),
                cuda_p50_us=int(p50 or 0),
                tail_ratio=float(ratio or 0.0),
                timeline=[
                    TimelineEntry(
                        str(t.get("layer", "")),
                        str(t.get("op", "")),
                        str(t.get("detail", "")),
                        t.get("dur_us"),
                    )
                    for t in _json_list(tl)
                    if isinstance(t, dict)
                ],
                origin="stored",
                family="stored",
            )
        )
    return chains


def sort_chains(chains: list[Chain]) -> list[Chain]:
    """Severity first (HIGH → LOW), then node, then most recent first."""
    return sorted(chains, key=lambda c: (c.severity_rank, c.node, -c.detected_at))
