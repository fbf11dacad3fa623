"""``ingero check`` and ``ingero trace``'s refusals: as root, as an unprivileged user, without bcc."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ingero.agent.trace import check
from ingero.cli.main import main

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="drops from root to nobody")
HIDE_BCC = (
    "import sys; sys.modules['bcc'] = None; from ingero.cli.main import main; raise SystemExit(main(sys.argv[1:]))"
)


def _ingero(*args: str, prefix: list[str] | None = None, code: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [*(prefix or []), sys.executable, *(["-c", code] if code else ["-m", "ingero"]), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")


def test_check_results_have_fixes_for_every_failure() -> None:
    results = check.run_checks()
    names = [r.name for r in results]
    for expected in ("kernel", "BTF", "kernel headers", "uprobes", "bcc", "privileges", "GPU / driver"):
        assert expected in names
    assert any(n.startswith("CUDA runtime") for n in names)
    for r in results:
        assert r.detail
        if not r.ok:
            assert r.fix, r


def test_ready_needs_every_required_check_and_no_optional_one() -> None:
    fine = check.CheckResult("kernel", True, "6.18")
    no_gpu = check.CheckResult("GPU / driver", False, "no NVIDIA driver", "install it", required=False)
    no_bcc = check.CheckResult("bcc", False, "not importable", "apt install python3-bpfcc")
    assert check.ready([fine, no_gpu])
    assert not check.ready([fine, no_gpu, no_bcc])
    assert not check.ready([no_bcc])


@pytest.mark.skipif(
    os.geteuid() != 0 or importlib.util.find_spec("bcc") is None, reason="needs root and bcc (CI's machine has both)"
)
def test_a_root_machine_with_bcc_is_ready() -> None:
    results = check.run_checks()
    assert check.ready(results), [(r.name, r.detail) for r in results if r.required and not r.ok]


def test_kernel_version_parsing() -> None:
    assert check.kernel_version("6.18.44-fc-v669") == (6, 18)
    assert check.kernel_version("5.4.0-150-generic") == (5, 4) < check.MIN_KERNEL
    assert check.kernel_version("garbage") == (0, 0)


def test_check_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == (0 if doc["ready"] else 1)
    assert {"name", "ok", "required", "detail", "fix"} <= set(doc["checks"][0])


@ROOT_ONLY
def test_check_as_an_unprivileged_user_names_the_fix() -> None:
    r = _ingero("check", prefix=NOBODY)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "✗ privileges" in r.stdout and "fix: run tracing as root" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("not ready:")
    doc = json.loads(_ingero("check", "--json", prefix=NOBODY).stdout)
    failed = {c["name"] for c in doc["checks"] if not c["ok"] and c["required"]}
    assert "privileges" in failed and not doc["ready"]


@ROOT_ONLY
def test_trace_as_an_unprivileged_user_is_one_line_and_exit_3(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    r = _ingero("trace", "--db", str(db), "--duration", "1s", prefix=NOBODY)
    assert r.returncode == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ingero: error: eBPF tracing needs root")
    assert "sudo" in lines[0]
    assert not db.exists()


def test_without_bcc_check_says_how_to_install_it() -> None:
    r = _ingero("check", "--json", code=HIDE_BCC)
    doc = json.loads(r.stdout)
    bcc = next(c for c in doc["checks"] if c["name"] == "bcc")
    assert not bcc["ok"] and "python3-bpfcc" in bcc["fix"]
    assert not doc["ready"] and r.returncode == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="as non-root the privilege check fails first")
def test_without_bcc_trace_is_one_line_and_exit_3(tmp_path: Path) -> None:
    r = _ingero("trace", "--db", str(tmp_path / "t.db"), code=HIDE_BCC)
    assert r.returncode == 3
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("ingero: error: bcc is not importable") and "python3-bpfcc" in line


def test_help_has_real_examples() -> None:
    for cmd in ("trace", "check"):
        r = _ingero(cmd, "--help")
        assert r.returncode == 0
        assert "examples:" in r.stdout and f"ingero {cmd}" in r.stdout
