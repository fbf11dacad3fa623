"""ingero mcp: driven by the official MCP SDK's own client over stdio (``.venv/bin/ingero mcp``)."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from mcp import ClientSession, StdioServerParameters, stdio_client

from ingero.errors import UsageError
from ingero.tools import local as lt
from ingero.tools import toolset
from ingero.tools.registry import ToolEnv
from tests.fleet_agents import AgentSpec, Pki, agents_in_thread, make_pki

INGERO = str(Path(sys.executable).with_name("ingero"))
NODES = ("sample-gpu-node-01.db", "sample-gpu-node-02.db", "sample-gpu-node-03.db")
TOOLS = set(toolset.tools())


@asynccontextmanager
async def session(tmp_path: Path, *args: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=INGERO, args=["mcp", *args], cwd=str(tmp_path))
    with (tmp_path / "mcp-stderr.log").open("w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            yield s


def run(fn: Callable[[], Awaitable[None]]) -> None:
    anyio.run(fn, backend="trio")


async def call(s: ClientSession, tool: str, args: dict[str, Any]) -> tuple[bool, Any]:
    """(is_error, decoded JSON answer or the error text)."""
    res = await s.call_tool(tool, args)
    text = res.content[0].text if res.content else ""  # type: ignore[union-attr]
    if res.is_error:
        return True, text
    return False, json.loads(text)


def write_config(path: Path, fleet: dict[str, Any] | None = None) -> Path:
    path.write_text(yaml.safe_dump({"fleet": fleet or {"nodes": []}}))
    return path


@pytest.mark.slow  # an MCP server subprocess: run by make test, not test-fast
def test_local_tools_over_stdio(tmp_path: Path, samples: Path) -> None:
    cfg = write_config(tmp_path / "ingero.yaml")
    db = samples / "sample-cluster.db"

    async def main() -> None:
        async with session(tmp_path, "--db", str(db), "--config", str(cfg)) as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert set(tools) == TOOLS
            assert {"get_trace_stats", "get_causal_chains", "run_sql", "get_stacks", "query_fleet"} <= TOOLS
            assert all(t.annotations and t.annotations.read_only_hint for t in tools.values())
            for name, t in tools.items():  # the schema the registry derived, published as is
                assert t.input_schema == toolset.get(name).input_schema, name
            assert tools["query_fleet"].input_schema["properties"]["action"]["enum"] == [
                "chains",
                "sql",
                "ops",
                "overview",
                "status",
            ]

            err, ov = await call(s, "get_trace_stats", {})
            assert not err and ov["events"] == 600 and ov["nodes"] == ["gpu-node-01", "gpu-node-02", "gpu-node-03"]
            assert ov["events_in_window_by_node"]["gpu-node-02"] == {"HOST": 62, "DRIVER": 40, "IO": 98}
            assert ov["top_ops_by_total_time"][0]["op"] in ("sched_switch", "block_write", "block_read")

            err, ch = await call(s, "get_causal_chains", {"severity": "HIGH"})
            assert not err and ch["count"] == 2
            assert {c["id"] for c in ch["chains"]} == {
                "gpu-node-01:drop-high-cuLaunchKernel",
                "gpu-node-01:tail-high-cuMemAlloc",
            }
            err, ch = await call(s, "get_causal_chains", {"node": "gpu-node-03"})
            assert not err and [c["summary"][:10] for c in ch["chains"]] == ["cuMemAlloc"]

            err, rows = await call(s, "run_sql", {"query": "SELECT node, count(*) AS n FROM events GROUP BY node"})
            assert not err and rows["rows"] == [["gpu-node-01", 200], ["gpu-node-02", 200], ["gpu-node-03", 200]]

            err, st = await call(s, "get_stacks", {"op": "cuMemAlloc_v2"})
            assert not err and (st["op"], st["calls"], len(st["stacks"])) == ("cuMemAlloc", 76, 1)
            assert "cudaMalloc+0x1f3 (libcudart.so.13)" in st["stacks"][0]["frames"]
            assert st["stacks"][0]["nodes"] == ["gpu-node-02", "gpu-node-03"]

            err, pr = await call(s, "processes", {"node": "gpu-node-02"})
            assert not err
            top = pr["processes"][0]
            assert (top["pid"], top["name"], top["gpu_api_calls"]) == (4599, "python3", 40)
            assert top["busiest_gpu_op"]["op"] == "cuMemAlloc"

            # bad input: a tool error each time, and the server keeps answering
            for tool, args, expect in [
                ("run_sql", {"query": "DELETE FROM events"}, "refused: DELETE statements are not allowed"),
                ("run_sql", {"query": 5}, "valid string"),
                ("run_sql", {"query": "SELECT nope FROM events"}, "validation: SQL error: no such column"),
                ("get_trace_stats", {"since": "soon"}, "validation: since='soon' is not a duration"),
                ("get_causal_chains", {"severity": "urgent"}, "'HIGH', 'MEDIUM' or 'LOW'"),
                ("get_stacks", {"op": "cudaFrobnicate"}, "validation: unknown op"),
                ("processes", {"limit": 0}, "greater than or equal to 1"),
                ("query_fleet", {"action": "status"}, "validation: no fleet nodes"),
                ("query_fleet", {"action": "reboot"}, "chains"),
                ("no_such_tool", {}, "Unknown tool"),
            ]:
                err, text = await call(s, tool, args)
                assert err, (tool, args, text)
                assert expect.lower() in text.lower(), (tool, text)
            err, again = await call(s, "run_sql", {"query": "SELECT count(*) AS n FROM events"})
            assert not err and again["rows"] == [[600]]

            prompts = (await s.list_prompts()).prompts
            assert [p.name for p in prompts] == ["investigate"]
            got = await s.get_prompt("investigate", {"symptom": "step time doubled on one node", "since": "10m"})
            text = got.messages[0].content.text  # type: ignore[union-attr]
            assert "step time doubled on one node" in text
            assert 'get_trace_stats(since="10m")' in text and "get_causal_chains(" in text and "get_stacks(" in text

    run(main)


def test_bad_database_fails_at_startup(tmp_path: Path) -> None:
    import subprocess

    cfg = write_config(tmp_path / "ingero.yaml")
    proc = subprocess.run(
        [INGERO, "mcp", "--db", str(tmp_path / "missing.db"), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("ingero: error:") and "no such database" in proc.stderr
    proc = subprocess.run(
        [INGERO, "mcp", "--config", str(cfg)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2 and "nothing to serve" in proc.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.slow  # an MCP server subprocess: run by make test, not test-fast
def test_query_fleet_over_three_loopback_agents(tmp_path: Path, samples: Path, pki: Pki) -> None:
    specs = [AgentSpec(samples / db, f"gpu-node-0{i + 1}", rank=i, world_size=3) for i, db in enumerate(NODES)]
    with agents_in_thread(pki, specs) as servers:
        dead = _closed_port()
        cfg = write_config(
            tmp_path / "ingero.yaml",
            {
                "nodes": [f"127.0.0.1:{s.port}" for s in servers]
                + [{"name": "gpu-node-04", "addr": f"127.0.0.1:{dead}"}],
                "ca_cert": str(pki.ca),
                "client_cert": str(pki.client_cert),
                "client_key": str(pki.client_key),
                "timeout": "10s",
            },
        )

        async def main() -> None:
            async with session(tmp_path, "--config", str(cfg)) as s:
                assert {t.name for t in (await s.list_tools()).tools} == TOOLS
                err, res = await call(
                    s,
                    "query_fleet",
                    {"action": "sql", "sql": "SELECT node, count(*) AS n FROM events GROUP BY node"},
                )
                assert not err, res
                assert res["columns"] == ["node", "n"]
                assert res["rows"] == [["gpu-node-01", 200], ["gpu-node-02", 200], ["gpu-node-03", 200]]
                assert (res["answered"], res["asked"]) == (3, 4)
                assert len(res["unreachable"]) == 1 and "gpu-node-04" in res["unreachable"][0]
                assert list(res)[:3] == ["identity_warnings", "clock_skew_warnings", "unreachable"]  # warnings first

                err, res = await call(
                    s,
                    "query_fleet",
                    {"action": "sql", "sql": "SELECT source, count(*) AS cnt FROM events GROUP BY source"},
                )
                assert not err and res["columns"] == ["node", "source", "cnt"]
                assert ["gpu-node-02", 4, 40] in res["rows"] and len(res["rows"]) == 8

                err, res = await call(s, "query_fleet", {"action": "status"})
                assert not err and res["answered"] == 3
                assert [r[1] for r in res["rows"][:3]] == ["gpu-node-01", "gpu-node-02", "gpu-node-03"]

                err, res = await call(s, "query_fleet", {"action": "chains"})
                assert not err and res["answered"] == 3  # the chains are explain's to decide; each names its node
                assert {c["node"] for c in res["chains"]} <= {"gpu-node-01", "gpu-node-02", "gpu-node-03"}
                assert "straggler" in res

                err, res = await call(s, "query_fleet", {"action": "ops", "since": "1h"})
                assert not err and res["columns"][0] == "node"
                assert {r[0] for r in res["rows"]} == {"gpu-node-01", "gpu-node-02", "gpu-node-03"}

                err, res = await call(s, "query_fleet", {"action": "overview"})
                assert not err and res["columns"][2:4] == ["first", "last"]
                assert res["rows"][0][2].endswith("Z") and len(res["rows"][0][2]) == 27  # ISO-8601, µs
                assert not err and sorted(r[:2] for r in res["rows"]) == [
                    ["gpu-node-01", 200],
                    ["gpu-node-02", 200],
                    ["gpu-node-03", 200],
                ]

                for args, expect in [
                    ({"action": "sql"}, "needs sql"),
                    ({"action": "chains", "sql": "SELECT 1"}, "only used with action=sql"),
                    ({"action": "ops", "since": "yesterday"}, "not a duration"),
                    ({"action": "sql", "sql": "DROP TABLE events"}, ""),
                ]:
                    err, text = await call(s, "query_fleet", args)
                    if expect:
                        assert err and expect in text, (args, text)
                    else:  # the agents refuse the write: each node's refusal is its outcome
                        assert not err and text["answered"] == 0 and len(text["unreachable"]) == 4
                err, text = await call(s, "get_trace_stats", {})
                assert err and "no local database" in text

        run(main)


def test_local_tool_validation_units(samples: Path) -> None:
    assert lt.check_since(" 5m ") == "5m"
    assert lt.check_since("") is None
    with pytest.raises(UsageError, match="positive"):
        lt.check_since("0s")
    with pytest.raises(UsageError, match="out of range"):
        lt.run_sql(ToolEnv(samples / NODES[0]), "SELECT 1", limit=5000)
    with pytest.raises(UsageError, match="empty"):
        lt.run_sql(ToolEnv(samples / NODES[0]), "   ")
    got = lt.get_stacks(ToolEnv(samples / NODES[0]), "cudaMalloc")
    assert got["calls"] == 0 and got["notes"] == ["no cudaMalloc events in the window"]
    win = lt.processes(ToolEnv(samples / NODES[2]), since="1s")
    assert "counts back" in (win["window"]["note"] or "")
