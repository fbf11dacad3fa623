"""Every tool, registered: what the surfaces (HTTP tools API, OpenAPI, MCP, dashboard) list, look up and call.

Importing this module imports the tool modules, whose ``@tool`` decorators register them in
:mod:`ingero.tools.registry`; the registry itself imports no tool module (one-way imports).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import ingero.tools.fleet
import ingero.tools.local  # noqa: F401  (registration happens at import)
from ingero.errors import ToolNotFoundError
from ingero.tools import registry


def tools() -> dict[str, registry.Tool]:
    """Every registered tool, by name (importing the tool modules registers them)."""
    return registry.registered()


def get(name: str) -> registry.Tool:
    found = tools().get(name)
    if found is None:
        raise ToolNotFoundError(f"unknown tool {name!r}", hint="tools: " + ", ".join(sorted(tools())))
    return found


async def call(
    name: str, args: Mapping[str, Any], env: registry.ToolEnv, *, run_sync: registry.SyncRunner | None = None
) -> dict[str, Any]:
    """Validate ``args`` and run tool ``name``; raises IngeroError / pydantic ValidationError on failure."""
    t = get(name)
    kwargs = t.validate(args)
    if t.is_async:
        result = t.fn(env, **kwargs)
        assert inspect.isawaitable(result)
        return await result
    if run_sync is None:
        import anyio

        return await anyio.to_thread.run_sync(lambda: t.fn(env, **kwargs))  # type: ignore[arg-type,return-value]
    return await run_sync(lambda: t.fn(env, **kwargs))  # type: ignore[arg-type,return-value]
