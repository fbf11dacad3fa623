"""``explain --per-cgroup``: a per-process report's op tables and chains grouped by the container /
pod / Slurm job / cgroup of their process (see :mod:`ingero.explain.cgroups`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ingero.explain.engine import ExplainReport
from ingero.explain.model import Chain
from ingero.explain.render import render_chains
from ingero.explain.stats import OpStats
from ingero.store.cgroups import CgroupInfo
from ingero.timeutil import fmt_latency

NODE_WIDE = "node-wide (no single process)"


@dataclass
class CgroupGroup:
    label: str
    info: CgroupInfo | None
    pids: list[int] = field(default_factory=list)
    chains: list[Chain] = field(default_factory=list)
    ops: list[OpStats] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        i = self.info
        return {
            "label": self.label,
            "cgroup_id": i.cgroup_id if i else None,
            "path": i.path if i else "",
            "container_id": i.container_id if i else "",
            "pod": i.pod_name if i else "",
            "namespace": i.namespace if i else "",
            "job_id": i.job_id if i else "",
            "pids": self.pids,
            "chains": [c.as_dict() for c in self.chains],
            "ops": [o.as_dict() for o in self.ops],
        }


def group_by_cgroup(report: ExplainReport, by_pid: dict[int, CgroupInfo]) -> list[CgroupGroup]:
    """A per-process report's chains and op tables grouped by the cgroup of their process; chains of
    no single process (node-wide: OOM, retransmits, GPU contention) in their own group, last."""
    groups: dict[str, CgroupGroup] = {}

    def group_of(pid: int | None) -> CgroupGroup:
        info = by_pid.get(pid) if pid is not None else None
        label = info.label if info else (NODE_WIDE if pid is None else "cgroup unknown")
        return groups.setdefault(label, CgroupGroup(label, info))

    for o in report.ops:
        if o.pid is None:
            continue
        g = group_of(o.pid)
        g.ops.append(o)
        if o.pid not in g.pids:
            g.pids.append(o.pid)
    for c in report.chains:
        pid = c.evidence.get("pid")
        group_of(int(pid) if isinstance(pid, int) else None).chains.append(c)
    order = sorted(groups.values(), key=lambda g: (g.label == NODE_WIDE, g.label))
    for g in order:
        g.pids.sort()
    return order


def render_groups(groups: list[CgroupGroup], *, source: str = "") -> str:
    lines = [f"{source}: {len(groups)} group(s) by container / pod / Slurm job / cgroup", ""]
    for g in groups:
        head = g.label + (f" — pids {', '.join(str(p) for p in g.pids)}" if g.pids else "")
        lines.append(f"== {head}")
        for o in sorted(g.ops, key=lambda o: -o.total_ns)[:8]:
            lines.append(
                f"   pid {o.pid}  {o.name:<24} n={o.count:<8} p50 {fmt_latency(o.p50_ns):>10}  p99 {fmt_latency(o.p99_ns):>10}"
            )
        if g.chains:
            lines.append(render_chains(g.chains, verbose=False).rstrip("\n"))
        else:
            lines.append("   no causal chain")
        lines.append("")
    return "\n".join(lines)


__all__ = ["NODE_WIDE", "CgroupGroup", "group_by_cgroup", "render_groups"]
