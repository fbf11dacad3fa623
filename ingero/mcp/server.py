"""``ingero mcp``: a Model Context Protocol server (official ``mcp`` SDK, ``MCPServer``, stdio transport).

Tools (all read-only):
  overview, chains, sql, stacks, processes  — on the local database (``--db``)
  query_fleet(action=chains|sql|ops|overview|status, since, sql)  — fanned out to the fleet's agents
Prompt:
  investigate(symptom, since)  — walks an assistant from overview to root cause

The server runs on trio (anyio's trio backend), so ``query_fleet`` awaits the fleet client directly;
database work runs in worker threads. Inputs are validated (the SDK checks types against each tool's
schema; the tools check values), and every failure comes back as a tool error (``isError``) with a
one-line message: the server never crashes on a bad call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from ingero import __version__
from ingero.config import NodeSpec
from ingero.errors import IngeroError
from ingero.fleet.settings import ClientSettings
from ingero.mcp import local_tools as lt
from ingero.mcp.prompt import INSTRUCTIONS, investigate_prompt

T = TypeVar("T")
Action = Literal["chains", "sql", "ops", "overview", "status"]


@dataclass
class McpSettings:
    db: Path | None = None
    nodes: list[NodeSpec] = field(default_factory=list)
    fleet: ClientSettings = field(default_factory=ClientSettings)


def build_server(settings: McpSettings) -> Any:
    """The configured ``MCPServer`` (typed Any: the SDK's generics add nothing here)."""
    import anyio
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import ToolAnnotations

    server = MCPServer(
        "ingero",
        title="ingero GPU causal observability",
        instructions=INSTRUCTIONS,
        version=__version__,
        log_level="WARNING",
    )
    ro = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True)
    fleet_ro = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=True)

    async def guarded(call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except IngeroError as e:
            raise ToolError(e.one_line()) from None
        except ToolError:
            raise
        except Exception as e:  # an unexpected failure is still just this call's error
            raise ToolError(f"internal error: {type(e).__name__}: {' '.join(str(e).split())}") from None

    async def local(fn: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        db = settings.db
        if db is None:
            raise ToolError("no local database: start the server with 'ingero mcp --db PATH' (or use query_fleet)")

        async def run() -> dict[str, Any]:
            return await anyio.to_thread.run_sync(lambda: fn(db, **kwargs))

        return await guarded(run)

    @server.tool(annotations=ro)
    async def overview(since: str | None = None) -> dict[str, Any]:
        """What the trace database holds: nodes, time span, event mix per node, the slowest ops (p50/p99,
        tail ratio) and causal-chain counts by severity. since: a duration (30s, 5m, 2h), optional."""
        return await local(lt.overview, since=since)

    @server.tool(annotations=ro)
    async def chains(
        since: str | None = None, severity: str | None = None, node: str | None = None, limit: int = 20
    ) -> dict[str, Any]:
        """Causal chains (GPU symptom -> host cause -> fix), most severe first: computed over the window
        plus those stored in the database. severity: HIGH, MEDIUM or LOW; node: one node's only."""
        return await local(lt.chains, since=since, severity=severity, node=node, limit=limit)

    @server.tool(annotations=ro)
    async def sql(query: str, limit: int = lt.DEFAULT_SQL_ROWS) -> dict[str, Any]:
        """Run one read-only SQL statement (SQLite) on the trace database; writes, ATTACH and PRAGMA
        writes are refused, queries stop after 2 s. Tables: events, stack_traces, causal_chains, sources,
        ops, sessions, system_snapshots, process_names. limit: rows returned (1..1000)."""
        return await local(lt.sql, query=query, limit=limit)

    @server.tool(annotations=ro)
    async def stacks(op: str, since: str | None = None, node: str | None = None, limit: int = 10) -> dict[str, Any]:
        """Call stacks behind one op (e.g. cudaMalloc, cuLaunchKernel, cudaStreamSynchronize), most frequent
        first, with calls, share, average and max latency and the resolved frames."""
        return await local(lt.stacks, op=op, since=since, node=node, limit=limit)

    @server.tool(annotations=ro)
    async def processes(since: str | None = None, node: str | None = None, limit: int = 20) -> dict[str, Any]:
        """Per-process breakdown: GPU API calls and time, off-CPU time (sched_switch), block I/O, busiest GPU
        op — who is busy and who is waiting."""
        return await local(lt.processes, since=since, node=node, limit=limit)

    @server.tool(annotations=fleet_ro)
    async def query_fleet(
        action: Action, since: str | None = None, sql: str | None = None, limit: int = 200
    ) -> dict[str, Any]:
        """Ask every agent of the fleet at once (nodes from the config) and merge the answers under a 'node'
        column. action: chains (causal chains + straggler verdict), sql (needs sql), ops (per-op latency),
        overview, status (reachability, versions, clock skew). The answer starts with clock-skew warnings
        and the nodes that did not answer."""
        from ingero.mcp.fleet_tool import query_fleet as run_fleet

        return await guarded(
            lambda: run_fleet(settings.nodes, settings.fleet, action, since=since, sql=sql, limit=limit)
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
