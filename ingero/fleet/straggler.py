"""The straggler verdict: which node is unlike its peers.

When the nodes recorded NCCL collectives, the verdict is the collectives join's
(:mod:`ingero.fleet.collectives`: the rank that arrives last, by how much, and what it cost the
others) — :func:`with_collectives`. Otherwise it comes from every node's ``/api/v1/ops`` figures:

Each node contributes a :class:`NodeFigures` (host-event count and mean latency, off-CPU and block-I/O
time, GPU-API mean latency, p99 per GPU op). For every metric, a robust z-score is computed across
the nodes with numpy — ``z = 0.6745 · (x − median) / MAD`` — which a single outlier cannot drag the
way it drags a mean and a standard deviation. A node is flagged on a metric when its z-score reaches
the threshold (3.5, Iglewicz & Hoaglin) *and* its value is at least ``min_ratio`` times the median of
its peers, its distance from them exceeds their own spread (max − min) and an absolute floor (1 ms,
100 events), so that low-value noise between near-identical nodes never makes a verdict. Lows are
reported as well as highs (``also unusual``), but only a high — more host events, slower calls —
names the outlier. With two nodes there is no median to speak of: the verdict then needs a 3x ratio.
The headline reads::

    gpu-node-01 is the outlier: 847 host events at 18.4 ms avg vs peers ~2 ms
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingero.fleet.collective_model import CollectiveVerdict
from ingero.fleet.outliers import Z_THRESHOLD, robust_z

MIN_RATIO = 2.0
TWO_NODE_RATIO = 3.0
_GPU_SOURCES = frozenset({"CUDA", "DRIVER", "NCCL"})
COUNT_FLOOR = 100.0  # events: smaller differences are noise
MS_FLOOR = 1.0  # milliseconds: smaller differences are noise
_COUNT_METRICS = frozenset({"host_events", "gpu_api_calls"})


@dataclass(frozen=True)
class NodeFigures:
    """One node's numbers, as the agent's ``/ops`` endpoint reports them."""

    node: str
    host_events: int = 0
    host_avg_ms: float = 0.0
    offcpu_ms: float = 0.0
    block_io_ms: float = 0.0
    gpu_api_calls: int = 0
    gpu_api_avg_ms: float = 0.0
    op_p99_ms: dict[str, float] = field(default_factory=dict)  # GPU ops only: "cuLaunchKernel" -> p99 ms

    @classmethod
    def from_ops_body(cls, node: str, body: dict[str, Any]) -> NodeFigures:
        host = body.get("host") if isinstance(body.get("host"), dict) else {}
        assert isinstance(host, dict)
        p99: dict[str, float] = {}
        for op in body.get("ops") or []:
            if isinstance(op, dict) and op.get("source") in _GPU_SOURCES and op.get("count"):
                p99[str(op.get("op"))] = _num(op.get("p99_us")) / 1000
        return cls(
            node=node,
            host_events=int(_num(host.get("host_events"))),
            host_avg_ms=_num(host.get("host_avg_ms")),
            offcpu_ms=_num(host.get("offcpu_ms")),
            block_io_ms=_num(host.get("block_io_ms")),
            gpu_api_calls=int(_num(host.get("gpu_api_calls"))),
            gpu_api_avg_ms=_num(host.get("gpu_api_avg_ms")),
            op_p99_ms=p99,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "host_events": self.host_events,
            "host_avg_ms": round(self.host_avg_ms, 4),
            "offcpu_ms": round(self.offcpu_ms, 3),
            "block_io_ms": round(self.block_io_ms, 3),
            "gpu_api_calls": self.gpu_api_calls,
            "gpu_api_avg_ms": round(self.gpu_api_avg_ms, 4),
            "op_p99_ms": {k: round(v, 4) for k, v in sorted(self.op_p99_ms.items())},
        }


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return 0.0
    return float(v)


@dataclass(frozen=True)
class Finding:
    """One node standing out on one metric."""

    node: str
    metric: str  # "host_events", "host_avg_ms", ..., "p99:cuLaunchKernel"
    value: float
    peers: float  # median of the other nodes
    z: float  # robust z-score (inf when all peers are identical)
    ratio: float  # value / peers
    direction: str = "high"  # "high" | "low"

    def phrase(self) -> str:
        name = _METRIC_WORDS.get(self.metric)
        if self.metric.startswith("p99:"):
            name = f"{self.metric[4:]} p99"
        if self.metric in {"host_events", "gpu_api_calls"}:
            return f"{_count(self.value)} {name} vs peers ~{_count(self.peers)}"
        return f"{name} {_ms(self.value)} vs peers ~{_ms(self.peers)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "metric": self.metric,
            "value": round(self.value, 4),
            "peers_median": round(self.peers, 4),
            "z": None if math.isinf(self.z) else round(self.z, 2),
            "ratio": None if math.isinf(self.ratio) else round(self.ratio, 2),
            "direction": self.direction,
        }


_METRIC_WORDS = {
    "host_events": "host events",
    "host_avg_ms": "host-event latency",
    "offcpu_ms": "off-CPU time",
    "block_io_ms": "block I/O time",
    "gpu_api_calls": "GPU API calls",
    "gpu_api_avg_ms": "GPU API latency",
}


@dataclass
class StragglerVerdict:
    outlier: str | None  # the node, or None when nobody stands out (or too few nodes)
    line: str  # one line for humans
    nodes: int  # nodes with figures
    findings: list[Finding] = field(default_factory=list)  # every (node, metric) past the threshold
    scores: dict[str, float] = field(default_factory=dict)  # node -> its strongest qualifying z
    figures: list[NodeFigures] = field(default_factory=list)
    collectives: CollectiveVerdict | None = None  # the collectives join, when the nodes recorded NCCL calls

    @property
    def source(self) -> str:
        """What the verdict rests on: ``collectives`` or ``host`` (per-node figures)."""
        return "collectives" if self.collectives is not None else "host"

    @property
    def others(self) -> list[str]:
        """Further nodes that stand out too (after the headline outlier)."""
        seen = {self.outlier}
        out: list[str] = []
        for f in sorted(self.findings, key=lambda f: -self.scores.get(f.node, 0)):
            if f.node not in seen:
                seen.add(f.node)
                out.append(f.node)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "outlier": self.outlier,
            "line": self.line,
            "nodes": self.nodes,
            "others": self.others,
            "findings": [f.as_dict() for f in self.findings],
            "scores": {k: (None if math.isinf(v) else round(v, 2)) for k, v in self.scores.items()},
            "figures": [f.as_dict() for f in self.figures],
            "source": self.source,
            "collectives": self.collectives.as_dict() if self.collectives is not None else None,
        }


def _metrics(figs: Sequence[NodeFigures]) -> dict[str, dict[str, float]]:
    """metric -> {node: value}, only where a node has the figure."""
    out: dict[str, dict[str, float]] = {}
    for name in ("host_events", "host_avg_ms", "offcpu_ms", "block_io_ms"):
        out[name] = {f.node: float(getattr(f, name)) for f in figs}
    out["gpu_api_avg_ms"] = {f.node: f.gpu_api_avg_ms for f in figs if f.gpu_api_calls > 0}
    ops = sorted({op for f in figs for op in f.op_p99_ms})
    for op in ops:
        out[f"p99:{op}"] = {f.node: f.op_p99_ms[op] for f in figs if op in f.op_p99_ms}
    return out


def verdict(
    figs: Sequence[NodeFigures],
    *,
    z_threshold: float = Z_THRESHOLD,
    min_ratio: float = MIN_RATIO,
) -> StragglerVerdict:
    """Compute the straggler verdict across nodes (see the module docstring)."""
    figs = list(figs)
    n = len(figs)
    if n < 2:
        return StragglerVerdict(
            None, f"no straggler verdict: it needs at least 2 nodes ({n} answered)", n, figures=figs
        )
    findings: list[Finding] = []
    for metric, by_node in _metrics(figs).items():
        if len(by_node) < 2:
            continue
        names = list(by_node)
        vals = np.array([by_node[k] for k in names], dtype=np.float64)
        z = robust_z(vals) if len(names) >= 3 else np.zeros(len(names))
        floor = COUNT_FLOOR if metric in _COUNT_METRICS else MS_FLOOR
        for i, node in enumerate(names):
            others = np.delete(vals, i)
            peers = float(np.median(others))
            value = float(vals[i])
            spread = float(others.max() - others.min())
            if abs(value - peers) <= max(spread, floor):
                continue  # within what the peers differ among themselves, or too small to matter
            ratio = value / peers if peers > 0 else math.inf
            if len(names) >= 3:
                if z[i] >= z_threshold and ratio >= min_ratio:
                    findings.append(Finding(node, metric, value, peers, float(z[i]), ratio))
                elif z[i] <= -z_threshold and value * min_ratio <= peers:
                    findings.append(Finding(node, metric, value, peers, float(z[i]), ratio, "low"))
            elif value > 0 and ratio >= max(min_ratio, TWO_NODE_RATIO):
                findings.append(Finding(node, metric, value, peers, math.inf, ratio))
    scores: dict[str, float] = {}
    for f in findings:
        # Rank nodes by how many metrics single them out, then by their strongest z-score.
        scores[f.node] = max(scores.get(f.node, 0.0), abs(f.z))
    highs = [f for f in findings if f.direction == "high"]
    if not highs:
        v = StragglerVerdict(None, _alike_line(figs), n, findings, scores, figs)
        if findings:
            v.line += "; also unusual: " + ", ".join(_low_notes(findings))
        return v
    findings = [*highs, *(f for f in findings if f.direction == "low")]
    count = {node: sum(1 for f in highs if f.node == node) for node in scores}
    outlier = max({f.node for f in highs}, key=lambda k: (count[k], _finite(scores[k]), k))
    fig = next(f for f in figs if f.node == outlier)
    line = _outlier_line(fig, figs, [f for f in highs if f.node == outlier])
    findings.sort(key=lambda f: (f.node != outlier, -count[f.node], f.node, -_finite(f.z)))
    v = StragglerVerdict(outlier, line, n, findings, scores, figs)
    if v.others:
        v.line += "; also unusual: " + ", ".join(v.others)
    return v


def _low_notes(findings: Sequence[Finding]) -> list[str]:
    return [f"{f.node} (low: {f.phrase()})" for f in findings if f.direction == "low"]


def with_collectives(v: StragglerVerdict, cv: CollectiveVerdict | None) -> StragglerVerdict:
    """The collectives verdict replaces the host-figures one wherever the nodes recorded collectives:
    a rank that waits is not slow, the one that arrives last is."""
    if cv is None or cv.kind == "no-collectives":
        return v
    v.collectives = cv
    v.outlier = cv.outlier
    v.line = cv.line
    return v


def _finite(z: float) -> float:
    return 1e300 if math.isinf(z) else z


def _outlier_line(fig: NodeFigures, figs: Sequence[NodeFigures], mine: list[Finding]) -> str:
    peers = [f for f in figs if f.node != fig.node]
    peer_avg = float(np.median([f.host_avg_ms for f in peers]))
    parts = [f"{_count(fig.host_events)} host events at {_ms(fig.host_avg_ms)} avg vs peers ~{_ms(peer_avg)}"]
    host_metrics = {"host_events", "host_avg_ms"}
    if not any(f.metric in host_metrics for f in mine):
        # The host figures are context; the finding that made the verdict goes first.
        strongest = max(mine, key=lambda f: (_finite(f.z), f.ratio))
        parts.insert(0, strongest.phrase())
    else:
        rest = [f for f in mine if f.metric not in host_metrics and f.metric.startswith("p99:")]
        if rest:
            parts.append(max(rest, key=lambda f: (_finite(f.z), f.ratio)).phrase())
    return f"{fig.node} is the outlier: " + "; ".join(parts)


def _alike_line(figs: Sequence[NodeFigures]) -> str:
    ev = [f.host_events for f in figs]
    avg = [f.host_avg_ms for f in figs]
    return (
        f"no straggler: the {len(figs)} nodes look alike "
        f"({_count(min(ev))}–{_count(max(ev))} host events at {_ms(min(avg))}–{_ms(max(avg))} avg)"
    )


def _count(v: float) -> str:
    return f"{round(v):,}"


def _ms(ms: float) -> str:
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.1f}".removesuffix(".0") + " ms"
    if ms >= 0.01:
        return f"{ms * 1000:.0f} µs"
    return f"{ms * 1000:.1f} µs" if ms > 0 else "0 ms"
