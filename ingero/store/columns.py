"""Column lists of the ``events`` and ``causal_chains`` tables, declared once.

Everything that names these columns derives them from here: the writer's INSERT, the merge's
``INSERT … SELECT`` (with the default to use when an input database lacks a column), the chain
dictionaries of the explain engine, the exports. ``tests/test_store_columns.py`` checks that the DDL in
:mod:`ingero.store.schema` creates exactly these columns, in this order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    name: str
    default: str  # SQL literal used when an input table lacks the column (merge) — and the DDL default
    recorded: bool = False  # written by the tracer for each event (the fixed-width event row)


# events, in table order. ``id`` and ``node`` are assigned by the writer / merge, not copied.
EVENTS: tuple[Column, ...] = (
    Column("id", "''"),
    Column("timestamp", "0", recorded=True),
    Column("pid", "0", recorded=True),
    Column("tid", "0", recorded=True),
    Column("source", "0", recorded=True),
    Column("op", "0", recorded=True),
    Column("duration", "0", recorded=True),
    Column("gpu_id", "0", recorded=True),
    Column("arg0", "0", recorded=True),
    Column("arg1", "0", recorded=True),
    Column("ret_code", "0", recorded=True),
    Column("stack_hash", "0", recorded=True),
    Column("node", "''"),
    Column("rank", "NULL"),
    Column("local_rank", "NULL"),
    Column("world_size", "NULL"),
    Column("stack_ips", "''"),
    Column("cgroup_id", "0", recorded=True),
)

# causal_chains, in table order.
CHAINS: tuple[Column, ...] = (
    Column("id", "''"),
    Column("detected_at", "0"),
    Column("severity", "'LOW'"),
    Column("summary", "''"),
    Column("root_cause", "''"),
    Column("explanation", "''"),
    Column("recommendations", "''"),
    Column("cuda_op", "''"),
    Column("cuda_p99_us", "0"),
    Column("cuda_p50_us", "0"),
    Column("tail_ratio", "0"),
    Column("timeline", "''"),
    Column("node", "''"),
)

# Assigned by whoever writes the row (writer: the node's identity; merge: the input's node), never copied.
_ASSIGNED = ("id", "node")
# The identity columns the writer stamps on every event it stores.
IDENTITY_FIELDS = ("node", "rank", "local_rank", "world_size")

# Column order of a recorded event row (the tracer's fixed-width record, the writer's input).
EVENT_FIELDS: tuple[str, ...] = tuple(c.name for c in EVENTS if c.recorded)
CHAIN_FIELDS: tuple[str, ...] = tuple(c.name for c in CHAINS)


def copied(table: tuple[Column, ...]) -> tuple[Column, ...]:
    """The columns a merge copies from an input (all but the assigned ``id`` and ``node``)."""
    return tuple(c for c in table if c.name not in _ASSIGNED)


def names(table: tuple[Column, ...]) -> tuple[str, ...]:
    return tuple(c.name for c in table)
