"""Helpers for the tool-surface tests: the three sample nodes as real mTLS agents, the MCP clients of the
official SDK (stdio and Streamable HTTP over TLS), and the normalisation of answers for comparison."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
from mcp import ClientSession, StdioServerParameters, stdio_client

from ingero.tls.context import client_ssl_context
from ingero.tools.registry import VOLATILE_FIELDS
from tests.fleet_agents import AgentSpec, Pki

INGERO = str(Path(sys.executable).with_name("ingero"))
NODE_DBS = ("sample-gpu-node-01.db", "sample-gpu-node-02.db", "sample-gpu-node-03.db")
NODE_NAMES = ("gpu-node-01", "gpu-node-02", "gpu-node-03")


def node_agents(samples: Path) -> list[AgentSpec]:
    """The three sample nodes as mTLS agents (ranks 0..2 of 3)."""
    named = zip(NODE_DBS, NODE_NAMES, strict=True)
    return [AgentSpec(samples / db, n, rank=i, world_size=3) for i, (db, n) in enumerate(named)]


def fleet_config(path: Path, pki: Pki, ports: list[int]) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "fleet": {
                    "nodes": [{"name": n, "addr": f"127.0.0.1:{p}"} for n, p in zip(NODE_NAMES, ports, strict=True)],
                    "ca_cert": str(pki.ca),
                    "client_cert": str(pki.client_cert),
                    "client_key": str(pki.client_key),
                    "timeout": "10s",
                }
            }
        )
    )
    return path


@asynccontextmanager
async def stdio_session(cwd: Path, *args: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=INGERO, args=["mcp", *args], cwd=str(cwd))
    with (cwd / "mcp-stderr.log").open("w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            yield s


@asynccontextmanager
async def http_session(url: str, pki: Pki, token: str | None) -> AsyncIterator[ClientSession]:
    """The SDK's Streamable HTTP client over TLS 1.3 trusting the fleet CA, with a client certificate."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    ctx = client_ssl_context(ca_cert=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        httpx2.AsyncClient(verify=ctx, headers=headers, timeout=60) as client,
        streamable_http_client(url, http_client=client) as (read, write),
        ClientSession(read, write) as s,
    ):
        await s.initialize()
        yield s


def https_client(base_url: str, pki: Pki, token: str | None = None) -> httpx.AsyncClient:
    ctx = client_ssl_context(ca_cert=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=base_url, verify=ctx, headers=headers, timeout=60)


async def mcp_call(s: ClientSession, tool: str, args: dict[str, Any]) -> tuple[bool, str]:
    """(is_error, the text answer)."""
    res = await s.call_tool(tool, args)
    text = res.content[0].text if res.content else ""  # type: ignore[union-attr]
    return bool(res.is_error), text


def stable(doc: Any) -> Any:
    """``doc`` without the fields that measure the call (``VOLATILE_FIELDS``), columns included."""
    if isinstance(doc, dict):
        out = {k: stable(v) for k, v in doc.items() if k not in VOLATILE_FIELDS}
        cols = doc.get("columns")
        if isinstance(cols, list) and isinstance(doc.get("rows"), list):
            keep = [i for i, c in enumerate(cols) if c not in VOLATILE_FIELDS]
            out["columns"] = [cols[i] for i in keep]
            out["rows"] = [[r[i] for i in keep] if isinstance(r, list) else r for r in doc["rows"]]
        return out
    if isinstance(doc, list):
        return [stable(v) for v in doc]
    return doc


def decoded(text: str) -> Any:
    return stable(json.loads(text))
