"""Whether numpy may back this process's large arrays with transparent huge pages: a process-wide choice
that belongs to the entry point (the CLI, the agent's API server, the benchmarks), declared here once.

On a host whose THP mode is ``madvise``, numpy madvises every array of a few megabytes for huge pages,
and each fresh multi-megabyte column of the explain engine then stalls in page-fault compaction: explain
on 4 M events cost 5.2-5.6x its 1 M time with the hint on (3.7-4.3x without). Choosing imports nothing
(a fleet query must not import numpy): the choice is applied now if numpy is already loaded, else by the
frame loader (:func:`apply`) before it allocates the first columns. Unlike ``NUMPY_MADVISE_HUGEPAGE``,
it does not leak into the programs ingero starts (a traced training job keeps its own numpy's default).
"""

from __future__ import annotations

import sys

__all__ = ["apply", "prefer_small_pages"]

_state = {"small": False, "applied": False}


def prefer_small_pages() -> None:
    """The entry point's choice: no huge-page hint for numpy's arrays in this process."""
    _state["small"] = True
    if "numpy" in sys.modules:
        apply()


def apply() -> None:
    """Apply the process's choice to numpy, once (nothing when no entry point made one)."""
    if not _state["small"] or _state["applied"]:
        return
    _state["applied"] = True
    try:
        from numpy._core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined]
    except ImportError:  # another numpy layout: keep its default
        return
    _set_madvise_hugepage(False)
