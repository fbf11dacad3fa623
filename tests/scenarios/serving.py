"""Serving engines: the GPU thread is a vLLM or SGLang engine loop, and the recording holds the engine's
own metrics (``engine_metrics``, scraped every second as ``ingero trace --inference`` does).

* ``engine-cpu-bound`` — serving's CPU bottleneck: a busy engine (24-32 requests running, a
  queue of 2-12 waiting at every scrape) whose loop runs its own host code after every GPU step
  (scheduling, sampling, detokenising) for the magnitude's share of the step: the GPU waits for the host
  while requests wait for the GPU.
* ``healthy-engine-idle`` — the same engine at low load: a request now and then (none waiting,
  at most one running), and between requests the loop polls for work on-CPU. The GPU idles because there
  is no work — not a CPU bottleneck.

The engine is vLLM or SGLang by seed (``(seed // 6) % 2``, so each sees every magnitude), its process
named as the tracer records it (``vllm``; SGLang's scheduler ``sglang::scheduler``), its series under
the names it publishes (:data:`ingero.explain.rules_serving.NAMES`), stored as the scraper stores them:
a full snapshot first, then each series when it changes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from ingero.demo.synth import SyntheticNode
from ingero.explain.rules_serving import NAMES
from ingero.store.engine_metrics import EngineMetricRow
from ingero.store.writer import StoreWriter
from tests.scenarios.base import SECONDS, Loop, Node, Params, finish, trainer
from tests.scenarios.host import _cpu_bound

SCRAPE_S = 1.0
PROCESS = {"vllm": "vllm", "sglang": "sglang::scheduler"}  # the engine loop's comm
LABELS = json.dumps({"model_name": "llama-3-8b"}, sort_keys=True)


def engine_of(p: Params) -> str:
    return ("vllm", "sglang")[(p.seed // 6) % 2]


State = dict[str, float]  # role (running, waiting, kv, done) -> value at one scrape


def _rows(engine: str, pid: int, node: SyntheticNode, states: list[tuple[float, State]]) -> list[EngineMetricRow]:
    """The scrapes as the scraper stores them: every series at the first, then only the changed ones."""
    names = NAMES[engine]
    last: dict[str, float] = {}
    out: list[EngineMetricRow] = []
    for t, state in states:
        for role, value in state.items():
            metric = names[role][0]
            if last.get(metric) != value:
                out.append((node.ts(t), pid, engine, metric, LABELS, float(value)))
                last[metric] = value
    return out


def _store(db: Path, node: Node, rows: list[EngineMetricRow]) -> None:
    with StoreWriter(db, node.identity()) as w:
        w.write_batch(engine_metrics=rows)


def scraped(loop: Loop, engine: str, state_at: Callable[[float], State], pid: int | None = None) -> None:
    """Scrape the engine (process ``pid``, default the loop's) every SCRAPE_S over the loop's run;
    ``state_at(t)`` says what it published at ``t`` seconds."""
    times = np.arange(0.0, loop.t + SCRAPE_S, SCRAPE_S) + float(loop.rec.rng.uniform(0, SCRAPE_S))
    states = [(float(t), state_at(float(t))) for t in times]
    assert isinstance(loop.rec, Node)
    rows = _rows(engine, loop.pid if pid is None else pid, loop.rec, states)
    loop.rec.after.append(partial(_store, node=loop.rec, rows=rows))


def busy(seed: int, *, waiting: tuple[int, int] = (2, 13)) -> Callable[[float], State]:
    """A busy engine's gauges: 24-32 requests running, ``waiting`` (low, high) waiting, the cache well used."""
    rng = np.random.default_rng(seed)
    done = [0.0]

    def at(t: float) -> State:
        done[0] += float(rng.integers(4, 12))
        return {
            "running": float(rng.integers(24, 33)),
            "waiting": float(rng.integers(*waiting)),
            "kv": round(float(rng.uniform(0.55, 0.7)), 3),
            "done": done[0],
        }

    return at


Run = Callable[[Loop, int], Callable[[float], State]]  # (loop, node index) -> its gauges at t seconds


def engines(p: Params, run: Run) -> list[SyntheticNode]:
    """``p.n_nodes`` engine nodes: ``run`` drives each loop and says what its engine published."""
    out = []
    for i in range(p.n_nodes):
        loop = trainer(p, i, PROCESS[engine_of(p)])
        scraped(loop, engine_of(p), run(loop, i))
        out.append(finish(loop))
    return out


def serving_engine_cpu_bound(p: Params) -> list[SyntheticNode]:
    """Every node a busy engine; node ``p.outlier``'s loop is CPU-bound at every step."""

    def run(loop: Loop, i: int) -> Callable[[float], State]:
        _cpu_bound(loop, p.magnitude if i == p.outlier else 0.0)
        return busy(p.seed * 7919 + i)

    return engines(p, run)


def low_load(loop: Loop) -> list[tuple[float, float]]:
    """A request every ~0.35 s (exponential), each a prefill and 8-24 decode steps; between requests the
    loop polls for work on-CPU. Returns the requests' (start, end) seconds."""
    rng, served = loop.rec.rng, []
    while loop.t < SECONDS * 2:
        loop.host_code(float(rng.exponential(0.35)))  # polling its input queue: nothing to do
        start = loop.t
        for _ in range(int(rng.integers(8, 24))):
            loop.work(copy=False)
            loop.sync(4.0)
            loop.host_code(float(rng.uniform(0.2, 0.6)) * 1e-3)  # sampling, detokenising: the usual turnaround
        served.append((start, loop.t))
        loop.steps += 1
    return served


def healthy_engine_low_load(p: Params) -> list[SyntheticNode]:
    def run(loop: Loop, i: int) -> Callable[[float], State]:
        served = low_load(loop)

        def idle(t: float) -> State:
            now = float(sum(a <= t < b for a, b in served))
            return {"running": now, "waiting": 0.0, "kv": 0.02 * now, "done": float(sum(b <= t for _, b in served))}

        return idle

    return engines(p, run)


FAMILIES = {
    "engine-cpu-bound": serving_engine_cpu_bound,
    "healthy-engine-idle": healthy_engine_low_load,
}
