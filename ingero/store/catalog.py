"""Source and op ids — the same numbers Ingero uses, plus NCCL after the existing ids.

``events.source`` / ``events.op`` are small integers; the ``sources`` and ``ops`` tables in every
database carry these names so SQL can join them. Lookups accept the C function names too
(``cudaStreamSynchronize`` → ``cudaStreamSync``, ``cuMemAlloc_v2`` → ``cuMemAlloc``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ingero.errors import UnknownOpError

# source ids
CUDA = 1
NVIDIA = 2
HOST = 3
DRIVER = 4
IO = 5
TCP = 6
NET = 7
NCCL = 8

SOURCES: list[tuple[int, str, str]] = [
    (CUDA, "CUDA", "CUDA Runtime API (libcudart.so) — uprobes"),
    (NVIDIA, "NVIDIA", "NVIDIA kernel driver (nvidia.ko) — reserved, not currently traced"),
    (HOST, "HOST", "Host kernel events — tracepoints (scheduler, memory, process lifecycle)"),
    (DRIVER, "DRIVER", "CUDA Driver API (libcuda.so) — uprobes"),
    (IO, "IO", "Block I/O events — tracepoints (block_rq_issue/block_rq_complete)"),
    (TCP, "TCP", "TCP events — tracepoints (tcp_retransmit_skb)"),
    (NET, "NET", "Network socket events — syscall tracepoints (sendto/recvfrom)"),
    (NCCL, "NCCL", "NCCL collectives (libnccl.so) — uprobes; arg0 = bytes, arg1 = communicator"),
]

# (source, op, name, description) — Ingero's rows in Ingero's order, then ours.
OPS: list[tuple[int, int, str, str]] = [
    (CUDA, 1, "cudaMalloc", "GPU memory allocation"),
    (CUDA, 2, "cudaFree", "GPU memory free"),
    (CUDA, 3, "cudaLaunchKernel", "Launch GPU kernel via runtime API"),
    (CUDA, 4, "cudaMemcpy", "Synchronous host<->device memory copy"),
    (CUDA, 5, "cudaStreamSync", "Wait for all ops in a CUDA stream to complete"),
    (CUDA, 6, "cudaDeviceSync", "Wait for all GPU work on device to complete"),
    (CUDA, 7, "cudaMemcpyAsync", "Asynchronous host<->device memory copy"),
    (HOST, 1, "sched_switch", "CPU context switch — thread was descheduled"),
    (HOST, 2, "sched_wakeup", "Thread woken up and enqueued to run queue"),
    (HOST, 3, "mm_page_alloc", "Kernel page allocation (arg0 = bytes)"),
    (HOST, 4, "oom_kill", "Out-of-memory killer invoked"),
    (HOST, 5, "process_exec", "New process executed (execve)"),
    (HOST, 6, "process_exit", "Process exited"),
    (HOST, 7, "process_fork", "Process forked (child auto-enrolled for tracing)"),
    (DRIVER, 1, "cuLaunchKernel", "Launch GPU kernel via driver API (cuBLAS/cuDNN path)"),
    (DRIVER, 2, "cuMemcpy", "Synchronous memory copy via driver API"),
    (DRIVER, 3, "cuMemcpyAsync", "Asynchronous memory copy via driver API"),
    (DRIVER, 4, "cuCtxSynchronize", "Wait for all GPU work in context to complete"),
    (DRIVER, 5, "cuMemAlloc", "GPU memory allocation via driver API"),
    (DRIVER, 6, "cuMemAllocManaged", "Unified Memory allocation via driver API"),
    (CUDA, 8, "cudaMallocManaged", "Unified Memory allocation via runtime API"),
    (IO, 1, "block_read", "Block device read request"),
    (IO, 2, "block_write", "Block device write request"),
    (IO, 3, "block_discard", "Block device discard/trim request"),
    (TCP, 1, "tcp_retransmit", "TCP segment retransmission"),
    (NET, 1, "net_send", "Socket send/sendto syscall"),
    (NET, 2, "net_recv", "Socket recv/recvfrom syscall"),
    (HOST, 10, "pod_restart", "K8s pod container restart detected"),
    (HOST, 11, "pod_eviction", "K8s pod eviction detected"),
    (HOST, 12, "pod_oom_kill", "K8s pod OOM kill detected"),
    (NCCL, 1, "ncclAllReduce", "NCCL all-reduce collective"),
    (NCCL, 2, "ncclBroadcast", "NCCL broadcast collective"),
    (NCCL, 3, "ncclReduce", "NCCL reduce collective"),
    (NCCL, 4, "ncclAllGather", "NCCL all-gather collective"),
    (NCCL, 5, "ncclReduceScatter", "NCCL reduce-scatter collective"),
    (NCCL, 6, "ncclSend", "NCCL point-to-point send"),
    (NCCL, 7, "ncclRecv", "NCCL point-to-point receive"),
]

ALIASES: dict[str, str] = {
    "cudastreamsynchronize": "cudaStreamSync",
    "cudadevicesynchronize": "cudaDeviceSync",
    "cumemalloc_v2": "cuMemAlloc",
    "cumemallocmanaged_v2": "cuMemAllocManaged",
    "cumemcpy_v2": "cuMemcpy",
    "cumemcpyasync_v2": "cuMemcpyAsync",
    "culaunchkernel_ptsz": "cuLaunchKernel",
}

# Sources whose ops are GPU API calls with meaningful latency (the explain engine's targets).
GPU_API_SOURCES = (CUDA, DRIVER, NCCL)


@dataclass(frozen=True)
class OpRef:
    source: int
    op: int
    name: str

    @property
    def source_name(self) -> str:
        return SOURCE_NAMES.get(self.source, str(self.source))


SOURCE_NAMES: dict[int, str] = {sid: name for sid, name, _ in SOURCES}
_BY_ID: dict[tuple[int, int], OpRef] = {(s, o): OpRef(s, o, n) for s, o, n, _ in OPS}
_BY_NAME: dict[str, OpRef] = {ref.name.lower(): ref for ref in _BY_ID.values()}


def op_name(source: int, op: int) -> str:
    """Name of an op id pair; unknown pairs read ``source/op`` rather than failing."""
    ref = _BY_ID.get((source, op))
    return ref.name if ref else f"{SOURCE_NAMES.get(source, source)}/{op}"


def lookup_op(name: str) -> OpRef:
    """Op by name (case-insensitive, C names accepted). Raises UnknownOpError with suggestions."""
    key = name.strip().lower()
    key = ALIASES.get(key, key).lower()
    ref = _BY_NAME.get(key)
    if ref is not None:
        return ref
    close = [r.name for r in _BY_ID.values() if key[:5] and r.name.lower().startswith(key[:5])]
    hint = ("did you mean " + ", ".join(sorted(set(close))[:4]) + "?") if close else "see: SELECT * FROM ops"
    raise UnknownOpError(f"unknown op {name!r}", hint=hint)


def all_ops() -> list[OpRef]:
    return list(_BY_ID.values())
