"""The CPU bottleneck in serving: the GPU idle while a serving engine's own thread runs host code.

The wall-time ledger already finds a GPU thread that leaves the GPU idle while it runs its own code
(``idle/host_code`` for incidents, ``idle/host_bound`` at every step: :mod:`ingero.explain.rules_ledger`).
When that thread belongs to a serving engine, the same seconds mean something else, and this module
rewords the ledger's chain as serving's — ``serving/cpu-bottleneck`` — with the engine's own evidence
and a serving fix in place of the training one.

**Which thread is an engine's.** The process is a serving engine when the recording holds its engine
series (``engine_metrics``, ``trace --inference``) under its pid, under an ancestor whose fork was
recorded, or — the engine loop in a child process started before the recording (vLLM's engine core) —
when its process name is an engine's (:data:`ENGINE_NAMES`, as the tracer records ``comm``) and the node
has one engine of that kind. A process named as an engine with no series recorded is still an engine.

**Under load, or idle at low load.** Each of the thread's idle gaps is split into its on-CPU part (the
gap less its recorded off-CPU time) and judged by the engine's own gauges in force then (carried
forward from the last scrape): requests running or waiting (:data:`~ingero.explain.rules_serving.NAMES`)
— the GPU waited for the host while there was work, the CPU bottleneck; none — a server idle at low
load polling for work, nothing lost. The ledger's host-code time is shared out in proportion
(``lost ≤ host code ≤ wall``) and graded as the ledger grades (:func:`~ingero.explain.rules_ledger.severity`,
never above the ledger's own chain). All of it at low load: no chain, a note says so.

**Without the engine's series** nothing says whether requests waited: the host code at every step
(``idle/host_bound``) is still the engine's pace — there were steps, so there was work — but incidents
of host code may be a server polling while idle, so that chain is at most LOW and names the signal
that would tell (``ingero trace --inference``).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ingero.explain.frame import Frame
from ingero.explain.ledger import HOST_CODE, LedgerRow, children
from ingero.explain.model import SEVERITY_RANK, Chain, TimelineEntry
from ingero.explain.offcpu import INVOL, UNKNOWN, VOL, OffCpu
from ingero.explain.rules_idle import ms
from ingero.explain.rules_ledger import severity
from ingero.explain.rules_serving import NAMES, window_rows
from ingero.store.engine_metrics import Series, series
from ingero.store.window import Window

FAMILY = "serving/cpu-bottleneck"
HOST_FAMILIES = ("idle/host_code", "idle/host_bound")  # the ledger's chains of a thread's own host code
LOAD_ROLES = ("running", "waiting")  # the engine gauges that say whether there was work
# Process names (``comm``, as the tracer records them) of each engine's processes: vLLM's CLI and its
# engine core / workers (setproctitle ``VLLM::EngineCore``, cut to 15 characters), SGLang's
# ``sglang::scheduler``, TGI's launcher and Python shards, Triton's server.
ENGINE_NAMES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "VLLM::"),
    "sglang": ("sglang::",),
    "tgi": ("text-generation",),
    "triton": ("tritonserver",),
}
# What to change, per engine: the host's work per step and the work off the engine loop.
FIXES: dict[str, list[str]] = {
    "vllm": [
        "run the V1 engine (VLLM_USE_V1=1, the default since 0.8): scheduling overlaps the GPU step and "
        "detokenisation runs in the front-end process, off the engine loop",
        "on the V0 engine: keep async output processing on (drop --disable-async-output-proc) and schedule "
        "several steps at once (--num-scheduler-steps 8)",
        "keep CUDA graphs (drop --enforce-eager) and let the batch grow (--max-num-seqs, "
        "--max-num-batched-tokens): fewer, larger steps for the same tokens",
    ],
    "sglang": [
        "keep the overlap scheduler on (drop --disable-overlap-schedule): it prepares the next batch while "
        "the GPU runs this one",
        "keep CUDA graphs (drop --disable-cuda-graph; raise --cuda-graph-max-bs to the batch you run)",
        "detokenise less on the loop: a larger --stream-interval, or --skip-tokenizer-init for clients that "
        "send and take token ids",
    ],
    "tgi": [
        "capture CUDA graphs for the batch sizes you run (--cuda-graphs) and let batches grow "
        "(--max-batch-total-tokens, --max-waiting-tokens)",
        "stream fewer, larger chunks to clients: per-token work on the shard's loop is host time per step",
    ],
    "triton": [
        "batch on the server (dynamic_batching with preferred_batch_size and max_queue_delay_microseconds "
        "in config.pbtxt) so each execution carries more requests",
        "move pre/post-processing out of a Python backend model (a C++ or TensorRT backend, or an ensemble "
        "step on another instance_group)",
    ],
}
UNSURE = "serving's CPU bottleneck if requests were waiting then, or an idle server polling for work (not recorded)"
INFERENCE = (
    "Record with `ingero trace --inference`: it scrapes the engine's own metrics (requests running and "
    "waiting), which tell a CPU bottleneck from a server idle at low load polling for work"
)


@dataclass(frozen=True)
class EngineOf:
    """The serving engine a GPU process belongs to."""

    engine: str
    pid: int  # the engine's top process (its series' pid), or the GPU process itself when named only
    load: dict[str, Series]  # role (running, waiting) -> the engine's gauge; empty: not recorded


def engine_of_name(name: str) -> str | None:
    """The engine a recorded process name (``comm``, or a command line) belongs to."""
    words = name.split(",", maxsplit=1)[0].split()
    first = os.path.basename(words[0]) if words else ""
    return next((e for e, names in ENGINE_NAMES.items() if first.startswith(names)), None)


def serving_host_chains(
    conn: sqlite3.Connection,
    window: Window,
    frames: Mapping[str, Frame],
    ledger: list[LedgerRow],
    chains: list[Chain],
    names: Mapping[int, str],
) -> tuple[list[Chain], list[str]]:
    """``chains`` with the ledger's host-code chains of serving engines' threads reworded as serving's
    (or left out where the engine was idle at low load), and the notes that say so."""
    host = {id(c) for c in chains if c.family in HOST_FAMILIES and c.evidence.get("rule") == "ledger"}
    if not host:
        return chains, []
    engines = _engines(conn, window, list(frames))
    offs: dict[str, OffCpu] = {}
    rows: dict[tuple[str, Any, Any], LedgerRow] = {(r.node, r.pid, r.tid): r for r in ledger if r.tid is not None}
    out: list[Chain] = []
    notes: list[str] = []
    for c in chains:
        fr = frames.get(c.node)
        row = rows.get((c.node, c.evidence.get("pid"), c.evidence.get("tid")))
        which = _which(c.node, int(row.pid or 0), engines, fr, names) if id(c) in host and row and fr else None
        if which is None or row is None or fr is None:
            out.append(c)
            continue
        if c.node not in offs:  # once a node (setdefault would build it for every chain)
            offs[c.node] = OffCpu(fr.args)
        off = offs[c.node]
        made, note = _reworded(c, row, which, off)
        out += [made] if made is not None else []
        notes += [note] if note else []
    return out, notes


def _engines(conn: sqlite3.Connection, window: Window, nodes: list[str]) -> dict[tuple[str, int], EngineOf]:
    """Every engine process with series in the window: (node, pid) -> its engine and load gauges."""
    wanted = tuple(n for kinds in NAMES.values() for role in LOAD_ROLES for n in kinds[role])
    rows = window_rows(conn, window, wanted)
    found: dict[tuple[str, int], EngineOf] = {}
    for (nd, pid, engine, metric), s in series(rows).items():
        if engine not in NAMES:
            continue
        node = nd or (nodes[0] if len(nodes) == 1 else "")
        e = found.setdefault((node, pid), EngineOf(engine, pid, {}))
        for role in LOAD_ROLES:
            if metric in NAMES[engine][role] and role not in e.load:
                e.load[role] = s
    return found


def _which(
    node: str, pid: int, engines: dict[tuple[str, int], EngineOf], fr: Frame, names: Mapping[int, str]
) -> EngineOf | None:
    """The engine GPU process ``pid`` of ``node`` belongs to (see the module doc), or None."""
    if (node, pid) in engines:
        return engines[(node, pid)]
    on_node = {p: e for (nd, p), e in engines.items() if nd == node}
    for epid, e in sorted(on_node.items()):
        if pid in children(fr.args, epid):
            return e
    kind = engine_of_name(names.get(pid, ""))
    if kind is None:
        return None
    same = [e for e in on_node.values() if e.engine == kind]
    return same[0] if len(same) == 1 else EngineOf(kind, pid, {})


def _on_cpu(row: LedgerRow, off: OffCpu) -> np.ndarray:
    """Each idle gap's on-CPU time: the gap less the thread's recorded off-CPU time in it."""
    s, e = row.gap_start, row.gap_end
    tids = np.full(s.size, int(row.tid or 0), dtype=np.int64)
    away = np.zeros(s.size, dtype=np.int64)
    for k in (INVOL, VOL, UNKNOWN):
        away += off.covered(k, tids, s, e)
    out: np.ndarray = np.clip((e - s) - away, 0, None).astype(np.float64)
    return out


def _highest(s: Series, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The highest value ``s`` held over each interval [a, b]: the value in force at ``a`` (carried forward
    from the last scrape row; the first row's before it) and every row up to ``b`` (the scraper stores a
    series when it changes, so the rows between are its changes)."""
    ts, v = np.asarray(s.ts, dtype=np.int64), np.asarray(s.values, dtype=np.float64)
    k0 = np.clip(np.searchsorted(ts, a, side="right") - 1, 0, None)
    k1 = np.clip(np.searchsorted(ts, b, side="right") - 1, 0, None)
    hi: np.ndarray = v[k0].copy()
    for i in np.flatnonzero(k1 > k0):  # a change inside the gap (rare: gaps are short against 1 s scrapes)
        hi[i] = v[k0[i] : k1[i] + 1].max()
    return hi


@dataclass(frozen=True)
class Load:
    """How the engine stood in the thread's host-code gaps (the ledger's host code shared out by each
    gap's on-CPU time)."""

    host_ns: int  # the ledger's own host code of the thread
    loaded_ns: int  # in gaps where requests were waiting (a queue: work the engine had not taken)
    idle_ns: int  # in gaps where no request was running or waiting throughout (low load)
    running_max: int  # in the loaded gaps
    waiting_max: int
    metrics: tuple[str, ...]  # the gauges read

    @property
    def unsure_ns(self) -> int:
        """In gaps with requests running but none waiting: work, maybe (a 1 s scrape cannot say it lasted)."""
        return self.host_ns - self.loaded_ns - self.idle_ns


def _load(row: LedgerRow, which: EngineOf, off: OffCpu) -> Load | None:
    """The engine's load in the gaps (None: its gauges were not recorded)."""
    if not which.load:
        return None
    host = int(row.idle_ns.get(HOST_CODE, 0))
    on = np.minimum(_on_cpu(row, off), row.gap_idle)
    total = float(on.sum())
    if total <= 0:
        return Load(host, 0, 0, 0, 0, tuple(s.metric for s in which.load.values()))
    levels = {role: _highest(s, row.gap_start, row.gap_end) for role, s in which.load.items()}
    queued = levels.get("waiting", np.zeros(on.size)) > 0
    none = np.ones(on.size, dtype=bool)
    for hi in levels.values():
        none &= hi <= 0
    loaded, idle = round(host * float(on[queued].sum()) / total), round(host * float(on[none].sum()) / total)
    peak = {r: int(hi[queued].max()) if queued.any() else 0 for r, hi in levels.items()}
    metrics = tuple(s.metric for s in which.load.values())
    return Load(host, loaded, min(idle, host - loaded), peak.get("running", 0), peak.get("waiting", 0), metrics)


def _reworded(c: Chain, row: LedgerRow, which: EngineOf, off: OffCpu) -> tuple[Chain | None, str]:
    """The serving chain for ledger chain ``c`` of engine ``which``'s thread (None: idle at low load), and a
    note for the host code at low load."""
    load = _load(row, which, off)
    wall, host = row.wall_ns, int(row.idle_ns.get(HOST_CODE, 0))
    every = c.family == "idle/host_bound"  # at every step: there were steps, so there was work
    who = f"{which.engine} (pid {which.pid})"
    note = ""
    if load is None:
        lost, sev = host, c.severity if every else "LOW"
        signals = (
            "whether requests were waiting meanwhile is not recorded — a server idle at low load polls the same way"
        )
    else:
        lost = load.loaded_ns + (load.unsure_ns if every else 0)
        if load.idle_ns >= host / 2:
            note = (
                f"{c.node}: {who}: GPU idle {ms(load.idle_ns)} while its engine thread (tid {row.tid}) ran host code "
                f"with no request running or waiting ({', '.join(load.metrics)}): a server idle at low load, not a "
                "CPU bottleneck"
            )
        found = severity(lost, wall)
        if found is None:
            return None, note
        sev = max(found, c.severity, key=lambda x: SEVERITY_RANK[x])  # never above the ledger's own chain
        signals = (
            f"while it idled, up to {load.running_max} request(s) were running and {load.waiting_max} waiting "
            f"({', '.join(load.metrics)}): the GPU waited for the host, not for work"
        )
        if load.idle_ns:
            signals += f"; {ms(load.idle_ns)} more fell while no request was there (low load: not counted)"
        if load.unsure_ns and not every:
            signals += f"; {ms(load.unsure_ns)} with requests running but none waiting (not counted)"
    pct = 100 * lost / wall if wall else 0.0
    pace = "at every step" if every else "in incidents between GPU steps"
    timeline = [*c.timeline]
    evidence = {
        **c.evidence,
        "rule": "serving",
        "ledger_family": c.family,
        "engine": which.engine,
        "engine_pid": which.pid,
        "host_code_ms": round(host / 1e6, 1),
        "lost_ms": round(lost / 1e6, 1),
        "lost_share": round(lost / wall, 4) if wall else 0.0,
        "score": round(lost / wall, 4) if wall else 0.0,
        "load_recorded": load is not None,
    }
    recs = [*FIXES[which.engine], f"see where the loop's time goes during a gap: py-spy dump --native -p {row.pid}"]
    if load is not None:
        timeline.append(
            TimelineEntry("HOST", "queue", f"up to {load.running_max} running, {load.waiting_max} waiting in the gaps")
        )
        evidence |= {
            "loaded_ms": round(load.loaded_ns / 1e6, 1),
            "low_load_ms": round(load.idle_ns / 1e6, 1),
            "running_max": load.running_max,
            "waiting_max": load.waiting_max,
            "load_metrics": list(load.metrics),
        }
    else:
        recs.append(INFERENCE)
    how = (
        "each host-code gap was judged by the engine's own gauges in force then (the last scrape before it and "
        "any change during it)."
        if load is not None
        else INFERENCE + "."
    )
    chain = Chain(
        id=f"{c.node}:serving-cpu-bottleneck-pid{row.pid}",
        node=c.node,
        detected_at=c.detected_at,
        severity=sev,
        summary=f"{who}: GPU idle {pct:.0f}% of wall time while the engine loop ran host code {pace} "
        f"({ms(lost)}) — " + (verdict := "serving's CPU bottleneck" if load is not None or every else UNSURE),
        root_cause=f"{verdict} — {which.engine}'s engine loop (tid {row.tid} of pid {row.pid}) stayed "
        "on-CPU in its own code (scheduling, sampling, detokenising, building the next batch) before it queued "
        f"the next GPU step; {signals}",
        explanation=f"{c.explanation} The thread is {which.engine}'s engine loop: {how}",
        recommendations=recs,
        cuda_op=c.cuda_op,
        timeline=timeline,
        origin=c.origin,
        family=FAMILY,
        evidence=evidence,
    )
    return chain, note


__all__ = ["ENGINE_NAMES", "FAMILY", "engine_of_name", "serving_host_chains"]
