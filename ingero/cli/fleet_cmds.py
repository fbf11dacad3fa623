"""Fleet mode of ``ingero query`` and ``ingero explain``, and the glue every fleet command shares.

``query.py`` and ``explain.py`` dispatch here when ``--nodes`` is given (or the config lists
``fleet.nodes`` and no local database); this module never imports them back. Imports of trio/httpx
happen only here, at call time.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ingero.cli import common
from ingero.cli.output import emit_json, emit_rows, note, warn
from ingero.config import NodeSpec
from ingero.errors import NoNodeAnsweredError, QueryError, UsageError

if TYPE_CHECKING:
    from ingero.fleet.outcome import NodeOutcome
    from ingero.fleet.render import Progress
    from ingero.fleet.settings import ClientSettings

STRICT_EXIT = 5  # --strict and some node failed (results were still printed)


def nodes_from(args: argparse.Namespace) -> list[NodeSpec]:
    nodes = common.fleet_nodes_from(args)
    if not nodes:
        raise UsageError(
            "no nodes to ask",
            hint="pass --nodes host:port,host:port or list fleet.nodes in the config (--config, $INGERO_CONFIG)",
        )
    return nodes


def settings_from_args(args: argparse.Namespace) -> ClientSettings:
    """The config's ``fleet:`` section overridden by the fleet flags."""
    from ingero.fleet.settings import settings_from

    cfg = common.config_from(args)
    return settings_from(
        cfg.fleet,
        config_path=cfg.path,
        timeout=getattr(args, "timeout", None),
        fanout=getattr(args, "fanout", None),
        token=getattr(args, "token", None),
        ca_cert=getattr(args, "ca_cert", None),
        client_cert=getattr(args, "client_cert", None),
        client_key=getattr(args, "client_key", None),
        plaintext=bool(getattr(args, "plaintext", False)),
        allow_plaintext_remote=bool(getattr(args, "allow_plaintext_remote", False)),
    )


def progress_for(nodes: Sequence[NodeSpec]) -> Progress:
    from ingero.fleet.render import Progress

    return Progress(len(nodes))


def report(outcomes: Sequence[NodeOutcome], settings: ClientSettings, *, strict: bool, what: str = "answer") -> int:
    """Skew warnings and the folded unanswered list on stderr; the exit code (or NoNodeAnsweredError)."""
    from ingero.fleet.render import folded_failure_lines, skew_warnings, twin_warning

    twins = twin_warning(outcomes)
    if twins:
        warn(twins)
    for line in skew_warnings([o for o in outcomes if o.answered], settings.skew_threshold_ms):
        warn(line)
    failed = [o for o in outcomes if not o.answered]
    folded = folded_failure_lines(outcomes)
    answered = len(outcomes) - len(failed)
    if failed:
        note(f"{len(failed)} of {len(outcomes)} node(s) did not {what}:")
        for line in folded:
            note(f"  {line}")
    if answered == 0:
        listing = "; ".join(folded) if len(folded) <= 4 else f"{len(folded)} kinds of failure listed above"
        raise NoNodeAnsweredError(
            f"none of the {len(outcomes)} node(s) answered: {listing}",
            hint="check the addresses, that the agents run (ingero fleet status), and the TLS/token settings",
        )
    if strict and failed:
        note(f"--strict: exiting with {STRICT_EXIT} because {len(failed)} node(s) failed")
        return STRICT_EXIT
    return 0


# The agent's answer to a statement that cannot run anywhere: bad SQL (400), a refused statement (403).
_SQL_STATUSES = frozenset({400, 403})


def query_error(outcomes: Sequence[NodeOutcome]) -> QueryError | None:
    """Bad SQL is the query's error, not N node failures: when no node answered and every node that was
    reached refused the statement with the same words, that is one :class:`QueryError` (exit 2)."""
    if any(o.answered for o in outcomes):
        return None
    reached = [o for o in outcomes if o.status is not None]
    if not reached or any(o.status not in _SQL_STATUSES for o in reached):
        return None
    reasons = {o.reason for o in reached}
    if len(reasons) != 1:
        return None
    reason = reasons.pop()
    prefix = f"HTTP {reached[0].status}: "
    text = reason[len(prefix) :] if reason.startswith(prefix) else reason
    where = "every node" if len(reached) == len(outcomes) else f"{len(reached)} of {len(outcomes)} node(s)"
    return QueryError(f"{text} (said by {where})")


def run_query(args: argparse.Namespace, sql: str) -> int:
    """``ingero query --nodes ... SQL``: rows from every node under a ``node`` column."""
    from ingero.fleet.operations import query_sync
    from ingero.fleet.render import query_footer, truncated_lines

    nodes = nodes_from(args)
    settings = settings_from_args(args)
    limit = getattr(args, "limit", None)
    if limit is not None and limit <= 0:
        raise UsageError(f"--limit {limit}: must be at least 1")
    progress = progress_for(nodes)
    try:
        result = query_sync(
            nodes,
            settings,
            sql,
            limit=limit,
            timeout_ms=getattr(args, "timeout_ms", None),
            since=getattr(args, "since", None),
            from_=getattr(args, "from_", None),
            to=getattr(args, "to", None),
            pid=getattr(args, "pid", None),
            op=getattr(args, "op", None),
            on_outcome=progress,
        )
    finally:
        progress.clear()
    from ingero.fleet.render import folded_failure_lines

    bad_sql = query_error(result.outcomes)
    if bad_sql is not None:
        unreached = [o for o in result.outcomes if o.status is None]
        for line in folded_failure_lines(unreached):
            note(f"not asked: {line}")
        raise bad_sql
    fmt = getattr(args, "format", "table")
    if getattr(args, "annotations", False) and result.answered and result.columns:
        from ingero.cli.annotate import fleet_labels

        result.rows = fleet_labels(nodes, settings, result.columns, result.rows)
        result.columns = [*result.columns, "labels"]
    if result.answered and result.columns:
        emit_rows(result.columns, result.rows, fmt, meta=result.meta(), headers=getattr(args, "headers", True))
    elif fmt == "json":
        emit_rows([], [], fmt, meta=result.meta())
    for line in truncated_lines(result.outcomes):
        note(line)
    if result.answered:
        note(query_footer(result))
    return report(result.outcomes, settings, strict=bool(getattr(args, "strict", False)))


def run_explain(args: argparse.Namespace) -> int:
    """``ingero explain --nodes ...``: every node's chains merged, plus the straggler verdict."""
    from ingero.fleet.operations import explain_sync
    from ingero.fleet.render import render_chains

    if getattr(args, "pid", None) is not None:  # a pid means nothing across nodes
        raise UsageError("--pid works on a local --db only", hint="drop --pid, or explain one node's database")
    op_name = None
    if getattr(args, "op", None):
        from ingero.store.catalog import lookup_op

        op_name = lookup_op(args.op).name
    wanted_node = getattr(args, "node", None)
    nodes = nodes_from(args)
    settings = settings_from_args(args)
    progress = progress_for(nodes)
    try:
        fleet = explain_sync(
            nodes,
            settings,
            since=getattr(args, "since", None),
            from_=getattr(args, "from_", None),
            to=getattr(args, "to", None),
            op=op_name,
            node=wanted_node,
            stored=bool(getattr(args, "chains", False)),
            per_process=bool(getattr(args, "per_process", False)),
            annotation=getattr(args, "annotation", None),
            annotations=bool(getattr(args, "annotations", False)),
            on_outcome=progress,
        )
    finally:
        progress.clear()
    if wanted_node is not None and fleet.answered and wanted_node not in {o.label for o in fleet.answered}:
        raise UsageError(
            f"no node {wanted_node!r} answered",
            hint="nodes: " + ", ".join(sorted(o.label for o in fleet.answered)),
        )
    from ingero.fleet.labels import label_doc, label_text

    asked = {
        "annotation": bool(getattr(args, "annotation", None)),
        "annotations": bool(getattr(args, "annotations", False)),
    }
    shown = [o for o in fleet.outcomes if wanted_node in (None, o.label)]
    if getattr(args, "format", "table") == "json":
        emit_json({**fleet.as_dict(), **label_doc(shown, **asked)})
    elif fleet.answered:
        print(label_text(shown, render_chains(fleet), **asked))
        window = _window_note(fleet.windows)
        note(
            f"{len(fleet.chains)} chain(s) from {len(fleet.answered)} node(s) in {fleet.elapsed_ms:.0f} ms"
            + (f" (window: {window})" if window else "")
        )
    for line in fleet.notes:  # what the fleet's own judgement left out (the late rank across nodes)
        note(line)
    return report(fleet.outcomes, settings, strict=bool(getattr(args, "strict", False)))


def _window_note(windows: dict[str, object]) -> str:
    """The agents' notes about the window they used (e.g. 'last 5m of the recording'), de-duplicated."""
    notes = set()
    for w in windows.values():
        if isinstance(w, dict) and w.get("note"):
            notes.add(str(w["note"]))
    return "; ".join(sorted(notes))
