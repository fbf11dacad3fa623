"""Verdict lines for bench/: every target judged the same way, printed the same way, tallied once.

A benchmark declares each target once (a :class:`Target`), measures, then calls :func:`verdict`:

    LATENCY = Target(100, "ms")                # measured ≤ 100 ms
    RATE = Target(300_000, " events/s", at_least=True, fmt="{:,.0f}")
    verdict("ingero --help", 41.2, LATENCY)                           # ok
    verdict("fan-out / raw", 1.3, Target(1.1, "x"), complete=answered == n, detail=f"answered {answered}/{n}")

Words: ``ok``; ``MISS`` (over target, or the run was incomplete: a figure from a run that lost answers,
rows or events is never ``ok``, whatever it measured); ``no verdict`` (a quick run, whose size is not
the target's: the figure is shown, nothing is claimed). :func:`summary` ends the benchmark: it prints
the tally and returns the exit status — 0 when every verdict is ok, :data:`EXIT_MISS` when any missed.
Any other non-zero status (a traceback's 1, argparse's 2) means the benchmark crashed
(``run_all.py`` says CRASH).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EXIT_MISS = 3  # the benchmark ran to its end and at least one verdict is MISS

OK, MISS, NO_VERDICT = "ok", "MISS", "no verdict"
_tally: dict[str, int] = {OK: 0, MISS: 0, NO_VERDICT: 0}


@dataclass(frozen=True)
class Target:
    """``measured <= limit`` (or ``<`` when ``strict``; ``>=`` when ``at_least``), shown in ``unit``."""

    limit: float
    unit: str = ""
    at_least: bool = False
    strict: bool = False
    fmt: str = "{:.2f}"

    def met(self, measured: float) -> bool:
        if self.at_least:
            return measured >= self.limit
        return measured < self.limit if self.strict else measured <= self.limit

    def show(self, value: float) -> str:
        return self.fmt.format(value) + self.unit if math.isfinite(value) else "n/a"

    def __str__(self) -> str:
        op = ">=" if self.at_least else "<" if self.strict else "<="
        return f"{op} {self.show(self.limit)}"


@dataclass
class Runs:
    """Wall times of repeated runs, each checked by its benchmark: a run whose outcome was not the expected
    one (an exit status, a missing answer) is counted and its time never used; ``complete`` only when every
    run went as expected."""

    times: list[float] = field(default_factory=list)  # of the runs that went as expected
    runs: int = 0
    problem: str = ""  # the first unexpected outcome

    def add(self, seconds: float, problem: str = "") -> None:
        self.runs += 1
        if problem:
            self.problem = self.problem or problem[:240]
        else:
            self.times.append(seconds)

    @property
    def best(self) -> float:
        return min(self.times, default=math.inf)

    @property
    def worst(self) -> float:
        return max(self.times, default=math.inf)

    @property
    def complete(self) -> bool:
        return self.runs > 0 and len(self.times) == self.runs

    @property
    def detail(self) -> str:
        return f"{len(self.times)}/{self.runs} runs as expected" + (f"; {self.problem}" if self.problem else "")


def verdict(name: str, measured: float, target: Target, *, complete: bool = True, detail: str = "") -> str:
    """Print ``name: measured (target ...)  ok|MISS`` and return the word; incomplete runs are a MISS."""
    if not complete:
        word, why = MISS, " (incomplete run)"
    else:
        word, why = (OK, "") if target.met(measured) else (MISS, "")
    _emit(name, f"{target.show(measured):>12}  target {target}", word, why, detail)
    return word


def no_verdict(name: str, measured: float, target: Target, why: str, *, detail: str = "") -> str:
    """A figure shown beside a target it cannot be judged against (e.g. ``why="quick run"``)."""
    _emit(name, f"{target.show(measured):>12}  target {target}", NO_VERDICT, f" ({why})", detail)
    return NO_VERDICT


def _emit(name: str, figures: str, word: str, why: str, detail: str) -> None:
    _tally[word] += 1
    print(f"  {name:<52} {figures:<34}  {word}{why}" + (f"   [{detail}]" if detail else ""), flush=True)


def summary() -> int:
    """Print the tally of this run's verdicts; the exit status: 0, or :data:`EXIT_MISS` if any missed."""
    parts = [f"{_tally[w]} {w}" for w in (OK, MISS, NO_VERDICT) if _tally[w]]
    print(f"verdicts: {', '.join(parts) or 'none'}", flush=True)
    return EXIT_MISS if _tally[MISS] else 0
