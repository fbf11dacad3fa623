"""How this process's C heap keeps the memory explain frees: a process-wide choice that belongs to the entry
point (the CLI, the agent's API server, the benchmarks), declared here once, beside the huge-page hint
(:mod:`ingero.explain.hugepages`).

glibc serves an allocation of at least its mmap threshold with a fresh ``mmap`` and unmaps it on ``free``.
The threshold adapts up to 32 MiB; explain's numpy columns and temporaries on 4 M events are 32 MB and more,
so each one came back as fresh zeroed pages, faulted in again on every use, while at 1 M events most freed
memory was reused. Raising the mmap and trim thresholds keeps freed memory for reuse, at the same peak: one
warm ``ingero explain`` on 4 M events went from 158-182 k page faults and 0.35-0.37 s of system time to
32-36 k and 0.14-0.15 s (on 1 M: 25-42 k -> 0.5-1.6 k faults). What remains comes from the reading threads'
own arenas (heaps of at most 64 MiB, unmapped whole once free), which these thresholds do not govern;
``M_ARENA_MAX=1`` removed it in a trial but puts every thread's ``malloc`` behind one lock: left out.

- :func:`one_shot` — a process that ends after its work (``ingero explain``): raise the thresholds; its
  memory goes back at exit.
- :func:`long_lived` — a process that answers requests for days (the agent's API server, under ``ingero
  serve`` and ``trace --listen``): raise the thresholds too, and hand the freed memory back to the system
  (``malloc_trim(0)``) when the last heavy request in flight ends (:func:`gives_back` marks those requests),
  so that its resident memory returns to about its pre-request level instead of holding its peak.

glibc only: where ``ctypes`` finds no glibc (no ``gnu_get_libc_version``, ``mallopt`` or ``malloc_trim`` in
the C library: musl, macOS), every function here does nothing, silently, and the process keeps its
allocator's defaults. Choosing imports no numpy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["gives_back", "long_lived", "one_shot", "trim"]

# glibc's <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# allocations below this come from the heap, not a fresh mmap, and up to this much free memory at the heap's
# top is kept for reuse: well above explain's columns (8 bytes x 4 M events = 32 MB), within mallopt's int
THRESHOLD_BYTES = 1 << 30

P = ParamSpec("P")
R = TypeVar("R")


class _Glibc:
    """The C library's ``mallopt`` and ``malloc_trim``, or nothing (not glibc)."""

    def __init__(self) -> None:
        self.mallopt: Callable[[int, int], int] | None = None
        self.malloc_trim: Callable[[int], int] | None = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
        except (OSError, AttributeError, TypeError):  # no C library by that name, or without these
            return
        if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its parameter numbers may mean other things
            return
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        self.mallopt, self.malloc_trim = mallopt, malloc_trim


_lock = threading.Lock()
_state = {"raised": False, "trims": False, "in_flight": 0, "rss_pages": 0, "trimmed": 0}
# A request trims only when the process's resident memory grew by this much while it ran: malloc_trim(0)
# walks every free chunk, 4-5 ms on a fragmented 150 MB heap even with nothing to give back — too much after
# each small query a fleet fans out; reading the resident size costs a few microseconds.
TRIM_GROWTH_BYTES = 16 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_pages() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


@functools.cache
def _glibc() -> _Glibc:
    return _Glibc()


def one_shot() -> None:
    """The entry point's choice for a process that ends after its work: keep freed memory for reuse."""
    with _lock:
        if _state["raised"]:
            return
        _state["raised"] = True
    mallopt = _glibc().mallopt
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)
        mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES)


def long_lived() -> None:
    """The entry point's choice for a server: as :func:`one_shot`, and give the memory back after each
    heavy request (:func:`gives_back`). Sticky: a later :func:`one_shot` does not undo it."""
    one_shot()
    with _lock:
        _state["trims"] = True


def trim() -> bool:
    """Return the C heap's free memory to the system now (``malloc_trim(0)``); False where nothing went
    back or the C library is not glibc."""
    malloc_trim = _glibc().malloc_trim
    return bool(malloc_trim(0)) if malloc_trim is not None else False


def gives_back(fn: Callable[P, R]) -> Callable[P, R]:
    """A heavy request handler (one that runs explain or reads many rows): in a :func:`long_lived`
    process, the last such request in flight trims the heap when it returns, once its frame (the columns,
    the temporaries) is gone, if the resident memory grew by TRIM_GROWTH_BYTES since the first of them
    began. Requests that overlap leave the memory to each other until the last ends."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with _lock:
            _state["in_flight"] += 1
            if _state["in_flight"] == 1 and _state["trims"]:
                _state["rss_pages"] = _resident_pages()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _state["in_flight"] -= 1
                last = _state["in_flight"] == 0 and _state["trims"]
            if last and (_resident_pages() - _state["rss_pages"]) * _PAGE >= TRIM_GROWTH_BYTES:
                _state["trimmed"] += 1
                trim()

    return wrapper
