"""``ingero explain --nodes``: the late rank told across nodes where no node recorded NCCL calls.

Each agent analyses only its own node, and on the late rank's node its extra host code is just host
code; only beside the other nodes' sleeps is it a late rank. So a fleet explain over several nodes asks
every agent for its step-gap summary with its ``/api/v1/chains`` answer (``steps=1``; answered as
``steps``: per GPU thread, the usual off-CPU time and the few gaps that can matter, bounded —
:class:`ingero.explain.rules_ranks_fleet.NodeSteps`), on the node's own clock. Here each summary is moved
onto this host's clock by the offset the fan-out measured (:mod:`ingero.fleet.skew`: the offset now;
a clock's drift since an old recording is not taken off) and judged by the same
:func:`~ingero.explain.rules_ranks_fleet.late_ranks` a database holding several nodes is judged by. A
late rank found so is the fleet's straggler verdict (:func:`with_late_rank`).

A node whose answer has no summary (an agent older than this), or whose clock could not be measured,
takes no part: the others are judged without it and one line says so; every node's own chains stand.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ingero.fleet.outcome import NodeFailure, NodeOutcome

if TYPE_CHECKING:
    from ingero.explain.model import Chain
    from ingero.explain.rules_ranks_fleet import NodeSteps
    from ingero.fleet.straggler import StragglerVerdict

STEPS = "steps"  # the /chains parameter (steps=1) and its answer's field
_REFUSED = 400  # what an agent answers to a parameter it does not know


def steps_params(params: dict[str, str] | None) -> dict[str, str]:
    """``/chains`` parameters that also ask for the node's step-gap summary (the agent computes it only
    when asked: 2-3 % of an explain's CPU on a 1 M-event node)."""
    return {**(params or {}), STEPS: "1"}


async def ask_with_steps(
    ask: Callable[[dict[str, str] | None], Awaitable[dict[str, Any]]],
    params: dict[str, str] | None,
) -> dict[str, Any]:
    """``ask`` (a ``/chains`` request) with ``steps=1``; an agent older than the summary refuses the
    parameter (400) and is asked again without it (its answer then has no ``steps``: told in one line)."""
    try:
        return await ask(steps_params(params))
    except NodeFailure as e:
        if e.status != _REFUSED:
            raise
    return await ask(params)


def node_summaries(outcomes: Sequence[NodeOutcome]) -> tuple[list[NodeSteps], list[str], list[str]]:
    """Every answered node's summaries on this host's clock, the nodes that sent none (older agents,
    or malformed summaries), and those whose clock offset is unknown."""
    from ingero.explain.rules_ranks_fleet import NodeSteps

    out: list[NodeSteps] = []
    older: list[str] = []
    unclocked: list[str] = []
    for o in sorted(outcomes, key=lambda o: o.label):
        body = o.data.get("chains") if o.answered and isinstance(o.data, dict) else None
        if not isinstance(body, dict):
            continue
        raw = body.get(STEPS)
        if not isinstance(raw, list):
            older.append(o.label)
            continue
        if o.skew is None or not math.isfinite(o.skew.offset_ns):
            unclocked.append(o.label)
            continue
        try:
            # a node's summary takes the fleet's label for it (a twin's is name@host:port), as its chains do
            parts = [NodeSteps.from_dict(d, o.label if d.get("node") in (o.node, None) else None) for d in raw]
        except (KeyError, TypeError, ValueError, AttributeError):
            older.append(o.label)
            continue
        out += [p.on_clock(o.skew.offset_ns) for p in parts]
    return out, older, unclocked


def with_late_ranks(outcomes: Sequence[NodeOutcome], chains: list[Chain]) -> tuple[list[Chain], list[str]]:
    """``chains`` with the late ranks told across the nodes' summaries, and the one-line notes (nodes
    left out of that judgement, and why)."""
    from ingero.explain.model import sort_chains
    from ingero.explain.rules_ranks_fleet import late_ranks

    summaries, older, unclocked = node_summaries(outcomes)
    notes = []
    if older:
        notes.append(
            f"late rank across nodes: no step summary from {', '.join(older)} (an older agent: upgrade it); "
            "judged without it, each node's own chains stand"
        )
    if unclocked:
        notes.append(
            f"late rank across nodes: {', '.join(unclocked)} left out (its clock offset could not be measured)"
        )
    # (an agent serving a database of several nodes may have told the same late rank: the same chain id, replaced)
    return sort_chains(late_ranks(summaries, list(chains))), notes


def with_late_rank(v: StragglerVerdict, chains: Sequence[Chain]) -> StragglerVerdict:
    """The late rank told across nodes (its lost time, the most where several) is the fleet's straggler:
    it replaces the host-figures verdict, which compares event counts and cannot see a rank others wait for."""
    late = [c for c in chains if c.family == "late-rank" and c.evidence.get("rule") == "late-rank-across-nodes"]
    if not late:
        return v
    top = max(late, key=lambda c: float(c.evidence.get("lost_ms") or 0.0))
    v.outlier = top.node
    v.line = f"{top.node} is the late rank: {top.summary.removeprefix('late rank: ')}"
    return v
