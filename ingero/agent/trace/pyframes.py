"""Python frames of a CPython 3.10–3.12 thread, read from the process's memory (``/proc/<pid>/mem``).

For a stored stack the tracer adds ``[Python] train.py:42 in step()`` frames beside the native ones:
the interpreter's ``_PyRuntime`` (its own ELF section ``.PyRuntime`` in libpython or the python
executable) -> the main interpreter -> its thread states -> the one whose ``native_thread_id`` is
the calling thread -> its current ``_PyInterpreterFrame`` chain. Code objects (file, qualified name,
first line, line table) are cached by address; the line comes from the frame's last instruction and
the code's location table (:mod:`ingero.agent.trace.pylines`). Struct offsets are version tables
(:data:`OFFSETS`, generated with ``offsetof`` against each version's internal headers; 3.13+ would
read ``_Py_DebugOffsets`` instead). Stacks are symbolized when first stored, a few milliseconds
after the call: the frames are the thread's at that moment — the caller's while it is still in the
call or its loop, which is the case this exists for (hot GPU call sites).

3.10 differs: a thread state holds ``thread_id`` (the ``pthread_t``) rather than the kernel's thread
id, which is read from the thread's ``struct pthread`` at an offset found once per process (the
main thread's holds the pid; glibc x86_64 keeps it at 720); frames are ``PyFrameObject`` linked by
``f_back`` with ``f_lasti`` in code units, code objects have ``co_name`` (no qualified name) and the
3.10 line table.

Not CPython, an unsupported version, or memory that cannot be read (``kernel.yama.ptrace_scope`` 3,
no CAP_SYS_PTRACE, another PID namespace) gives no Python frames and a :attr:`PyProcess.problem`;
``ingero check`` reports the ptrace setting.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ingero.agent.trace.procmaps import read_maps
from ingero.agent.trace.pylines import line_of, line_of_310

MAX_FRAMES = 64
MAX_THREADS = 4096
MAX_STR = 1024
YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")
_VERSION = re.compile(r"python(3\.\d+)")

# bytes and str objects' layout, the same in 3.10 and 3.11 (str still has its wstr fields)
_OBJECTS_310_311 = {
    "bytes_size": 16,
    "bytes_data": 32,
    "unicode_length": 16,
    "unicode_state": 32,
    "unicode_ascii_data": 48,
    "unicode_compact_data": 72,
}
# offsetof() of what is read, per CPython version (x86_64 / aarch64 LP64 layout).
OFFSETS: dict[str, dict[str, int]] = {
    "3.11": {
        "runtime_interpreters_head": 40,
        "interp_threads_head": 16,
        "tstate_next": 8,
        "tstate_native_thread_id": 160,
        "tstate_cframe": 56,
        "cframe_current_frame": 8,
        "frame_code": 32,
        "frame_previous": 48,
        "frame_prev_instr": 56,
        "frame_owner": 69,
        "code_filename": 112,
        "code_qualname": 128,
        "code_firstlineno": 72,
        "code_linetable": 136,
        "code_adaptive": 184,
        **_OBJECTS_310_311,
    },
    "3.12": {
        "runtime_interpreters_head": 40,
        "interp_threads_head": 72,
        "tstate_next": 8,
        "tstate_native_thread_id": 144,
        "tstate_cframe": 56,
        "cframe_current_frame": 0,
        "frame_code": 0,
        "frame_previous": 8,
        "frame_prev_instr": 56,
        "frame_owner": 70,
        "code_filename": 112,
        "code_qualname": 128,
        "code_firstlineno": 68,
        "code_linetable": 136,
        "code_adaptive": 192,
        "bytes_size": 16,
        "bytes_data": 32,
        "unicode_length": 16,
        "unicode_state": 32,
        "unicode_ascii_data": 40,
        "unicode_compact_data": 56,
    },
}
OFFSETS["3.10"] = {
    "runtime_interpreters_head": 32,
    "interp_threads_head": 8,
    "tstate_next": 8,
    "tstate_thread_id": 176,  # the pthread_t; the kernel tid lies in its struct pthread
    "tstate_frame": 24,
    "frame_back": 24,
    "frame_code": 32,
    "frame_lasti": 96,
    "code_filename": 104,
    "code_qualname": 112,  # co_name: 3.10 code objects have no qualified name
    "code_firstlineno": 40,
    "code_linetable": 120,
    **_OBJECTS_310_311,
}
SUPPORTED = tuple(sorted(OFFSETS))
PTHREAD_TID_OFFSET = 720  # glibc x86_64's struct pthread.tid; searched for when it does not hold
PTHREAD_SPAN = 2048  # bytes of a struct pthread searched for the tid
FRAME_OWNED_BY_CSTACK = 3  # 3.12: the C stack's entry shim, not Python code


@dataclass(frozen=True)
class PyFrame:
    filename: str
    qualname: str
    line: int

    def as_frame(self) -> dict[str, str]:
        """A ``stack_traces.frames`` entry."""
        return {"s": f"[Python] {os.path.basename(self.filename)}:{self.line} in {self.qualname}()", "f": self.filename}


@dataclass(frozen=True)
class _Code:
    filename: str
    qualname: str
    firstlineno: int
    linetable: bytes


def ptrace_scope() -> int | None:
    """kernel.yama.ptrace_scope (None: no Yama here, so only the usual permission checks)."""
    try:
        return int(YAMA.read_text().strip())
    except (OSError, ValueError):
        return None


def ptrace_problem(scope: int | None, *, root: bool) -> str:
    """Why Python frames cannot be read here ('' when they can)."""
    if scope == 3:
        return "kernel.yama.ptrace_scope = 3: no process may read another's memory (Python frames off)"
    if scope in (1, 2) and not root:
        return f"kernel.yama.ptrace_scope = {scope}: reading another process's memory needs root or CAP_SYS_PTRACE"
    return ""


def _python_mappings(pid: int) -> dict[str, tuple[int, int, str]] | None:
    """File mappings whose name says python: path -> (lowest start, its file offset, a path openable from
    here); None: the process is gone."""
    maps = read_maps(pid)
    if not maps:
        return None
    out: dict[str, tuple[int, int, str]] = {}
    for m in maps:
        if not m.reachable or "python" not in os.path.basename(m.path):
            continue
        if m.path not in out or m.start < out[m.path][0]:
            out[m.path] = (m.start, m.offset, m.reachable)
    return out


class PyProcess:
    """One process's interpreter, found once; :meth:`frames` walks a thread's frame chain."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.version = ""
        self.problem = ""
        self.runtime = 0
        self._fd: int | None = None
        self._codes: dict[int, _Code | None] = {}
        self._tid_offset: int | None = None  # 3.10: where struct pthread keeps the kernel tid
        self._locate()

    def _locate(self) -> None:
        from ingero.agent.trace import elfsyms

        maps = _python_mappings(self.pid)
        if maps is None:
            self.problem = "process gone"
            return
        for path, (start, offset, reachable) in maps.items():
            ver = _VERSION.search(os.path.basename(path))
            if ver is None:
                continue
            try:
                image = elfsyms.load(reachable)  # cached per file: the symbolizer reads the same images
            except (OSError, elfsyms.ElfError):
                continue
            vaddr = image.sections.get(".PyRuntime")
            if vaddr is None:
                continue
            self.version = ver.group(1)
            if self.version not in OFFSETS:
                self.problem = f"CPython {self.version}: Python frames are read for {', '.join(SUPPORTED)} only"
                return
            at_start = image.offset_to_vaddr(offset)
            load_base = 0 if image.elf_type == 2 or at_start is None else start - at_start
            self.runtime = load_base + vaddr
            break
        else:
            self.problem = "not a CPython process (no .PyRuntime section mapped)"
            return
        try:
            self._fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY)
        except OSError as e:
            scope = ptrace_scope()
            self.problem = f"cannot read the memory of pid {self.pid} ({e.strerror})" + (
                f"; kernel.yama.ptrace_scope = {scope}" if scope else ""
            )

    @property
    def ok(self) -> bool:
        return self._fd is not None and not self.problem

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _read(self, addr: int, size: int) -> bytes:
        assert self._fd is not None
        if addr <= 0:
            raise OSError("null pointer")
        data = os.pread(self._fd, size, addr)
        if len(data) != size:
            raise OSError("short read")
        return data

    def _ptr(self, addr: int) -> int:
        return int(struct.unpack("<Q", self._read(addr, 8))[0])

    def _str(self, obj: int, o: dict[str, int]) -> str:
        length = min(int(struct.unpack("<q", self._read(obj + o["unicode_length"], 8))[0]), MAX_STR)
        state = int(struct.unpack("<I", self._read(obj + o["unicode_state"], 4))[0])
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if length <= 0 or not compact:
            return ""
        if ascii_:
            return self._read(obj + o["unicode_ascii_data"], length).decode("ascii", "replace")
        width = {1: 1, 2: 2, 4: 4}.get(kind, 1)
        raw = self._read(obj + o["unicode_compact_data"], length * width)
        return raw.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[width], "replace")

    def _code(self, addr: int, o: dict[str, int]) -> _Code | None:
        if addr in self._codes:
            return self._codes[addr]
        code: _Code | None
        try:
            table = self._ptr(addr + o["code_linetable"])
            size = min(int(struct.unpack("<q", self._read(table + o["bytes_size"], 8))[0]), 1 << 20)
            code = _Code(
                self._str(self._ptr(addr + o["code_filename"]), o),
                self._str(self._ptr(addr + o["code_qualname"]), o),
                int(struct.unpack("<i", self._read(addr + o["code_firstlineno"], 4))[0]),
                self._read(table + o["bytes_data"], size) if size > 0 else b"",
            )
        except OSError:
            code = None
        self._codes[addr] = code
        return code

    def _tstates(self, o: dict[str, int]) -> list[int]:
        interp = self._ptr(self.runtime + o["runtime_interpreters_head"])
        ts = self._ptr(interp + o["interp_threads_head"])
        out: list[int] = []
        while ts and len(out) < MAX_THREADS:
            out.append(ts)
            ts = self._ptr(ts + o["tstate_next"])
        return out

    def _tstate(self, tid: int, o: dict[str, int]) -> int:
        states = self._tstates(o)
        for ts in states:
            if self._native_tid(ts, o, states) == tid:
                return ts
        return 0

    def _native_tid(self, ts: int, o: dict[str, int], states: list[int]) -> int:
        if "tstate_native_thread_id" in o:
            return int(struct.unpack("<Q", self._read(ts + o["tstate_native_thread_id"], 8))[0])
        pthread = self._ptr(ts + o["tstate_thread_id"])
        off = self._pthread_tid_offset(o, states)
        return -1 if off is None else int(struct.unpack("<i", self._read(pthread + off, 4))[0])

    def _pthread_tid_offset(self, o: dict[str, int], states: list[int]) -> int | None:
        """Where this process's libc keeps a thread's kernel tid in its ``struct pthread``: the offset
        at which the main thread's holds the pid (:data:`PTHREAD_TID_OFFSET` when it does there)."""
        if self._tid_offset is not None:
            return self._tid_offset
        for ts in states:
            try:
                block = self._read(self._ptr(ts + o["tstate_thread_id"]), PTHREAD_SPAN)
            except OSError:
                continue
            ints = struct.unpack(f"<{PTHREAD_SPAN // 4}i", block)
            if ints[PTHREAD_TID_OFFSET // 4] == self.pid:
                self._tid_offset = PTHREAD_TID_OFFSET
            elif self.pid in ints:
                self._tid_offset = ints.index(self.pid) * 4
            if self._tid_offset is not None:
                break
        return self._tid_offset

    def frames(self, tid: int) -> list[PyFrame]:
        """The thread's Python frames, innermost first ([] when it has none or cannot be read)."""
        if not self.ok:
            return []
        o = OFFSETS[self.version]
        out: list[PyFrame] = []
        try:
            ts = self._tstate(tid, o)
            if not ts:
                return []
            if "tstate_frame" in o:
                return self._frames_310(self._ptr(ts + o["tstate_frame"]), o)
            frame = self._ptr(self._ptr(ts + o["tstate_cframe"]) + o["cframe_current_frame"])
            span = max(o["frame_owner"] + 1, o["frame_code"] + 8, o["frame_previous"] + 8, o["frame_prev_instr"] + 8)
            for _ in range(MAX_FRAMES):
                if not frame:
                    break
                raw = self._read(frame, span)  # one read per frame: the fields used lie in its first bytes
                owner = raw[o["frame_owner"]]
                code_addr = int.from_bytes(raw[o["frame_code"] : o["frame_code"] + 8], "little")
                if owner != FRAME_OWNED_BY_CSTACK and code_addr:
                    code = self._code(code_addr, o)
                    if code is not None:
                        instr = int.from_bytes(raw[o["frame_prev_instr"] : o["frame_prev_instr"] + 8], "little")
                        index = (instr - (code_addr + o["code_adaptive"])) // 2
                        out.append(
                            PyFrame(code.filename, code.qualname, line_of(code.linetable, code.firstlineno, index))
                        )
                frame = int.from_bytes(raw[o["frame_previous"] : o["frame_previous"] + 8], "little")
        except OSError:
            pass  # the thread moved on meanwhile: what was read so far
        return out

    def _frames_310(self, frame: int, o: dict[str, int]) -> list[PyFrame]:
        """3.10's ``PyFrameObject`` chain (``f_back``), innermost first."""
        out: list[PyFrame] = []
        span = max(o["frame_back"] + 8, o["frame_code"] + 8, o["frame_lasti"] + 4)
        try:
            for _ in range(MAX_FRAMES):
                if not frame:
                    break
                raw = self._read(frame, span)
                code_addr = int.from_bytes(raw[o["frame_code"] : o["frame_code"] + 8], "little")
                code = self._code(code_addr, o) if code_addr else None
                if code is not None:
                    lasti = int.from_bytes(raw[o["frame_lasti"] : o["frame_lasti"] + 4], "little", signed=True)
                    out.append(
                        PyFrame(code.filename, code.qualname, line_of_310(code.linetable, code.firstlineno, lasti * 2))
                    )
                frame = int.from_bytes(raw[o["frame_back"] : o["frame_back"] + 8], "little")
        except OSError:
            pass  # the thread moved on meanwhile: what was read so far
        return out


class PyFrames:
    """Python frames for the recorder's stored stacks: one :class:`PyProcess` per traced pid."""

    def __init__(self, opener: Callable[[int], PyProcess] = PyProcess) -> None:
        self._opener = opener
        self._procs: dict[int, PyProcess] = {}
        self.problems: dict[int, str] = {}

    def frames(self, pid: int, tid: int) -> list[PyFrame]:
        proc = self._procs.get(pid)
        if proc is None:
            proc = self._opener(pid)
            self._procs[pid] = proc
            if proc.problem and proc.version:  # CPython we cannot read: worth saying (others: not Python)
                self.problems[pid] = proc.problem
        return proc.frames(tid)

    def forget(self, pid: int) -> None:
        proc = self._procs.pop(pid, None)
        if proc is not None:
            proc.close()


def insert_python(native: list[dict[str, str]], python: list[PyFrame]) -> list[dict[str, str]]:
    """Python frames where the interpreter's evaluation loop is in the native stack (innermost
    first), or after the native frames when the walk stopped before it (no frame pointers)."""
    if not python:
        return native
    py = [p.as_frame() for p in python]
    for i, f in enumerate(native):
        if f.get("s", "").startswith("_PyEval_EvalFrame"):
            return native[:i] + py + native[i:]
    return native + py


__all__ = [
    "OFFSETS",
    "PyFrame",
    "PyFrames",
    "PyProcess",
    "insert_python",
    "line_of",
    "ptrace_problem",
    "ptrace_scope",
]
