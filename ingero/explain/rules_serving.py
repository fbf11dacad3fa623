"""Serving diagnosis from the engines' own metrics (``ingero trace --inference``: ``engine_metrics``).

Per engine process (node, pid), over the window's scrapes (values carried forward between rows:
:func:`ingero.store.engine_metrics.series`):

* **KV-cache pressure** — the KV cache is at least :data:`KV_FULL` used while the preemption counter
  rises: requests are evicted and their prefill recomputed. A cache that is full but preempts nothing is
  well used, not a problem. Severity is the share of the window spent so: HIGH ≥ 20 %, MEDIUM ≥ 5 %,
  LOW below (and at least :data:`MIN_PREEMPTIONS` preemptions).
* **Queue growth / TTFT regression** — requests waiting grow through the window (the last third's mean
  at least :data:`QUEUE_X` times the first third's plus :data:`QUEUE_FLOOR` requests, rising in most
  scrape steps), and/or time to first token (its histogram's ``_sum``/``_count`` per scrape interval)
  reaches :data:`TTFT_X` times its first third's level. Both: HIGH when the TTFT regression reaches
  :data:`TTFT_HIGH_X`, else MEDIUM; one alone: LOW (a queue that grows while first tokens stay fast is
  absorbing a burst; a slower first token with no queue is the prompt mix). When KV-cache pressure is
  present on the same engine, the queue chain names it as the root cause.
* **Head-of-line blocking** — at most :data:`HOL_RUNNING` requests running, at least :data:`HOL_WAITING`
  waiting and no request finishing, over :data:`HOL_STEPS` scrape steps or more: a long request holds
  the batch. Severity is its share of the window, as for the KV cache; the queue chain then names it.
* **Token generation slowed** — time per output token (vLLM's ``time_per_output_token_seconds`` or
  ``inter_token_latency_seconds``, SGLang's, TGI's mean time per token) reaches :data:`TPOT_X` times its
  baseline. Severity is the time lost (what the baseline speed would have saved) as a share of the window.

**Phases.** TTFT and time per output token are judged per phase (:mod:`ingero.explain.serving_phases`):
scrape intervals are told apart as prefill-like or decode-like by the prompt tokens the engine prefilled
in them (its own counter), or by the grid sizes of its kernel launches where it has none, and an
interval's latency is compared only with the baseline of its own phase — a burst of long prompts, which
slows first tokens and the decode steps between them, is not a regression against decode's baseline,
nor decode against prefill's.

A busy but healthy server — a full batch, a cache well used, a steady queue, steady TTFT, prefill bursts
among steady decoding — gets no chain.
Each engine's series are named as it publishes them: :data:`NAMES`.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from typing import Any

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.model import Chain, TimelineEntry
from ingero.explain.serving_phases import DECODE, Judgement, Phases, by_launches, by_tokens, judge, one_phase, worst
from ingero.store.catalog import LAUNCH_GRID_SHIFT, op_ids
from ingero.store.engine_metrics import TABLE, Series, has_engine_metrics, load_rows, series
from ingero.store.window import Window

KV_FULL = 0.95
MIN_PREEMPTIONS = 1
QUEUE_X = 3.0
QUEUE_FLOOR = 5.0
RISING = 0.6  # share of scrape steps in which the queue grew or held (of those that moved)
TTFT_X = 2.0
TTFT_HIGH_X = 3.0
MIN_SCRAPES = 6
HOL_RUNNING = 2  # head-of-line blocking: at most this many running ...
HOL_WAITING = 8  # ... at least this many waiting ...
HOL_STEPS = 3  # ... with no request finishing, over at least this many scrape steps
TPOT_X = 2.0  # time per output token this many times its phase's baseline: token generation slowed
LAUNCH_OPS = op_ids("cudaLaunchKernel", "cuLaunchKernel")
Launches = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # scrape grid -> (launch ts, grid blocks)
# per engine: KV-cache usage gauges, preemption counters, waiting and running gauges, TTFT histograms,
# finished-request counters, time-per-output-token histograms, prompt-token counters
NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "kv": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        "preempt": ("vllm:num_preemptions_total",),
        "waiting": ("vllm:num_requests_waiting",),
        "running": ("vllm:num_requests_running",),
        "ttft": ("vllm:time_to_first_token_seconds",),
        "done": ("vllm:request_success_total",),
        "tpot": ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
        "prompt": ("vllm:prompt_tokens_total",),
    },
    "sglang": {
        "kv": ("sglang:token_usage",),
        "preempt": ("sglang:num_retracted_reqs_total",),
        "waiting": ("sglang:num_queue_reqs",),
        "running": ("sglang:num_running_reqs",),
        "ttft": ("sglang:time_to_first_token_seconds",),
        "done": ("sglang:num_requests_total",),
        "tpot": ("sglang:time_per_output_token_seconds", "sglang:inter_token_latency_seconds"),
        "prompt": ("sglang:prompt_tokens_total",),
    },
    "tgi": {
        "kv": (),
        "preempt": (),
        "waiting": ("tgi_queue_size",),
        "running": ("tgi_batch_current_size",),
        "ttft": ("tgi_request_queue_duration",),
        "done": ("tgi_request_success",),
        "tpot": ("tgi_request_mean_time_per_token_duration",),
        "prompt": (),
    },
    "triton": {
        "kv": (),
        "preempt": (),
        "waiting": ("nv_inference_pending_request_count",),
        "running": (),
        "ttft": (),
        "done": ("nv_inference_request_success",),
        "tpot": (),
        "prompt": (),
    },
}


HISTOGRAMS = ("ttft", "tpot")  # roles read as a histogram's _sum and _count
_HISTOGRAM = ("_sum", "_count")


def _wanted() -> tuple[str, ...]:
    out: list[str] = []
    for kinds in NAMES.values():
        for role, names in kinds.items():
            out += [f"{n}{suffix}" for n in names for suffix in (_HISTOGRAM if role in HISTOGRAMS else ("",))]
    return tuple(out)


EngineRow = tuple[int, str, int, str, str, str, float]  # ts, node, pid, engine, metric, labels, value


def window_rows(
    conn: sqlite3.Connection, window: Window, metrics: tuple[str, ...], node: str | None = None
) -> list[EngineRow]:
    """The rows of ``metrics`` in ``window`` (of ``node`` only, when given), oldest first, after each series' value in force when the window
    opens (its last row before, stamped at the window's start): the scraper stores a series when it
    changes, so a steady gauge may have no row inside a later window."""
    rows = load_rows(conn, window.start_ns, window.end_ns, node=node, metrics=metrics)
    if window.start_ns is None or not has_engine_metrics(conn):
        return rows
    where = f"ts < ? AND metric IN ({', '.join('?' * len(metrics))})" + (" AND node = ?" if node is not None else "")
    sql = f"SELECT max(ts), node, pid, engine, metric, labels, value FROM {TABLE} WHERE {where} "
    sql += "GROUP BY node, pid, engine, metric, labels"
    start = window.start_ns
    params = (start, *metrics, *([node] if node is not None else []))
    before = [
        (start, str(nd), int(pid), str(e), str(m), str(lb), float(v))
        for _, nd, pid, e, m, lb, v in conn.execute(sql, params)
    ]
    return before + rows


def serving_chains(conn: sqlite3.Connection, window: Window, nodes: list[str], node: str | None = None) -> list[Chain]:
    """The serving chains of every engine recorded in ``window`` (of ``node`` only, when given)."""
    rows = window_rows(conn, window, _wanted(), node)
    by_engine: dict[tuple[str, int, str], dict[str, Series]] = {}
    for (nd, pid, engine, metric), s in series(rows).items():
        by_engine.setdefault((nd, pid, engine), {})[metric] = s
    chains: list[Chain] = []
    for (nd, pid, engine), ss in sorted(by_engine.items()):
        if engine in NAMES:
            named = nd or (nodes[0] if len(nodes) == 1 else "")
            chains += _engine_chains(named, pid, engine, ss, functools.partial(_launches, conn, nd, pid))
    return chains


def _launches(conn: sqlite3.Connection, node: str, pid: int, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(timestamp, grid blocks) of engine process ``pid``'s kernel launches between the first and last scrape."""
    cols = {row[1] for row in conn.execute("PRAGMA main.table_info(events)")}
    if not cols:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ops = " OR ".join("(source = ? AND op = ?)" for _ in LAUNCH_OPS)
    where = f"pid = ? AND timestamp > ? AND timestamp <= ? AND ({ops})"
    params: list[Any] = [pid, int(grid[0]), int(grid[-1]), *(x for o in LAUNCH_OPS for x in o)]
    if node and "node" in cols:
        where += " AND node = ?"
        params.append(node)
    sql = f"SELECT timestamp, (arg1 >> {LAUNCH_GRID_SHIFT}) & {(1 << 32) - 1} FROM main.events WHERE {where}"
    got = np.array(conn.execute(sql, params).fetchall(), dtype=np.int64).reshape(-1, 2)
    return got[:, 0], got[:, 1]


def _pick(ss: dict[str, Series], names: tuple[str, ...], suffix: str = "") -> Series | None:
    return next((ss[n + suffix] for n in names if n + suffix in ss), None)


def _grid(s: Series, grid: np.ndarray) -> np.ndarray:
    """``s`` at each instant of ``grid``, carried forward (NaN before its first row)."""
    ts = np.asarray(s.ts, dtype=np.int64)
    v = np.asarray(s.values, dtype=np.float64)
    k = np.searchsorted(ts, grid, side="right") - 1
    out: np.ndarray = np.where(k >= 0, v[np.maximum(k, 0)], np.nan)
    return out


def _phases(ss: dict[str, Series], engine: str, grid: np.ndarray, launches: Launches) -> Phases:
    """Each scrape interval's phase: by the engine's prompt-token counter, else by its launches (only when
    it has a latency to judge: the launches are read from the events then)."""
    names = NAMES[engine]
    prompt = _pick(ss, names["prompt"])
    if prompt is not None:
        return by_tokens(np.diff(_grid(prompt, grid)))
    if not any(_pick(ss, names[role], "_count") for role in HISTOGRAMS):
        return one_phase(grid.size - 1)
    return by_launches(grid, *launches(grid))


def _engine_chains(node: str, pid: int, engine: str, ss: dict[str, Series], launches: Launches) -> list[Chain]:
    names = NAMES[engine]
    grid = np.unique(np.concatenate([np.asarray(s.ts, dtype=np.int64) for s in ss.values()]))
    if grid.size < MIN_SCRAPES:
        return []
    span = int(grid[-1] - grid[0]) or 1
    step = np.diff(grid)
    out: list[Chain] = []
    kv_s, pre_s = _pick(ss, names["kv"]), _pick(ss, names["preempt"])
    pressure = None
    if kv_s is not None and pre_s is not None:
        kv, pre = _grid(kv_s, grid), _grid(pre_s, grid)
        rose = np.diff(np.nan_to_num(pre)) > 0
        hot = rose & (np.nan_to_num(kv[1:]) >= KV_FULL)
        n_pre = int(np.diff(np.nan_to_num(pre))[hot].sum())
        if n_pre >= MIN_PREEMPTIONS:
            share = float(step[hot].sum()) / span
            pressure = _kv_chain(node, pid, engine, kv_s.metric, pre_s.metric, share, n_pre, float(np.nanmax(kv)), grid)
            out.append(pressure)
    hol = _hol_chain(node, pid, engine, ss, grid)
    if hol is not None:
        out.append(hol)
    phases = _phases(ss, engine, grid, launches)
    q = _queue_chain(node, pid, engine, ss, grid, pressure or hol, phases)
    decode = _decode_chain(node, pid, engine, ss, grid, phases)
    return out + [c for c in (q, decode) if c is not None]


def _hol_chain(node: str, pid: int, engine: str, ss: dict[str, Series], grid: np.ndarray) -> Chain | None:
    """Head-of-line blocking: a few requests running, many waiting, and none finishing."""
    names = NAMES[engine]
    run_s, wait_s, done_s = _pick(ss, names["running"]), _pick(ss, names["waiting"]), _pick(ss, names["done"])
    if run_s is None or wait_s is None or done_s is None:
        return None
    run, wait, done = _grid(run_s, grid)[1:], _grid(wait_s, grid)[1:], np.diff(_grid(done_s, grid))
    stuck = (run >= 1) & (run <= HOL_RUNNING) & (wait >= HOL_WAITING) & (np.nan_to_num(done) == 0)
    if int(stuck.sum()) < HOL_STEPS:
        return None
    held = float(np.diff(grid)[stuck].sum())
    share = held / (int(grid[-1] - grid[0]) or 1)
    sev = cz.severity_of_loss(share, 1.0)
    worst = int(np.nanmax(np.where(stuck, wait, 0)))
    return _chain(
        node,
        pid,
        grid,
        "head-of-line",
        severity=sev,
        summary=f"{engine} (pid {pid}): head-of-line blocking — ≤ {HOL_RUNNING} request(s) running, up to {worst} "
        f"waiting, none finishing ({share:.0%} of the window)",
        root_cause="head-of-line blocking — a long request holds the batch while the queue waits behind it",
        explanation=f"From {engine}'s own metrics: for {held / 1e9:.1f} s ({share:.0%} of the scraped time) at most "
        f"{HOL_RUNNING} request(s) ran ({run_s.metric}) while at least {HOL_WAITING} waited ({wait_s.metric}) and "
        f"{done_s.metric} did not move: the batch is not taking the waiting requests in.",
        recommendations=[
            "cap a request's length (max_tokens, --max-model-len) so one request cannot hold the batch",
            "enable chunked prefill (vLLM: --enable-chunked-prefill) so a long prompt shares the step with others",
            "check what keeps the batch from growing: the KV cache, --max-num-seqs, a long prompt",
        ],
        timeline=[TimelineEntry("HOST", "queue", f"{run_s.metric} ≤ {HOL_RUNNING}, {wait_s.metric} ≥ {HOL_WAITING}")],
        evidence={
            "rule": "serving",
            "pid": pid,
            "engine": engine,
            "share": round(share, 4),
            "held_s": round(held / 1e9, 3),
            "waiting_max": worst,
        },
    )


def _kv_chain(
    node: str, pid: int, engine: str, kv: str, pre: str, share: float, n: int, peak: float, grid: np.ndarray
) -> Chain:
    sev = cz.severity_of_loss(share, 1.0)
    return _chain(
        node,
        pid,
        grid,
        "kv-cache",
        severity=sev,
        summary=f"{engine} (pid {pid}): KV cache ≥ {KV_FULL:.0%} full while it preempted {n} request(s) "
        f"({share:.0%} of the window)",
        root_cause=f"KV-cache pressure — the cache peaked at {peak:.0%} ({kv}) and {pre} rose by {n}: running "
        "requests were evicted and their prefill recomputed",
        explanation=f"From {engine}'s own metrics: in {share:.0%} of the scraped time the KV cache was at least "
        f"{KV_FULL:.0%} used while preemptions rose. Preempted requests lose their KV blocks; resuming them "
        "recomputes the prompt, so GPU time goes to work already done and latency grows.",
        recommendations=[
            "give the KV cache more memory (vLLM: --gpu-memory-utilization; SGLang: --mem-fraction-static)",
            "cap the batch (vLLM: --max-num-seqs / --max-num-batched-tokens; SGLang: --max-running-requests)",
            "shorten contexts (--max-model-len) or quantise the KV cache (--kv-cache-dtype fp8)",
        ],
        timeline=[TimelineEntry("CUDA", "kv-cache", f"{kv} ≥ {KV_FULL:.0%}, {pre} +{n}")],
        evidence={
            "rule": "serving",
            "pid": pid,
            "engine": engine,
            "preemptions": n,
            "share": round(share, 4),
            "kv_peak": round(peak, 4),
            "kv_metric": kv,
            "preempt_metric": pre,
        },
    )


def _chain(node: str, pid: int, grid: np.ndarray, kind: str, **fields: Any) -> Chain:
    """A serving chain of engine process ``pid`` (family ``serving/<kind>``), as of the last scrape."""
    return Chain(
        id=f"{node}:serving-{kind}-pid{pid}", node=node, detected_at=int(grid[-1]), family=f"serving/{kind}", **fields
    )


def _thirds(x: np.ndarray) -> tuple[float, float]:
    n = x.size // 3
    first, last = x[:n], x[-n:]
    f = float(np.nanmean(first)) if np.isfinite(first).any() else float("nan")
    la = float(np.nanmean(last)) if np.isfinite(last).any() else float("nan")
    return f, la


def _per_interval(ss: dict[str, Series], names: tuple[str, ...], grid: np.ndarray) -> tuple[str, np.ndarray] | None:
    """A histogram's mean per scrape interval (Δsum / Δcount; NaN where nothing was observed): (metric, means)."""
    s, c = _pick(ss, names, "_sum"), _pick(ss, names, "_count")
    if s is None or c is None:
        return None
    ds, dc = np.diff(_grid(s, grid)), np.diff(_grid(c, grid))
    per: np.ndarray = np.where(dc > 0, ds / np.where(dc > 0, dc, 1), np.nan)
    return s.metric[: -len("_sum")], per


def _judged(
    ss: dict[str, Series], names: tuple[str, ...], grid: np.ndarray, phases: Phases
) -> tuple[str, Judgement] | None:
    """A latency's worst phase: its last third against the first third of the same phase's intervals."""
    found = _per_interval(ss, names, grid)
    j = worst(found[1], phases) if found is not None else None
    return (found[0], j) if found is not None and j is not None else None


def _which(j: Judgement, phases: Phases) -> str:
    return f", {j.name(phases)} intervals against their own baseline" if phases.split else ""


def _queue_chain(
    node: str, pid: int, engine: str, ss: dict[str, Series], grid: np.ndarray, pressure: Chain | None, phases: Phases
) -> Chain | None:
    names = NAMES[engine]
    w_s = _pick(ss, names["waiting"])
    grew, w0, w1 = False, 0.0, 0.0
    if w_s is not None:
        w = _grid(w_s, grid)
        w0, w1 = _thirds(w)
        moves = np.diff(np.nan_to_num(w))
        moved = moves[moves != 0]
        rising = float((moved > 0).mean()) if moved.size else 0.0
        grew = bool(np.isfinite(w0) and np.isfinite(w1) and w1 >= QUEUE_X * w0 + QUEUE_FLOOR and rising >= RISING)
    t = _judged(ss, names["ttft"], grid, phases)
    slower = t is not None and t[1].ratio >= TTFT_X
    if not grew and not slower:
        return None
    ratio = t[1].ratio if t is not None else 0.0
    sev = ("HIGH" if ratio >= TTFT_HIGH_X else "MEDIUM") if grew and slower else "LOW"
    parts = []
    if grew and w_s is not None:
        parts.append(f"requests waiting grew {w0:.0f} → {w1:.0f} ({w_s.metric})")
    if slower and t is not None:
        metric, j = t
        parts.append(
            f"time to first token {j.baseline:.3g} s → {j.late:.3g} s ({ratio:.1f}x, {metric}{_which(j, phases)})"
        )
    if pressure is not None and pressure.family == "serving/head-of-line":
        root = "head-of-line blocking: a long request holds the batch (see its chain)"
    elif pressure is not None:
        root = "KV-cache pressure: preempted requests go back to the queue and their prefill is recomputed"
    elif grew:
        root = "demand above capacity: requests arrive faster than the engine finishes them"
    else:
        root = "first tokens slowed with no queue behind them: longer prompts, or prefill competing with decode"
    return _chain(
        node,
        pid,
        grid,
        "queue",
        severity=sev,
        summary=f"{engine} (pid {pid}): " + "; ".join(parts),
        root_cause=root,
        explanation=f"From {engine}'s own metrics, first third of the window against the last: "
        + "; ".join(parts)
        + ". A queue that grows while first tokens slow is a server past its capacity.",
        recommendations=[
            "add replicas or route load away from this engine",
            "bound the queue (admission control) so latency stays within its objective",
        ]
        + ([f"relieve the cause first (see the {pressure.family} chain)"] if pressure is not None else []),
        timeline=[TimelineEntry("HOST", "queue", p) for p in parts],
        evidence={
            "rule": "serving",
            "pid": pid,
            "engine": engine,
            "waiting_first": round(w0, 2),
            "waiting_last": round(w1, 2),
            "queue_grew": grew,
            "ttft_first_s": round(t[1].baseline, 6) if t else None,
            "ttft_last_s": round(t[1].late, 6) if t else None,
            "ttft_x": round(ratio, 2),
            "phases_by": phases.by or None,
        },
    )


def _decode_chain(
    node: str, pid: int, engine: str, ss: dict[str, Series], grid: np.ndarray, phases: Phases
) -> Chain | None:
    """Token generation slowed: time per output token reaches TPOT_X times its phase's baseline (decode's
    named first when both phases slowed). The time lost is, in each later interval of a slowed phase at
    least TPOT_X over, the share of it the baseline speed would not have needed; its share of the window
    is the severity."""
    found = _per_interval(ss, NAMES[engine]["tpot"], grid)
    regressed = [j for j in judge(found[1], phases) if j.ratio >= TPOT_X] if found is not None else []
    if found is None or not regressed:
        return None
    metric, j = found[0], regressed[0]  # decode's when it regressed (judge lists it first)
    lost = 0.0
    for r in regressed:
        slow = r.values >= TPOT_X * r.baseline
        lost += float((np.diff(grid)[r.after[slow]] * (1 - r.baseline / r.values[slow])).sum())
    span = float(grid[-1] - grid[0]) or 1.0
    if not cz.worth_a_chain(lost, span):
        return None
    share = lost / span
    what = f"time per output token {j.baseline * 1e3:.3g} ms → {j.late * 1e3:.3g} ms ({j.ratio:.1f}x, {metric}{_which(j, phases)})"
    what += "".join(f"; {r.ratio:.1f}x in the {r.name(phases)} intervals too" for r in regressed[1:])
    told = {"tokens": "the prompt tokens they prefilled", "launches": "the grid sizes of the engine's kernel launches"}
    return _chain(
        node,
        pid,
        grid,
        "decode",
        severity=cz.severity_of_loss(lost, span),
        summary=f"{engine} (pid {pid}): token generation slowed — {what}; {share:.0%} of the window lost",
        root_cause="decode regression — each generation step takes longer than this engine's own decode baseline "
        "(the GPU is shared, throttled or running slower kernels)"
        if j.phase == DECODE
        else "prefill regression — intervals of long prompts produce tokens slower than they did earlier",
        explanation=f"From {engine}'s own metrics: {what}. "
        + (
            f"Scrape intervals were told apart as prefill-like or decode-like by {told[phases.by]}, and each is judged "
            "only against earlier intervals of its own phase: a burst of long prompts slows the decode steps between "
            "them, which is the mix of work, not a regression. "
            if phases.split
            else "The engine ran one steady mix of prefill and decode: the whole window shares one baseline. "
        )
        + f"Generating at the baseline speed would have saved {lost / 1e9:.1f} s of the {span / 1e9:.1f} s scraped.",
        recommendations=[
            "look for another process on the GPU (nvidia-smi, ingero explain on this node) or throttled clocks",
            "compare the kernels of the slow steps with earlier ones (a new model revision, a changed batch shape)",
            "cap the batch (vLLM: --max-num-seqs) if the slowdown follows a larger batch",
        ],
        timeline=[TimelineEntry("CUDA", "decode", what)],
        evidence={
            "rule": "serving",
            "pid": pid,
            "engine": engine,
            "metric": metric,
            "phase": j.name(phases),
            "phases_by": phases.by or None,
            "baseline_s": round(j.baseline, 6),
            "late_s": round(j.late, 6),
            "ratio": round(j.ratio, 2),
            "lost_s": round(lost / 1e9, 3),
            "share": round(share, 4),
        },
    )


__all__ = ["NAMES", "serving_chains"]
