"""Every event of one node as parallel numpy columns: :class:`Frame` (and :class:`ArgRows`, the rows whose
arguments some rule reads), with the lookups the rules share (:func:`distinct`, :func:`member`).

Frames are loaded by :func:`ingero.explain.frame_load.load_frames` (one pass over ``events``, packed
inside SQLite); databases written by several nodes are split into one frame per node, because latency
distributions of different machines are never mixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

from ingero.store.catalog import ALLOC_OPS, FREE_OPS, GPU_API_SOURCES, IO, NET, TCP, op_ids

I64 = npt.NDArray[np.int64]

GPU_SOURCES = GPU_API_SOURCES  # the catalog's one list of GPU API sources

# Rows whose arguments some rule reads: block I/O (sectors), socket I/O (bytes), page allocations
# (bytes), OOM kills, process starts and forks (who), copies (bytes, direction), allocations and frees
# (bytes, pointer), kernel launches (the kernel function: ingero's tracer records it in arg0), and the
# scheduler rows the per-thread off-CPU intervals are built from (sched_switch: arg0 = prev_state,
# arg1 = the preemptor's tid — Ingero's own rows carry the thread itself there; sched_wakeup: the waker).
ARG_SOURCES = (IO, NET, TCP)  # every op of these
ARG_OPS = (
    *op_ids(
        *("sched_switch", "sched_wakeup", "mm_page_alloc", "oom_kill", "process_exec", "process_exit", "process_fork"),
        *("pod_oom_kill", "cudaMemcpy", "cudaMemcpyAsync", "cuMemcpy", "cuMemcpyAsync"),
    ),
    *ALLOC_OPS,  # every allocation (bytes, the returned pointer) and free (the pointer): the catalog's sets
    *FREE_OPS,
)
LAUNCH_ARG_OPS = op_ids("cudaLaunchKernel", "cuLaunchKernel")  # arg0 = the kernel function, when recorded (not 0)


_ARG_TABLE = np.zeros(16 * 256, dtype=bool)
for _src in ARG_SOURCES:
    _ARG_TABLE[_src * 256 : _src * 256 + 256] = True
for _src, _op in ARG_OPS:
    _ARG_TABLE[_src * 256 + _op] = True
_GPU_TABLE = np.zeros(16, dtype=bool)
_GPU_TABLE[list(GPU_SOURCES)] = True
_LAUNCH_TABLE = np.zeros(16 * 256, dtype=bool)
for _src, _op in LAUNCH_ARG_OPS:
    _LAUNCH_TABLE[_src * 256 + _op] = True


def distinct(arr: I64, few: int = 16) -> I64:
    """``np.unique`` for columns that hold a few distinct values (pids, tids of GPU calls): peel them off
    one comparison pass at a time, falling back to a sort when there are more than ``few``."""
    rest = arr
    found: list[int] = []
    while rest.size and len(found) < few:
        x = int(rest[0])
        found.append(x)
        rest = rest[rest != x]
    if rest.size:
        return np.unique(arr)
    return np.asarray(sorted(found), dtype=np.int64)


def member(arr: I64, values: Sequence[int] | I64) -> npt.NDArray[np.bool_]:
    """``np.isin`` for the usual case of a few values (the GPU processes, their threads): one
    comparison per value instead of a sort of the whole column."""
    v = np.unique(np.asarray(values, dtype=np.int64))
    if v.size > 8:
        out: npt.NDArray[np.bool_] = np.isin(arr, v)
        return out
    m = np.zeros(arr.shape, dtype=bool)
    for x in v.tolist():
        m |= arr == x
    return m


def rows_of(mask: npt.NDArray[np.bool_]) -> I64:
    """The positions a row mask selects: one pass over the mask for the several columns taken with it
    (a boolean index scans the mask again for every column)."""
    out: I64 = np.flatnonzero(mask)
    return out


def arg_row_mask(source: I64, op: I64, arg0: I64) -> npt.NDArray[np.bool_]:
    """The rows whose arguments some rule reads (:data:`ARG_OPS`, launches with a kernel function)."""
    key = source * 256 + op
    out: npt.NDArray[np.bool_] = _ARG_TABLE[key] | (_LAUNCH_TABLE[key] & (arg0 != 0))
    return out


@dataclass
class ArgRows:
    """Rows that carry meaningful ``arg0``/``arg1`` (see :func:`arg_row_mask`), for one node."""

    source: I64
    op: I64
    pid: I64
    ts_ns: I64
    arg0: I64
    arg1: I64
    tid: I64
    dur: I64

    @cached_property
    def _op_key(self) -> I64 | None:
        """Each row's (source, op) in one number (one comparison per :meth:`is_op`); None when an id
        does not fit its 31 bits."""
        for ids in (self.source, self.op):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 31):
                return None
        key: I64 = (self.source << 32) | self.op
        return key

    def is_op(self, source_op: tuple[int, int]) -> npt.NDArray[np.bool_]:
        """Rows of one op (``catalog.op_id(name)``)."""
        s, o = source_op
        key = self._op_key
        if key is None or not (0 <= s < 1 << 31 and 0 <= o < 1 << 31):
            both: npt.NDArray[np.bool_] = (self.source == s) & (self.op == o)
            return both
        m: npt.NDArray[np.bool_] = key == (s << 32) | o
        return m

    def is_any(self, ops: Sequence[tuple[int, int]]) -> npt.NDArray[np.bool_]:
        """Rows of any of ``ops`` (``catalog.op_ids(...)``)."""
        m: npt.NDArray[np.bool_] = np.logical_or.reduce([self.is_op(op) for op in ops])
        return m

    @classmethod
    def empty(cls) -> ArgRows:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z, z, z, z, z)

    def select(self, mask: npt.NDArray[np.bool_]) -> ArgRows:
        i = rows_of(mask)
        return ArgRows(
            self.source[i], self.op[i], self.pid[i], self.ts_ns[i], self.arg0[i], self.arg1[i], self.tid[i], self.dur[i]
        )

    def of(self, source: int, ops: Sequence[int] | None = None) -> ArgRows:
        m = self.source == source
        if ops is not None:
            m &= np.isin(self.op, np.asarray(ops, dtype=np.int64))
        return self.select(m)


@dataclass
class Frame:
    """Every event of one node in a window, as parallel arrays (not necessarily time-ordered)."""

    node: str
    source: I64
    op: I64
    dur: I64
    ts_ns: I64
    pid: I64
    failed: npt.NDArray[np.bool_]  # ret_code != 0
    tid: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # thread ids (= pid when unknown)
    args: ArgRows = field(default_factory=ArgRows.empty)
    gpu_ids: dict[int, set[int]] = field(default_factory=dict)  # pid -> GPU ids it used

    def __post_init__(self) -> None:
        if self.tid.size != self.pid.size:  # threads unknown: each row is its process's
            self.tid = self.pid.copy()

    @property
    def size(self) -> int:
        return int(self.source.size)

    @property
    def first_ns(self) -> int:
        return int(self.ts_ns.min()) if self.size else 0

    @property
    def last_ns(self) -> int:
        return int(self.ts_ns.max()) if self.size else 0

    def is_op(self, source: int, op: int | None = None) -> npt.NDArray[np.bool_]:
        m: npt.NDArray[np.bool_] = self.source == source
        if op is not None:
            m &= self.op == op
        return m

    @cached_property
    def pids(self) -> I64:
        """Distinct pids of the rows (computed once per frame)."""
        return distinct(self.pid)

    @cached_property
    def _gpu(self) -> npt.NDArray[np.bool_]:
        out: npt.NDArray[np.bool_] = _GPU_TABLE[self.source & 0xF]
        out.flags.writeable = False  # shared by every caller
        return out

    def gpu_mask(self) -> npt.NDArray[np.bool_]:
        """The GPU API rows (computed once per frame; read-only)."""
        return self._gpu

    def select(self, mask: npt.NDArray[np.bool_]) -> Frame:
        i = rows_of(mask)
        return Frame(
            self.node,
            self.source[i],
            self.op[i],
            self.dur[i],
            self.ts_ns[i],
            self.pid[i],
            self.failed[i],
            self.tid[i],
            self.args,
            self.gpu_ids,
        )
