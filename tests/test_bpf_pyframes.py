"""Real uprobes: a CPython program calling the test libcudart through ctypes from step() gets
``[Python] cudart_pyframes.py:<line> in step()`` frames in its stored stacks (3.10, 3.11 and 3.12)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from ingero.agent.trace.tracer import TraceReady
from ingero.identity import Identity
from ingero.store import catalog
from tests.bpf_support import FIXTURES, Built, build, record, trace_options
from tests.conftest import python_interpreter

pytestmark = pytest.mark.bpf
PROGRAM = FIXTURES / "cudart_pyframes.py"
SYNC = catalog.lookup_op("cudaDeviceSynchronize")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("bpf-build"))


# Why CPython 3.10 / 3.12 may be missing (checked on CI's Debian 12): Debian 12 packages 3.11 only, and
# every other source of a prebuilt or buildable interpreter is a download from a host CI cannot reach —
# `uv python install` (python-build-standalone, from GitHub), pyenv (sources from python.org), and the
# PyPI / npm packages that wrap them (they fetch the same archives at install time).
MISSING = (
    "no python{v} on PATH: Debian 12 packages CPython 3.11 only, and uv/pyenv fetch interpreters from hosts "
    "this machine cannot reach; install python{v} (e.g. `uv python install {v}`) where they are reachable"
)


def _python(version: str) -> str:
    exe = python_interpreter(version)
    if exe is None:
        pytest.skip(MISSING.format(v=version))
    return exe


@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12"])
def test_python_function_and_line_in_stored_stacks(built: Built, tmp_path: Path, version: str) -> None:
    exe = _python(version)
    opts = trace_options(
        tmp_path / "py.db",
        Identity("py-node"),
        built.overrides(),
    )

    def action(_ready: TraceReady) -> tuple[int, int]:
        proc = subprocess.Popen(
            [exe, str(PROGRAM), str(built.cudart), "1.0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _done, calls, line = proc.stdout.readline().split()
        assert proc.wait(timeout=60) == 0 and int(calls) > 0
        return proc.pid, int(line)

    _summary, (pid, line) = record(opts, action)
    with sqlite3.connect(f"file:{opts.db_path}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT DISTINCT s.frames FROM events e JOIN stack_traces s ON s.hash = e.stack_hash "
            "WHERE e.pid = ? AND e.source = ? AND e.op = ?",
            (pid, SYNC.source, SYNC.op),
        ).fetchall()
    assert rows, "no stored stack for cudaDeviceSynchronize"
    entries = [f for (text,) in rows for f in json.loads(text)]
    frames = [f.get("s", "") for f in entries]
    assert f"[Python] cudart_pyframes.py:{line} in step()" in frames
    assert any(f.startswith("[Python] cudart_pyframes.py:") and f.endswith(" in train()") for f in frames)
    assert any("i" in f for f in entries), entries  # the native frames (with their addresses) stay
