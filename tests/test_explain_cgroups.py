"""explain by container: a noisy neighbour names the other container; --per-cgroup groups by it."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from ingero.agent.trace.cgroups import describe
from ingero.cli.main import main
from ingero.store.cgroups import CgroupInfo, write_cgroups
from tests.conftest import SharedDbs
from tests.test_explain_rules import gpu_shared_by_eval, only, report_of

TRAIN = describe(4101, "/kubepods/burstable/pod1b2c3d4e-aaaa-bbbb-cccc-0123456789ab/" + "a" * 64, {})
EVAL = describe(4202, "/system.slice/docker-" + "b" * 64 + ".scope", {})
JOB = describe(4303, "/system.slice/slurmstepd.scope/job_77/step_0", {})


@pytest.fixture
def shared_gpu(shared_dbs: SharedDbs) -> Path:
    """Three containers' processes on a node's GPUs, the eval job sharing the trainer's (built once)."""

    def write(d: Path) -> Path:
        db = gpu_shared_by_eval(d / "g.db")
        conn = sqlite3.connect(db)
        try:  # closed here: a connection left open keeps a -wal beside the database
            with conn:
                for pid, info in ((100, TRAIN), (200, EVAL), (300, JOB)):
                    conn.execute("UPDATE events SET cgroup_id = ? WHERE pid = ?", (info.cgroup_id, pid))
        finally:
            conn.close()
        write_cgroups(db, [TRAIN, EVAL, JOB])
        return db

    return shared_dbs.get("cgroups-shared-gpu", write)


def test_noisy_neighbour_chain_names_the_other_container(shared_gpu: Path) -> None:
    c = only(report_of(shared_gpu), "gpu-contention")
    assert c.evidence["intruder"] == 200
    assert f"pid 200 (python3 eval.py, container {'b' * 12})" in c.summary
    assert "pid 100 (python3 train.py, pod pod1b2c3d4e-aaaa-bbbb-cccc-0123456789ab)" in c.root_cause  # the victim's


def test_bare_metal_names_stay_plain(tmp_path: Path) -> None:
    gpu_shared_by_eval(tmp_path / "b.db", other_gpu=False)
    write_cgroups(tmp_path / "b.db", [CgroupInfo(1, "/")])  # a path only: no container to name
    c = only(report_of(tmp_path / "b.db"), "gpu-contention")
    assert "pid 200 (python3 eval.py)" in c.summary


def test_per_cgroup_groups_chains_and_ops(shared_gpu: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--db", str(shared_gpu), "--per-cgroup", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    groups = {g["label"]: g for g in doc["groups"]}
    pod = "pod pod1b2c3d4e-aaaa-bbbb-cccc-0123456789ab"
    assert set(groups) >= {pod, f"container {'b' * 12}", "slurm job 77"}
    assert groups[pod]["pids"] == [100] and groups["slurm job 77"]["pids"] == [300]
    assert groups[pod]["container_id"] == "a" * 64 and groups["slurm job 77"]["job_id"] == "77"
    assert {o["pid"] for o in groups[f"container {'b' * 12}"]["ops"]} == {200}
    chain_groups = {label for label, g in groups.items() for c in g["chains"] if c["family"] == "gpu-contention"}
    assert len(chain_groups) == 1
    assert main(["explain", "--db", str(shared_gpu), "--per-cgroup"]) == 0
    text = capsys.readouterr().out
    assert f"== {pod} — pids 100" in text and "== slurm job 77 — pids 300" in text
    with pytest.raises(SystemExit) as exit_info:  # one grouping at a time
        main(["explain", "--db", str(shared_gpu), "--per-cgroup", "--per-process"])
    assert exit_info.value.code == 2
