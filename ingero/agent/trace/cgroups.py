"""Containers, Kubernetes pods and Slurm jobs of the traced processes: ``cgroup_metadata`` rows.

Every event carries ``bpf_get_current_cgroup_id()`` — the id of the task's cgroup v2 (the kernfs
inode number of its directory in the cgroup2 mount, on a hybrid v1/v2 host too). For each cgroup id
the tracer first sees, :class:`CgroupTracker` reads one of its processes' ``/proc/<pid>/cgroup``
(the ``0::`` line) and environment, checks that the path still names that id (the process may have
moved) — or, once its processes are gone, finds the directory with that id in the cgroup2 tree
(no environment then) — and derives:

* ``container_id``: the 64-hex id of Docker / containerd / CRI-O / Podman scopes in the path;
* ``pod_name``: the Kubernetes pod (``HOSTNAME`` of a process with ``KUBERNETES_SERVICE_HOST`` set,
  else ``pod<uid>`` from a ``kubepods`` path) and ``namespace`` (``POD_NAMESPACE`` when the pod spec
  exports it);
* ``job_id``: the Slurm job (``SLURM_JOB_ID``, else ``job_<n>`` in a ``slurm`` path).

Rows are written in their own short transaction (like annotations: the tracer's writer lock is for
event writers only), only for new cgroups, from the tracer's maintenance task.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import numpy as np

from ingero.store import catalog
from ingero.store.cgroups import CgroupInfo, CgroupRow, cgroup_rows

PROC = Path("/proc")
MAX_ATTEMPTS = 8  # syncs (take) in which an unresolved cgroup id is tried before it is left unnamed
PIDS_PER_TRY = 4  # processes of one cgroup id tried per sync
MAX_WALK = 20_000  # cgroup directories looked at to find an id whose processes are gone
_HEX64 = re.compile(r"(?:^|[-/:_])([0-9a-f]{64})(?:\.scope)?$")
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_SLURM_JOB = re.compile(r"/job_(\d+)(?:/|$)")


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup`` or, hybrid, ``.../unified``)."""
    try:
        lines = (PROC / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return Path(left.split(" ")[4])
    return None


def cgroup_path(pid: int) -> str | None:
    """The cgroup v2 path of a process (the ``0::`` line of /proc/<pid>/cgroup); None once it is gone."""
    try:
        text = (PROC / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def cgroup_id_of(mount: Path, path: str) -> int | None:
    """The id BPF reports for the cgroup at ``path``: its directory's inode number."""
    try:
        return os.stat(mount / path.lstrip("/")).st_ino
    except OSError:
        return None


def find_cgroup_path(mount: Path, cgroup_id: int, *, limit: int = MAX_WALK) -> str | None:
    """The path of the cgroup whose id is ``cgroup_id``, by walking the cgroup2 tree (its processes
    are gone, the directory usually is not). Directory entries carry their inode: no stat per entry."""
    if cgroup_id == 1:
        return "/"
    stack, seen = [mount], 0
    while stack and seen < limit:
        top = stack.pop()
        try:
            with os.scandir(top) as it:
                for entry in it:
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    seen += 1
                    if entry.inode() == cgroup_id:
                        return "/" + str(Path(entry.path).relative_to(mount))
                    stack.append(Path(entry.path))
        except OSError:
            continue
    return None


def read_environ(pid: int) -> dict[str, str]:
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def describe(cgroup_id: int, path: str, env: dict[str, str]) -> CgroupInfo:
    """Container / pod / job of a cgroup path and one of its processes' environment."""
    container = ""
    for part in reversed(path.split("/")):
        m = _HEX64.search(part)
        if m:
            container = m.group(1)
            break
    pod, namespace = "", env.get("POD_NAMESPACE", "")
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("HOSTNAME"):
        pod = env["HOSTNAME"]
    else:
        m = _POD_UID.search(path)
        if m:
            pod = "pod" + m.group(1).replace("_", "-")
    job = env.get("SLURM_JOB_ID", "")
    if not job:
        m = _SLURM_JOB.search(path)
        if m and any(part == "slurm" or part.startswith("slurmstepd") for part in path.split("/")):
            job = m.group(1)
    return CgroupInfo(cgroup_id, path, container, pod, namespace if pod else "", job)


def resolve(pid: int, cgroup_id: int, mount: Path | None) -> CgroupInfo | None:
    """The cgroup of ``pid`` if it is still ``cgroup_id``; None when the process is gone or moved."""
    path = cgroup_path(pid)
    if path is None or mount is None or cgroup_id_of(mount, path) != cgroup_id:
        return None
    return describe(cgroup_id, path, read_environ(pid))


class CgroupTracker:
    """Sees drained events (any thread: only notes new cgroup ids), resolves each once on :meth:`take`
    / :meth:`flush` (the maintenance thread), writes rows on flush."""

    def __init__(self, mount: Path | None = None) -> None:
        self.mount = mount if mount is not None else cgroup2_mount()
        self._lock = threading.Lock()
        self._done: set[int] = set()
        self._attempts: dict[int, int] = {}
        self._pending: list[CgroupInfo] = []
        self._todo: dict[int, list[int]] = {}  # cgroup id -> a few of its processes, to resolve
        self.known: dict[int, CgroupInfo] = {}

    def on_events(self, ev: np.ndarray) -> None:
        """Note the cgroup ids not resolved yet, with a few of their processes (the drain calls this on
        the trio loop: no /proc reads here; :meth:`take` resolves, in the maintenance thread)."""
        if ev.size == 0:
            return
        ids = ev["cgroup_id"]
        first = int(ids[0])
        if first in self._done and bool((ids == first).all()):  # the common case: one known cgroup
            return
        real = (ids != 0) & (ev["op"] < catalog.NCCL_COMM_INIT_OP)  # control records carry other ids there
        fresh = [cid for cid in np.unique(ids[real]).tolist() if cid not in self._done]
        if not fresh:
            return
        with self._lock:
            for cid in fresh:
                pids = np.unique(ev["pid"][real & (ids == cid)])[:PIDS_PER_TRY].tolist()
                self._todo[int(cid)] = [int(p) for p in pids]

    def _resolve(self) -> None:
        """Name each noted cgroup id from its processes' /proc entries, else from its directory."""
        with self._lock:
            todo, self._todo = self._todo, {}
        for cid, pids in todo.items():
            info = None
            for pid in pids:
                info = resolve(pid, cid, self.mount) if pid > 0 else None
                if info is not None:
                    break
            if info is None and self.mount is not None:  # its processes are gone: find the directory
                path = find_cgroup_path(self.mount, cid)
                info = describe(cid, path, {}) if path is not None else None
            tries = self._attempts.get(cid, 0) + 1
            self._attempts[cid] = tries
            with self._lock:
                if info is None:
                    if tries >= MAX_ATTEMPTS:  # its processes are gone or moved: leave it unnamed
                        self._done.add(cid)
                    continue
                self._done.add(cid)
                self.known[cid] = info
                self._pending.append(info)

    def take(self) -> list[CgroupInfo]:
        """The cgroups resolved since the last take (resolving what was noted first: reads /proc)."""
        self._resolve()
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def rows(self) -> list[CgroupRow]:
        """The ``cgroup_metadata`` rows resolved since the last call, for the writer's next batch (the
        tracer's single writer: never a second connection to the database it is writing)."""
        return cgroup_rows(self.take())


__all__ = [
    "CgroupTracker",
    "cgroup2_mount",
    "cgroup_id_of",
    "cgroup_path",
    "describe",
    "find_cgroup_path",
    "read_environ",
    "resolve",
]
