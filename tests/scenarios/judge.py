"""Run one scenario through explain in one layout and judge the report against its expectation.

:func:`run` builds the scenario's database (recorded layout), rewrites it to Ingero's layout when
asked, runs explain, and returns an :class:`Outcome`: whether the family was named as required
(``found``), everything explain said that it must not have (``false``), and the ledger rows that do
not add up to their wall time (``unbalanced``; checked only where the report carries a ledger).
Used by tests/test_diagnosis_catalog.py and bench/bench_diagnosis.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingero.explain.engine import ExplainReport, explain
from ingero.explain.model import Chain
from ingero.store.db import open_readonly
from tests.scenarios import FAMILIES
from tests.scenarios.base import Params, write
from tests.scenarios.expectations import (
    CATALOG,
    INGERO,
    MISSING_PREV_STATE,
    MULTI_RANK,
    OFFCPU_UNKNOWN,
    RECORDED,
    Expect,
    rank,
)
from tests.scenarios.ingero_layout import rewrite

CONSERVATION = 0.01  # a ledger row's buckets add up to its wall time within this share


@dataclass
class Outcome:
    family: str
    layout: str
    params: Params
    expected: str | None  # the least severity the family must be named at (None: nothing required)
    found: bool | None  # None where nothing was required
    false: list[str] = field(default_factory=list)
    unbalanced: list[str] = field(default_factory=list)
    chains: list[tuple[str, str, str]] = field(default_factory=list)  # (node, family, severity)
    ledger_rows: int | None = None  # None: the report has no ledger

    @property
    def ok(self) -> bool:
        return self.found is not False and not self.false and not self.unbalanced


def _named(c: Chain, names: tuple[str, ...]) -> bool:
    return c.family.startswith(names) if names else False


def _text(c: Chain) -> str:
    return " ".join([c.summary, c.root_cause, c.explanation, *c.recommendations, *(t.detail for t in c.timeline)])


def _says_what_is_missing(c: Chain) -> bool:
    """A finding of off-CPU time of unknown kind counts only if it names the missing signal."""
    return not c.family.startswith(OFFCPU_UNKNOWN) or MISSING_PREV_STATE in _text(c)


def judge(report: ExplainReport, exp: Expect, p: Params, family: str, layout: str) -> Outcome:
    least, most = exp.least(p.magnitude), exp.most(p.magnitude)
    out = Outcome(family, layout, p, least, None, chains=[(c.node, c.family, c.severity) for c in report.chains])
    outlier = p.node_name(p.outlier % max(p.n_nodes, 2 if family in MULTI_RANK else 1))
    mine = [c for c in report.chains if (exp.anywhere or c.node == outlier) and _named(c, exp.names)]
    if least is not None:
        hits = [c for c in mine if rank(c.severity) >= rank(least) and _says_what_is_missing(c)]
        out.found = bool(hits)
    for c in mine:
        if rank(c.severity) > rank(most):
            out.false.append(f"{c.family} {c.severity} on {c.node}: above {most or 'nothing'} for {p.magnitude:.1%}")
    for c in report.chains:
        if c.family.startswith(exp.must_not) if exp.must_not else False:
            out.false.append(f"{c.family} {c.severity} on {c.node}: must not be named")
        elif c.severity in ("HIGH", "MEDIUM") and (
            exp.healthy or (c.node != outlier and exp.peers_clean and not _named(c, exp.names))
        ):
            out.false.append(f"{c.family} {c.severity} on healthy {c.node}")
    out.ledger_rows, out.unbalanced = conservation(report)
    return out


def _get(row: Any, key: str) -> Any:
    return row[key] if isinstance(row, dict) else getattr(row, key)


def conservation(report: ExplainReport) -> tuple[int | None, list[str]]:
    """(rows, rows whose buckets do not add up to wall_ns within 1 %), or (None, []) with no ledger."""
    ledger = getattr(report, "ledger", None)
    if ledger is None:
        return None, []
    bad = []
    for row in ledger:
        wall, buckets = int(_get(row, "wall_ns")), dict(_get(row, "buckets"))
        total = sum(int(v) for v in buckets.values())
        if any(int(v) < 0 for v in buckets.values()) or abs(total - wall) > CONSERVATION * max(wall, 1):
            bad.append(f"{_get(row, 'node')} tid {_get(row, 'tid')}: buckets {total} ns vs wall {wall} ns")
    return len(ledger), bad


def explain_file(path: Path) -> ExplainReport:
    conn = open_readonly(path)
    try:
        return explain(conn)
    finally:
        conn.close()


def build(family: str, p: Params, tmp: Path) -> dict[str, Path]:
    """The scenario's database in both layouts."""
    stem = f"{family}-s{p.seed}-m{p.magnitude}-n{p.n_nodes}-o{p.outlier}"
    recorded = write(FAMILIES[family](p), tmp / f"{stem}.db")
    return {RECORDED: recorded, INGERO: rewrite(recorded, tmp / f"{stem}-ingero.db")}


def run(family: str, p: Params, tmp: Path, layouts: tuple[str, ...] = (RECORDED, INGERO)) -> list[Outcome]:
    paths = build(family, p, tmp)
    return [judge(explain_file(paths[lay]), CATALOG[family][lay], p, family, lay) for lay in layouts]
