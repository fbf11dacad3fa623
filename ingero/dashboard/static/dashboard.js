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

function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(3).replace(/\.?0+$/, "");
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

function fillTable(table, columns, rows, rowAttrs) {
  table.replaceChildren();
  const head = el("tr", {}, ...columns.map((c) => el("th", {}, c)));
  table.append(el("thead", {}, head));
  const body = el("tbody");
  rows.forEach((r, i) => {
    const tr = el("tr", rowAttrs ? rowAttrs(r, i) : {});
    r.forEach((v) => tr.append(el("td", { class: typeof v === "number" ? "num" : "" }, fmt(v))));
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
    fillTable(table, cols, status.rows, (r) => ({
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
  fillTable(table, ["node", ...sources], rows, (r) => ({ "data-node": r[0], class: "up" }));
  verdict.textContent = `one database (${config.database}): ${stats.events} events, ${stats.first_event} → ${stats.last_event}`;
}

// --- per-op latency -------------------------------------------------------------------------------

const OP_COLUMNS = ["node", "source", "op", "count", "p50_us", "p95_us", "p99_us", "max_us", "tail_ratio", "total_ms"];

async function loadOps() {
  const table = document.getElementById("ops");
  if (config.mode === "fleet") {
    const ops = await tool("query_fleet", { action: "ops" });
    const idx = OP_COLUMNS.map((c) => ops.columns.indexOf(c));
    const rows = ops.rows.map((r) => idx.map((i) => (i >= 0 ? r[i] : null)));
    rows.sort((a, b) => (b[6] || 0) - (a[6] || 0));
    fillTable(table, OP_COLUMNS, rows.slice(0, 60));
  } else {
    const stats = await tool("get_trace_stats");
    const rows = stats.top_ops_by_total_time.map((o) => OP_COLUMNS.map((c) => o[c] === undefined ? null : o[c]));
    fillTable(table, OP_COLUMNS, rows);
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
    guarded(loadNodes, "nodes"), guarded(loadOps, "ops"), guarded(loadChains, "chains"), guarded(loadTimeline, "timeline"),
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
