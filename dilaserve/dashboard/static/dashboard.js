// The dashboard: draws the data shape of dilaserve/dashboard/timeline.py as SVG.
// window.DASHBOARD is {url, refresh_ms} (live: poll the server) or {data} (a run's
// dashboard-data.js, or a self-contained report).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const W = 640, H = 230, PAD = {left: 52, right: 12, top: 24, bottom: 28};
const COLORS = ["#3b6fd8", "#e0742b", "#2f9e5b", "#b8439b", "#8c6d1f", "#18a2b8", "#d6404e",
                "#6b5bd1", "#7f8c8d"];
const THRESHOLD_COLORS = ["#d73027", "#f46d43", "#fdae61", "#fee08b", "#d9ef8b", "#a6d96a",
                          "#66bd63", "#1a9850"];

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function text(parent, x, y, content, attrs) {
  const node = el("text", Object.assign({x, y}, attrs || {}), parent);
  node.textContent = content;
  return node;
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function fmt(value) {
  if (value === null || value === undefined) return "-";
  if (Number.isInteger(value)) return String(value);
  if (Math.abs(value) >= 100) return value.toFixed(0);
  if (Math.abs(value) >= 10) return value.toFixed(1);
  return value.toFixed(value === Math.round(value) ? 0 : 2);
}

// A frame: axes, grid and ticks for x in [x0, x1] and y in [0, yMax]; returns the scales.
function frame(svg, x0, x1, yMax, yLabel) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const sx = (x) => PAD.left + (x - x0) / Math.max(x1 - x0, 1e-9) * (W - PAD.left - PAD.right);
  const sy = (y) => H - PAD.bottom - y / yMax * (H - PAD.top - PAD.bottom);
  const mantissa = yMax / Math.pow(10, Math.floor(Math.log10(yMax)));
  const divisions = mantissa === 2.5 || mantissa === 5 ? 5 : 4;  // round ticks
  for (let k = 0; k <= divisions; k++) {
    const y = yMax * k / divisions;
    el("line", {x1: PAD.left, x2: W - PAD.right, y1: sy(y), y2: sy(y), class: "grid-line"}, svg);
    text(svg, PAD.left - 6, sy(y) + 4, fmt(y), {"text-anchor": "end"});
  }
  const span = x1 - x0, step = niceMax(span / 6);
  for (let x = Math.ceil(x0 / step) * step; x <= x1; x += step) {
    text(svg, sx(x), H - PAD.bottom + 16, fmt(x), {"text-anchor": "middle"});
  }
  text(svg, W - PAD.right, H - 2, "time (s)", {"text-anchor": "end"});
  if (yLabel) text(svg, 4, PAD.top - 10, yLabel);
  el("line", {x1: PAD.left, x2: PAD.left, y1: PAD.top, y2: H - PAD.bottom, class: "axis"}, svg);
  el("line", {x1: PAD.left, x2: W - PAD.right, y1: H - PAD.bottom, y2: H - PAD.bottom,
              class: "axis"}, svg);
  return {sx, sy};
}

function legend(svg, names, colors, yLabel) {
  let x = Math.max(PAD.left + 4, 12 + 6.5 * (yLabel || "").length);
  names.forEach((name, k) => {
    el("rect", {x, y: 6, width: 10, height: 10, fill: colors[k % colors.length]}, svg);
    const label = text(svg, x + 14, 15, name);
    x += 22 + 7 * name.length;
    label.setAttribute("data-legend", name);
  });
}

function markEvents(svg, data, sx, x0, x1) {
  for (const e of data.events) {
    if (e.t < x0 || e.t > x1) continue;
    const color = e.kind === "reconfiguration" ? "#d6404e" : "#222";
    const line = el("line", {x1: sx(e.t), x2: sx(e.t), y1: PAD.top, y2: H - PAD.bottom,
                             stroke: color, "stroke-dasharray": "4 3", class: "event"}, svg);
    el("title", {}, line).textContent = `${fmt(e.t)} s: ${e.kind}: ${e.text}`;
  }
}

// Lines over the intervals' middles; null values break a line.
function lineChart(svg, data, series, opts) {
  const t = data.series.t, half = data.interval / 2;
  const x0 = t.length ? t[0] : 0, x1 = Math.max(data.now, x0 + data.interval);
  let top = opts.yMax;
  if (top === undefined) {
    const all = series.flatMap((s) => s.values).filter((v) => v !== null);
    if (opts.ref) all.push(opts.ref);
    top = niceMax(Math.max(0, ...all) * 1.1);
  }
  const {sx, sy} = frame(svg, x0, x1, top, opts.yLabel);
  let points = 0;
  series.forEach((s, k) => {
    const color = s.color || COLORS[k % COLORS.length];
    let d = "";
    s.values.forEach((v, i) => {
      if (v === null) { d += " "; return; }
      const cmd = d === "" || d.endsWith(" ") ? "M" : "L";
      d += `${cmd}${sx(t[i] + half).toFixed(1)},${sy(Math.min(v, top)).toFixed(1)}`;
      points++;
      if (s.values.filter((u) => u !== null).length <= 2) {
        const dot = el("circle", {cx: sx(t[i] + half), cy: sy(Math.min(v, top)), r: 2.5,
                                  fill: color}, svg);
        el("title", {}, dot).textContent = `${s.name}: ${fmt(v)}`;
      }
    });
    const path = el("path", {d: d.trim().replace(/ +/g, " "), fill: "none", stroke: color,
                             "stroke-width": s.width || 1.8, "data-series": s.name}, svg);
    if (s.dash) path.setAttribute("stroke-dasharray", s.dash);
  });
  if (opts.ref) {
    el("line", {x1: PAD.left, x2: W - PAD.right, y1: sy(opts.ref), y2: sy(opts.ref),
                stroke: "#d6404e", "stroke-dasharray": "6 4"}, svg);
    text(svg, W - PAD.right - 2, sy(opts.ref) - 4, opts.refLabel, {"text-anchor": "end"});
  }
  markEvents(svg, data, sx, x0, x1);
  legend(svg, series.map((s) => s.name), series.map((s, k) => s.color || COLORS[k]),
         opts.yLabel);
  if (!points) text(svg, W / 2, H / 2, opts.empty || "no data yet", {class: "empty",
                                                                      "text-anchor": "middle"});
  svg.setAttribute("data-points", points);
  return {sx, sy, x0, x1};
}

function barsAt(svg, data, values, scale, color, name) {
  const t = data.series.t, width = scale.sx(data.interval) - scale.sx(0);
  values.forEach((v, i) => {
    if (!v) return;
    const bar = el("rect", {x: scale.sx(t[i]) + 1, width: Math.max(width - 2, 1), y: scale.sy(v),
                            height: scale.sy(0) - scale.sy(v), fill: color, opacity: 0.5}, svg);
    el("title", {}, bar).textContent = `${name}: ${v}`;
  });
}

function thresholdChart(svg, data) {
  const t = data.series.t, edges = data.threshold_edges;
  const x0 = t.length ? t[0] : 0, x1 = Math.max(data.now, x0 + data.interval);
  const {sx, sy} = frame(svg, x0, x1, 1, "share");
  const width = sx(x0 + data.interval) - sx(x0);
  let bars = 0;
  data.series.thresholds.forEach((counts, i) => {
    const total = counts.reduce((a, b) => a + b, 0);
    if (!total) return;
    let below = 0;
    counts.forEach((n, k) => {
      if (!n) return;
      const rect = el("rect", {x: sx(t[i]) + 0.5, width: Math.max(width - 1, 1),
                               y: sy(below + n / total), height: sy(below) - sy(below + n / total),
                               fill: THRESHOLD_COLORS[k % THRESHOLD_COLORS.length]}, svg);
      el("title", {}, rect).textContent = `${bucketName(edges, k)}: ${n} steps`;
      below += n / total;
      bars++;
    });
  });
  markEvents(svg, data, sx, x0, x1);
  legend(svg, edges.map((_, k) => bucketName(edges, k)), THRESHOLD_COLORS, "share");
  if (!bars) text(svg, W / 2, H / 2, "no steps finished yet", {class: "empty",
                                                               "text-anchor": "middle"});
  svg.setAttribute("data-points", bars);
}

function bucketName(edges, k) {
  return k === 0 ? `\u2264${edges[0]}` : `${edges[k - 1]}\u2013${edges[k]}`;
}

function drawCharts(data) {
  const s = data.series;
  const priorities = Object.keys(s.attainment_by_priority);
  const attainment = [{name: "overall", values: s.attainment, width: 2.6, color: "#1d2330"},
                      {name: "of arrivals (refused = missed)", values: s.attainment_of_arrivals,
                       width: 2, dash: "6 2", color: "#c0392b"}];
  if (priorities.length > 1) {
    priorities.forEach((p, k) => attainment.push({name: `priority ${p}`, dash: "5 3",
                                                  values: s.attainment_by_priority[p],
                                                  color: COLORS[k % COLORS.length]}));
  }
  lineChart(document.getElementById("chart-attainment"), data, attainment,
            {yMax: 1, yLabel: "on time", empty: "no request finished yet"});
  lineChart(document.getElementById("chart-latency"), data, [
    {name: "p50", values: s.latency_p50}, {name: "p90", values: s.latency_p90},
    {name: "p99", values: s.latency_p99}],
  {yLabel: "seconds", ref: data.slo_s, refLabel: `SLO ${fmt(data.slo_s)} s`,
   empty: "no request finished yet"});
  thresholdChart(document.getElementById("chart-thresholds"), data);
  lineChart(document.getElementById("chart-load"), data, [
    {name: "in flight", values: s.in_flight}, {name: "queue", values: s.queue},
    {name: "rejected", values: s.rejected, dash: "2 3"}],
  {yLabel: "requests"});
  lineChart(document.getElementById("chart-slowdown"), data, [
    {name: "slowdown", values: s.slowdown || [], color: "#c0392b"}],
  {yLabel: "x profile", ref: 1, refLabel: "profile", empty: "no slowdown sampled"});
  const instances = document.getElementById("chart-instances");
  const tps = Object.keys(s.instances_by_tp);
  const migrations = Math.max(0, ...s.migrations);
  const scale = lineChart(instances, data, tps.map((tp) => (
    {name: `TP-${tp}`, values: s.instances_by_tp[tp]})),
  {yLabel: "instances", yMax: 4 * Math.ceil(Math.max(1, migrations, ...tps.flatMap(
    (tp) => s.instances_by_tp[tp])) * 1.1 / 4)});
  barsAt(instances, data, s.migrations, scale, "#7f8c8d", "migrations");
  lineChart(document.getElementById("chart-tokens"), data, [
    {name: "tokens/s", values: s.tokens_per_s}], {yLabel: "tokens/s"});
  drawInstances(data);
}

function drawInstances(data) {
  const box = document.getElementById("instance-charts");
  const ids = Object.keys(data.instances);
  while (box.children.length > ids.length) box.removeChild(box.lastChild);
  ids.forEach((iid, k) => {
    let figure = box.children[k];
    if (!figure) {
      figure = document.createElement("figure");
      figure.appendChild(document.createElement("figcaption"));
      figure.appendChild(el("svg", {class: "chart instance-chart", viewBox: `0 0 ${W} ${H}`}));
      box.appendChild(figure);
    }
    const inst = data.instances[iid];
    const tp = inst.tp === null ? "?" : inst.tp;
    figure.firstChild.textContent = `instance ${iid} (TP-${tp}${inst.serving ? "" : ", gone"}): `
      + "mean step latency by step kind (ms)";
    const series = Object.entries(inst.step_ms).map(([kind, values]) => ({name: kind, values}));
    const svg = figure.lastChild;
    svg.setAttribute("data-instance", iid);
    lineChart(svg, data, series, {yLabel: "ms", empty: "no step in this window"});
  });
  // the step kinds the instances ran (recompute and cache; prefill, block and commit; full)
  const kinds = [...new Set(data.current.instances.flatMap((i) => Object.keys(i.step_ms)))].sort();
  const rows = data.current.instances.map((i) => [i.id, i.tp, fmt(i.batch_tokens),
    ...kinds.map((k) => fmt(i.step_ms[k]))]);
  if (!rows.length) rows.push(["no instance reported its steps", "", ""]);
  table("instances-table", ["instance", "TP", "batch tokens", ...kinds.map((k) => `${k} ms`)],
        rows);
}

function table(id, head, rows) {
  const node = document.getElementById(id);
  node.innerHTML = "";
  const tr = node.insertRow();
  head.forEach((h) => { const th = document.createElement("th"); th.textContent = h;
                        tr.appendChild(th); });
  rows.forEach((row) => {
    const r = node.insertRow();
    row.forEach((cell) => { r.insertCell().textContent = cell; });
  });
}

function drawHeader(data) {
  document.getElementById("source").textContent = data.source;
  const about = document.getElementById("about");
  about.innerHTML = "";
  const parts = [["model", data.model], ["policy", data.policy],
                 ["SLO", data.slo_s === null ? "per request" : `${fmt(data.slo_s)} s`]];
  const calibration = data.calibration ? Object.entries(data.calibration).map(
    ([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ")
    : "not given";
  parts.push(["calibration", calibration]);
  (data.notes || []).forEach((note) => parts.push(["note", note]));
  parts.forEach(([k, v], i) => {
    if (i) about.appendChild(document.createTextNode(" \u00b7 "));
    about.appendChild(document.createTextNode(`${k} `));
    const code = document.createElement("code");
    code.textContent = v;
    code.id = `about-${k.toLowerCase()}`;
    about.appendChild(code);
  });
  if (data.title) document.title = data.title;
  const t = data.totals;
  const share = (x) => (x === null || x === undefined ? "-" : `${(100 * x).toFixed(1)}%`);
  const slowdown = data.current.slowdown;
  const factor = data.current.deadline_factor;
  const loss = data.current.quality_loss, budget = data.current.quality_budget;
  const lost = loss === null || loss === undefined ? "-"
    : `${(100 * loss).toFixed(2)}% of ${(100 * budget).toFixed(1)}%`;
  const cards = [["within SLO (refused = missed)", share(t.attainment_of_arrivals)],
                 ["of finished, on time", share(t.attainment)],
                 ["finished", t.finished], ["failed", t.failed], ["rejected", t.rejected],
                 ["step slowdown", slowdown === null || slowdown === undefined ? "-"
                   : `${slowdown.toFixed(1)}x`],
                 ["deadline factor", factor === null || factor === undefined ? "-"
                   : `${factor.toFixed(2)}x`],
                 ["quality lost (budget)", lost],
                 ["in flight", data.current.in_flight], ["queue", data.current.queue],
                 ["migrations", t.migrations], ["time", `${fmt(data.now)} s`]];
  const box = document.getElementById("totals");
  box.innerHTML = "";
  cards.forEach(([k, v]) => {
    const card = document.createElement("div");
    card.dataset.total = k;
    if (k === "rejected" && t.rejected > 0) card.classList.add("bad");
    if (k === "quality lost (budget)" && loss > budget) card.classList.add("bad");
    card.textContent = k;
    const b = document.createElement("b");
    b.textContent = v;
    card.prepend(b);
    box.appendChild(card);
  });
  const events = data.events.slice(-20).reverse().map((e) => [`${fmt(e.t)} s`, e.kind, e.text]);
  table("events-table", ["time", "event", "what"], events);
}

function draw(data) {
  drawHeader(data);
  drawCharts(data);
  const body = document.body;
  if (!body.dataset.firstNow) body.dataset.firstNow = data.now;
  body.dataset.now = data.now;
  body.dataset.refreshes = Number(body.dataset.refreshes) + 1;
}

function showStatus(message) {
  const status = document.getElementById("status");
  status.hidden = !message;
  status.textContent = message || "";
}

async function poll(config) {
  try {
    // (from the origin: a page opened as http://user:key@host/ must not send the key in a URL)
    const url = new URL(config.url, window.location.origin);
    const headers = config.token ? {Authorization: `Bearer ${config.token}`} : {};
    const response = await fetch(url, {cache: "no-store", credentials: "same-origin", headers});
    if (response.status === 401 && config.token) {
      throw new Error("the page's dashboard token has expired: reload the page");
    }
    if (!response.ok) throw new Error(`HTTP ${response.status} from ${config.url}`);
    draw(await response.json());
    showStatus("");
  } catch (e) {
    showStatus(`cannot refresh: ${e.message}`);
  }
  setTimeout(() => poll(config), config.refresh_ms);
}

function start() {
  const config = window.DASHBOARD;
  if (!config) showStatus("no data: dashboard-data.js did not load");
  else if (config.data) draw(config.data);
  else poll(config);
}

start();
