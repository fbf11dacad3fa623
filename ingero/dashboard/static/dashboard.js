// ingero dashboard: every figure comes from the tool registry's HTTP API (/api/v1/tools/<name>).
// Text from the server is always set with textContent (never parsed as HTML).
"use strict";

const HEADERS = { "Content-Type": "application/json", "X-Ingero": "1" };
const REFRESH_S = 5;
const TIMELINE_ROWS = 1000;
const TIMELINE_SQL =
  "SELECT e.node, e.timestamp, e.duration, coalesce(s.name, e.source) AS source, coalesce(o.name, e.op) AS op " +
  "FROM events e LEFT JOIN sources s ON s.id = e.source " +
  "LEFT JOIN ops o ON o.source_id = e.source AND o.op_id = e.op ORDER BY e.timestamp DESC";
let config = null;
let liveTimer = null;

async function tool(name, args) {
  const r = await fetch(`/api/v1/tools/${name}`, {
    method: "POST", headers: HEADERS, body: JSON.stringify(args || {}), credentials: "same-origin",
  });
  const doc = await r.json();
  if (r.status === 401) { location.href = "/login"; }
  if (!r.ok) { throw new Error(`${doc.kind}: ${doc.error}`); }
  return doc;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c === null || c === undefined ? "" : c);
  return e;
}

// --- figures as the CLI prints them ----------------------------------------------------------------
// fixed() is Python's format(x, ".Nf") (exact ties to even), fmtLatency() ingero.timeutil.fmt_latency and
// fmtCount() Python's f"{n:,}": tests/test_dashboard_browser.py checks them against Python, value for value.

function fixed(x, digits) {
  const sign = x < 0 ? "-" : "";
  const a = Math.abs(x);
  const exact = a.toFixed(100); // every digit of the double (toFixed rounds exact ties up)
  const dot = exact.indexOf(".");
  const kept = exact.slice(0, digits ? dot + 1 + digits : dot);
  const tie = /^50*$/.test(exact.slice(dot + 1 + digits));
  return sign + (tie && Number(kept[kept.length - 1]) % 2 === 0 ? kept : a.toFixed(digits));
}

function fmtLatency(ns) {
  if (ns >= 1e9) return `${fixed(ns / 1e9, 2)} s`;
  if (ns >= 1e6) return `${fixed(ns / 1e6, 1)} ms`;
  if (ns >= 1e3) return `${fixed(ns / 1e3, 0)} µs`;
  return `${fixed(ns, 0)} ns`;
}

function fmtCount(n) {
  const [whole, frac] = String(n).split(".");
  return whole.replace(/\B(?=(\d{3})+(?!\d))/g, ",") + (frac === undefined ? "" : `.${frac}`);
}

function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(3).replace(/\.?0+$/, "");
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

// columns: names, or [name, format] pairs (a formatted column is numeric: right-aligned)
function fillTable(table, columns, rows, rowAttrs) {
  table.replaceChildren();
  const cols = columns.map((c) => (Array.isArray(c) ? c : [c, null]));
  const head = el("tr", {}, ...cols.map(([c]) => el("th", {}, c)));
  table.append(el("thead", {}, head));
  const body = el("tbody");
  rows.forEach((r, i) => {
    const tr = el("tr", rowAttrs ? rowAttrs(r, i) : {});
    r.forEach((v, j) => {
      const f = cols[j] && cols[j][1];
      const text = f && v !== null && v !== undefined ? f(v) : fmt(v);
      tr.append(el("td", { class: f || typeof v === "number" ? "num" : "" }, text));
    });
    body.append(tr);
  });
  table.append(body);
}

function setStatus(text, bad) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = bad ? "error" : "muted";
}

// --- nodes and the straggler verdict ------------------------------------------------------------

async function loadNodes() {
  const table = document.getElementById("nodes");
  const verdict = document.getElementById("verdict");
  if (config.mode === "fleet") {
    const [status, outliers] = await Promise.all([tool("fleet_status"), tool("find_outlier_nodes")]);
    const cols = status.columns;
    const heads = cols.map((c) => (c === "events" ? [c, fmtCount] : c));
    fillTable(table, heads, status.rows, (r) => ({
      "data-node": fmt(r[cols.indexOf("node")]),
      class: String(r[0]).startsWith("yes") ? "up" : "down",
    }));
    verdict.textContent = outliers.headline || "no verdict";
    verdict.className = "verdict" + (outliers.outlier ? " outlier" : "");
    const problems = [...status.clock_skew_warnings, ...status.unreachable];
    document.getElementById("unreachable").textContent = problems.join(" · ");
    return;
  }
  const stats = await tool("get_trace_stats");
  const byNode = stats.events_in_window_by_node;
  const sources = [...new Set(Object.values(byNode).flatMap((m) => Object.keys(m)))].sort();
  const rows = stats.nodes.map((n) => [n, ...sources.map((s) => (byNode[n] || {})[s] || 0)]);
  fillTable(table, ["node", ...sources.map((s) => [s, fmtCount])], rows, (r) => ({ "data-node": r[0], class: "up" }));
  verdict.textContent =
    `one database (${config.database}): ${fmtCount(stats.events)} events, ${stats.first_event} → ${stats.last_event}`;
}

// --- per-op latency -------------------------------------------------------------------------------

const us = (v) => fmtLatency(Math.round(v * 1e3));
// [column as the CLI names it, the tools' field, its format]
const OP_TABLE = [
  ["node", "node", null], ["source", "source", null], ["op", "op", null], ["count", "count", fmtCount],
  ["p50", "p50_us", us], ["p95", "p95_us", us], ["p99", "p99_us", us], ["max", "max_us", us],
  ["p99/p50", "tail_ratio", (r) => `${fixed(r, 1)}x`], ["total", "total_ms", (v) => fmtLatency(Math.round(v * 1e6))],
];
const OP_HEADS = OP_TABLE.map(([name, , f]) => (f ? [name, f] : name));

async function loadOps() {
  const table = document.getElementById("ops");
  const field = (name) => OP_TABLE.findIndex((c) => c[1] === name);
  if (config.mode === "fleet") {
    const ops = await tool("query_fleet", { action: "ops" });
    const idx = OP_TABLE.map(([, f]) => ops.columns.indexOf(f));
    const rows = ops.rows.map((r) => idx.map((i) => (i >= 0 ? r[i] : null)));
    rows.sort((a, b) => (b[field("p99_us")] || 0) - (a[field("p99_us")] || 0));
    fillTable(table, OP_HEADS, rows.slice(0, 60));
  } else {
    const stats = await tool("get_trace_stats");
    const rows = stats.top_ops_by_total_time.map((o) => OP_TABLE.map(([, f]) => (o[f] === undefined ? null : o[f])));
    fillTable(table, OP_HEADS, rows);
  }
  setStatus(`updated ${new Date().toISOString().replace(/\.\d+Z$/, "Z")}`);
}

// --- causal chains --------------------------------------------------------------------------------

function chainCard(c) {
  const card = el("div", { class: `chain ${c.severity}`, "data-chain": c.id });
  card.append(el("div", {}, el("span", { class: "sev" }, c.severity), el("b", {}, c.node), ": ", c.summary));
  if (c.root_cause) card.append(el("div", {}, "root cause: ", c.root_cause));
  if (c.recommendations && c.recommendations.length) {
    card.append(el("ul", {}, ...c.recommendations.map((r) => el("li", {}, "fix: ", r))));
  }
  if (c.timeline && c.timeline.length) {
    const ev = el("details", {}, el("summary", {}, `evidence (${c.timeline.length})`));
    ev.append(el("ul", {}, ...c.timeline.map((t) => el("li", {}, `[${t.layer}] ${t.op}: ${t.detail}`))));
    card.append(ev);
  }
  return card;
}

async function loadChains() {
  const box = document.getElementById("chains");
  const doc = config.mode === "fleet"
    ? await tool("query_fleet", { action: "chains", limit: 20 })
    : await tool("get_causal_chains", { limit: 20 });
  box.replaceChildren(...doc.chains.map(chainCard));
  if (!doc.chains.length) box.append(el("p", { class: "muted" }, "no causal chains in the window"));
  showLedger(doc.ledger || []);
}

// --- the wall-time ledger: each GPU thread's wall time, bucket by bucket (they add up to it) --------

function ledgerBar(r) {
  const bar = el("div", { class: "ledger-bar" });
  config.ledger_buckets.forEach((b, i) => {
    const ns = r.buckets[b.name] || 0;
    if (ns <= 0) return;
    const share = (100 * ns) / r.wall_ns;
    const seg = el("span", {
      class: `seg b${i}`, "data-bucket": b.name, "data-ns": String(ns),
      title: `${b.label}: ${fixed(share, 1)} % (${fmtLatency(ns)})`,
    });
    seg.style.width = `${share}%`;
    bar.append(seg);
  });
  return bar;
}

function showLedger(rows) {
  const box = document.getElementById("ledger");
  box.replaceChildren();
  if (!rows.length) {
    box.append(el("p", { class: "muted" }, "no GPU thread in the window"));
    return;
  }
  const used = new Set(rows.flatMap((r) => Object.keys(r.buckets).filter((b) => r.buckets[b] > 0)));
  box.append(el("div", { class: "legend" }, ...config.ledger_buckets.flatMap((b, i) =>
    used.has(b.name) ? [el("span", { class: `key b${i}` }), b.label] : [])));
  const byNode = new Map();
  for (const r of rows) {
    if (!byNode.has(r.node)) byNode.set(r.node, []);
    byNode.get(r.node).push(r);
  }
  for (const [node, threads] of [...byNode.entries()].sort()) {
    box.append(el("h3", {}, node));
    threads.sort((a, b) => b.wall_ns - a.wall_ns);
    for (const r of threads) {
      const who = `GPU thread ${r.tid}` + (r.name ? ` (${r.name})` : ` (pid ${r.pid})`);
      box.append(el("div", { class: "ledger-row", "data-node": node, "data-tid": String(r.tid) },
        el("div", { class: "who" }, who), ledgerBar(r), el("div", { class: "summary" }, r.summary || "")));
    }
  }
}

// --- serving engines' own metrics (ingero trace --inference) -----------------------------------------

// per engine process and series: the last value, summed over its label sets (as get_engine_metrics does);
// a fleet node without the table (a recording older than schema 5) has no engine: not an error (asked
// through ENGINE_TABLE_SQL when a node failed, as `ingero export --nodes` does); other failures, one line each
const ENGINE_TABLE_SQL = "SELECT 1 AS has FROM sqlite_master WHERE type = 'table' AND name = 'engine_metrics'";
const ENGINE_SQL =
  "SELECT pid, engine, metric, sum(value) AS value, max(ts) AS last_ns FROM (" +
  "SELECT node, pid, engine, metric, labels, value, max(ts) AS ts FROM engine_metrics " +
  "WHERE substr(metric, -7) <> '_bucket' GROUP BY node, pid, engine, metric, labels) " +
  "GROUP BY node, pid, engine, metric ORDER BY pid, engine, metric";

// the fan-out's failed nodes, one line each (doc.unreachable lists them in doc.nodes' order), less the
// nodes that answer that their recording has no engine_metrics table
async function engineFailures(doc) {
  const lines = doc.unreachable || [];
  const label = (n) => n.node || n.name || n.addr;
  const failed = doc.nodes.filter((n) => !n.answered).map((n, k) => [n, String(lines[k] ?? `${label(n)}: ${n.outcome}`)]);
  if (!failed.length) return [];
  const has = await tool("query_fleet", { action: "sql", sql: ENGINE_TABLE_SQL, limit: 1 });
  const tableless = new Set(has.nodes.filter((n) => n.answered && !has.rows_by_node[label(n)]).map((n) => n.addr));
  return failed.filter(([n]) => !tableless.has(n.addr)).map(([, line]) => line.split("\n")[0]);
}

async function loadEngines() {
  const box = document.getElementById("engines");
  let engines;
  let missing = [];
  if (config.mode === "fleet") {
    const doc = await tool("query_fleet", { action: "sql", sql: ENGINE_SQL, limit: 1000 });
    const c = (name) => doc.columns.indexOf(name);
    const byEngine = new Map();
    for (const r of doc.rows) {
      const key = JSON.stringify([r[c("node")], r[c("pid")], r[c("engine")]]);
      if (!byEngine.has(key)) {
        byEngine.set(key, { node: r[c("node")], pid: r[c("pid")], engine: r[c("engine")], last: {}, last_ns: 0 });
      }
      const e = byEngine.get(key);
      e.last[r[c("metric")]] = r[c("value")];
      e.last_ns = Math.max(e.last_ns, r[c("last_ns")]);
    }
    engines = [...byEngine.values()];
    missing = [...(await engineFailures(doc)), ...(doc.truncated_nodes || []).map((n) => `${n}: more series than shown`)];
  } else {
    engines = (await tool("get_engine_metrics")).engines;
  }
  box.replaceChildren();
  if (!engines.length) {
    box.append(el("p", { class: "muted" },
      "no serving engine recorded (ingero trace --inference scrapes vLLM, SGLang, TGI and Triton)"));
  }
  for (const e of engines) {
    const when = new Date(e.last_ns / 1e6).toISOString();
    const scrapes = e.scrapes === undefined ? "" : `${fmtCount(e.scrapes)} scrapes, `;
    const holder = el("div", { class: "engine", "data-node": e.node, "data-pid": String(e.pid) },
      el("h3", {}, `${e.engine} (pid ${e.pid}) on ${e.node}`, el("span", { class: "muted" }, ` ${scrapes}last ${when}`)));
    const table = el("table", { class: "engine-metrics" });
    // a client library's *_created series are the series' creation times, not figures: left out
    const rows = Object.keys(e.last).filter((m) => !m.endsWith("_created")).sort().map((m) => [m, e.last[m]]);
    const value = (v) => fmtCount(Number.isInteger(v) ? v : Math.abs(v) >= 1 ? Number(v.toFixed(3)) : Number(v.toPrecision(4)));
    fillTable(table, ["metric", ["last value", value]], rows, (r) => ({ "data-metric": r[0] }));
    holder.append(el("div", { class: "table-wrap" }, table));
    box.append(holder);
  }
  if (missing.length) box.append(el("p", { class: "muted" }, missing.join(" · ")));
}

// --- timeline (uPlot, one chart per node) ---------------------------------------------------------

async function loadTimeline() {
  const box = document.getElementById("timeline");
  const doc = config.mode === "fleet"
    ? await tool("query_fleet", { action: "sql", sql: TIMELINE_SQL, limit: TIMELINE_ROWS })
    : await tool("run_sql", { query: TIMELINE_SQL, limit: TIMELINE_ROWS });
  const c = (name) => doc.columns.indexOf(name);
  const byNode = new Map();
  for (const r of doc.rows) {
    const node = r[c("node")];
    if (!byNode.has(node)) byNode.set(node, []);
    byNode.get(node).push(r);
  }
  box.replaceChildren();
  const gpu = new Set(config.gpu_sources);
  const width = Math.max(400, box.clientWidth - 20);
  for (const [node, rows] of [...byNode.entries()].sort()) {
    rows.sort((a, b) => a[c("timestamp")] - b[c("timestamp")]);
    const xs = rows.map((r) => r[c("timestamp")] / 1e9);
    const ms = (r) => r[c("duration")] / 1e6;
    const gpuY = rows.map((r) => (gpu.has(String(r[c("source")])) ? ms(r) : null));
    const hostY = rows.map((r) => (gpu.has(String(r[c("source")])) ? null : ms(r)));
    const holder = el("div", { class: "node-chart", "data-node": node }, el("h3", {}, `${node} — ${rows.length} events`));
    box.append(holder);
    const points = { show: true, size: 5 };
    new uPlot({
      width, height: 180,
      scales: { x: { time: true }, y: { distr: 3 } },
      series: [
        {},
        { label: "GPU API (ms)", stroke: "#1565c0", paths: () => null, points },
        { label: "host events (ms)", stroke: "#ef6c00", paths: () => null, points },
      ],
      axes: [{}, { label: "duration ms" }],
      cursor: { drag: { x: true, y: false } },
    }, [xs, gpuY, hostY], holder);
  }
}

// --- SQL box ----------------------------------------------------------------------------------------

async function runSql() {
  const query = document.getElementById("sql-query").value;
  const err = document.getElementById("sql-error");
  const meta = document.getElementById("sql-meta");
  err.textContent = "";
  try {
    const doc = config.mode === "fleet"
      ? await tool("query_fleet", { action: "sql", sql: query, limit: 200 })
      : await tool("run_sql", { query, limit: 200 });
    fillTable(document.getElementById("sql-result"), doc.columns, doc.rows);
    meta.textContent = `${doc.rows.length} row(s)` + (doc.truncated ? " (truncated at the limit)" : "");
    if (doc.unreachable && doc.unreachable.length) err.textContent = doc.unreachable.join(" · ");
  } catch (e) {
    document.getElementById("sql-result").replaceChildren();
    meta.textContent = "";
    err.textContent = e.message;
  }
}

// --- start ------------------------------------------------------------------------------------------

async function guarded(fn, where) {
  try { await fn(); } catch (e) { setStatus(`${where}: ${e.message}`, true); }
}

async function start() {
  const r = await fetch("/dashboard/config", { headers: HEADERS, credentials: "same-origin" });
  if (r.status === 401) { location.href = "/login"; return; }
  config = await r.json();
  document.getElementById("scope").textContent = config.mode === "fleet" ? `fleet of ${config.nodes.length}` : config.database;
  if (!config.login) document.getElementById("logout").hidden = true;
  document.getElementById("refresh-s").textContent = String(REFRESH_S);
  document.getElementById("sql-run").addEventListener("click", runSql);
  await Promise.all([
    guarded(loadNodes, "nodes"), guarded(loadOps, "ops"), guarded(loadChains, "chains"),
    guarded(loadEngines, "engines"), guarded(loadTimeline, "timeline"),
  ]);
  document.body.dataset.loaded = "1";
  const live = document.getElementById("live");
  const arm = () => {
    clearInterval(liveTimer);
    if (live.checked) liveTimer = setInterval(() => guarded(loadOps, "ops"), REFRESH_S * 1000);
  };
  live.addEventListener("change", arm);
  arm();
}

document.addEventListener("DOMContentLoaded", start);
