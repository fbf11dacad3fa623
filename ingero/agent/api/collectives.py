"""``GET /api/v1/collectives?since=&from=&to=&comm=``: this node's NCCL calls as columnar arrays.

The fleet client joins them across nodes (:mod:`ingero.fleet.collectives`); the shape and the bound
(at most :data:`ingero.store.nccl.MAX_CALLS` calls, the newest, ``truncated`` set) are
:mod:`ingero.store.nccl`'s. ``comm`` restricts the answer to one communicator (its cluster-wide id,
16 hex digits). A database without NCCL tables (Ingero's, or older ones) answers empty arrays.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from ingero.agent.api.endpoints import WINDOW_PARAMS, AgentContext, encode, ok, reader, window_from_params
from ingero.errors import UsageError
from ingero.store.nccl import parse_comm, read_calls

PARAMS = (*WINDOW_PARAMS, "comm")


def collectives(ctx: AgentContext, params: Mapping[str, str], cancel: threading.Event) -> bytes:
    try:
        comm = parse_comm(params.get("comm"))
    except ValueError as e:
        raise UsageError(str(e), hint="pass the id shown by: ingero fleet stragglers --json") from None
    with reader(ctx, cancel) as conn:
        window = window_from_params(conn, params)
        body = read_calls(conn, window, comm=comm)
    return encode(ok(ctx, window=window.as_dict(), **body))
