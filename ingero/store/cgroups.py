"""``cgroup_metadata``: what each cgroup id of ``events.cgroup_id`` is — container, pod, Slurm job.

Resolved by the tracer (:mod:`ingero.agent.trace.cgroups` reads /proc in its maintenance thread) and
written in its single writer's batches, never over a second connection; read by ``explain --per-cgroup`` and the noisy-neighbour chains.
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


INSERT_SQL = f"INSERT OR REPLACE INTO cgroup_metadata({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
CgroupRow = tuple[int, str, str, str, str, str, int]  # in COLUMNS order


def cgroup_rows(infos: list[CgroupInfo], *, seen_at: int | None = None) -> list[CgroupRow]:
    """``cgroup_metadata`` rows (the tracer hands them to its single writer's next batch)."""
    at = now_ns() if seen_at is None else seen_at
    return [(as_sqlite_int(r.cgroup_id), r.container_id, r.path, r.pod_name, r.namespace, r.job_id, at) for r in infos]


def write_cgroups(db: Path, rows: list[CgroupInfo], *, seen_at: int | None = None) -> None:
    """Write rows in a transaction of their own (a database no tracer is writing: tests, scenarios)."""
    with write_transaction(db) as conn:
        conn.executemany(INSERT_SQL, cgroup_rows(rows, seen_at=seen_at))


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


__all__ = ["COLUMNS", "INSERT_SQL", "CgroupInfo", "CgroupRow", "cgroup_labels", "cgroup_rows", "write_cgroups"]
