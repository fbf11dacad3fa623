"""One query budget: the row, time and size limits for untrusted SQL, declared once.

:class:`QueryBudget` travels from the CLI flags / config (``ingero serve --max-rows ...``) through
:class:`~ingero.agent.api.server.ServerSettings` and the API context to the SQL guard; each layer asks it
(:meth:`QueryBudget.rows`, :meth:`QueryBudget.timeout_ms`) instead of clamping on its own. The hard
ceilings below are the only place those numbers appear.

:class:`Deadline` is the one progress-handler deadline every guarded connection uses: it stops a
statement when its time is up or its ``cancel`` event is set, and lets an optional ``checkpoint``
pause the statement (the agent's admission control moves a long query to its heavy lane there);
the pause is added to the deadline, so waiting for a worker is never charged to the query.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ingero.errors import UsageError

DEFAULT_ROWS = 1000  # rows a query gets when it does not ask
MAX_ROWS = 10_000  # most rows any query may ask for
DEFAULT_TIMEOUT_MS = 2000  # a query's time limit when neither it nor the operator says otherwise
MAX_TIMEOUT_MS = 60_000  # the operator's ceiling (--max-timeout-ms)
MAX_RESPONSE_BYTES = 8 * 1024 * 1024
ANALYSIS_TIMEOUT_MS = 30_000  # explain / ops / overview / info
PROGRESS_EVERY = 2000  # VM instructions between deadline checks

Checkpoint = Callable[[], float]  # may block; returns the seconds it paused


@dataclass(frozen=True)
class QueryBudget:
    """What one untrusted query may use. Built once (validated), then only asked."""

    max_rows: int = MAX_ROWS
    default_rows: int = DEFAULT_ROWS
    max_timeout_ms: int = DEFAULT_TIMEOUT_MS
    max_response_bytes: int = MAX_RESPONSE_BYTES
    analysis_timeout_ms: int = ANALYSIS_TIMEOUT_MS

    def __post_init__(self) -> None:
        for name, value, ceiling in (
            ("max_rows", self.max_rows, MAX_ROWS),
            ("default_rows", self.default_rows, MAX_ROWS),
            ("max_timeout_ms", self.max_timeout_ms, MAX_TIMEOUT_MS),
            ("max_response_bytes", self.max_response_bytes, None),
            ("analysis_timeout_ms", self.analysis_timeout_ms, None),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
            if ceiling is not None and value > ceiling:
                raise UsageError(f"{name.replace('_', '-')} is at most {ceiling}, got {value}")
        if self.default_rows > self.max_rows:  # a lowered --max-rows lowers the default with it
            object.__setattr__(self, "default_rows", self.max_rows)

    def rows(self, asked: int | None) -> int:
        """The row cap for a query that asked for ``asked`` (None: the default)."""
        return _granted("limit", asked, self.default_rows, self.max_rows)

    def timeout_ms(self, asked: int | None) -> int:
        """The time limit for a query that asked for ``asked`` ms (None: the operator's maximum)."""
        return _granted("timeout_ms", asked, self.max_timeout_ms, self.max_timeout_ms)


def _granted(name: str, asked: int | None, default: int, ceiling: int) -> int:
    if asked is None:
        return default
    if asked < 1:
        raise UsageError(f"{name} must be at least 1, got {asked}")
    return min(asked, ceiling)


class Deadline:
    """A statement deadline checked by SQLite's progress handler (see the module notes)."""

    def __init__(
        self, budget_ms: int, cancel: threading.Event | None = None, checkpoint: Checkpoint | None = None
    ) -> None:
        self.budget_ms = budget_ms
        self.cancel = cancel if cancel is not None else threading.Event()
        self._checkpoint = checkpoint
        self._until = time.monotonic() + budget_ms / 1000.0

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def expired(self) -> bool:
        """Cancelled or out of time (no checkpoint: safe to ask anywhere)."""
        return self.cancel.is_set() or time.monotonic() > self._until

    def stopped(self) -> bool:
        """The progress handler's question, on the query's thread: run the checkpoint, then expired()."""
        if self._checkpoint is not None and not self.cancel.is_set():
            self._until += self._checkpoint()
        return self.expired()

    def install(self, conn: sqlite3.Connection, every: int = PROGRESS_EVERY) -> None:
        conn.set_progress_handler(lambda: 1 if self.stopped() else 0, every)


def errorname(e: BaseException) -> str:
    """SQLite's primary error name (``SQLITE_INTERRUPT``, ``SQLITE_AUTH``, ...; extended names such as
    ``SQLITE_READONLY_DBMOVED`` reduced to their primary) from ``e.sqlite_errorname``, or "" for
    errors that did not come from SQLite itself."""
    name = str(getattr(e, "sqlite_errorname", "") or "")
    return "_".join(name.split("_")[:2])
