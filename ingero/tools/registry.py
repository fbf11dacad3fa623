"""The one tool registry: each tool is one typed Python function, registered once with :func:`tool`.

A tool is ``fn(env: ToolEnv, **typed_arguments) -> dict`` (sync functions do blocking database work and
run in a worker thread; async ones await the fleet client). Its JSON schema is derived once, from the
type hints, by the MCP SDK's own machinery (``func_metadata``: a pydantic model of the arguments); the
same model validates the arguments on every surface:

* MCP (stdio and Streamable HTTP) — :mod:`ingero.mcp.server` registers each tool with the SDK;
* the HTTP+JSON tools API — :mod:`ingero.tools.http` (``POST /api/v1/tools/<name>``) on the agent and
  the dashboard;
* the OpenAPI document — :mod:`ingero.tools.openapi`.

The tool modules (:mod:`ingero.tools.local`, :mod:`ingero.tools.fleet`) import this one to register;
:mod:`ingero.tools.toolset` imports them and is what the surfaces ask for the tools (no import circle).

Every surface answers with :func:`encode_answer` (compact JSON, the same bytes everywhere) and maps
failures with :func:`ingero.tools.failures.classify` (one error vocabulary).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ingero import compactjson
from ingero.config import GpuRates, NodeSpec
from ingero.errors import UsageError
from ingero.fleet.settings import ClientSettings

if TYPE_CHECKING:
    from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata

Scope = Literal["local", "fleet", "host"]
ToolFn = Callable[..., dict[str, Any] | Awaitable[dict[str, Any]]]
SyncRunner = Callable[[Callable[[], dict[str, Any]]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class ToolEnv:
    """What a tool may read: one local database and/or the fleet's nodes (with the client settings and
    the GPU-hour rates of ``fleet.gpu_hourly_usd`` for ``get_cost``)."""

    db: Path | None = None
    nodes: tuple[NodeSpec, ...] = ()
    fleet: ClientSettings = field(default_factory=ClientSettings)
    rates: GpuRates = field(default_factory=GpuRates)

    def need_db(self) -> Path:
        if self.db is None:
            raise UsageError(
                "no local database on this server",
                hint="start it with --db PATH (ingero mcp / dashboard), or use query_fleet",
            )
        return self.db


@dataclass(frozen=True)
class Tool:
    name: str
    fn: ToolFn
    scope: Scope
    title: str

    @functools.cached_property
    def meta(self) -> FuncMetadata:
        """The arguments' pydantic model, derived on first use: importing the MCP SDK is most of a
        server's start-up, and a refusal or a server no tool is asked of never needs it."""
        from mcp.server.mcpserver.utilities.func_metadata import func_metadata

        return func_metadata(self.fn, skip_names=["env"], structured_output=False)

    @property
    def description(self) -> str:
        return inspect.cleandoc(self.fn.__doc__ or self.title)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    @property
    def input_schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = self.meta.arg_model.model_json_schema(by_alias=True)
        return schema

    def signature(self) -> inspect.Signature:
        """The function's signature without ``env``: what a caller passes."""
        sig = inspect.signature(self.fn, eval_str=True)
        return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "env"])

    def validate(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments checked against the schema (raises pydantic's ValidationError)."""
        unknown = sorted(set(args) - set(self.meta.arg_model.model_fields))
        if unknown:
            raise UsageError(
                f"{self.name}: unknown argument {unknown[0]!r}",
                hint="arguments: " + (", ".join(self.meta.arg_model.model_fields) or "none"),
            )
        return self.meta.validate_arguments(dict(args))

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "scope": self.scope,
            "description": self.description,
            "input_schema": self.input_schema,
        }


_TOOLS: dict[str, Tool] = {}


def tool(title: str, *, scope: Scope, name: str | None = None) -> Callable[[ToolFn], ToolFn]:
    """Register ``fn`` as a tool (its schema derived once, on first use: :attr:`Tool.meta`)."""

    def register(fn: ToolFn) -> ToolFn:
        key = name or fn.__name__
        if key in _TOOLS:
            raise ValueError(f"tool {key!r} registered twice")
        _TOOLS[key] = Tool(key, fn, scope, title)
        return fn

    return register


def registered() -> dict[str, Tool]:
    """The tools registered so far (:func:`ingero.tools.toolset.tools` has them all)."""
    return dict(_TOOLS)


def encode_answer(doc: Mapping[str, Any]) -> str:
    """Compact JSON (no pretty-printing), the same text on every surface; NaN/Inf become null."""
    return compactjson.dumps(doc)


def iso_us(ns: int | None) -> str | None:
    """Unix ns → ``2026-04-03T12:18:43.111234Z`` (ISO-8601, UTC, microseconds): every tool's timestamps."""
    if not ns:
        return None
    from datetime import UTC, datetime, timedelta

    dt = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# Fields that measure the call itself (time taken, network round trips, clock offsets), not the data:
# two calls with the same arguments may differ in these and only these.
VOLATILE_FIELDS = frozenset({"elapsed_ms", "skew", "rtt_ms", "offset_ms", "uncertainty_ms", "clock_skew_warnings"})
