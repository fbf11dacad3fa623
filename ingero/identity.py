"""Node identity: who this agent is in the fleet.

``--node`` > ``agent.node`` in the config file > the node recorded in the database an agent serves
(``ingero serve`` over a recording answers as the node that recorded it) > hostname. ``rank``, ``local_rank`` and
``world_size`` come from the ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` variables set by
torchrun / mpirun / SLURM launchers when present. The identity is stamped on every event and session.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ingero.errors import InvalidNodeNameError

NAME_SOURCES = ("--node", "config", "recorded", "hostname")
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class Identity:
    node: str
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    source: str = "hostname"  # where the name came from: one of NAME_SOURCES

    def as_dict(self) -> dict[str, object]:
        return {
            "node": self.node,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
        }


def validate_node_name(name: str) -> str:
    """Node names end up in ids ``{node}:{seq}``: no ``:``, and a hostname-like alphabet."""
    if ":" in name:
        raise InvalidNodeNameError(
            f"node name {name!r} contains ':'", hint="ids are '{node}:{seq}'; pick a name without ':'"
        )
    if not _NODE_RE.match(name):
        raise InvalidNodeNameError(
            f"node name {name!r} is not valid",
            hint="use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return name


def hostname_node() -> str:
    """The short hostname, made into a valid node name."""
    host = socket.gethostname().split(".")[0] or "localhost"
    host = re.sub(r"[^A-Za-z0-9._-]", "-", host).lstrip("._-")[:63]
    return host or "localhost"


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def resolve_identity(
    cli_node: str | None = None,
    config_node: str | None = None,
    env: Mapping[str, str] | None = None,
    recorded: str | None = None,
) -> Identity:
    """``recorded``: the node a served recording was made on (used only when it is a valid name)."""
    env = os.environ if env is None else env
    if recorded is not None and not _NODE_RE.match(recorded):
        recorded = None
    candidates = (cli_node, config_node, recorded)
    source, node = next(
        ((src, name) for src, name in zip(NAME_SOURCES, candidates, strict=False) if name),
        ("hostname", hostname_node()),
    )
    return Identity(
        node=validate_node_name(node),
        source=source,
        rank=_env_int(env, "RANK"),
        local_rank=_env_int(env, "LOCAL_RANK"),
        world_size=_env_int(env, "WORLD_SIZE"),
    )
