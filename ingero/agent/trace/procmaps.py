"""A process's memory mappings from ``/proc/<pid>/maps``: one parser for the stack symbolizer
(:mod:`ingero.agent.trace.stacks`) and the Python-frame reader (:mod:`ingero.agent.trace.pyframes`)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    path: str  # as listed in maps
    reachable: str  # openable from here ('' for [vdso], [heap], deleted files, ...)


def read_maps(pid: int) -> list[Mapping]:
    """File-backed (and pseudo) mappings of a process, sorted by address; [] if it is gone."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out: list[Mapping] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        lo, _, hi = parts[0].partition("-")
        path = parts[5]
        reachable = ""
        if path.startswith("/") and not path.endswith(" (deleted)"):
            reachable = path if os.path.exists(path) else f"/proc/{pid}/root{path}"
        out.append(Mapping(int(lo, 16), int(hi, 16), int(parts[2], 16), path, reachable))
    out.sort(key=lambda m: m.start)
    return out
