"""``ingero dashboard`` in a real headless browser: Debian's chromium + chromium-driver driven by Selenium.

The dashboard (fleet of the three sample nodes, real mTLS agents on loopback) is served over TLS 1.3 with
a certificate of the test fleet CA; Chromium trusts that CA through its own NSS database (certutil), so
certificate errors are never ignored. The test logs in (a wrong token first), then checks the three nodes,
the straggler verdict and a chain against the tools' own answers, runs a SQL query, and checks the session
cookie's flags and the CSRF header rule. Screenshots go to ``$INGERO_ARTIFACTS`` (default
``build/test-artifacts``) — look at them. Marked ``browser`` and ``slow``; skipped where Chromium is missing.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ingero.agent.api.https import Listen
from ingero.agent.api.server import BoundServer
from ingero.config import NodeSpec
from ingero.dashboard.app import DashboardSettings, serve_dashboard
from ingero.tls.context import client_ssl_context
from ingero.tools.local import get_causal_chains, get_engine_metrics, get_trace_stats
from ingero.tools.registry import ToolEnv
from tests.fleet_agents import Pki, agents_in_thread, client_settings, make_pki
from tests.test_dashboard import cli_ledger_lines, local_answer
from tests.tools_surfaces import NODE_DBS, NODE_NAMES, node_agents

TOKEN = "dashboard-s3cret"
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
CERTUTIL = shutil.which("certutil")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER and CERTUTIL),
        reason="needs Debian chromium, chromium-driver and libnss3-tools (scripts/setup.sh --system installs them)",
    ),
]


def artifacts() -> Path:
    d = Path(os.environ.get("INGERO_ARTIFACTS", ROOT / "build" / "test-artifacts")) / "dashboard"
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextmanager
def dashboard_in_thread(settings: DashboardSettings, listen: Listen) -> Iterator[BoundServer]:
    ready: queue.Queue[BoundServer | BaseException] = queue.Queue()
    token_box: list[trio.lowlevel.TrioToken] = []
    stop: list[trio.CancelScope] = []

    async def main() -> None:
        token_box.append(trio.lowlevel.current_trio_token())
        try:
            async with trio.open_nursery() as nursery:
                stop.append(nursery.cancel_scope)
                ready.put(await nursery.start(serve_dashboard, settings, listen))
        except BaseException as e:
            ready.put(e)
            raise

    thread = threading.Thread(target=lambda: trio.run(main), daemon=True)
    thread.start()
    got = ready.get(timeout=60)
    if isinstance(got, BaseException):
        raise RuntimeError(f"dashboard failed to start: {got!r}") from got
    try:
        yield got
    finally:
        trio.from_thread.run_sync(stop[0].cancel, trio_token=token_box[0])
        thread.join(30)


@contextmanager
def chromium_trusting(ca: Path, home: Path) -> Iterator[Any]:
    """Headless Chromium whose NSS database trusts ``ca`` (and nothing was switched off to get there)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    nssdb = home / ".pki" / "nssdb"
    nssdb.mkdir(parents=True)
    subprocess.run([CERTUTIL, "-N", "-d", f"sql:{nssdb}", "--empty-password"], check=True)
    subprocess.run(
        [CERTUTIL, "-A", "-d", f"sql:{nssdb}", "-t", "C,,", "-n", "ingero-test-ca", "-i", str(ca)], check=True
    )
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1800"):
        opts.add_argument(arg)
    opts.add_argument(f"--user-data-dir={home / 'profile'}")
    service = Service(executable_path=str(CHROMEDRIVER), env={**os.environ, "HOME": str(home)})
    driver = webdriver.Chrome(options=opts, service=service)
    try:
        driver.set_page_load_timeout(60)
        yield driver
    finally:
        driver.quit()


def tool_answer(url: str, pki: Pki, name: str, args: dict[str, Any]) -> Any:
    """The same tool through the HTTP API with the bearer token: what the page must show."""
    ctx = client_ssl_context(ca_cert=pki.ca)
    r = httpx.post(
        f"{url}api/v1/tools/{name}", json=args, verify=ctx, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


ENGINE_NODE, ENGINE_PID = "gpu-node-02", 5151


@pytest.fixture(scope="module")
def demo_dbs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three demo nodes of ``make demo`` (``ingero investigations``), made fresh; gpu-node-02 also
    serves a (stand-in) vLLM whose metrics the real scraper recorded under KV-cache pressure."""
    from ingero.demo.investigations import generate
    from ingero.identity import Identity
    from ingero.store.writer import StoreWriter
    from tests.engine_standin import N, recording

    out = tmp_path_factory.mktemp("demo")
    generate(out)
    engine = recording(out / "engine.db", ENGINE_NODE, [(ENGINE_PID, "vllm", "kv_pressure")], N)
    conn = sqlite3.connect(engine)
    try:
        rows = conn.execute("SELECT ts, pid, engine, metric, labels, value FROM engine_metrics").fetchall()
    finally:
        conn.close()
    for name in ("sample-gpu-node-02.db", "sample-cluster.db"):
        with StoreWriter(out / name, Identity(ENGINE_NODE)) as w:
            w.write_batch(engine_metrics=rows)
    return out


# --- what the page must show, computed in Python from the tools' answers -----------------------------

OP_HEADS = ["node", "source", "op", "count", "p50", "p95", "p99", "max", "p99/p50", "total"]


def op_cells(d: dict[str, Any]) -> list[str]:
    """One per-op row as the CLI words it (ingero.timeutil.fmt_latency, counts with separators)."""
    from ingero.timeutil import fmt_latency

    def us(v: float) -> str:
        return fmt_latency(round(v * 1000))

    return [
        *(str(d[k]) for k in ("node", "source", "op")),
        f"{d['count']:,}",
        *(us(d[k]) for k in ("p50_us", "p95_us", "p99_us", "max_us")),
        f"{d['tail_ratio']:.1f}x",
        fmt_latency(round(d["total_ms"] * 1e6)),
    ]


def engine_value(v: float) -> str:
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{round(v, 3) if abs(v) >= 1 else float(f'{v:.4g}'):,}"


def table_cells(driver: Any, css: str) -> list[list[str]]:
    from selenium.webdriver.common.by import By

    return [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")] for tr in driver.find_elements(By.CSS_SELECTOR, css)
    ]


def check_ledger(driver: Any, rows: list[dict[str, Any]], cli: dict[tuple[str, int], str]) -> None:
    """Every GPU thread of the tool's ledger on the page: the line explain prints for it, and a bar whose
    segments are its buckets (nanoseconds as answered) and fill it."""
    from selenium.webdriver.common.by import By

    shown = driver.find_elements(By.CSS_SELECTOR, "#ledger .ledger-row")
    rows = sorted(rows, key=lambda r: (r["node"], -r["wall_ns"]))  # by node, the longest thread first
    assert [(e.get_attribute("data-node"), int(e.get_attribute("data-tid"))) for e in shown] == [
        (r["node"], r["tid"]) for r in rows
    ]
    assert set(cli) == {(r["node"], r["tid"]) for r in rows}
    for e, r in zip(shown, rows, strict=True):
        who = e.find_element(By.CSS_SELECTOR, ".who").text
        summary = e.find_element(By.CSS_SELECTOR, ".summary").text
        assert f"{who}: {summary}" == cli[(r["node"], r["tid"])]  # word for word what the CLI prints
        segs = e.find_elements(By.CSS_SELECTOR, ".ledger-bar .seg")
        assert {s.get_attribute("data-bucket"): int(s.get_attribute("data-ns")) for s in segs} == {
            b: ns for b, ns in r["buckets"].items() if ns > 0
        }
        assert sum(r["buckets"].values()) == r["wall_ns"]
        bar = e.find_element(By.CSS_SELECTOR, ".ledger-bar")
        inner = driver.execute_script("return arguments[0].clientWidth", bar)
        assert abs(sum(s.rect["width"] for s in segs) - inner) <= len(segs)  # the buckets fill the bar


def check_engine(driver: Any, node: str, local: dict[str, Any]) -> None:
    """The engine's panel: each series' last value as get_engine_metrics answers on that node's database."""
    from selenium.webdriver.common.by import By

    (e,) = [e for e in local["engines"] if e["node"] == node]
    (box,) = driver.find_elements(By.CSS_SELECTOR, "#engines .engine")
    assert (box.get_attribute("data-node"), int(box.get_attribute("data-pid"))) == (node, ENGINE_PID)
    assert box.find_element(By.TAG_NAME, "h3").text.startswith(f"vllm (pid {ENGINE_PID}) on {node}")
    cells = {m: v for m, v in table_cells(box, "tbody tr")}
    assert cells == {m: engine_value(v) for m, v in e["last"].items() if not m.endswith("_created")}
    assert cells["vllm:kv_cache_usage_perc"] == "0.985"  # the scenario's full cache, as scraped
    assert cells["vllm:num_requests_running"] == "48"


def test_duration_and_count_formats_are_the_clis(tmp_path: Path, pki: Pki) -> None:
    """The page's fmtLatency / fixed / fmtCount against ingero.timeutil.fmt_latency, format(x, '.Nf') and
    f'{n:,}': exact ties (1.25 ms, 2.5 µs), values just under each unit, and a seeded sweep of magnitudes."""
    import numpy as np

    from ingero.timeutil import fmt_latency

    rng = np.random.default_rng(20)
    ns = [0, 1, 499.5, 999, 999.5, 1000, 1500, 2500, 999_499, 999_500, 999_949, 999_950, 1_000_000, 1_050_000]
    ns += [1_150_000, 1_250_000, 17_077_187, 999_950_000, 999_994_999, 10**9, 1_005_000_000, 1_015_000_000]
    ns += [1_234_567_890_123, *np.round(10 ** rng.uniform(0, 13, 400)).tolist()]
    ns += (np.round(10 ** rng.uniform(0, 7, 200)) + 0.5).tolist()
    floats = [0.25, 0.125, 2.5, 3.5, 1.15, 2.675, 1e-3, *rng.uniform(0, 1000, 200).round(3).tolist()]
    counts = [0, 7, 999, 1000, 12_345, 30_070, 1_234_567, 10**15, *rng.integers(0, 10**12, 100).tolist()]
    listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key)
    with (
        dashboard_in_thread(DashboardSettings(env=ToolEnv(db=tmp_path / "none.db")), listen) as bound,
        chromium_trusting(pki.ca, tmp_path / "home") as driver,
    ):
        driver.get(bound.url)
        got = driver.execute_script(
            "const [ns, floats, counts] = arguments;"
            "return [ns.map(fmtLatency), [0, 1, 2, 3].map((d) => floats.map((x) => fixed(x, d))),"
            " counts.map(fmtCount)];",
            ns,
            floats,
            counts,
        )
    assert got[0] == [fmt_latency(v) for v in ns]
    assert got[1] == [[format(x, f".{d}f") for x in floats] for d in range(4)]
    assert got[2] == [f"{n:,}" for n in counts]
    assert fmt_latency(17_077_187) == "17.1 ms" and "17.1 ms" in got[0]


def test_dashboard_in_chromium(tmp_path: Path, demo_dbs: Path, pki: Pki) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    shots = artifacts()
    with agents_in_thread(pki, node_agents(demo_dbs)) as servers:
        env = ToolEnv(
            nodes=tuple(NodeSpec("127.0.0.1", s.port, name=n) for n, s in zip(NODE_NAMES, servers, strict=True)),
            fleet=client_settings(pki, timeout_s=10.0),
        )
        listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key, token=TOKEN)
        with (
            dashboard_in_thread(DashboardSettings(env=env, token=TOKEN), listen) as bound,
            chromium_trusting(pki.ca, tmp_path / "home") as driver,
        ):
            url = bound.url  # https://127.0.0.1:PORT/
            assert url.startswith("https://")
            wait = WebDriverWait(driver, 60)

            # not logged in: the page sends the browser to the login form
            driver.get(url)
            wait.until(ec.presence_of_element_located((By.ID, "login-form")))
            assert driver.current_url.endswith("/login")
            # the TLS connection is trusted (no interstitial): Chromium validated the fleet CA's certificate
            assert "Privacy error" not in driver.title

            # a wrong token is refused
            driver.find_element(By.ID, "token").send_keys("not-the-token")
            driver.find_element(By.ID, "login").click()
            wait.until(ec.text_to_be_present_in_element((By.ID, "login-error"), "wrong token"))
            assert "error=wrong-token" in driver.current_url and not driver.get_cookies()
            driver.save_screenshot(str(shots / "01-wrong-token.png"))

            driver.find_element(By.ID, "token").send_keys(TOKEN)
            driver.find_element(By.ID, "login").click()
            wait.until(lambda d: d.execute_script("return document.body.dataset.loaded") == "1")
            cookie = driver.get_cookie("ingero_session")
            assert cookie is not None
            assert (cookie["secure"], cookie["httpOnly"], cookie["sameSite"]) == (True, True, "Strict")

            # the three demo nodes, reachable
            rows = driver.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")
            assert [r.get_attribute("data-node") for r in rows] == list(NODE_NAMES)
            assert all(r.get_attribute("class") == "up" for r in rows)
            # the straggler verdict and the chains: exactly what the tools answer
            outliers = tool_answer(url, pki, "find_outlier_nodes", {})
            assert driver.find_element(By.ID, "verdict").text == outliers["headline"]
            assert outliers["outlier"] == "gpu-node-01"  # make demo's straggler
            chains = tool_answer(url, pki, "query_fleet", {"action": "chains", "limit": 20})["chains"]
            shown = driver.find_elements(By.CSS_SELECTOR, "#chains .chain")
            assert chains and [c.get_attribute("data-chain") for c in shown] == [c["id"] for c in chains]
            assert chains[0]["summary"] in shown[0].text
            # per-op latency table: the fleet's percentiles with units, as the CLI prints them
            heads = [h.text for h in driver.find_elements(By.CSS_SELECTOR, "#ops thead th")]
            assert heads == OP_HEADS
            ops = tool_answer(url, pki, "query_fleet", {"action": "ops"})
            expected = [op_cells(dict(zip(ops["columns"], r, strict=True))) for r in ops["rows"]]
            shown_ops = table_cells(driver, "#ops tbody tr")
            assert len(shown_ops) > 3 and sorted(shown_ops) == sorted(expected)
            assert any(c.endswith(" ms") and "." in c for r in shown_ops for c in r[4:8])
            # where each node's GPU thread spent its wall time: the lines explain prints, as bars
            ledger = tool_answer(url, pki, "query_fleet", {"action": "chains", "limit": 20})["ledger"]
            assert {r["node"] for r in ledger} == set(NODE_NAMES)
            cli: dict[tuple[str, int], str] = {}
            for db in NODE_DBS:
                cli |= cli_ledger_lines(demo_dbs / db)
            check_ledger(driver, ledger, cli)
            # gpu-node-02's serving engine: its series' last values, as its own database answers
            check_engine(driver, ENGINE_NODE, local_answer(get_engine_metrics, demo_dbs / "sample-gpu-node-02.db"))
            driver.execute_script("document.getElementById('ledger-section').scrollIntoView()")
            driver.save_screenshot(str(shots / "02-ledger-engines.png"))
            driver.execute_script("window.scrollTo(0, 0)")
            # one zoomable chart per node
            charts = driver.find_elements(By.CSS_SELECTOR, "#timeline .node-chart")
            assert [c.get_attribute("data-node") for c in charts] == list(NODE_NAMES)
            assert all(c.find_elements(By.CSS_SELECTOR, "canvas") for c in charts)
            driver.save_screenshot(str(shots / "02-fleet.png"))

            # a SQL query through the guarded tool
            box = driver.find_element(By.ID, "sql-query")
            box.clear()
            sql = "SELECT node, count(*) AS n FROM events GROUP BY node"
            box.send_keys(sql)
            driver.find_element(By.ID, "sql-run").click()
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#sql-result tbody tr")) == 3)
            cells = [
                [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
                for tr in driver.find_elements(By.CSS_SELECTOR, "#sql-result tbody tr")
            ]
            counted = tool_answer(url, pki, "query_fleet", {"action": "sql", "sql": sql, "limit": 200})["rows"]
            assert cells == [[n, str(c)] for n, c in counted] and [c[0] for c in cells] == list(NODE_NAMES)
            # a write is refused by the SQL guard, in one line
            box.clear()
            box.send_keys("DELETE FROM events")
            driver.find_element(By.ID, "sql-run").click()
            wait.until(ec.text_to_be_present_in_element((By.ID, "sql-error"), "read-only"))
            driver.execute_script("document.getElementById('sql').scrollIntoView()")
            driver.save_screenshot(str(shots / "03-sql.png"))

            # the cookie alone is not enough for a tool call: the page's X-Ingero header is (CSRF)
            status = driver.execute_async_script(
                "const done = arguments[0];"
                "fetch('/api/v1/tools/run_sql', {method: 'POST', headers: {'Content-Type': 'application/json'},"
                " body: JSON.stringify({query: 'SELECT 1'})}).then(r => done(r.status));"
            )
            assert status == 401

            # logging out ends the session
            driver.find_element(By.CSS_SELECTOR, "#logout button").click()
            wait.until(ec.presence_of_element_located((By.ID, "login-form")))
            driver.get(url)
            wait.until(ec.presence_of_element_located((By.ID, "login-form")))

    written = sorted(p.name for p in shots.glob("0[123]-*.png"))
    assert written == ["01-wrong-token.png", "02-fleet.png", "02-ledger-engines.png", "03-sql.png"]
    (shots / "README.json").write_text(json.dumps({"url": url, "screenshots": written}))


def test_dashboard_of_one_database_in_chromium(tmp_path: Path, demo_dbs: Path, pki: Pki) -> None:
    """One (merged cluster) database, no token on loopback: the same page, fed by the local tools."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    shots = artifacts()
    db = demo_dbs / "sample-cluster.db"
    listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key)
    with (
        dashboard_in_thread(DashboardSettings(env=ToolEnv(db=db)), listen) as bound,
        chromium_trusting(pki.ca, tmp_path / "home") as driver,
    ):
        driver.get(bound.url)
        WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.body.dataset.loaded") == "1")
        assert driver.find_element(By.ID, "status").get_attribute("class") == "muted"  # no tool failed
        rows = driver.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")
        assert [r.get_attribute("data-node") for r in rows] == list(NODE_NAMES)
        stats = local_answer(get_trace_stats, db)
        assert (
            f"one database (sample-cluster.db): {stats['events']:,} events"
            in driver.find_element(By.ID, "verdict").text
        )
        by = stats["events_in_window_by_node"]  # the nodes table: events per source, with separators
        sources = sorted({s for m in by.values() for s in m})
        assert table_cells(driver, "#nodes tbody tr") == [
            [n, *(f"{by.get(n, {}).get(s, 0):,}" for s in sources)] for n in stats["nodes"]
        ]
        assert not driver.find_element(By.ID, "logout").is_displayed()  # nothing to log out of
        chains = driver.find_elements(By.CSS_SELECTOR, "#chains .chain")
        assert chains and chains[0].get_attribute("data-chain").split(":")[0] in NODE_NAMES
        # the per-op table, the ledger and the engine: what the local tools answer, worded as the CLI does
        assert sorted(table_cells(driver, "#ops tbody tr")) == sorted(
            op_cells(o) for o in stats["top_ops_by_total_time"]
        )
        ledger = local_answer(get_causal_chains, db)["ledger"]
        assert {r["node"] for r in ledger} == set(NODE_NAMES)
        check_ledger(driver, ledger, cli_ledger_lines(db))
        engines = local_answer(get_engine_metrics, db)
        check_engine(driver, ENGINE_NODE, engines)
        (e,) = engines["engines"]
        head = driver.find_element(By.CSS_SELECTOR, "#engines .engine h3").text
        assert f"{e['scrapes']:,} scrapes, last " in head and e["scrapes"] >= 30
        charts = driver.find_elements(By.CSS_SELECTOR, "#timeline .node-chart")
        assert [c.get_attribute("data-node") for c in charts] == list(NODE_NAMES)
        driver.find_element(By.ID, "sql-run").click()  # the default query
        WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#sql-result tbody tr"))
        heads = [h.text for h in driver.find_elements(By.CSS_SELECTOR, "#sql-result thead th")]
        assert heads == ["node", "source", "cnt", "avg_us"]
        driver.save_screenshot(str(shots / "04-one-database.png"))


def test_fleet_engine_panel_without_the_table_and_with_a_dead_node(tmp_path: Path, demo_dbs: Path, pki: Pki) -> None:
    """gpu-node-01's recording predates engine_metrics (the table dropped), gpu-node-02 serves its vLLM, and a
    fourth configured node is down: the engine panel shows gpu-node-02's engine and lists the dead node in one
    line, and gpu-node-01 not at all (no table is no engine, not an error). The nodes table prints each node's
    events with thousands separators, as fleet_status answers them."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.engine_standin import free_port

    dbs = tmp_path / "dbs"
    dbs.mkdir()
    for db in NODE_DBS:
        shutil.copy(demo_dbs / db, dbs / db)
    conn = sqlite3.connect(dbs / NODE_DBS[0])
    with conn:
        conn.execute("DROP TABLE engine_metrics")
    conn.close()
    dead = NodeSpec("127.0.0.1", free_port(), name="gpu-node-09")
    with agents_in_thread(pki, node_agents(dbs)) as servers:
        live = tuple(NodeSpec("127.0.0.1", s.port, name=n) for n, s in zip(NODE_NAMES, servers, strict=True))
        env = ToolEnv(nodes=(*live, dead), fleet=client_settings(pki, timeout_s=10.0))
        listen = Listen(tls_cert=pki.node_cert, tls_key=pki.node_key, token=TOKEN)
        with (
            dashboard_in_thread(DashboardSettings(env=env, token=TOKEN), listen) as bound,
            chromium_trusting(pki.ca, tmp_path / "home") as driver,
        ):
            driver.get(bound.url)
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: d.find_elements(By.ID, "token"))
            driver.find_element(By.ID, "token").send_keys(TOKEN)
            driver.find_element(By.ID, "login").click()
            wait.until(lambda d: d.execute_script("return document.body.dataset.loaded") == "1")

            status = tool_answer(bound.url, pki, "fleet_status", {})
            at = status["columns"].index("events")
            counts = {r[status["columns"].index("node")]: r[at] for r in status["rows"]}
            heads = [h.text for h in driver.find_elements(By.CSS_SELECTOR, "#nodes thead th")]
            shown = {r[heads.index("node")]: r[heads.index("events")] for r in table_cells(driver, "#nodes tbody tr")}
            assert {n: shown[n] for n in NODE_NAMES} == {n: f"{counts[n]:,}" for n in NODE_NAMES}
            assert any("," in shown[n] for n in NODE_NAMES)  # the sample nodes hold thousands of events

            (box,) = driver.find_elements(By.CSS_SELECTOR, "#engines .engine")
            assert box.get_attribute("data-node") == ENGINE_NODE
            notes = [p.text for p in driver.find_elements(By.CSS_SELECTOR, "#engines > p")]
            assert len(notes) == 1, notes
            lines = notes[0].split(" · ")
            assert len(lines) == 1 and lines[0].startswith("gpu-node-09") and "\n" not in notes[0], notes
            assert "engine_metrics" not in notes[0] and NODE_NAMES[0] not in notes[0]
            driver.execute_script("document.getElementById('engines').scrollIntoView()")
            driver.save_screenshot(str(artifacts() / "05-fleet-engines-old-node.png"))
