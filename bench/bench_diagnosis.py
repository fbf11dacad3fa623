"""Diagnosis benchmark: Ingero's detection catalog over many seeds, in both layouts.

Every scenario family (``tests/scenarios``) runs ``--seeds`` times (default 20): seed k takes the k-th
magnitude of ``MAGNITUDES`` (both sides of every severity threshold), 1-4 nodes, the outlier anywhere
in node order. Each database is explained as recorded and again rewritten to Ingero's layout, and
judged by its expectation (``tests/scenarios/expectations.py``).

Printed per family and layout, by the severity the magnitude calls for (HIGH, MEDIUM, LOW, or none):
found / missed / false. *found*: named at that severity or above; *missed*: not; *false*: something
it must not say (a must-not-name at any severity, a severity above what the magnitude warrants, HIGH
or MEDIUM on a healthy node). Then the verdicts:

* every family named in ≥ 95 % of its seeds, in both layouts;
* 0 HIGH or MEDIUM chains on healthy jobs (the healthy families, and the healthy nodes of every run);
* CPU contention never named where the involuntary share is not dominant (every family but the CPU ones,
  and the CPU ones in Ingero's layout, where it cannot be told);
* every ledger adds up to its wall time (where the reports carry one).

A run that crashed on a scenario is incomplete: its verdicts are MISS. ``--quick`` runs 4 seeds of
each family: figures are shown, no verdict is claimed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from verdict import Target, no_verdict, summary, verdict  # noqa: E402

from tests.scenarios import FAMILIES  # noqa: E402
from tests.scenarios.base import Params  # noqa: E402
from tests.scenarios.expectations import (  # noqa: E402
    CPU_CONTENTION,
    CPU_FAMILIES,
    HEALTHY_FAMILIES,
    LAYOUTS,
    MAGNITUDES,
    MULTI_RANK,
    RECORDED,
)
from tests.scenarios.judge import Outcome, run  # noqa: E402

NAMED = Target(95.0, " %", at_least=True, fmt="{:.0f}")
NONE_ALLOWED = Target(0, "", fmt="{:.0f}")
CLASSES = ("HIGH", "MEDIUM", "LOW", "none")


def params(family: str, k: int) -> Params:
    """Seed k: the k-th magnitude, 1-4 nodes (2-4 for the multi-rank families), the outlier anywhere."""
    lo = 2 if family in MULTI_RANK else 1
    n = lo + (k * 7 + 3) % (5 - lo)
    return Params(seed=1000 + k, magnitude=MAGNITUDES[k % len(MAGNITUDES)], n_nodes=n, outlier=(k * 5 + 1) % n)


def cpu_named(o: Outcome) -> list[str]:
    """CPU contention chains where it must not be named: every family but the CPU ones as recorded."""
    if o.family in CPU_FAMILIES and o.layout == RECORDED:
        return []
    return [f"{n} {f} {s}" for n, f, s in o.chains if f.startswith(CPU_CONTENTION)]


def healthy_high(o: Outcome) -> list[str]:
    """HIGH/MEDIUM chains on healthy jobs: the healthy families' nodes, every run's healthy nodes."""
    return [x for x in o.false if " on healthy " in x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20, help="seeds per family (default 20)")
    ap.add_argument("--quick", action="store_true", help="4 seeds per family: figures only, no verdict")
    ap.add_argument("--family", action="append", default=[], help="only these families (repeatable)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every miss and false finding")
    args = ap.parse_args()
    seeds = 4 if args.quick else args.seeds
    families = args.family or sorted(FAMILIES)
    outcomes: list[Outcome] = []
    crashed: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-diagnosis-") as tmp:
        for family in families:
            for k in range(seeds):
                p = params(family, k)
                try:
                    outcomes += run(family, p, Path(tmp))
                except Exception:
                    crashed.append(f"{family} seed {p.seed}: {traceback.format_exc(limit=-1).strip().splitlines()[-1]}")
    elapsed = time.monotonic() - t0
    _table(outcomes, families)
    if args.verbose:
        for o in outcomes:
            if not o.ok:
                print(
                    f"  {o.family} {o.layout} m={o.params.magnitude} n={o.params.n_nodes} outlier={o.params.outlier}"
                    f" expected={o.expected} found={o.found} false={o.false} unbalanced={o.unbalanced}"
                )
    for c in crashed:
        print(f"  CRASH {c}")
    print(
        f"{len(outcomes)} runs of {len(families)} families x {seeds} seeds x {len(LAYOUTS)} layouts in {elapsed:.1f} s"
    )
    _verdicts(
        outcomes,
        families,
        complete=not crashed and len(outcomes) == len(families) * seeds * len(LAYOUTS),
        quick=args.quick,
    )
    return summary()


def _cell(rows: list[Outcome]) -> str:
    if not rows:
        return "-"
    found = sum(1 for o in rows if o.found)
    missed = sum(1 for o in rows if o.found is False)
    false = sum(1 for o in rows if o.false)
    return f"{found}/{missed}/{false}"


def _table(outcomes: list[Outcome], families: list[str]) -> None:
    by: dict[tuple[str, str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by[o.family, o.layout, o.expected or "none"].append(o)
    print(f"{'family':<22}{'layout':<10}" + "".join(f"{c:>12}" for c in CLASSES) + f"{'named':>8}{'ledger':>9}")
    print(f"{'':<32}" + "".join(f"{'f/m/x':>12}" for _ in CLASSES))
    for family in families:
        for layout in LAYOUTS:
            rows = [o for o in outcomes if o.family == family and o.layout == layout]
            need = [o for o in rows if o.found is not None]
            named = f"{100 * sum(1 for o in need if o.found) / len(need):.0f}%" if need else "-"
            ledger = (
                "n/a" if all(o.ledger_rows is None for o in rows) else f"{sum(1 for o in rows if o.unbalanced)} bad"
            )
            cells = "".join(f"{_cell(by[family, layout, c]):>12}" for c in CLASSES)
            print(f"{family:<22}{layout:<10}{cells}{named:>8}{ledger:>9}")
    print(
        "f/m/x = found / missed / false (a must-not-name, a severity above the magnitude's, HIGH/MEDIUM on a healthy node)"
    )


def _verdicts(outcomes: list[Outcome], families: list[str], *, complete: bool, quick: bool) -> None:
    def judge(name: str, measured: float, target: Target, detail: str = "") -> None:
        if quick:
            no_verdict(name, measured, target, "quick run", detail=detail)
        else:
            verdict(name, measured, target, complete=complete, detail=detail)

    for family in families:
        if family in HEALTHY_FAMILIES:
            continue
        rates: list[float | None] = []  # None: the layout lacks the family's signal, nothing is required there
        for layout in LAYOUTS:
            need = [o for o in outcomes if o.family == family and o.layout == layout and o.found is not None]
            rates.append(100.0 * sum(1 for o in need if o.found) / len(need) if need else None)
        shown = ", ".join(f"{lay} {'-' if r is None else f'{r:.0f}%'}" for lay, r in zip(LAYOUTS, rates, strict=True))
        judge(f"{family}: named (worse layout)", min((r for r in rates if r is not None), default=0.0), NAMED, shown)
    bad = [x for o in outcomes for x in healthy_high(o)]
    judge("HIGH/MEDIUM chains on healthy jobs", len(bad), NONE_ALLOWED, "; ".join(sorted(set(bad))[:3]))
    cpu = [x for o in outcomes for x in cpu_named(o)]
    judge("CPU contention named, not dominant", len(cpu), NONE_ALLOWED, "; ".join(sorted(set(cpu))[:3]))
    unbalanced = [x for o in outcomes for x in o.unbalanced]
    if any(o.ledger_rows is not None for o in outcomes):
        judge("ledger rows not adding up (±1 %)", len(unbalanced), NONE_ALLOWED, "; ".join(unbalanced[:2]))
    else:
        print("  ledger: the reports carry none (ExplainReport.ledger): conservation not checked")


if __name__ == "__main__":
    sys.exit(main())
