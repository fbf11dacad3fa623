"""The collectives join's data: one node's calls as the agent sends them (:class:`NodeCalls`) and what
the join finds (:class:`RankRow`, :class:`CommSummary`, :class:`CollectiveVerdict`), with the
wording helpers. The join itself is :mod:`ingero.fleet.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingero.store.nccl import CALL_COLUMNS

KINDS = ("hung", "straggler", "inconclusive", "slow-collective", "no-straggler", "no-collectives")


@dataclass
class NodeCalls:
    """One node's calls, columnar (``comm`` is the cluster-wide id as an unsigned 64-bit integer)."""

    node: str
    comm: np.ndarray  # uint64
    seq: np.ndarray  # int64
    op: np.ndarray  # int64 (NCCL op id)
    bytes: np.ndarray  # int64
    entry_ns: np.ndarray  # int64, the node's wall clock
    duration_ns: np.ndarray  # int64, IN_FLIGHT when not returned
    rank: np.ndarray  # int64, rank inside the communicator
    nranks: dict[int, int] = field(default_factory=dict)  # comm id -> communicator size
    offset_ns: float = 0.0  # node clock − this host's clock
    uncertainty_ns: float = 0.0  # ± of offset_ns
    gpu_model: str = ""

    def __len__(self) -> int:
        return int(self.seq.size)

    @classmethod
    def from_body(
        cls, node: str, body: dict[str, Any], offset_ns: float = 0.0, uncertainty_ns: float = 0.0
    ) -> NodeCalls:
        """Decode an agent's ``/api/v1/collectives`` answer; raises ValueError on a malformed one."""
        comms = body.get("comms")
        calls = body.get("calls")
        if not isinstance(comms, list) or not isinstance(calls, dict):
            raise ValueError("the /collectives answer lacks 'comms' or 'calls'")
        ids = np.array([int(str(c.get("id")), 16) for c in comms], dtype=np.uint64)
        nranks = {int(ids[i]): int(c.get("nranks") or 0) for i, c in enumerate(comms)}
        cols: dict[str, np.ndarray] = {}
        n = None
        for name in CALL_COLUMNS:
            raw = calls.get(name)
            if not isinstance(raw, list):
                raise ValueError(f"the /collectives answer lacks the {name!r} column")
            cols[name] = np.asarray(raw, dtype=np.int64)
            if n is not None and cols[name].size != n:
                raise ValueError("the /collectives columns differ in length")
            n = cols[name].size
        idx = cols["comm"]
        if idx.size and (idx.min() < 0 or idx.max() >= ids.size):
            raise ValueError("a /collectives call names a communicator outside 'comms'")
        return cls(
            node=node,
            comm=ids[idx] if idx.size else np.zeros(0, dtype=np.uint64),
            seq=cols["seq"],
            op=cols["op"],
            bytes=cols["bytes"],
            entry_ns=cols["entry_ns"],
            duration_ns=cols["duration_ns"],
            rank=cols["rank"],
            nranks=nranks,
            offset_ns=float(offset_ns),
            uncertainty_ns=float(uncertainty_ns),
            gpu_model=str(body.get("gpu_model") or ""),
        )


def comm_hex(comm: int) -> str:
    return f"{comm & 0xFFFFFFFFFFFFFFFF:016x}"


@dataclass
class RankRow:
    """One rank of one communicator: how often it came last, by how much, and how long it waited."""

    node: str
    comm: str
    rank: int
    calls: int  # complete calls it took part in
    last: int  # calls where it arrived last
    median_lag_ms: float  # median lag over the calls where it came last
    wait_s: float  # total time it waited for others
    wait_share: float  # wait / its active span
    uncertainty_ms: float  # its node's clock uncertainty
    gpu_model: str = ""
    clock_conflicts: int = 0  # calls where its wait exceeded its own call time beyond the clocks' ±

    @property
    def last_share(self) -> float:
        return self.last / self.calls if self.calls else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "comm": self.comm,
            "rank": self.rank,
            "calls": self.calls,
            "last": self.last,
            "last_share": round(self.last_share, 4),
            "median_lag_ms": round(self.median_lag_ms, 4),
            "wait_s": round(self.wait_s, 6),
            "wait_share": round(self.wait_share, 5),
            "uncertainty_ms": round(self.uncertainty_ms, 4),
            "clock_conflicts": self.clock_conflicts,
        }


@dataclass
class CommSummary:
    comm: str
    nranks: int
    op: str  # most frequent op
    complete: int
    incomplete: int
    in_flight: int
    median_bytes: float
    median_transfer_ms: float
    bandwidth_gbps: float  # bytes / transfer (algorithm bandwidth), median call
    transfer_share: float  # transfers / span
    ranks: list[RankRow] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "comm": self.comm,
            "nranks": self.nranks,
            "op": self.op,
            "complete_calls": self.complete,
            "incomplete_calls": self.incomplete,
            "in_flight_calls": self.in_flight,
            "median_bytes": self.median_bytes,
            "median_transfer_ms": round(self.median_transfer_ms, 4),
            "bandwidth_gbps": round(self.bandwidth_gbps, 4),
            "transfer_share": round(self.transfer_share, 4),
            "ranks": [r.as_dict() for r in self.ranks],
        }


@dataclass
class CollectiveVerdict:
    """``line`` is the verdict without a prefix for a straggler or a hung rank (``gpu-node-03 (rank 2)
    arrived last at …``: printed after ``straggler:``) and self-describing otherwise (``inconclusive:
    …``, ``no straggler: …``); :meth:`headline` is the full line."""

    kind: str  # one of KINDS
    line: str
    node: str | None = None
    rank: int | None = None
    comm: str | None = None
    lag_ms: float = 0.0
    uncertainty_ms: float = 0.0
    last_calls: int = 0
    calls: int = 0
    peers_wait_s: float = 0.0
    peers_wait_share: float = 0.0
    comms: list[CommSummary] = field(default_factory=list)

    @property
    def ranks(self) -> list[RankRow]:
        return [r for c in self.comms for r in c.ranks]

    def headline(self) -> str:
        return f"straggler: {self.line}" if self.kind in ("straggler", "hung") else self.line

    @property
    def outlier(self) -> str | None:
        """The node to blame (a straggler or a hung rank), else None."""
        return self.node if self.kind in ("straggler", "hung") else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "line": self.line,
            "headline": self.headline(),
            "node": self.node,
            "rank": self.rank,
            "comm": self.comm,
            "lag_ms": round(self.lag_ms, 4),
            "uncertainty_ms": round(self.uncertainty_ms, 4),
            "last_calls": self.last_calls,
            "calls": self.calls,
            "peers_wait_s": round(self.peers_wait_s, 6),
            "peers_wait_share": round(self.peers_wait_share, 5),
            "comms": [c.as_dict() for c in self.comms],
        }


# --- the join ----------------------------------------------------------------------------------


def fmt_ms(ms: float) -> str:
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.1f} ms"
    return f"{ms * 1000:.0f} µs"


def fmt_secs(s: float) -> str:
    if s >= 7200:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s" if s >= 1 else fmt_ms(s * 1000)


def fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"
