"""Helpers of the bpf tests: build the CUDA-shaped fixtures with gcc, run a trace in-process.

The fixture libraries are compiled so every function starts with ``push %rbp`` (``-O0
-fno-omit-frame-pointer -fcf-protection=none``): the shape of the real libcudart prologue, which the
kernel emulates instead of single-stepping. Binaries go to a temporary directory, never the tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ingero.agent.trace.tracer import TraceOptions, TraceReady, TraceSummary, run_trace
from ingero.identity import Identity

FIXTURES = Path(__file__).resolve().parent / "bpf_fixtures"
ROOT = Path(__file__).resolve().parents[1]
LIB_CFLAGS = ["-O0", "-fno-omit-frame-pointer", "-fcf-protection=none", "-shared", "-fPIC"]


def _real_cudart() -> Path | None:
    """libcudart.so.12 of the nvidia-cuda-runtime-cu12 wheel (a dev dependency), wherever pip put it."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(loc) / "lib" / "libcudart.so.12"
        if lib.exists():
            return lib
    return None


REAL_CUDART = _real_cudart()
CUDART_CTYPES = FIXTURES / "cudart_ctypes.py"


@dataclass(frozen=True)
class Built:
    dir: Path
    cudart: Path
    cuda: Path
    nccl: Path
    workload: Path
    hog: Path

    def overrides(self) -> dict[str, list[str]]:
        return {"cudart": [str(self.cudart)], "cuda": [str(self.cuda)], "nccl": [str(self.nccl)]}


_built: dict[str, Built] = {}


def _gcc(args: list[str]) -> None:
    subprocess.run(["gcc", *args], check=True, capture_output=True, text=True)


def build_program(source: str, out: Path) -> Path:
    """Compile one more fixture program (``bpf_fixtures/<source>``, pthreads and dlopen) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    exe = out / Path(source).stem
    _gcc(["-O0", "-fno-omit-frame-pointer", "-o", str(exe), str(FIXTURES / source), "-ldl", "-lpthread"])
    return exe


def build_library(source: str, soname: str, out: Path) -> Path:
    """``bpf_fixtures/<source>`` as the shared library ``out/<soname>`` (the fixtures' prologue flags)."""
    out.mkdir(parents=True, exist_ok=True)
    _gcc([*LIB_CFLAGS, f"-Wl,-soname,{soname}", "-o", str(out / soname), str(FIXTURES / source)])
    return out / soname


def build_busy_cudart(out: Path) -> Path:
    """``busy_cudart.c`` as ``out/libcudart.so.12``: the six functions busy_threads.c calls, only."""
    out.mkdir(parents=True, exist_ok=True)
    lib = out / "libcudart.so.12"
    _gcc([*LIB_CFLAGS, "-Wl,-soname,libcudart.so.12", "-o", str(lib), str(FIXTURES / "busy_cudart.c")])
    return lib


def build(out: Path) -> Built:
    """Compile the fixtures once per test session (cached by the first output directory)."""
    if "b" in _built:
        return _built["b"]
    out.mkdir(parents=True, exist_ok=True)
    libs = {
        "libcudart.so.12": "fake_cudart.c",
        "libcuda.so.1": "fake_cuda.c",
        "libnccl.so.2": "fake_nccl.c",
    }
    for soname, src in libs.items():
        _gcc([*LIB_CFLAGS, f"-Wl,-soname,{soname}", "-o", str(out / soname), str(FIXTURES / src)])
    _gcc(["-O0", "-fno-omit-frame-pointer", "-o", str(out / "workload"), str(FIXTURES / "workload.c"), "-ldl"])
    _gcc(["-O1", "-o", str(out / "cpu_hog"), str(FIXTURES / "cpu_hog.c")])
    b = Built(
        out,
        out / "libcudart.so.12",
        out / "libcuda.so.1",
        out / "libnccl.so.2",
        out / "workload",
        out / "cpu_hog",
    )
    _built["b"] = b
    return b


def trace_options(db_path: Path, identity: Identity, overrides: dict[str, list[str]], **extra: Any) -> TraceOptions:
    """A quiet recording of the given libraries only (no system library search, no following new
    processes' libraries); ``extra`` sets any other TraceOptions field."""
    fields: dict[str, Any] = {"system_search": False, "follow": False, "output": "quiet", **extra}
    return TraceOptions(db_path=db_path, identity=identity, overrides=overrides, **fields)


def record(opts: TraceOptions, action: Callable[[TraceReady], Any]) -> tuple[TraceSummary, Any]:
    """Run a trace in this process, call ``action(ready)`` in a worker thread once the probes are
    attached, stop the trace when it returns; (summary, action's result)."""
    result: dict[str, Any] = {}

    async def tracer(task_status: trio.TaskStatus[TraceReady] = trio.TASK_STATUS_IGNORED) -> None:
        result["summary"] = await run_trace(opts, task_status=task_status, handle_signals=False)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ready: TraceReady = await nursery.start(tracer)
            try:
                result["action"] = await trio.to_thread.run_sync(partial(action, ready))
            finally:
                ready.control.stop("test done")

    trio.run(main)
    return result["summary"], result.get("action")


class BusyJob:
    """busy_threads (tests/bpf_fixtures/busy_threads.c) running until closed: its pid and thread ids."""

    def __init__(self, exe: Path, lib_dir: Path, mode: str, threads: int) -> None:
        self.proc = subprocess.Popen(
            [str(exe), mode, str(lib_dir), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        # Lowest priority: the job still calls flat out whenever a CPU is free, but the tracer (and
        # the other engineers' work on a shared CI machine) is not starved by a tight loop.
        os.setpriority(os.PRIO_PROCESS, self.proc.pid, 19)
        self.tids: list[int] = []
        for line in self.proc.stdout:
            if line.strip() == "ready":
                break
            self.tids.append(int(line.split()[1]))
        assert len(self.tids) == threads, "busy_threads did not start"

    def close(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        assert self.proc.wait(timeout=30) == 0
        return out


def pin(proc: subprocess.Popen[str] | subprocess.Popen[bytes], cpu: int, nice: int = 0) -> None:
    os.sched_setaffinity(proc.pid, {cpu})
    if nice:
        os.setpriority(os.PRIO_PROCESS, proc.pid, nice)


def run_beside_cpu_hog(work: subprocess.Popen[str], hog_exe: Path, cpu: int) -> int:
    """Start a CPU hog on ``work``'s core at nice -10, tell ``work`` (waiting for "go") to start, wait for its
    "done" and its exit; the hog is killed on the way out. Returns the hog's pid."""
    assert work.stdout is not None and work.stdin is not None
    hog = subprocess.Popen([str(hog_exe)])
    pin(hog, cpu, -10)
    try:
        work.stdin.write("go\n")
        work.stdin.flush()
        assert work.stdout.readline().strip() == "done"
        assert work.wait(timeout=120) == 0
    finally:
        hog.send_signal(signal.SIGKILL)
        hog.wait()
    return hog.pid
