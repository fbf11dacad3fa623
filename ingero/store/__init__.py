"""Trace store: Ingero-compatible SQLite schema, the single writer, read-only access and the SQL guard."""

from ingero.store.db import DbSummary, open_readonly, open_writable, summarize
from ingero.store.schema import SCHEMA_VERSION
from ingero.store.window import Window, resolve_window
from ingero.store.writer import EVENT_FIELDS, EventRow, StoreWriter

__all__ = [
    "EVENT_FIELDS",
    "SCHEMA_VERSION",
    "DbSummary",
    "EventRow",
    "StoreWriter",
    "Window",
    "open_readonly",
    "open_writable",
    "resolve_window",
    "summarize",
]
