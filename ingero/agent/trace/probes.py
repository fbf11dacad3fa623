"""The BPF programs: compile, attach, read maps, detach. The only module that imports bcc.

bcc is imported lazily inside functions, so every other module (and ``ingero --help``, ``ingero
check``) works on machines without it. All bcc/OS failures leave this module as one-line
:class:`~ingero.errors.TracingUnavailableError` messages with the fix.

Programs live in ``ingero/agent/trace/bpf/``: ``ingero_common.h`` (event record, shared maps, helpers) is
prepended to ``gpu_probes.c`` and ``nccl_probes.c`` (uprobes), ``host_probes.c`` and ``io_probes.c`` (tracepoints, attached
by bcc as soon as the program loads). Uprobes are attached per library file (an inode: every process
mapping it is covered, including ones started later) at offsets computed by
:mod:`ingero.agent.trace.elfsyms`.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ingero.agent.trace import btf, elfsyms
from ingero.agent.trace.libc_sockets import (
    FSBASE_MEMBERS,
    SOCKET_FUNCTIONS,
    SOCKET_RETURN,
    errno_tp_offset,
    libc_of,
)
from ingero.agent.trace.ringbuf import EMPTY, RECORD_SIZE, RingReader
from ingero.errors import TracingUnavailableError
from ingero.store import catalog

BPF_DIR = Path(__file__).resolve().parent / "bpf"
TRACEFS_DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")

# Library kind -> [(symbol alternatives, entry program, return program)]. The first alternative the
# library exports is probed; aliases at one address (ncclAllReduce/pncclAllReduce) are probed once.
R, C = "on_return", "on_return_comm"
RO = "on_return_out"  # arg1 holds an out-parameter's address: the return reads the value written there
GPU_FUNCTIONS: dict[str, list[tuple[tuple[str, ...], str, str]]] = {
    "cudart": [
        (("cudaMalloc",), "enter_cudaMalloc", RO),
        (("cudaFree",), "enter_cudaFree", R),
        (("cudaLaunchKernel",), "enter_cudaLaunchKernel", R),
        (("cudaLaunchKernel_ptsz",), "enter_cudaLaunchKernel", R),
        (("cudaMemcpy",), "enter_cudaMemcpy", R),
        (("cudaMemcpy_ptds",), "enter_cudaMemcpy", R),
        (("cudaStreamSynchronize",), "enter_cudaStreamSynchronize", R),
        (("cudaStreamSynchronize_ptsz",), "enter_cudaStreamSynchronize", R),
        (("cudaDeviceSynchronize",), "enter_cudaDeviceSynchronize", R),
        (("cudaMemcpyAsync",), "enter_cudaMemcpyAsync", R),
        (("cudaMemcpyAsync_ptsz",), "enter_cudaMemcpyAsync", R),
        (("cudaMallocManaged",), "enter_cudaMallocManaged", RO),
        # cuda_more_probes.c
        (("cudaMemcpy2D",), "enter_cudaMemcpy2D", R),
        (("cudaMemcpy2D_ptds",), "enter_cudaMemcpy2D", R),
        (("cudaMemcpy2DAsync",), "enter_cudaMemcpy2DAsync", R),
        (("cudaMemcpy2DAsync_ptsz",), "enter_cudaMemcpy2DAsync", R),
        (("cudaMemcpyPeer",), "enter_cudaMemcpyPeer", R),
        (("cudaMemcpyPeerAsync",), "enter_cudaMemcpyPeerAsync", R),
        (("cudaMemset",), "enter_cudaMemset", R),
        (("cudaMemset_ptds",), "enter_cudaMemset", R),
        (("cudaMemsetAsync",), "enter_cudaMemsetAsync", R),
        (("cudaMemsetAsync_ptsz",), "enter_cudaMemsetAsync", R),
        (("cudaMemset2D",), "enter_cudaMemset2D", R),
        (("cudaMemset2D_ptds",), "enter_cudaMemset2D", R),
        (("cudaMemset2DAsync",), "enter_cudaMemset2DAsync", R),
        (("cudaMemset2DAsync_ptsz",), "enter_cudaMemset2DAsync", R),
        (("cudaEventSynchronize",), "enter_cudaEventSynchronize", R),
        (("cudaEventQuery",), "enter_cudaEventQuery", R),
        (("cudaHostAlloc",), "enter_cudaHostAlloc", R),
        (("cudaMallocHost",), "enter_cudaMallocHost", R),
        (("cudaMallocAsync",), "enter_cudaMallocAsync", RO),
        (("cudaMallocAsync_ptsz",), "enter_cudaMallocAsync", RO),
        (("cudaFreeAsync",), "enter_cudaFreeAsync", R),
        (("cudaFreeAsync_ptsz",), "enter_cudaFreeAsync", R),
        (("cudaStreamBeginCapture",), "enter_cudaStreamBeginCapture", R),
        (("cudaStreamBeginCapture_ptsz",), "enter_cudaStreamBeginCapture", R),
        (("cudaStreamEndCapture",), "enter_cudaStreamEndCapture", RO),
        (("cudaStreamEndCapture_ptsz",), "enter_cudaStreamEndCapture", RO),
        (("cudaGraphInstantiate",), "enter_cudaGraphInstantiate", RO),
        (("cudaGraphInstantiateWithFlags",), "enter_cudaGraphInstantiate", RO),
        (("cudaGraphLaunch",), "enter_cudaGraphLaunch", R),
        (("cudaGraphLaunch_ptsz",), "enter_cudaGraphLaunch", R),
    ],
    "cuda": [
        (("cuLaunchKernel",), "enter_cuLaunchKernel", R),
        (("cuLaunchKernel_ptsz",), "enter_cuLaunchKernel", R),
        (("cuMemcpy",), "enter_cuMemcpy", R),
        (("cuMemcpy_ptds",), "enter_cuMemcpy", R),
        (("cuMemcpyHtoD_v2", "cuMemcpyHtoD"), "enter_cuMemcpyHtoD", R),
        (("cuMemcpyDtoH_v2", "cuMemcpyDtoH"), "enter_cuMemcpyDtoH", R),
        (("cuMemcpyDtoD_v2", "cuMemcpyDtoD"), "enter_cuMemcpyDtoD", R),
        (("cuMemcpyAsync",), "enter_cuMemcpyAsync", R),
        (("cuMemcpyAsync_ptsz",), "enter_cuMemcpyAsync", R),
        (("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"), "enter_cuMemcpyHtoDAsync", R),
        (("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync"), "enter_cuMemcpyDtoHAsync", R),
        (("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"), "enter_cuMemcpyDtoDAsync", R),
        (("cuCtxSynchronize",), "enter_cuCtxSynchronize", R),
        (("cuMemAlloc_v2", "cuMemAlloc"), "enter_cuMemAlloc", RO),
        (("cuMemAllocManaged",), "enter_cuMemAllocManaged", RO),
        (("cuMemFree_v2", "cuMemFree"), "enter_cuMemFree", R),
        # CUDA Graphs through the driver (same arguments as the runtime's: cuda_more_probes.c)
        (("cuStreamBeginCapture_v2", "cuStreamBeginCapture"), "enter_cudaStreamBeginCapture", R),
        (("cuStreamEndCapture",), "enter_cudaStreamEndCapture", RO),
        (("cuGraphInstantiateWithFlags", "cuGraphInstantiate"), "enter_cudaGraphInstantiate", RO),
        (("cuGraphLaunch",), "enter_cudaGraphLaunch", R),
    ],
    "nccl": [
        (("ncclAllReduce",), "enter_ncclAllReduce", R),
        (("ncclBroadcast",), "enter_ncclBroadcast", R),
        (("ncclReduce",), "enter_ncclReduce", R),
        (("ncclAllGather",), "enter_ncclAllGather", R),
        (("ncclReduceScatter",), "enter_ncclReduceScatter", R),
        (("ncclSend",), "enter_ncclSend", R),
        (("ncclRecv",), "enter_ncclRecv", R),
        (("ncclCommInitRank",), "enter_ncclCommInitRank", C),
        (("ncclCommInitRankConfig",), "enter_ncclCommInitRank", C),
        (("ncclCommInitAll",), "enter_ncclCommInitAll", C),
    ],
}

DETACH_THREADS = 16

# The kernel counters, in CNT_* slot order (ingero_common.h).
COUNTER_NAMES = ("events_dropped_ring", "nest_overflow", "orphan_returns", "stack_errors", "frames_discarded")
STACK_MODES = {"off": 0, "site": 1, "full": 2}


@dataclass(frozen=True)
class ProbeOptions:
    pid_filter: bool = False  # only --pid targets (and their children)
    stack_mode: str = "site"  # off | site | full
    ring_mb: int = 16
    host: bool = True  # scheduler / process / memory tracepoints
    io: bool = True  # block I/O and TCP tracepoints
    socket_rw: bool = False  # read/write on sockets too (with io; every process's read/write pays a lookup)

    @property
    def socket_uprobes(self) -> bool:
        """Socket calls through per-process libc uprobes (attach_sockets); else --socket-rw's tracepoints."""
        return self.io and not self.socket_rw


@dataclass
class AttachedProbe:
    kind: str
    path: str
    symbol: str
    offset: int
    first_insn: str


@dataclass
class LibraryAttach:
    kind: str
    path: str
    probes: list[AttachedProbe] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def bcc_status() -> tuple[bool, str]:
    """(importable, detail) for ``from bcc import BPF``."""
    try:
        import bcc

        return True, f"bcc from {Path(bcc.__file__).parent}"
    except ImportError as e:
        return False, str(e)
    except Exception as e:  # libbcc.so missing or broken: bcc raises plain Exception/OSError
        return False, f"{type(e).__name__}: {e}"


def tracefs_root() -> str | None:
    for d in TRACEFS_DIRS:
        if os.path.isdir(os.path.join(d, "events")):
            return d
    return None


def tracepoint_exists(category: str, name: str) -> bool:
    root = tracefs_root()
    return bool(root) and os.path.isdir(os.path.join(root or "", "events", category, name))


def preflight() -> None:
    """Raise TracingUnavailableError (one line + the fix) unless tracing can start here."""
    _require_privileges()
    ok, detail = bcc_status()
    if not ok:
        raise TracingUnavailableError(
            f"bcc is not importable ({detail})",
            hint="install Debian's python3-bpfcc (scripts/setup.sh --system) and run ingero from the project venv",
        )
    if tracefs_root() is None:
        raise TracingUnavailableError(
            "tracefs is not mounted", hint="mount -t tracefs nodev /sys/kernel/tracing (scripts/setup.sh --system)"
        )


def _first_clang_error(text: str) -> str:
    for line in text.splitlines():
        if "error:" in line:
            return line.split("error:", 1)[1].strip()
    return text.strip().splitlines()[-1] if text.strip() else "unknown error"


def program_text(options: ProbeOptions) -> str:
    names = ("ingero_common.h", "gpu_probes.c", "nccl_probes.c", "cuda_more_probes.c")
    parts = [(BPF_DIR / name).read_text() for name in names]
    if options.host:
        parts.append((BPF_DIR / "host_probes.c").read_text())
    if options.io:
        parts.append((BPF_DIR / "io_probes.c").read_text())
        parts.append((BPF_DIR / "net_probes.c").read_text())
    return "\n".join(parts)


def ring_pages(options: ProbeOptions) -> int:
    pages = max(1, options.ring_mb * 1024 * 1024 // os.sysconf("SC_PAGE_SIZE"))
    return 1 << (pages.bit_length() - 1)  # a power of two


def _cflags(options: ProbeOptions) -> list[str]:
    if options.stack_mode not in STACK_MODES:
        raise ValueError(f"stack mode {options.stack_mode!r}")
    return [
        f"-DINGERO_PID_FILTER={int(options.pid_filter)}",
        f"-DINGERO_STACK_MODE={STACK_MODES[options.stack_mode]}",
        f"-DINGERO_RING_PAGES={ring_pages(options)}",
        f"-DINGERO_HAVE_OOM={int(tracepoint_exists('oom', 'mark_victim'))}",
        f"-DINGERO_SOCKET_RW={int(options.io and options.socket_rw)}",
        *(btf.offset_defines() if options.io and options.socket_rw else []),
        *_errno_defines(options),
        *catalog_defines(),
        "-Wno-unused-function",
    ]


def _errno_defines(options: ProbeOptions) -> list[str]:
    """errno of a failed libc socket call (net_probes.c's libc_errno): the FS base's place in
    task_struct from the kernel's BTF; off (ret stays -1) without BTF or on another arch."""
    if options.socket_uprobes:
        with contextlib.suppress(TracingUnavailableError):
            return ["-DINGERO_ERRNO_TLS=1", *btf.offset_defines(FSBASE_MEMBERS)]
    return ["-DINGERO_ERRNO_TLS=0"]


def catalog_defines() -> list[str]:
    """The BPF C's source and op ids, from :mod:`ingero.store.catalog` (their one declaration):
    ``SRC_<source name>`` and ``OP_<op name>`` (``SRC_CUDA``, ``OP_cudaMalloc``, ``OP_sched_switch``),
    plus the control-record op ids. The C defines none of them itself (tests/test_trace_bpf_ids.py)."""
    flags = [f"-DSRC_{name}={sid}" for sid, name, _ in catalog.SOURCES]
    flags += [f"-DOP_{name}={op}" for _, op, name, _ in catalog.OPS]
    flags += [f"-DOP_NCCL_COMM_INIT={catalog.NCCL_COMM_INIT_OP}", f"-DOP_NCCL_CALL_ENTER={catalog.NCCL_CALL_ENTER_OP}"]
    return flags


class BpfProbes:
    """One compiled BPF program set: uprobes on GPU libraries + host tracepoints + the ring reader.

    Thread-safety: attach/detach and map reads take an internal lock (the discovery task attaches
    new libraries while the drainer reads).
    """

    def __init__(self, options: ProbeOptions) -> None:
        preflight()
        from bcc import BPF

        self.options = options
        self._lock = threading.Lock()
        self._closed = False
        self._attached: dict[tuple[int, int, int], AttachedProbe] = {}  # (dev, ino, offset)
        self._sockets: dict[int, list[tuple[bytes, int, bool]]] = {}  # pid -> its socket uprobes (path, addr, ret)
        self.libraries: list[LibraryAttach] = []
        self.bpf: Any = _compile(BPF, program_text(options), _cflags(options))
        if not _loads(self.bpf, BPF):
            self.bpf.cleanup()
            raise TracingUnavailableError(
                "the kernel's verifier rejected ingero's uprobe programs", hint="run 'sudo ingero check --compile'"
            )
        try:
            self.ring = RingReader(self.bpf[b"events"].map_fd, ring_pages(options) * os.sysconf("SC_PAGE_SIZE"))
        except BaseException:
            self.bpf.cleanup()
            raise
        release_compiler_memory()

    # --- attaching -------------------------------------------------------------------------------

    def attach_library(self, kind: str, path: str) -> LibraryAttach:
        """Attach every known function ``path`` exports. Idempotent per (inode, offset).

        Every return probe goes in before any entry probe: an entry whose return probe is not
        there yet would leave a frame that no return pops (the BPF side discards such frames by
        stack pointer and counts them, but none should be made in the first place).
        """
        result = LibraryAttach(kind, path)
        try:
            image = elfsyms.load(path)
            st = os.stat(path)
        except (elfsyms.ElfError, OSError) as e:
            result.missing.append(f"unreadable: {e}")
            return result
        with self._lock:
            if self._closed:
                return result
            todo: list[tuple[tuple[int, int, int], int, str, str, AttachedProbe]] = []
            for names, enter, ret in GPU_FUNCTIONS[kind]:
                name = next((n for n in names if n in image.symbols), None)
                where = elfsyms.probe_offset(image, name) if name is not None else None
                vaddr = image.offset_to_vaddr(where[0]) if where is not None else None
                if name is None or where is None or vaddr is None:
                    result.missing.append(name or names[0])
                    continue
                key = (st.st_dev, st.st_ino, where[0])
                if key in self._attached or any(t[0] == key for t in todo):
                    continue
                todo.append((key, vaddr, enter, ret, AttachedProbe(kind, path, name, where[0], where[1])))
            for _, vaddr, _, ret, probe in todo:
                self._attach(probe, vaddr, ret, retprobe=True)
            for key, vaddr, enter, _, probe in todo:
                self._attach(probe, vaddr, enter, retprobe=False)
                self._attached[key] = probe
                result.probes.append(probe)
        self.libraries.append(result)
        return result

    def _attach(self, probe: AttachedProbe, vaddr: int, fn: str, *, retprobe: bool) -> None:
        attach = self.bpf.attach_uretprobe if retprobe else self.bpf.attach_uprobe
        try:
            attach(name=probe.path.encode(), addr=vaddr, fn_name=fn.encode())
        except Exception as e:  # bcc raises plain Exception for every attach failure
            raise TracingUnavailableError(
                f"cannot attach a uprobe to {probe.symbol} in {probe.path}: {e}",
                hint="the kernel needs CONFIG_UPROBES; run 'ingero check'",
            ) from None

    def attach_sockets(self, pid: int) -> int:
        """Uprobes on the socket calls of the libc ``pid`` maps, for that process alone (its perf
        events carry the pid: no other process gets a breakpoint). Returns how many; 0 when the process
        is gone or maps no libc. Idempotent per pid; :meth:`detach_sockets` undoes it."""
        path = libc_of(pid)
        if path is None or not self.options.socket_uprobes:
            return 0
        try:
            image = elfsyms.load(path)
        except (elfsyms.ElfError, OSError):
            return 0
        tpoff = errno_tp_offset(pid, image)
        addrs: dict[int, str] = {}  # vaddr -> entry program (aliases at one address probed once)
        for symbol, fn in SOCKET_FUNCTIONS:
            where = elfsyms.probe_offset(image, symbol)
            vaddr = image.offset_to_vaddr(where[0]) if where is not None else None
            if vaddr is not None:
                addrs.setdefault(vaddr, fn)
        done: list[tuple[bytes, int, bool]] = []
        name = path.encode()
        with self._lock:
            if self._closed or pid in self._sockets:
                return len(self._sockets.get(pid, []))
            self._sockets[pid] = done
            # bcc raises plain Exception; the process may have exited meanwhile (ESRCH): keep what went on
            with contextlib.suppress(Exception):
                if tpoff is not None:  # before the probes: a failed call's errno is read from the first one on
                    self.bpf[b"errno_tpoff"][ct.c_uint(pid)] = ct.c_int64(tpoff)
                for vaddr, fn in addrs.items():  # the return first (see attach_library)
                    self.bpf.attach_uretprobe(name=name, addr=vaddr, fn_name=SOCKET_RETURN.encode(), pid=pid)
                    done.append((name, vaddr, True))
                    self.bpf.attach_uprobe(name=name, addr=vaddr, fn_name=fn.encode(), pid=pid)
                    done.append((name, vaddr, False))
        return len(done)

    def detach_sockets(self, pids: Iterable[int]) -> None:
        """Remove these processes' socket uprobes. The kernel waits out a grace period per probe
        (~0.2 s here: 12 probes a process took 2.4 s one after another), so they are closed all at
        once from a few threads: about one grace period in all."""
        with self._lock:
            gone = [pid for pid in pids if pid in self._sockets]
            todo = [(pid, probe) for pid in gone for probe in self._sockets.pop(pid)]
            if self._closed or not todo:
                return
            tpoffs = self.bpf[b"errno_tpoff"]
            for pid in gone:
                with contextlib.suppress(KeyError):
                    del tpoffs[ct.c_uint(pid)]

            def close(item: tuple[int, tuple[bytes, int, bool]]) -> None:
                pid, (name, vaddr, ret) = item
                detach = self.bpf.detach_uretprobe if ret else self.bpf.detach_uprobe
                with contextlib.suppress(Exception):  # bcc raises plain Exception: already gone
                    detach(name=name, addr=vaddr, pid=pid)

            with ThreadPoolExecutor(max_workers=min(DETACH_THREADS, len(todo))) as pool:
                list(pool.map(close, todo))

    def socket_pids(self) -> set[int]:
        """The processes whose socket calls are probed now."""
        with self._lock:
            return set(self._sockets)

    def target_pids(self) -> set[int]:
        """The traced processes (``targets``: --pid targets, processes that called a probed GPU
        function, their children), as the kernel holds them now."""
        with self._lock:
            if self._closed:
                return set()
            return {int(k.value) for k in self.bpf[b"targets"]}

    def attached_probes(self) -> list[AttachedProbe]:
        with self._lock:
            return list(self._attached.values())

    def add_targets(self, pids: Iterable[int]) -> None:
        with self._lock:
            if self._closed:
                return
            table = self.bpf[b"targets"]
            for pid in pids:
                table[ct.c_uint(pid)] = ct.c_ubyte(1)

    def add_target_uids(self, uids: Iterable[int]) -> None:
        """--user: processes of these uids become targets on their first probed call (pid filter)."""
        with self._lock:
            if self._closed:
                return
            table = self.bpf[b"target_uids"]
            for uid in uids:
                table[ct.c_uint(uid)] = ct.c_ubyte(1)

    # --- reading maps ----------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        with self._lock:
            if self._closed:
                return {}
            table = self.bpf[b"counters"]
            return {name: int(table.sum(ct.c_int(i)).value) for i, name in enumerate(COUNTER_NAMES)}

    def page_allocs(self) -> dict[int, tuple[int, int]]:
        """Cumulative (allocations, bytes) per traced tgid since start; key 0 = every other process."""
        if not self.options.host:
            return {}
        out: dict[int, tuple[int, int]] = {}
        with self._lock:
            if self._closed:
                return out
            rest = self.bpf[b"page_allocs_rest"][ct.c_int(0)]  # every other process: one per-CPU slot
            tables = [(0, rest), *((int(k.value), per_cpu) for k, per_cpu in self.bpf[b"page_allocs"].items())]
            for key, per_cpu in tables:
                count = sum(int(v.count) for v in per_cpu)
                if count:  # as a hash entry, the slot exists once something was counted
                    out[key] = (count, sum(int(v.bytes) for v in per_cpu))
        return out

    def forget_page_allocs(self, tgids: Iterable[int]) -> None:
        with self._lock:
            if self._closed or not self.options.host:
                return
            table = self.bpf[b"page_allocs"]
            for t in tgids:
                with contextlib.suppress(KeyError):
                    del table[ct.c_uint(t)]

    def stack_ips(self, stack_id: int) -> list[int]:
        """The user-stack IPs behind a stack id ([] when unknown)."""
        if self.options.stack_mode == "off" or stack_id < 0:
            return []
        with self._lock:
            if self._closed:
                return []
            table = self.bpf[b"stacks"]
            try:
                leaf = table[table.Key(stack_id)]
            except KeyError:
                return []
            ips: list[int] = []
            for ip in leaf.ip:
                if not ip:
                    break
                ips.append(int(ip))
            return ips

    def read_events(self) -> np.ndarray:
        """Every record the ring buffer holds now (see :class:`~ingero.agent.trace.ringbuf.RingReader`)."""
        if self._closed:
            return EMPTY
        return self.ring.read(max_records=1 << 18)

    def pending_records(self) -> int:
        """Records waiting in the ring buffer (two words of the mapped ring: no system call)."""
        if self._closed:
            return 0
        return self.ring.pending_bytes() // RECORD_SIZE

    def peek_events(self, since: int) -> tuple[np.ndarray, int]:
        """Records waiting from ring position ``since`` on, left for :meth:`read_events` (a hint for
        another thread: see :meth:`~ingero.agent.trace.ringbuf.RingReader.peek`)."""
        if self._closed:
            return EMPTY, since
        return self.ring.peek(since)

    # --- shutdown --------------------------------------------------------------------------------

    def stop_events(self) -> None:
        """Make every program return at once (no new events); the maps stay readable for a last drain.

        Instant, unlike detaching: closing a uprobe's perf event costs the kernel ~0.1 s (an RCU grace
        period each), so :meth:`close` runs after the database is closed.
        """
        with self._lock:
            if self._closed:
                return
            self.bpf[b"control"][ct.c_int(0)] = ct.c_uint(1)

    def close(self) -> None:
        """Detach every probe and free the maps. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.ring.close()
            finally:
                self.bpf.cleanup()

    def __enter__(self) -> BpfProbes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _captured_stderr() -> Iterator[Callable[[], str]]:
    """Capture fd 2 (clang and the verifier write there directly); yields a reader of what came."""
    import tempfile

    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as err:
        os.dup2(err.fileno(), 2)

        def text() -> str:
            err.seek(0)
            return err.read().decode("utf-8", "replace")

        try:
            yield text
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _loads(bpf: Any, bpf_cls: Any) -> bool:
    """Whether the kernel's verifier accepts the uprobe programs (bcc loads them lazily on attach)."""
    with _captured_stderr():
        try:
            bpf.load_func(b"enter_cudaMalloc", bpf_cls.KPROBE)
            bpf.load_func(b"on_return", bpf_cls.KPROBE)
        except Exception:
            return False
    return True


def _compile(bpf_cls: Any, text: str, cflags: list[str]) -> Any:
    """Compile with clang's diagnostics captured, so a failure is one line, not a screenful."""
    with _captured_stderr() as diagnostics:
        try:
            return bpf_cls(text=text.encode(), cflags=cflags)
        except Exception as e:
            diag, failure = diagnostics(), str(e)
    first = _first_clang_error(diag) if "error:" in diag else failure
    if "linux/" in diag and "file not found" in diag:
        raise TracingUnavailableError(
            f"bcc cannot find the kernel headers for {os.uname().release}",
            hint="install linux-headers-amd64 and link /lib/modules/$(uname -r)/build to them "
            "(scripts/setup.sh --system does both)",
        ) from None
    raise TracingUnavailableError(f"BPF program failed to load: {first}", hint="run 'ingero check'") from None


COMPILER_LIBRARIES = ("libLLVM", "libclang")  # what bcc compiles with: needed no more once loaded
MADV_PAGEOUT = 21  # linux/mman.h (5.4+)


def release_compiler_memory() -> None:
    """After the programs are compiled and loaded: give back the heap LLVM freed (glibc's
    ``malloc_trim``) and page out the compiler libraries' pages (``MADV_PAGEOUT``: clean file pages,
    read back from disk if ever touched again). The agent then holds ~20 MB of LLVM heap instead of
    ~50, and none of LLVM's ~80 MB of code when no other process maps it (bench/bench_overhead.py)."""
    libc = ct.CDLL(None, use_errno=True)
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:  # glibc only
        trim(ct.c_size_t(0))
    madvise = libc.madvise
    madvise.argtypes = [ct.c_void_p, ct.c_size_t, ct.c_int]
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].rsplit("/", 1)[-1].startswith(COMPILER_LIBRARIES):
            continue
        lo, _, hi = parts[0].partition("-")
        madvise(int(lo, 16), int(hi, 16) - int(lo, 16), MADV_PAGEOUT)  # best effort: older kernels say EINVAL


def _require_privileges() -> None:
    if os.geteuid() == 0:
        return
    if has_bpf_capabilities():
        return
    raise TracingUnavailableError(
        "eBPF tracing needs root (or CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN)",
        hint="run it with sudo: sudo ingero trace ...",
    )


def has_bpf_capabilities() -> bool:
    """Effective CAP_SYS_ADMIN (21), or CAP_BPF (39) + CAP_PERFMON (38), per /proc/self/status."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
                return bool(caps >> 21 & 1) or bool(caps >> 39 & 1 and caps >> 38 & 1)
    except (OSError, ValueError):
        pass
    return False
