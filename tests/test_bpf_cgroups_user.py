"""Real uprobes: events carry their cgroup v2 id and ``cgroup_metadata`` names two real cgroups made
here; ``--user`` traces a user's process started after the tracer and nothing of other users."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.agent.trace.cgroups import cgroup2_mount
from ingero.agent.trace.tracer import TraceReady
from ingero.identity import Identity
from tests.bpf_support import Built, build, record, trace_options

pytestmark = pytest.mark.bpf
NOBODY = 65534
GPU_SOURCES = (1, 4)  # CUDA runtime, driver


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("bpf-build"))


@pytest.fixture
def two_cgroups() -> Iterator[tuple[Path, Path]]:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 mount")
    top = mount / f"ingero-bpf-{uuid.uuid4().hex[:8]}"
    a = top / "slurmstepd.scope" / "job_5150"  # Slurm's cgroup v2 layout: the job id is in the path
    b = top / "other"
    made = [top, top / "slurmstepd.scope", a, b]
    try:
        for g in made:
            g.mkdir()
        yield a, b
    finally:
        for g in reversed(made):
            if g.exists():
                for pid in (g / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (mount / "cgroup.procs").write_text(pid)
                g.rmdir()


def _contention(built: Built, calls: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [str(built.workload), "contention", str(built.dir), "0", str(calls), "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"
    assert proc.wait(timeout=60) == 0


def test_events_carry_cgroup_ids_that_cgroup_metadata_names(
    built: Built, tmp_path: Path, two_cgroups: tuple[Path, Path]
) -> None:
    a, b = two_cgroups
    opts = trace_options(
        tmp_path / "cg.db",
        Identity("cg-node"),
        built.overrides(),
    )

    def action(_ready: TraceReady) -> list[int]:
        jobs = [_contention(built, 200), _contention(built, 300)]
        for job, group in zip(jobs, (a, b), strict=True):
            (group / "cgroup.procs").write_text(str(job.pid))  # before its first GPU call
        for job in jobs:
            _go(job)
        return [j.pid for j in jobs]

    _summary, pids = record(opts, action)
    ids = (a.stat().st_ino, b.stat().st_ino)
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as conn:
        by_pid = dict(
            conn.execute(
                f"SELECT pid, group_concat(DISTINCT cgroup_id) FROM events WHERE source IN {GPU_SOURCES} "
                "AND pid IN (?, ?) GROUP BY pid",
                pids,
            ).fetchall()
        )
        meta = {
            r[0]: r[1:]
            for r in conn.execute("SELECT cgroup_id, cgroup_path, job_id, container_id FROM cgroup_metadata")
        }
    assert by_pid == {pids[0]: str(ids[0]), pids[1]: str(ids[1])}
    rel = {g: "/" + str(g.relative_to(cgroup2_mount() or Path("/"))) for g in (a, b)}
    assert meta[ids[0]] == (rel[a], "5150", "")  # the jobs exited before the tracer looked: found by id
    assert meta[ids[1]] == (rel[b], "", "")


@pytest.fixture
def shared_build(built: Built) -> Iterator[Built]:
    """The fixture libraries and workload where another user can run them (pytest's tmp is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="ingero-user-"))
    try:
        d.chmod(0o755)
        for f in built.dir.iterdir():
            if f.is_file():
                shutil.copy2(f, d / f.name)
        yield Built(d, d / built.cudart.name, d / built.cuda.name, d / built.nccl.name, d / "workload", d / "cpu_hog")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_user_traces_a_process_of_that_user_started_later_and_no_other(shared_build: Built, tmp_path: Path) -> None:
    opts = trace_options(
        tmp_path / "user.db",
        Identity("user-node"),
        shared_build.overrides(),
        uids=[NOBODY],
    )
    loop = [str(shared_build.workload), "loop", str(shared_build.dir)]

    def action(_ready: TraceReady) -> tuple[int, int]:
        mine = subprocess.Popen([*loop, "333"], stdout=subprocess.DEVNULL)
        theirs = subprocess.Popen([*loop, "444"], stdout=subprocess.DEVNULL, user=NOBODY, group=NOBODY)
        assert mine.wait(timeout=60) == 0 and theirs.wait(timeout=60) == 0
        return mine.pid, theirs.pid

    summary, (mine, theirs) = record(opts, action)
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as conn:
        counted = dict(
            conn.execute(
                f"SELECT pid, sum(count) FROM event_aggregates WHERE source IN {GPU_SOURCES} GROUP BY pid"
            ).fetchall()
        )
        flags = conn.execute("SELECT flags FROM sessions").fetchone()[0]
    assert counted.get(theirs, 0) >= 444
    assert mine not in counted
    assert set(counted) == {theirs}
    assert f"users={NOBODY}" in flags
    assert summary.stats["events_dropped_ring"] == 0
