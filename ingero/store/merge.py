"""``ingero merge``: several node databases → one queryable cluster database.

How
* Inputs are inspected read-only (:mod:`ingero.store.merge_inputs`) and then ATTACHed read-only
  (``mode=ro``, ``immutable`` when no writer is live), one at a time; every table is copied with
  ``INSERT ... SELECT`` inside SQLite, never row by row in Python (sessions, a handful of rows,
  are the exception: they are renumbered).
* The output is built in a temporary file beside the destination (schema from
  :func:`ingero.store.db.open_writable`, bulk pragmas, the timestamp index rebuilt once at the end)
  and renamed into place only when complete: a failed merge leaves nothing half-written, and an
  existing output is replaced only with ``force``.

What happens to each table (collisions are about rows from *different* inputs)
* ``events``: node-namespaced ids kept. Ingero 0.8 rows (integer ids, no ``node``) need a forced
  node name; their ids become ``{node}:{old id}``. Rows with an empty ``node`` take the forced name
  when one is given. A node found in several inputs is fine when its ids are disjoint (e.g. a
  rotated database); if ids repeat, the merge is refused unless ``dedupe``, which keeps the first
  copy of each id (same id = same event: ids are unique per node by construction).
* ``stack_traces``: deduplicated by hash (resolved frames win over unresolved ones).
* ``causal_chains``: by id; the most recent detection of an id wins.
* ``sessions``: renumbered in input order; ``session_stats`` follow their session.
* ``system_snapshots``: every snapshot kept, its ``node`` column (schema 2) saying whose it is —
  copied from inputs that have it, else the input's only node, else the node whose session was
  running at that moment. Ingero declares ``timestamp UNIQUE``: a snapshot whose nanosecond
  timestamp is already taken by another node is moved 1 ns later (the same node's same timestamp
  twice is a duplicate and skipped).
* ``process_names``: Ingero's primary key is ``pid`` alone, and pids collide across nodes. The
  table keeps one row per pid (the first input's, as Ingero's own merge does); the complete
  per-node mapping is in ``node_process_names(node, pid, name, seen_at)``.
* ``event_aggregates``: kept per node (schema 6's ``node``, in the key), so each node's storage regime
  and unstored calls stay its own; an input without the column gives its rows its only node (an older
  merge holding several nodes: ``''``, attributed to none). The same node's same (bucket, source, op,
  pid) in two inputs (a rotated database) is summed; with ``dedupe``, an input whose nodes were all
  merged already contributes none (it would double count).
* ``engine_metrics`` (schema 5), ``annotations``: every row, with its node (``annotations`` renumbered);
  with ``dedupe``, as ``event_aggregates``: rows with no identity of their own are not copied twice.
* ``cgroup_metadata``, ``cgroup_schedstat``, ``nccl_comms``: first row per key wins.
* ``schema_info``: ours, plus the inputs' notes and a ``merge_inputs`` entry (JSON).
* ``node_seq``: one row per node, past its highest id, so a writer can append later.
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingero import __version__
from ingero.errors import StoreError, UsageError
from ingero.store import columns
from ingero.store import merge_inputs as mi
from ingero.store import merge_tables as mt
from ingero.store.db import open_writable, translate
from ingero.store.merge_tables import lit
from ingero.store.rename import renamed_copy
from ingero.timeutil import NS_PER_S, now_ns

DEFAULT_SKEW_THRESHOLD_NS = NS_PER_S

# (column, default when the input lacks it), derived from the one declaration in store/columns.py
EVENT_COLUMNS: tuple[tuple[str, str], ...] = tuple((c.name, c.default) for c in columns.copied(columns.EVENTS))
CHAIN_COLUMNS: tuple[tuple[str, str], ...] = tuple((c.name, c.default) for c in columns.copied(columns.CHAINS))


@dataclass
class NodeReport:
    node: str
    events: int = 0
    chains: int = 0
    sessions: int = 0
    first_ns: int | None = None
    last_ns: int | None = None
    inputs: list[str] = field(default_factory=list)


@dataclass
class MergeReport:
    output: Path
    inputs: list[mi.InputInfo]
    nodes: dict[str, NodeReport]
    events: int = 0
    duplicates_skipped: int = 0
    stacks: int = 0
    stacks_seen: int = 0
    chains: int = 0
    sessions: int = 0
    snapshots: int = 0
    snapshots_moved: int = 0
    process_names: int = 0
    process_name_conflicts: int = 0
    aggregates: int = 0
    warnings: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "inputs": [
                {"path": str(i.shown), "layout": i.layout, "events": i.events, "nodes": i.node_names, "live": i.live}
                for i in self.inputs
            ],
            "nodes": [vars(n) for n in sorted(self.nodes.values(), key=lambda n: n.node)],
            "events": self.events,
            "duplicates_skipped": self.duplicates_skipped,
            "stacks": self.stacks,
            "stacks_seen": self.stacks_seen,
            "chains": self.chains,
            "sessions": self.sessions,
            "snapshots": self.snapshots,
            "snapshots_moved": self.snapshots_moved,
            "process_names": self.process_names,
            "process_name_conflicts": self.process_name_conflicts,
            "aggregates": self.aggregates,
            "warnings": self.warnings,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _ro_uri(path: Path) -> str:
    live = Path(str(path) + "-wal").exists()
    params = {"mode": "ro"} if live else {"mode": "ro", "immutable": "1"}
    return f"file:{urllib.parse.quote(str(path.resolve()))}?{urllib.parse.urlencode(params)}"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def merge_databases(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    force_node: list[str] | None = None,
    force: bool = False,
    dedupe: bool = False,
    skew_threshold_ns: int = DEFAULT_SKEW_THRESHOLD_NS,
    progress: Callable[[str], None] | None = None,
) -> MergeReport:
    """Merge ``inputs`` into a new database at ``output``. Raises IngeroError subclasses."""
    t0 = time.perf_counter()
    paths = [Path(p).expanduser() for p in inputs]
    out = Path(output).expanduser()
    if not paths:
        raise UsageError("nothing to merge", hint="give one or more databases: ingero merge a.db b.db -o cluster.db")
    for p in paths:
        if _same_file(p, out):
            raise UsageError(f"output {out} is also an input", hint="write the merge to a new file")
    if out.is_dir():
        raise UsageError(f"output {out} is a directory")
    if out.exists() and not force:
        raise UsageError(f"output {out} already exists", hint="pass --force to replace it")
    default_node, per_file = mi.parse_force_node(force_node, paths)
    infos = [mi.inspect_input(p, per_file.get(p.resolve(), default_node)) for p in paths]
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.twins-", dir=out.parent) as twin_dir:
        renames = twin_renames(infos)
        for i, (old, new) in renames.items():
            info = infos[i]
            copy = renamed_copy(info.path, Path(twin_dir) / f"{i}-{info.path.name}", old, new)
            infos[i] = mi.inspect_input(copy, info.force_node)
            infos[i].origin = info.path
        report = _merge(infos, out, force=force, dedupe=dedupe, skew_threshold_ns=skew_threshold_ns, progress=progress)
        report.warnings[:0] = [
            f"{infos[i].shown}: node {old!r} was also recorded by another database (a distinct instance: cloned "
            f"hosts, or recordings made without --node); its rows are kept as node {new!r}"
            for i, (old, new) in renames.items()
        ]
    report.elapsed_s = time.perf_counter() - t0
    return report


def twin_renames(infos: list[mi.InputInfo]) -> dict[int, tuple[str, str]]:
    """Inputs whose node another *distinct* database also recorded with colliding ids (two instance ids
    that differ, id ranges that overlap: two hosts that share a name, not a rotated database, whose ids
    continue): the first keeps the name, each later one's node becomes ``name@file-stem``. Databases
    without an instance id (Ingero's) cannot be told from a copy: they merge as before."""
    first: dict[str, tuple[str, mi.NodeStats]] = {}  # node -> the first database's instance id and ids
    taken = {n.node for info in infos for n in info.nodes}
    renames: dict[int, tuple[str, str]] = {}
    for i, info in enumerate(infos):
        for n in info.nodes:
            if not n.node or info.instance is None:
                continue
            owner, seen = first.setdefault(n.node, (info.instance, n))
            if owner != info.instance and n.min_seq <= seen.max_seq and seen.min_seq <= n.max_seq:
                new, k = f"{n.node}@{info.path.stem}", 2
                while new in taken:
                    new, k = f"{n.node}@{info.path.stem}-{k}", k + 1
                taken.add(new)
                renames[i] = (n.node, new)  # one shared name per input: a merged input is renamed once
    return renames


def _merge(
    infos: list[mi.InputInfo],
    out: Path,
    *,
    force: bool,
    dedupe: bool,
    skew_threshold_ns: int,
    progress: Callable[[str], None] | None,
) -> MergeReport:
    report = MergeReport(out, infos, {})
    for info in infos:
        for n in info.nodes:
            if not n.node and n.events:
                report.warnings.append(
                    f"{info.path}: {n.events} event(s) have no node name (pass --force-node NAME to name them)"
                )
    seen: dict[str, list[Path]] = {}
    for info in infos:
        for name in {n.node for n in info.nodes}:
            seen.setdefault(name, []).append(info.path)
    overlapping = {name for name, where in seen.items() if len(where) > 1}

    tmp = out.with_name(f".{out.name}.merging-{os.getpid()}")
    _remove(tmp)
    try:
        open_writable(tmp).close()
        conn = sqlite3.connect(f"file:{urllib.parse.quote(str(tmp.resolve()))}", uri=True, isolation_level=None)
    except sqlite3.Error as e:
        _remove(tmp)
        raise translate(e, tmp) from None
    except BaseException:
        _remove(tmp)
        raise
    try:
        _Merger(conn, report, overlapping, dedupe, progress).run()
        report.warnings.extend(mi.skew_warnings(infos, skew_threshold_ns))
        conn.execute("PRAGMA journal_mode = WAL").fetchone()
        conn.close()
        if force:
            _remove(out)
        tmp.replace(out)
    except sqlite3.Error as e:
        conn.close()
        _remove(tmp)
        raise translate(e, out) from None
    except BaseException:
        conn.close()
        _remove(tmp)
        raise
    return report


def _remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(str(path) + suffix).unlink(missing_ok=True)


class _Merger:
    """Copies each attached input into the output connection."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        report: MergeReport,
        overlapping: set[str],
        dedupe: bool,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.conn = conn
        self.report = report
        self.overlapping = overlapping
        self.dedupe = dedupe
        self.progress = progress
        self.merged_nodes: set[str] = set()

    def run(self) -> None:
        c = self.conn
        for pragma in ("journal_mode = OFF", "synchronous = OFF", "cache_size = -131072", "temp_store = MEMORY"):
            c.execute(f"PRAGMA {pragma}").fetchall()
        c.executescript(mt.SIDE_TABLES)
        c.execute("DROP INDEX IF EXISTS idx_events_timestamp")  # rebuilt once at the end: faster than per row
        if self.dedupe and self.overlapping:
            c.execute("CREATE UNIQUE INDEX merge_tmp_event_ids ON events(id)")
        for info in self.report.inputs:
            if self.progress:
                self.progress(f"merging {info.shown} ({info.layout}, {info.events} events)")
            c.execute("ATTACH DATABASE ? AS src", (_ro_uri(info.path),))
            try:
                c.execute("BEGIN")
                self._copy_input(info)
                c.execute("COMMIT")
            except BaseException:
                if c.in_transaction:
                    c.execute("ROLLBACK")
                raise
            finally:
                c.execute("DETACH DATABASE src")
            self.merged_nodes.update(n.node for n in info.nodes)
        c.execute("BEGIN")
        self._check_duplicates()
        c.execute("DROP INDEX IF EXISTS merge_tmp_event_ids")
        c.execute("CREATE INDEX IF NOT EXISTS idx_events_timestamp ON events(timestamp)")
        self._finish()
        c.execute("COMMIT")

    # --- per input -----------------------------------------------------------------------------

    def _copy_input(self, info: mi.InputInfo) -> None:
        c = self.conn
        self._copy_events(info)
        self._copy_stacks(info)
        self._copy_chains(info)
        session_map, sessions = mt.copy_sessions(c, info, self.merged_nodes)
        self.report.sessions += sessions
        mt.copy_session_stats(c, info, session_map)
        snapshots, moved = mt.copy_snapshots(c, info)
        self.report.snapshots += snapshots
        self.report.snapshots_moved += moved
        mt.copy_process_names(c, info)
        if not (self.dedupe and info.nodes and all(n.node in self.merged_nodes for n in info.nodes)):
            # tables without a row identity: a copy of a database merged already would count twice
            mt.copy_aggregates(c, info)
            mt.copy_simple(c, info, "annotations", skip=("id",))
            mt.copy_simple(c, info, "engine_metrics")
        for table in ("cgroup_metadata", "cgroup_schedstat", "nccl_comms", "nccl_calls"):
            mt.copy_simple(c, info, table)
        if info.has("schema_info", "value"):
            c.execute("INSERT OR IGNORE INTO schema_info(key, value) SELECT key, value FROM src.schema_info")

    def _copy_events(self, info: mi.InputInfo) -> None:
        cols = info.columns["events"]
        force = info.force_node
        if not info.has_node:
            assert force
            node_expr, id_expr = lit(force), f"{lit(force + ':')} || CAST(id AS TEXT)"
        elif force and any(n.source_node == "" for n in info.nodes):
            node_expr = f"CASE WHEN node = '' THEN {lit(force)} ELSE node END"
            id_expr = f"CASE WHEN node = '' THEN {lit(force + ':')} || ltrim(CAST(id AS TEXT), ':') ELSE id END"
        else:
            node_expr, id_expr = "node", ("id" if info.text_ids else "CAST(id AS TEXT)")
        select = ", ".join(c if c in cols else d for c, d in EVENT_COLUMNS)
        names = ", ".join(c for c, _ in EVENT_COLUMNS)
        verb = "INSERT OR IGNORE" if self.dedupe and self.overlapping else "INSERT"
        cur = self.conn.execute(
            f"{verb} INTO main.events(id, node, {names}) SELECT {id_expr}, {node_expr}, {select} FROM src.events"
        )
        added = max(cur.rowcount, 0)
        self.report.events += added
        self.report.duplicates_skipped += info.events - added
        for n in info.nodes:
            nr = self.report.nodes.setdefault(n.node, NodeReport(n.node))
            nr.events += n.events
            nr.inputs.append(str(info.shown))
            if n.first_ns is not None:
                nr.first_ns = n.first_ns if nr.first_ns is None else min(nr.first_ns, n.first_ns)
            if n.last_ns is not None:
                nr.last_ns = n.last_ns if nr.last_ns is None else max(nr.last_ns, n.last_ns)

    def _copy_stacks(self, info: mi.InputInfo) -> None:
        if not info.has("stack_traces", "hash"):
            return
        cols = info.columns["stack_traces"]
        ips = "ips" if "ips" in cols else "''"
        frames = "frames" if "frames" in cols else "''"
        self.report.stacks_seen += self.conn.execute("SELECT count(*) FROM src.stack_traces").fetchone()[0]
        self.conn.execute(
            f"INSERT INTO main.stack_traces(hash, ips, frames) SELECT hash, {ips}, {frames} FROM src.stack_traces "
            "WHERE true ON CONFLICT(hash) DO UPDATE SET ips = excluded.ips, frames = excluded.frames "
            "WHERE main.stack_traces.frames = '' AND excluded.frames != ''"
        )

    def _copy_chains(self, info: mi.InputInfo) -> None:
        if not info.has("causal_chains", "id"):
            return
        cols = info.columns["causal_chains"]
        fallback = lit(info.single_node or "")
        from_id = "CASE WHEN instr(id, ':') > 0 THEN substr(id, 1, instr(id, ':') - 1) ELSE '' END"
        if "node" in cols:
            node_expr = f"CASE WHEN node != '' THEN node WHEN {from_id} != '' THEN {from_id} ELSE {fallback} END"
        else:
            node_expr = f"CASE WHEN {from_id} != '' THEN {from_id} ELSE {fallback} END"
        # ids are "{node}:{descriptor}"; a bare descriptor (older layouts) gets the node prefix
        id_expr = f"CASE WHEN instr(id, ':') > 0 OR {node_expr} = '' THEN id ELSE {node_expr} || ':' || id END"
        select = ", ".join(c if c in cols else d for c, d in CHAIN_COLUMNS)
        names = ", ".join(c for c, _ in CHAIN_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c, _ in CHAIN_COLUMNS)
        self.conn.execute(
            f"INSERT INTO main.causal_chains(id, node, {names}) SELECT {id_expr}, {node_expr}, {select} "
            f"FROM src.causal_chains WHERE true ON CONFLICT(id) DO UPDATE SET {updates}, node = excluded.node "
            "WHERE excluded.detected_at > main.causal_chains.detected_at"
        )

    # --- after all inputs ----------------------------------------------------------------------

    def _check_duplicates(self) -> None:
        if not self.overlapping or self.dedupe:
            return
        for node in sorted(self.overlapping):
            dup = self.conn.execute(
                "SELECT id FROM main.events WHERE node = ? GROUP BY id HAVING count(*) > 1 LIMIT 1", (node,)
            ).fetchone()
            if dup is not None:
                where = [i.shown.name for i in self.report.inputs if node in i.node_names]
                raise StoreError(
                    f"node {node!r} is in {', '.join(where)} with the same event ids (e.g. {dup[0]}): "
                    "merging it twice would duplicate its events",
                    hint="pass --dedupe to keep one copy of each id, or merge each node's database once",
                )

    def _finish(self) -> None:
        c = self.conn
        r = self.report
        if r.duplicates_skipped:  # per-node counts from the inputs over-count: count what was kept
            for node, count in c.execute("SELECT node, count(*) FROM main.events GROUP BY node"):
                if node in r.nodes:
                    r.nodes[node].events = int(count)
        seqs: dict[str, int] = {}
        for info in r.inputs:
            for n in info.nodes:
                if n.node:
                    seqs[n.node] = max(seqs.get(n.node, 0), n.max_seq)
        c.executemany(
            "INSERT INTO main.node_seq(node, next_seq) VALUES (?, ?) ON CONFLICT(node) DO UPDATE SET "
            "next_seq = max(next_seq, excluded.next_seq)",
            [(node, seq + 1) for node, seq in seqs.items()],
        )
        for table, attr in (("causal_chains", "chains"), ("sessions", "sessions")):
            for node, count in c.execute(f"SELECT node, count(*) FROM main.{table} GROUP BY node"):
                setattr(r.nodes.setdefault(node, NodeReport(node)), attr, int(count))
        r.stacks = c.execute("SELECT count(*) FROM main.stack_traces").fetchone()[0]
        r.chains = c.execute("SELECT count(*) FROM main.causal_chains").fetchone()[0]
        r.process_names = c.execute("SELECT count(*) FROM main.process_names").fetchone()[0]
        r.process_name_conflicts = c.execute(
            "SELECT count(*) FROM (SELECT pid FROM main.node_process_names GROUP BY pid HAVING count(DISTINCT name) > 1)"
        ).fetchone()[0]
        r.aggregates = c.execute("SELECT count(*) FROM main.event_aggregates").fetchone()[0]
        notes = {
            "merged_at": str(now_ns()),
            "merged_by": f"ingero-py {__version__}",
            "merge_inputs": json.dumps(
                [
                    {"file": i.shown.name, "layout": i.layout, "nodes": i.node_names, "events": i.events}
                    for i in r.inputs
                ]
            ),
            "merge_note": "process_names keeps one row per pid (first input); node_process_names has every node's. "
            "system_snapshots.node says which node sampled each snapshot.",
        }
        c.executemany("INSERT OR REPLACE INTO main.schema_info(key, value) VALUES (?, ?)", notes.items())
