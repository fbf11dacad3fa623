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

A busy but healthy server — a full batch, a cache well used, a steady queue, steady TTFT — gets no chain.
Each engine's series are named as it publishes them: :data:`NAMES`.
"""

from __future__ import annotations

import sqlite3

import numpy as np

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
SHARES = (("HIGH", 0.20), ("MEDIUM", 0.05))
# per engine: (KV-cache usage gauges, preemption counters, waiting gauges, running gauges, TTFT histograms)
NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "kv": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        "preempt": ("vllm:num_preemptions_total",),
        "waiting": ("vllm:num_requests_waiting",),
        "running": ("vllm:num_requests_running",),
        "ttft": ("vllm:time_to_first_token_seconds",),
    },
    "sglang": {
        "kv": ("sglang:token_usage",),
        "preempt": ("sglang:num_retracted_reqs_total",),
        "waiting": ("sglang:num_queue_reqs",),
        "running": ("sglang:num_running_reqs",),
        "ttft": ("sglang:time_to_first_token_seconds",),
    },
    "tgi": {
        "kv": (),
        "preempt": (),
        "waiting": ("tgi_queue_size",),
        "running": ("tgi_batch_current_size",),
        "ttft": ("tgi_request_queue_duration",),
    },
    "triton": {"kv": (), "preempt": (), "waiting": ("nv_inference_pending_request_count",), "running": (), "ttft": ()},
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
    q = _queue_chain(node, pid, engine, ss, grid, pressure)
    return out + ([q] if q is not None else [])


def _kv_chain(
    node: str, pid: int, engine: str, kv: str, pre: str, share: float, n: int, peak: float, grid: np.ndarray
) -> Chain:
    sev = next((s for s, least in SHARES if share >= least), "LOW")
    return Chain(
        id=f"{node}:serving-kv-pid{pid}",
        node=node,
        detected_at=int(grid[-1]),
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
        family="serving/kv-cache",
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
    if pressure is not None:
        root = "KV-cache pressure: preempted requests go back to the queue and their prefill is recomputed"
    elif grew:
        root = "demand above capacity: requests arrive faster than the engine finishes them"
    else:
        root = "first tokens slowed with no queue behind them: longer prompts, or prefill competing with decode"
    return Chain(
        id=f"{node}:serving-queue-pid{pid}",
        node=node,
        detected_at=int(grid[-1]),
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
        + (["relieve the KV cache first (see the KV-cache chain)"] if pressure is not None else []),
        timeline=[TimelineEntry("HOST", "queue", p) for p in parts],
        family="serving/queue",
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
