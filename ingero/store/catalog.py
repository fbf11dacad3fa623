"""Source and op ids — the same numbers Ingero uses, plus NCCL on an id Ingero does not use.

Ingero uses source 8 for CUDA Graph events, so NCCL is 9 (schema 3 moved it off 8; the migration
rewrites the rows of our older databases, see :mod:`ingero.store.schema`).

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
CUDA_GRAPH = 8  # Ingero's id for CUDA Graph events; traced by ingero too (capture, instantiate, launch)
NCCL = 9

SOURCES: list[tuple[int, str, str]] = [
    (CUDA, "CUDA", "CUDA Runtime API (libcudart.so) — uprobes"),
    (NVIDIA, "NVIDIA", "NVIDIA kernel driver (nvidia.ko) — reserved, not currently traced"),
    (HOST, "HOST", "Host kernel events — tracepoints (scheduler, memory, process lifecycle)"),
    (DRIVER, "DRIVER", "CUDA Driver API (libcuda.so) — uprobes"),
    (IO, "IO", "Block I/O events — tracepoints (block_rq_issue/block_rq_complete)"),
    (TCP, "TCP", "TCP events — tracepoints (tcp_retransmit_skb)"),
    (NET, "NET", "Socket send/receive of traced processes — syscall tracepoints (sendto/sendmsg/recvfrom/recvmsg)"),
    (CUDA_GRAPH, "CUDA_GRAPH", "CUDA Graph events — uprobes on libcudart/libcuda; arg0/arg1 = graph handles"),
    (NCCL, "NCCL", "NCCL collectives (libnccl.so) — uprobes; arg0 = bytes, arg1 = communicator (see nccl_calls)"),
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
    # More runtime calls (ours, after Ingero's ids). Arguments: see ingero/agent/trace/bpf/gpu_probes.c.
    (CUDA, 9, "cudaMemcpy2D", "Synchronous 2-D copy (arg0 = width x height bytes, arg1 = cudaMemcpyKind)"),
    (CUDA, 10, "cudaMemcpy2DAsync", "Asynchronous 2-D copy (arg0 = width x height bytes, arg1 = cudaMemcpyKind)"),
    (CUDA, 11, "cudaMemcpyPeer", "Synchronous copy between GPUs (arg0 = bytes, arg1 = src device << 16 | dst device)"),
    (CUDA, 12, "cudaMemcpyPeerAsync", "Asynchronous copy between GPUs (arg0 = bytes, arg1 = src << 16 | dst)"),
    (CUDA, 13, "cudaMemset", "Synchronous device memset, 1-D or 2-D (arg0 = bytes)"),
    (CUDA, 14, "cudaMemsetAsync", "Asynchronous device memset, 1-D or 2-D (arg0 = bytes)"),
    (CUDA, 15, "cudaEventSynchronize", "Wait for a CUDA event (arg0 = event)"),
    (CUDA, 16, "cudaEventQuery", "Poll a CUDA event (arg0 = event; ret 600 = not ready)"),
    (CUDA, 17, "cudaHostAlloc", "Pinned host memory allocation (arg0 = bytes, arg1 = flags)"),
    (CUDA, 18, "cudaMallocHost", "Pinned host memory allocation (arg0 = bytes)"),
    (DRIVER, 7, "cuMemFree", "GPU memory free via driver API (arg0 = device pointer)"),
    (CUDA, 19, "cudaMallocAsync", "Stream-ordered GPU allocation (arg0 = bytes, arg1 = the returned pointer)"),
    (CUDA, 20, "cudaFreeAsync", "Stream-ordered GPU memory free (arg0 = device pointer)"),
    # CUDA Graphs (Ingero's source 8); runtime and driver calls share an op.
    (CUDA_GRAPH, 1, "graphBeginCapture", "Stream capture begins (arg0 = stream, arg1 = capture mode)"),
    (CUDA_GRAPH, 2, "graphEndCapture", "Stream capture ends (arg0 = stream, arg1 = the captured graph)"),
    (CUDA_GRAPH, 3, "graphInstantiate", "Graph instantiated (arg0 = graph, arg1 = the executable graph)"),
    (CUDA_GRAPH, 4, "graphLaunch", "Executable graph launched (arg0 = executable graph, arg1 = stream)"),
]

ALIASES: dict[str, str] = {
    "cudastreamsynchronize": "cudaStreamSync",
    "cudadevicesynchronize": "cudaDeviceSync",
    "cumemalloc_v2": "cuMemAlloc",
    "cumemallocmanaged_v2": "cuMemAllocManaged",
    "cumemcpy_v2": "cuMemcpy",
    "cumemcpyasync_v2": "cuMemcpyAsync",
    "culaunchkernel_ptsz": "cuLaunchKernel",
    "cudamemcpy2d_ptds": "cudaMemcpy2D",
    "cudamemcpy2dasync_ptsz": "cudaMemcpy2DAsync",
    "cudamemset2d": "cudaMemset",
    "cudamemset2dasync": "cudaMemsetAsync",
    # CUDA Graph ops carry Ingero's names (its events.go); the runtime/driver C names are aliases
    "cudastreambegincapture": "graphBeginCapture",
    "cudastreambegincapture_ptsz": "graphBeginCapture",
    "cudastreamendcapture": "graphEndCapture",
    "cudastreamendcapture_ptsz": "graphEndCapture",
    "cudagraphinstantiate": "graphInstantiate",
    "cudagraphinstantiatewithflags": "graphInstantiate",
    "cudagraphlaunch": "graphLaunch",
    "cudagraphlaunch_ptsz": "graphLaunch",
    "custreambegincapture": "graphBeginCapture",
    "custreambegincapture_v2": "graphBeginCapture",
    "custreamendcapture": "graphEndCapture",
    "cugraphinstantiate": "graphInstantiate",
    "cugraphinstantiatewithflags": "graphInstantiate",
    "cugraphlaunch": "graphLaunch",
    "cumemfree_v2": "cuMemFree",
    "cudamallocasync_ptsz": "cudaMallocAsync",
    "cudafreeasync_ptsz": "cudaFreeAsync",
}


# Kernel launches (cudaLaunchKernel, cuLaunchKernel) carry their grid and block in arg1:
#   bits 0-10 block.x, 11-21 block.y, 22-28 block.z, 32-63 grid blocks (x*y*z, saturated at 2^32-1).
LAUNCH_BLOCK_BITS = ((0, 11), (11, 11), (22, 7))
LAUNCH_GRID_SHIFT = 32


def launch_dims(arg1: int) -> tuple[int, tuple[int, int, int]]:
    """(grid blocks, (block.x, block.y, block.z)) of a launch's arg1 (see LAUNCH_BLOCK_BITS)."""
    u = arg1 & U64
    bx, by, bz = ((u >> shift) & ((1 << width) - 1) for shift, width in LAUNCH_BLOCK_BITS)
    return u >> LAUNCH_GRID_SHIFT, (bx, by, bz)


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


def op_id(name: str) -> tuple[int, int]:
    """``(source, op)`` of an op by its catalog name: how code outside this module names an op, so
    that no id is written twice (``frame.is_op(*op_id("sched_switch"))``)."""
    ref = lookup_op(name)
    return ref.source, ref.op


def op_ids(*names: str) -> tuple[tuple[int, int], ...]:
    return tuple(op_id(n) for n in names)


# Allocations whose returned pointer the tracer records in arg1 (read from the out-parameter at
# return; 0 when the call failed), and the frees whose arg0 is that pointer (see allocations.py).
ALLOC_OPS = op_ids("cudaMalloc", "cudaMallocManaged", "cudaMallocAsync", "cuMemAlloc", "cuMemAllocManaged")
FREE_OPS = op_ids("cudaFree", "cudaFreeAsync", "cuMemFree")


# --- NCCL communicators and calls ----------------------------------------------------------------

U64 = (1 << 64) - 1
NCCL_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
# Private op ids of the tracer's control records (>= 100: never stored as events; see nccl_probes.c).
NCCL_COMM_INIT_OP = 100  # a communicator: comm, rank, nranks, cluster-wide id
NCCL_CALL_ENTER_OP = 101  # a call's entry: comm, seq, count, datatype, redop, peer

# ncclDataType_t -> (name, bytes per element); ncclRedOp_t -> name. bytes = count × size.
NCCL_DATATYPES: dict[int, tuple[str, int]] = {
    0: ("int8", 1),
    1: ("uint8", 1),
    2: ("int32", 4),
    3: ("uint32", 4),
    4: ("int64", 8),
    5: ("uint64", 8),
    6: ("float16", 2),
    7: ("float32", 4),
    8: ("float64", 8),
    9: ("bfloat16", 2),
    10: ("float8e4m3", 1),
    11: ("float8e5m2", 1),
}
NCCL_REDOPS: dict[int, str] = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}


def splitmix64(x: int) -> int:
    """One splitmix64 step (Steele, Lea & Flood), on unsigned 64-bit integers."""
    z = (x + 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def nccl_comm_id(unique_id: bytes) -> int:
    """The cluster-wide communicator id: splitmix64 folded over the 16 little-endian u64 words of the
    128-byte ``ncclUniqueId`` (``h = splitmix64(h ^ word)``, h starting at 0). The BPF program
    (``ingero/agent/trace/bpf/nccl_probes.c``) computes the same; unsigned, as :func:`as_sqlite_int`
    stores it signed."""
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an ncclUniqueId has {NCCL_UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
    h = 0
    for i in range(0, NCCL_UNIQUE_ID_BYTES, 8):
        h = splitmix64(h ^ int.from_bytes(unique_id[i : i + 8], "little"))
    return h


def as_sqlite_int(u: int) -> int:
    """An unsigned 64-bit value as SQLite's signed INTEGER (and back with ``& U64``)."""
    u &= U64
    return u - (1 << 64) if u >= 1 << 63 else u
