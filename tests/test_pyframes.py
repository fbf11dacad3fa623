"""Python frames read from another CPython process's memory; location tables; ptrace wording."""

from __future__ import annotations

import os
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.agent.trace.pyframes import PyFrame, PyFrames, PyProcess, insert_python, line_of, ptrace_problem
from tests.conftest import python_interpreter

CHILD = """
import sys, threading
ready = threading.Event()
def step():
    ready.set()
    threading.Event().wait()  # STEP_LINE
def outer():
    step()
t = threading.Thread(target=outer, daemon=True)
t.start()
ready.wait()
print(threading.get_native_id(), t.native_id, flush=True)
sys.stdin.readline()
"""
STEP_LINE = next(i for i, text in enumerate(CHILD.splitlines(), 1) if "STEP_LINE" in text)


@pytest.fixture(params=["3.11", "3.12", "3.10"])
def child(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str], int, int]]:
    exe = python_interpreter(request.param)
    if exe is None:
        pytest.skip(f"no python{request.param} here")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([exe, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        main_tid, worker_tid = (int(x) for x in proc.stdout.readline().split())
        yield request.param, proc, main_tid, worker_tid
    finally:
        proc.kill()
        proc.wait()


def test_frames_of_each_thread(child: tuple[str, subprocess.Popen[str], int, int]) -> None:
    version, proc, main_tid, worker_tid = child
    p = PyProcess(proc.pid)
    try:
        assert p.ok and p.version == version
        worker = p.frames(worker_tid)
        names = [(os.path.basename(f.filename), f.qualname) for f in worker]
        i = names.index(("child.py", "step"))
        assert worker[i].line == STEP_LINE
        assert names[i + 1] == ("child.py", "outer") and worker[i + 1].line == STEP_LINE + 2
        assert names[0][0] == "threading.py"  # innermost first: Event.wait -> Condition.wait
        assert names[-1][1] == ("_bootstrap" if version == "3.10" else "Thread._bootstrap")  # 3.10: co_name
        main = p.frames(main_tid)
        assert [(os.path.basename(f.filename), f.qualname) for f in main] == [("child.py", "<module>")]
        assert main[0].as_frame() == {"s": f"[Python] child.py:{main[0].line} in <module>()", "f": main[0].filename}
        assert p.frames(123456789) == []  # not a thread of it
    finally:
        p.close()


def test_not_cpython_is_said_and_yields_nothing() -> None:
    with subprocess.Popen(["cat"], stdin=subprocess.PIPE) as proc:
        try:
            reader = PyFrames()
            assert reader.frames(proc.pid, proc.pid) == []
            p = PyProcess(proc.pid)
            assert p.problem == "not a CPython process (no .PyRuntime section mapped)"
            assert reader.problems == {}  # not Python at all: nothing worth a note
        finally:
            proc.kill()


def _walk(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _walk(c)


def test_line_of_matches_the_interpreter_for_every_instruction() -> None:
    import ingero.agent.trace.pyframes as module

    source = Path(module.__file__).read_text()
    checked = 0
    for code in _walk(compile(source, "pyframes.py", "exec")):
        for start, end, line in code.co_lines():
            if line is None:
                continue
            for offset in range(start, end, 2):
                assert line_of(code.co_linetable, code.co_firstlineno, offset // 2) == line, (code.co_name, offset)
                checked += 1
    assert checked > 1000


LINES_310 = """
import json, sys, types
def walk(c):
    yield c
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            yield from walk(k)
out = []
for c in walk(compile(open(sys.argv[1]).read(), "x.py", "exec")):
    out.append([c.co_linetable.hex(), c.co_firstlineno, [list(r) for r in c.co_lines()]])
print(json.dumps(out))
"""


def test_line_of_310_matches_the_310_interpreter_for_every_instruction() -> None:
    import json

    import ingero.agent.trace.pyframes as module
    from ingero.agent.trace.pylines import line_of_310

    exe = python_interpreter("3.10")
    if exe is None:
        pytest.skip("no python3.10 here")
    done = subprocess.run([exe, "-c", LINES_310, module.__file__], capture_output=True, text=True, check=True)
    checked = 0
    for table, first, ranges in json.loads(done.stdout):
        for start, end, line in ranges:
            if line is None:
                continue
            for offset in range(start, end, 2):
                assert line_of_310(bytes.fromhex(table), first, offset) == line, (first, offset)
                checked += 1
    assert checked > 1000


def test_python_frames_sit_where_the_interpreter_is_in_the_native_stack() -> None:
    native = [{"s": "cudaMalloc+0x4"}, {"i": "0x1"}, {"s": "_PyEval_EvalFrameDefault+0x99"}, {"s": "main+0x1"}]
    py = [PyFrame("/w/train.py", "step", 42), PyFrame("/w/train.py", "<module>", 7)]
    out = insert_python(native, py)
    assert [f.get("s", f.get("i")) for f in out] == [
        "cudaMalloc+0x4",
        "0x1",
        "[Python] train.py:42 in step()",
        "[Python] train.py:7 in <module>()",
        "_PyEval_EvalFrameDefault+0x99",
        "main+0x1",
    ]
    assert insert_python(native[:2], py)[2:] == [p.as_frame() for p in py]  # walk stopped early: appended
    assert insert_python(native, []) is native


def test_ptrace_wording() -> None:
    assert "= 3" in ptrace_problem(3, root=True)
    assert "CAP_SYS_PTRACE" in ptrace_problem(1, root=False)
    assert ptrace_problem(1, root=True) == ptrace_problem(0, root=False) == ptrace_problem(None, root=False) == ""


def test_check_reports_python_frames() -> None:
    from ingero.agent.trace.check import check_python_frames

    assert check_python_frames(3, root=True).ok is False and "= 3" in check_python_frames(3, root=True).detail
    blocked = check_python_frames(2, root=False)
    assert not blocked.ok and not blocked.required and "CAP_SYS_PTRACE" in blocked.fix
    fine = check_python_frames(1, root=True)
    assert fine.ok and "3.10, 3.11, 3.12" in fine.detail and "ptrace_scope = 1" in fine.detail
