"""Phase-aware baselines for the serving chains: prefill-like and decode-like scrape intervals, each judged
only against the baseline of its own phase.

A serving engine alternates two kinds of work. **Prefill** runs a request's whole prompt through the model
at once: few, large launches, a long step, first tokens that wait on it. **Decode** produces one token per
running request per step: many short steps with small launches. While long prompts are being prefilled
the decode steps between them slow down (the prefill shares the GPU) and first tokens take longer; that is
the mix of work, not a regression. So each scrape interval gets a phase and a latency is compared only with
earlier intervals of the same phase:

* **By the engine's own counters** where it publishes them (vLLM's and SGLang's ``prompt_tokens_total``):
  the prompt tokens prefilled in the interval, on a log scale. Not their share of all tokens: the
  generated tokens move with the decode speed — what is being judged — so a decode slowdown would raise
  the prompt share and move its own intervals into the other phase, out of reach of the decode baseline.
  The prefill work does not depend on how fast decode runs.
* **By launch patterns** where it has none (TGI, Triton): the median grid size (blocks) of the engine
  process's kernel launches in the interval (``cudaLaunchKernel`` / ``cuLaunchKernel`` arg1, see
  :func:`ingero.store.catalog.launch_dims`), on a log scale — prefill launches cover a whole prompt's
  tokens, decode launches one token per request.

The feature is split in two by Otsu's threshold (the split that maximises the variance between the two
sides); the split is kept only when the two sides' means are at least :data:`TOKENS_GAP` (log2 prompt
tokens: 2x more prompt) or :data:`LAUNCH_GAP` (log2 blocks: 2x larger launches) apart and each side has
:data:`MIN_PHASE` intervals.
Otherwise the engine ran one steady mix and every interval shares one baseline, as before.

:func:`judge` compares, per phase, the first third of that phase's intervals (its baseline) with its last
third, in time order; a phase with fewer than :data:`MIN_PHASE` intervals has no baseline and is not judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

DECODE, PREFILL = 0, 1
PHASE_NAMES = {DECODE: "decode-like", PREFILL: "prefill-like"}
TOKENS_GAP = 1.0
LAUNCH_GAP = 1.0
MIN_PHASE = 6
UNKNOWN = -1  # an interval with nothing to classify it by (no tokens, no launches)
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Phases:
    """Each interval's phase (DECODE, PREFILL or UNKNOWN) and how they were told apart."""

    of: I64
    by: str  # "" (one phase) | "tokens" | "launches"

    @property
    def split(self) -> bool:
        return bool(self.by)


@dataclass(frozen=True)
class Judgement:
    """One phase's baseline (its first third's mean) against its last third's."""

    phase: int
    baseline: float
    late: float
    after: I64  # the intervals after the baseline (their indices), in time order
    values: F64  # their values

    @property
    def ratio(self) -> float:
        return self.late / self.baseline if self.baseline > 0 else 0.0

    def name(self, phases: Phases) -> str:
        return PHASE_NAMES[self.phase] if phases.split else "all"


def one_phase(n: int) -> Phases:
    return Phases(np.zeros(n, dtype=np.int64), "")


def otsu(x: F64) -> tuple[float, float, float] | None:
    """(threshold, low side's mean, high side's mean) of the two-class split of ``x`` that maximises the
    between-class variance (None for fewer than two distinct values)."""
    v = np.sort(x[np.isfinite(x)])
    if v.size < 2 or v[0] == v[-1]:
        return None
    k = np.arange(1, v.size)
    c = np.cumsum(v)
    lo, hi = c[:-1] / k, (c[-1] - c[:-1]) / (v.size - k)
    between = k * (v.size - k) * (hi - lo) ** 2
    between[v[1:] == v[:-1]] = -1  # split between distinct values only
    i = int(np.argmax(between))
    return float((v[i] + v[i + 1]) / 2), float(lo[i]), float(hi[i])


def _split(feature: F64, gap: float, by: str) -> Phases:
    found = otsu(feature)
    if found is None:
        return one_phase(feature.size)
    thr, lo, hi = found
    finite = np.isfinite(feature)
    of = np.where(finite, np.where(feature > thr, PREFILL, DECODE), UNKNOWN).astype(np.int64)
    if hi - lo < gap or min(int((of == DECODE).sum()), int((of == PREFILL).sum())) < MIN_PHASE:
        return one_phase(feature.size)
    return Phases(of, by)


def by_tokens(prompt: F64) -> Phases:
    """Phases from the prompt tokens each interval prefilled (Δ of the engine's counter)."""
    feature = np.where(np.isfinite(prompt), np.log2(1 + np.maximum(np.nan_to_num(prompt), 0)), np.nan)
    return _split(feature, TOKENS_GAP, "tokens")


def by_launches(grid: I64, launch_ts: I64, blocks: I64) -> Phases:
    """Phases from the median grid size (log2 blocks) of the launches in each interval (grid[i], grid[i+1]]."""
    n = grid.size - 1
    feature = np.full(n, np.nan)
    if launch_ts.size:
        at = np.searchsorted(grid, launch_ts, side="left") - 1  # (grid[i], grid[i+1]] -> i
        keep = (at >= 0) & (at < n)
        at, logs = at[keep], np.log2(np.maximum(blocks[keep], 1).astype(np.float64))
        order = np.argsort(at, kind="stable")
        at, logs = at[order], logs[order]
        bounds = np.searchsorted(at, np.arange(n + 1))
        for i in range(n):
            if bounds[i + 1] > bounds[i]:
                feature[i] = float(np.median(logs[bounds[i] : bounds[i + 1]]))
    return _split(feature, LAUNCH_GAP, "launches")


def judge(values: F64, phases: Phases) -> list[Judgement]:
    """Per phase with a baseline: its first third of intervals (with a value) against its last third."""
    out = []
    for phase in (DECODE, PREFILL):
        idx = np.flatnonzero((phases.of == phase) & np.isfinite(values))
        need = MIN_PHASE if phases.split else 3
        if idx.size < need:
            continue
        third = idx.size // 3
        base = float(values[idx[:third]].mean())
        late = float(values[idx[-third:]].mean())
        if math.isfinite(base) and base > 0:
            out.append(Judgement(phase, base, late, idx[third:], values[idx[third:]]))
    return out


def worst(values: F64, phases: Phases) -> Judgement | None:
    """The phase whose last third strayed furthest above its baseline."""
    found = judge(values, phases)
    return max(found, key=lambda j: j.ratio) if found else None


__all__ = [
    "DECODE",
    "PREFILL",
    "Judgement",
    "Phases",
    "by_launches",
    "by_tokens",
    "judge",
    "one_phase",
    "otsu",
    "worst",
]
