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

A busy but healthy server — a full batch, a cache well used, a steady queue, steady TTFT — gets no chain.
Each engine's series are named as it publishes them: :data:`NAMES`.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import numpy as np

from ingero.explain import causes as cz
from ingero.explain.model import Chain, TimelineEntry
from ingero.store.engine_metrics import Series, load_rows, series
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
# per engine: KV-cache usage gauges, preemption counters, waiting and running gauges, TTFT histograms,
# finished-request counters
NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "kv": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        "preempt": ("vllm:num_preemptions_total",),
        "waiting": ("vllm:num_requests_waiting",),
        "running": ("vllm:num_requests_running",),
        "ttft": ("vllm:time_to_first_token_seconds",),
        "done": ("vllm:request_success_total",),
    },
    "sglang": {
        "kv": ("sglang:token_usage",),
        "preempt": ("sglang:num_retracted_reqs_total",),
        "waiting": ("sglang:num_queue_reqs",),
        "running": ("sglang:num_running_reqs",),
        "ttft": ("sglang:time_to_first_token_seconds",),
        "done": ("sglang:num_requests_total",),
    },
    "tgi": {
        "kv": (),
        "preempt": (),
        "waiting": ("tgi_queue_size",),
        "running": ("tgi_batch_current_size",),
        "ttft": ("tgi_request_queue_duration",),
        "done": ("tgi_request_success",),
    },
    "triton": {
        "kv": (),
        "preempt": (),
        "waiting": ("nv_inference_pending_request_count",),
        "running": (),
        "ttft": (),
        "done": ("nv_inference_request_success",),
    },
}


def _wanted() -> tuple[str, ...]:
    out: list[str] = []
    for kinds in NAMES.values():
        for role, names in kinds.items():
            out += [f"{n}{suffix}" for n in names for suffix in (("_sum", "_count") if role == "ttft" else ("",))]
    return tuple(out)


def serving_chains(conn: sqlite3.Connection, window: Window, nodes: list[str], node: str | None = None) -> list[Chain]:
    """The serving chains of every engine recorded in ``window`` (of ``node`` only, when given)."""
    rows = load_rows(conn, window.start_ns, window.end_ns, node=node, metrics=_wanted())
    by_engine: dict[tuple[str, int, str], dict[str, Series]] = {}
    for (nd, pid, engine, metric), s in series(rows).items():
        by_engine.setdefault((nd, pid, engine), {})[metric] = s
    chains: list[Chain] = []
    for (nd, pid, engine), ss in sorted(by_engine.items()):
        if engine in NAMES:
            chains += _engine_chains(nd or (nodes[0] if len(nodes) == 1 else ""), pid, engine, ss)
    return chains


def _pick(ss: dict[str, Series], names: tuple[str, ...], suffix: str = "") -> Series | None:
    return next((ss[n + suffix] for n in names if n + suffix in ss), None)


def _grid(s: Series, grid: np.ndarray) -> np.ndarray:
    """``s`` at each instant of ``grid``, carried forward (NaN before its first row)."""
    ts = np.asarray(s.ts, dtype=np.int64)
    v = np.asarray(s.values, dtype=np.float64)
    k = np.searchsorted(ts, grid, side="right") - 1
    out: np.ndarray = np.where(k >= 0, v[np.maximum(k, 0)], np.nan)
    return out


def _engine_chains(node: str, pid: int, engine: str, ss: dict[str, Series]) -> list[Chain]:
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
    q = _queue_chain(node, pid, engine, ss, grid, pressure or hol)
    return out + ([q] if q is not None else [])


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


def _ttft(ss: dict[str, Series], names: tuple[str, ...], grid: np.ndarray) -> tuple[str, float, float] | None:
    """TTFT's mean per scrape interval (Δsum / Δcount): (metric, first third's level, last third's)."""
    s, c = _pick(ss, names, "_sum"), _pick(ss, names, "_count")
    if s is None or c is None:
        return None
    ds, dc = np.diff(_grid(s, grid)), np.diff(_grid(c, grid))
    per = np.where(dc > 0, ds / np.where(dc > 0, dc, 1), np.nan)
    first, last = _thirds(per)
    if not (np.isfinite(first) and np.isfinite(last)) or first <= 0:
        return None
    return s.metric[: -len("_sum")], first, last


def _queue_chain(
    node: str, pid: int, engine: str, ss: dict[str, Series], grid: np.ndarray, pressure: Chain | None
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
    t = _ttft(ss, names["ttft"], grid)
    slower = t is not None and t[2] >= TTFT_X * t[1]
    if not grew and not slower:
        return None
    ratio = t[2] / t[1] if t is not None else 0.0
    sev = ("HIGH" if ratio >= TTFT_HIGH_X else "MEDIUM") if grew and slower else "LOW"
    parts = []
    if grew and w_s is not None:
        parts.append(f"requests waiting grew {w0:.0f} → {w1:.0f} ({w_s.metric})")
    if slower and t is not None:
        parts.append(f"time to first token {t[1]:.3g} s → {t[2]:.3g} s ({ratio:.1f}x, {t[0]})")
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
            "ttft_first_s": round(t[1], 6) if t else None,
            "ttft_last_s": round(t[2], 6) if t else None,
            "ttft_x": round(ratio, 2),
        },
    )


__all__ = ["NAMES", "serving_chains"]
