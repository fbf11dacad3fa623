"""NCCL calls from the tracer's records to ``nccl_calls`` rows (see :mod:`ingero.store.schema`).

A call leaves two records (``ingero/agent/trace/bpf/nccl_probes.c``): at its entry an
``NCCL_CALL_ENTER_OP`` control record (communicator, seq, count, datatype, reduce op, peer), at its
return the usual NCCL event (duration, bytes, return code). Both carry the same entry timestamp, so
``(pid, tid, ts)`` pairs them. A call still in flight when a batch is written is written with
duration −1 (a rank waiting for a hung peer is visible); its return writes the row again, which
replaces it (the writer's ``INSERT OR REPLACE`` on node, pid, tid, timestamp).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ingero.store.catalog import NCCL_DATATYPES, as_sqlite_int
from ingero.store.nccl import IN_FLIGHT

MAX_PENDING = 65_536  # calls entered and not returned that are remembered (the oldest are forgotten)
NO_REDOP = 15  # nccl_probes.c's NCCL_NO_REDOP
Row = tuple[int, ...]  # (pid, tid, comm, seq, op, timestamp, duration, datatype, redop, count, bytes, peer, ret)


class NcclCalls:
    """Pairs entry records with returns. One thread at a time (the recorder's)."""

    def __init__(self) -> None:
        # (pid, tid, raw ts) -> (row fields, [written already as in flight?])
        self._pending: OrderedDict[tuple[int, int, int], tuple[list[int], list[bool]]] = OrderedDict()
        self.unpaired_returns = 0

    def enter(self, e: tuple[int, ...], offset_ns: int) -> None:
        """One entry record, as ``ndarray.tolist()`` gives it: (ts, duration, arg0, arg1, cgroup_id,
        pid, tid, ret, stack_id, source, op, cpu, flags)."""
        ts, count, comm, pid, tid, peer, packed, seq = e[0], e[2], e[3], e[5], e[6], e[7], e[11], e[12]
        op, datatype, redop = packed & 0xF, (packed >> 4) & 0xF, (packed >> 8) & 0xF
        size = NCCL_DATATYPES.get(datatype, ("", 1))[1]
        row = [pid, tid, as_sqlite_int(comm), seq, op, ts + offset_ns, IN_FLIGHT, datatype,
               -1 if redop == NO_REDOP else redop, count, count * size, peer, 0]  # fmt: skip
        self._pending[(pid, tid, ts)] = (row, [False])
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def returned(self, ev: np.ndarray) -> list[Row]:
        """Rows for the NCCL events (returns) in ``ev`` whose entry was seen."""
        out: list[Row] = []
        for ts, pid, tid, dur, nbytes, ret in zip(
            ev["ts"].tolist(), ev["pid"].tolist(), ev["tid"].tolist(), ev["duration"].tolist(),
            ev["arg0"].tolist(), ev["ret"].tolist(), strict=True,
        ):  # fmt: skip
            got = self._pending.pop((pid, tid, ts), None)
            if got is None:
                self.unpaired_returns += 1
                continue
            row = got[0]
            row[6], row[10], row[12] = int(dur), int(nbytes), int(ret)
            out.append(tuple(row))
        return out

    def in_flight(self) -> list[Row]:
        """Calls entered and not returned, each written once (duration −1) until its return."""
        out: list[Row] = []
        for row, written in self._pending.values():
            if not written[0]:
                out.append(tuple(row))
                written[0] = True
        return out
