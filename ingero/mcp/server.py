"""``ingero mcp``: the Model Context Protocol surface of the tool registry (official ``mcp`` SDK, ``MCPServer``).

Every tool of :mod:`ingero.tools.registry` is registered here under its own name, with the schema the
registry derived (the SDK's ``func_metadata`` over the same signature), answering the registry's
compact JSON as text; the ``investigate`` prompt walks an assistant to a root cause. Two transports:

* stdio (:func:`run_stdio`) — for Claude Desktop and any local MCP client;
* Streamable HTTP (:func:`serve_http`) — ``ingero mcp --http :8471`` over TLS 1.3 with a bearer token
  and/or mTLS, served by hypercorn's trio worker (:mod:`ingero.agent.api.https`).

The server runs on trio (anyio's trio backend), so fleet tools await the fleet client directly and
database work runs in worker threads. Every failure comes back as a tool error (``isError``) whose text
starts with the error kind (:mod:`ingero.tools.failures`): the server never crashes on a bad call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ingero import __version__
from ingero.config import GpuRates, NodeSpec
from ingero.fleet.settings import ClientSettings
from ingero.mcp.prompt import INSTRUCTIONS, investigate_prompt
from ingero.tools import registry, toolset
from ingero.tools.failures import classify
from ingero.tools.registry import Tool, ToolEnv

if TYPE_CHECKING:
    from ingero.agent.api.https import Listen
    from ingero.agent.api.server import BoundServer

MCP_PATH = "/mcp"


@dataclass
class McpSettings:
    db: Path | None = None
    nodes: list[NodeSpec] = field(default_factory=list)
    fleet: ClientSettings = field(default_factory=ClientSettings)
    rates: GpuRates = field(default_factory=GpuRates)

    def env(self) -> ToolEnv:
        return ToolEnv(self.db, tuple(self.nodes), self.fleet, self.rates)


def _mcp_function(t: Tool, env: ToolEnv) -> Callable[..., Any]:
    """An async function with the tool's signature (``env`` bound) answering its compact JSON."""
    from mcp.server.mcpserver.exceptions import ToolError

    async def call(**kwargs: Any) -> str:
        try:
            return registry.encode_answer(await toolset.call(t.name, kwargs, env))
        except Exception as e:  # every failure is this call's error, in the registry's vocabulary
            raise ToolError(classify(e, tool=t.name).mcp_text()) from None

    sig = t.signature()
    call.__signature__ = sig.replace(return_annotation=str)  # type: ignore[attr-defined]
    call.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()} | {"return": str}
    call.__name__ = t.name
    call.__doc__ = t.description
    return call


def build_server(settings: McpSettings) -> Any:
    """The configured ``MCPServer`` (typed Any: the SDK's generics add nothing here)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import ToolAnnotations

    class Server(MCPServer[Any]):
        async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
            """The registry checks the call first, so MCP refuses exactly what the HTTP API refuses
            (unknown tools and arguments included), in the same words."""
            try:
                toolset.get(name).validate(arguments)
            except Exception as e:
                raise ToolError(classify(e, tool=name).mcp_text()) from None
            return await super().call_tool(name, arguments, context)

    server = Server(
        "ingero",
        title="ingero GPU causal observability",
        instructions=INSTRUCTIONS,
        version=__version__,
        log_level="WARNING",
    )
    env = settings.env()
    for t in toolset.tools().values():
        annotations = ToolAnnotations(
            title=t.title,
            read_only_hint=True,
            destructive_hint=False,
            idempotent_hint=t.scope != "fleet",
            open_world_hint=t.scope == "fleet",
        )
        server.add_tool(
            _mcp_function(t, env),
            name=t.name,
            title=t.title,
            description=t.description,
            annotations=annotations,
            structured_output=False,
        )

    @server.prompt(title="Investigate a slow GPU job")
    def investigate(symptom: str = "", since: str = "5m") -> str:
        """Step-by-step investigation from overview to root cause with the ingero tools."""
        return investigate_prompt(symptom, since, fleet=bool(settings.nodes))

    return server


def run_stdio(settings: McpSettings) -> None:
    """Serve on stdin/stdout until the client closes the stream."""
    import anyio

    server = build_server(settings)
    anyio.run(server.run_stdio_async, backend="trio")


def http_app(settings: McpSettings) -> Any:
    """The Streamable HTTP ASGI app (stateless JSON responses: every request stands alone)."""
    from mcp.server.transport_security import TransportSecuritySettings

    server = build_server(settings)
    # TLS plus a bearer token or a client certificate authenticate callers; Host checks add nothing there
    security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    return server.streamable_http_app(
        streamable_http_path=MCP_PATH, json_response=True, stateless_http=True, transport_security=security
    )


async def serve_http(
    settings: McpSettings,
    listen: Listen,
    *,
    task_status: trio.TaskStatus[BoundServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve MCP over Streamable HTTP at ``listen`` (a :class:`ingero.agent.api.https.Listen`) until cancelled,
    with the HTTP tools API on the same port, behind one guard (auth → audit → rate limit)."""
    from ingero.agent.api.https import serve_asgi
    from ingero.tools.http import Auth, Guard, ToolsAPI

    app = ToolsAPI(settings.env(), fallback=http_app(settings), title="ingero MCP server tools API")
    guard = Guard(app, auth=Auth(token=listen.token, mtls=listen.client_ca is not None), surface="mcp")
    await serve_asgi(guard, listen, path=MCP_PATH, task_status=task_status)
