"""cgroup id -> container / pod / Slurm job: path parsing, the cgroup2 mount, and a real cgroup v2 group
created here (root) with a real process moved into it."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ingero.agent.trace.cgroups import (
    CgroupTracker,
    cgroup2_mount,
    cgroup_id_of,
    cgroup_path,
    describe,
    find_cgroup_path,
    resolve,
)
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.identity import Identity
from ingero.store.cgroups import CgroupInfo, cgroup_labels
from ingero.store.writer import StoreWriter

DOCKER = "a" * 64
CRIO = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("path", "env", "expected"),
    [
        (f"/system.slice/docker-{DOCKER}.scope", {}, (DOCKER, "", "", "", f"container {DOCKER[:12]}")),
        (f"/docker/{DOCKER}", {}, (DOCKER, "", "", "", f"container {DOCKER[:12]}")),
        (
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_aaaa_bbbb_cccc_0123456789ab.slice"
            f"/crio-{CRIO}.scope",
            {},
            (CRIO, "pod1b2c3d4e-aaaa-bbbb-cccc-0123456789ab", "", "", "pod pod1b2c3d4e-aaaa-bbbb-cccc-0123456789ab"),
        ),
        (
            f"/kubepods/burstable/pod1b2c3d4e-aaaa-bbbb-cccc-0123456789ab/{DOCKER}",
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "trainer-0", "POD_NAMESPACE": "ml"},
            (DOCKER, "trainer-0", "ml", "", "pod ml/trainer-0"),
        ),
        ("/slurm/uid_1000/job_4242/step_0/user/task_0", {}, ("", "", "", "4242", "slurm job 4242")),
        ("/system.slice/slurmstepd.scope/job_31/step_batch/user/task_0", {}, ("", "", "", "31", "slurm job 31")),
        ("/user.slice/user-1000.slice/session-3.scope", {"SLURM_JOB_ID": "77"}, ("", "", "", "77", "slurm job 77")),
        (
            "/user.slice/user-1000.slice/session-3.scope",
            {},
            ("", "", "", "", "cgroup /user.slice/user-1000.slice/session-3.scope"),
        ),
        ("/job_12/not-slurm", {}, ("", "", "", "", "cgroup /job_12/not-slurm")),
    ],
)
def test_describe(path: str, env: dict[str, str], expected: tuple[str, str, str, str, str]) -> None:
    info = describe(7, path, env)
    assert (info.container_id, info.pod_name, info.namespace, info.job_id, info.label) == expected


def test_own_cgroup_resolves_to_the_id_bpf_reports() -> None:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 mount")
    path = cgroup_path(os.getpid())
    assert path is not None and path.startswith("/")
    cid = cgroup_id_of(mount, path)
    assert cid is not None and cid > 0
    info = resolve(os.getpid(), cid, mount)
    assert info is not None and info.path == path
    assert resolve(os.getpid(), cid + 12345, mount) is None  # moved/other id: not claimed


@pytest.fixture
def two_cgroups() -> Iterator[tuple[Path, Path]]:
    mount = cgroup2_mount()
    if mount is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup2 mount")
    tag = uuid.uuid4().hex[:8]
    groups = [mount / f"ingero-test-{tag}-a", mount / f"ingero-test-{tag}-b"]
    try:
        for g in groups:
            g.mkdir()
        yield groups[0], groups[1]
    finally:
        for g in groups:
            if g.exists():
                for pid in (g / "cgroup.procs").read_text().split():  # back to the root group
                    with contextlib.suppress(OSError):
                        (mount / "cgroup.procs").write_text(pid)
                g.rmdir()


def _sleeper_in(group: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    code = "import sys; sys.stdin.readline()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True, env={**os.environ, **env})
    (group / "cgroup.procs").write_text(str(proc.pid))
    return proc


def test_tracker_names_two_real_cgroups_and_writes_them(two_cgroups: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = two_cgroups
    procs = [_sleeper_in(a, {"SLURM_JOB_ID": "9001"}), _sleeper_in(b, {})]
    try:
        ids = [a.stat().st_ino, b.stat().st_ino]
        ev = np.zeros(6, dtype=EVENT_DTYPE)
        ev["pid"] = [procs[0].pid, procs[1].pid, procs[0].pid, procs[1].pid, procs[0].pid, 0]
        ev["cgroup_id"] = [ids[0], ids[1], ids[0], ids[1], ids[0], 0]
        ev["source"], ev["op"] = 1, 1
        tracker = CgroupTracker()
        tracker.on_events(ev)
        db = tmp_path / "cg.db"
        with StoreWriter(db, Identity("n")) as w:  # the tracer's one writer takes them in its batch
            rows = tracker.rows()
            assert len(rows) == 2
            w.write_batch(cgroups=rows)
            tracker.on_events(ev)  # known ids: nothing new
            assert tracker.rows() == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
    with sqlite3.connect(db) as conn:
        labels = cgroup_labels(conn)
    assert labels[ids[0]] == CgroupInfo(ids[0], "/" + a.name, job_id="9001")
    assert labels[ids[1]] == CgroupInfo(ids[1], "/" + b.name)
    assert labels[ids[0]].label == "slurm job 9001" and labels[ids[1]].label == f"cgroup /{b.name}"


def test_unresolvable_ids_are_left_unnamed_not_guessed(tmp_path: Path) -> None:
    ev = np.zeros(1, dtype=EVENT_DTYPE)
    ev["pid"], ev["cgroup_id"], ev["source"], ev["op"] = os.getpid(), 987654321, 1, 1
    tracker = CgroupTracker()
    for _ in range(10):
        tracker.on_events(ev)
    assert tracker.take() == [] and tracker.known == {}


def test_a_cgroup_whose_processes_are_gone_is_found_by_its_id(two_cgroups: tuple[Path, Path], tmp_path: Path) -> None:
    a, _b = two_cgroups
    proc = _sleeper_in(a, {"SLURM_JOB_ID": "1"})
    proc.kill()
    proc.wait()
    mount = cgroup2_mount()
    assert mount is not None
    assert find_cgroup_path(mount, a.stat().st_ino) == "/" + a.name
    assert find_cgroup_path(mount, 1) == "/"
    ev = np.zeros(1, dtype=EVENT_DTYPE)
    ev["pid"], ev["cgroup_id"], ev["source"], ev["op"] = proc.pid, a.stat().st_ino, 1, 1
    tracker = CgroupTracker()
    tracker.on_events(ev)
    assert tracker.take() == [CgroupInfo(a.stat().st_ino, "/" + a.name)]  # no environment: no job id
