"""A real ``ingero trace --annotate`` (bcc): a Python training-loop stand-in labels its steps through
ingero.annotate while it calls the CUDA-shaped library; hostile input on the real socket; a socket
directory owned by someone else stops the agent from starting."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingero.annotate import MAX_LINE_BYTES, SOCKET_DIR, SOCKET_NAME
from ingero.cli.main import main
from tests.bpf_support import ROOT, Built, build

pytestmark = pytest.mark.bpf
NOBODY = 65534

TRAINING_LOOP = """
import ctypes, os, sys, time
import ingero.annotate as ann
lib = ctypes.CDLL(sys.argv[1])
ptr = ctypes.c_void_p()
for step in range(3):
    with ann.span(step=step, phase="train"):
        for _ in range(20):
            lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(4096))
        time.sleep(0.05)
    time.sleep(0.05)
lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(4096))  # outside every span
print(os.getpid(), ann.dropped())
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("bpf-build"))


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """/run/ingero must not exist before (another agent's) and is removed after."""
    if SOCKET_DIR.exists():
        pytest.skip(f"{SOCKET_DIR} exists: another agent may be using it")
    yield SOCKET_DIR
    shutil.rmtree(SOCKET_DIR, ignore_errors=True)


def _trace(built: Built, db: Path, ready: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ingero", "trace", "--db", str(db), "--cuda-lib", str(built.cudart)]
    cmd += [
        "--no-system-search",
        "--no-follow",
        "--quiet",
        "--node",
        "ann-node",
        "--annotate",
        "--ready-file",
        str(ready),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _exchange(path: Path, lines: list[bytes]) -> list[dict[str, object]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        f = s.makefile("rb")
        out = []
        for line in lines:
            s.sendall(line + b"\n")
            out.append(json.loads(f.readline()))
        return out


def test_trace_annotate_records_step_labels_and_refuses_hostile_input(
    built: Built, tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db, ready = tmp_path / "train.db", tmp_path / "ready.json"
    tracer = _trace(built, db, ready)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert tracer.poll() is None and time.monotonic() < deadline, tracer.communicate()[1]
            time.sleep(0.05)
        sock = Path(json.loads(ready.read_text())["annotate_socket"])
        assert sock == run_dir / SOCKET_NAME
        st = run_dir.stat()
        assert (st.st_uid, st.st_mode & 0o777, sock.stat().st_mode & 0o777) == (0, 0o700, 0o600)

        hostile = [
            b'{"labels": {"k": "' + b"x" * 10_000_000 + b'"}}',  # a 10 MB line
            b'{"labels": {"k": "a\\u001b[2Jb"}}',  # a terminal escape
            json.dumps({"labels": {f"k{i}": "v" for i in range(10_000)}}).encode(),  # 10,000 labels
            json.dumps({"labels": {f"k{i}": "v" for i in range(40)}}).encode(),
            b'{"labels": {"task_id": "ok"}, "span_start": 2, "span_end": 1}',
            b'{"labels": {"task_id": "kept"}}',
        ]
        replies = _exchange(sock, hostile)
        assert [r["ok"] for r in replies] == [False, False, False, False, False, True]
        assert f"at most {MAX_LINE_BYTES}" in str(replies[0]["error"]) and "control" in str(replies[1]["error"])

        as_nobody = (  # another uid cannot even reach the socket (directory 0700)
            "import os, socket; os.setgroups([]); os.setgid(65534); os.setuid(65534); "
            f"s = socket.socket(socket.AF_UNIX); s.connect({str(sock)!r})"
        )
        out = subprocess.run([sys.executable, "-c", as_nobody], capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and "PermissionError" in out.stderr

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        loop = subprocess.run(
            [sys.executable, "-c", TRAINING_LOOP, str(built.cudart)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert loop.returncode == 0, loop.stderr
        worker, dropped = (int(x) for x in loop.stdout.split())
        assert dropped == 0
    finally:
        tracer.send_signal(signal.SIGTERM)
        _, err = tracer.communicate(timeout=120)
    assert tracer.returncode == 0, err
    assert not (run_dir / SOCKET_NAME).exists()  # removed when the agent stopped

    sql = f"SELECT timestamp, pid, node FROM events WHERE source = 1 AND op = 1 AND pid = {worker} ORDER BY timestamp"
    assert main(["query", "--db", str(db), "--annotations", "--tsv", "--no-headers", sql]) == 0
    labels = [line.split("\t")[-1] for line in capsys.readouterr().out.splitlines()]
    # the steps inside their spans; the node-wide task_id (an instant sent earlier) from then on
    assert labels == [*(f"phase=train step={k} task_id=kept" for k in range(3) for _ in range(20)), "task_id=kept"]
    assert main(["annotate", "--db", str(db), "--list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["labels"] for r in rows if r.get("pid") == worker] == [
        {"phase": "train", "step": str(k)} for k in range(3)
    ]
    kept = [r for r in rows if r["labels"] == {"task_id": "kept"}]
    assert len(kept) == 1 and kept[0]["node"] == "ann-node"


def test_trace_annotate_refuses_a_directory_owned_by_someone_else(built: Built, tmp_path: Path, run_dir: Path) -> None:
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, NOBODY, NOBODY)
    tracer = _trace(built, tmp_path / "t.db", tmp_path / "ready.json")
    _, err = tracer.communicate(timeout=120)
    assert tracer.returncode == 2
    assert f"annotation socket directory {run_dir} is owned by uid {NOBODY}, not this agent" in err
    assert not (tmp_path / "ready.json").exists() and list(run_dir.iterdir()) == []
