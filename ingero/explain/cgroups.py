"""Which container / pod / Slurm job each GPU process ran in (``events.cgroup_id`` named by
``cgroup_metadata``), and process names that carry it, so that a chain about another process on the
GPU (a noisy neighbour) names the other container, not only a pid. Grouping: :mod:`.per_cgroup`.
"""

from __future__ import annotations

import sqlite3

from ingero.store.catalog import GPU_API_SOURCES
from ingero.store.cgroups import CgroupInfo, cgroup_labels
from ingero.store.window import Window

_GPU_SQL = ", ".join(map(str, GPU_API_SOURCES))


def pid_cgroups(
    conn: sqlite3.Connection, window: Window | None = None, *, named_only: bool = False
) -> dict[int, CgroupInfo]:
    """GPU process -> its cgroup (the last one its GPU calls ran in within ``window``). With
    ``named_only``, only cgroups that are a container, a pod or a Slurm job (bare-metal databases
    then cost one small query)."""
    labels = cgroup_labels(conn)
    if named_only:
        labels = {k: v for k, v in labels.items() if v.container_id or v.pod_name or v.job_id}
    if not labels:
        return {}
    where, params = (window or Window()).clause("timestamp")
    marks = ",".join("?" * len(labels))
    try:
        rows = conn.execute(
            f"SELECT pid, cgroup_id, max(timestamp) FROM events WHERE cgroup_id IN ({marks}) "
            f"AND source IN ({_GPU_SQL}) AND {where} GROUP BY pid, cgroup_id",
            [*labels, *params],
        ).fetchall()
    except sqlite3.OperationalError:  # a database without events.cgroup_id
        return {}
    latest: dict[int, tuple[int, int]] = {}
    for pid, cid, ts in rows:
        if int(pid) not in latest or int(ts) > latest[int(pid)][1]:
            latest[int(pid)] = (int(cid), int(ts))
    return {pid: labels[cid] for pid, (cid, _ts) in latest.items()}


def with_cgroups(names: dict[int, str], by_pid: dict[int, CgroupInfo]) -> dict[int, str]:
    """Process names that carry their container / pod / job: ``python3, container 3f2a...``."""
    out = dict(names)
    for pid, info in by_pid.items():
        base = names.get(pid, "")
        out[pid] = f"{base}, {info.label}" if base else info.label
    return out


__all__ = ["pid_cgroups", "with_cgroups"]
