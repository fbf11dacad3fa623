"""``cgroup_metadata``: what each cgroup id of ``events.cgroup_id`` is — container, pod, Slurm job.

Written by the tracer (:mod:`ingero.agent.trace.cgroups` resolves the ids from /proc) in its own short
transaction; read by ``explain --per-cgroup`` and the noisy-neighbour chains.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ingero.store.catalog import as_sqlite_int
from ingero.store.db import write_transaction
from ingero.timeutil import now_ns

COLUMNS = ("cgroup_id", "container_id", "cgroup_path", "pod_name", "namespace", "job_id", "seen_at")


@dataclass(frozen=True)
class CgroupInfo:
    cgroup_id: int
    path: str  # cgroup v2 path ("/" for the root)
    container_id: str = ""
    pod_name: str = ""
    namespace: str = ""
    job_id: str = ""

    @property
    def label(self) -> str:
        """What a person calls it: the pod, the container, the Slurm job, else the cgroup path."""
        if self.pod_name:
            return f"pod {self.namespace}/{self.pod_name}" if self.namespace else f"pod {self.pod_name}"
        if self.container_id:
            return f"container {self.container_id[:12]}"
        if self.job_id:
            return f"slurm job {self.job_id}"
        return f"cgroup {self.path}"


def write_cgroups(db: Path, rows: list[CgroupInfo], *, seen_at: int | None = None) -> None:
    at = now_ns() if seen_at is None else seen_at
    with write_transaction(db) as conn:
        conn.executemany(
            f"INSERT OR REPLACE INTO cgroup_metadata({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
            [(as_sqlite_int(r.cgroup_id), r.container_id, r.path, r.pod_name, r.namespace, r.job_id, at) for r in rows],
        )


def cgroup_labels(conn: sqlite3.Connection) -> dict[int, CgroupInfo]:
    """cgroup id -> what it is, from ``cgroup_metadata`` ({} when the table or its columns are missing)."""
    try:
        rows = conn.execute(
            "SELECT cgroup_id, cgroup_path, container_id, pod_name, namespace, job_id FROM cgroup_metadata"
        ).fetchall()
    except sqlite3.OperationalError:
        try:
            rows = [
                (*r, "")
                for r in conn.execute(
                    "SELECT cgroup_id, cgroup_path, container_id, pod_name, namespace FROM cgroup_metadata"
                )
            ]
        except sqlite3.OperationalError:
            return {}
    return {int(r[0]): CgroupInfo(int(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5])) for r in rows}


__all__ = ["COLUMNS", "CgroupInfo", "cgroup_labels", "write_cgroups"]
