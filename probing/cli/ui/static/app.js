// probing ui: one script, one page per path (/job, /diagnose, /sql, /gpu, /timeline).
// No libraries: SVG and tables drawn by hand, data from /api/* (same origin, cookie auth).
"use strict";

const PAGE = location.pathname.replace(/^\/+|\/+$/g, "") || "job";
const params = new URLSearchParams(location.search);
const REFRESH_S = Number(params.get("refresh") || 2);
const $ = (sel, root = document) => root.querySelector(sel);
const main = $("#page");

function el(tag, attrs = {}, ...kids) {
  const svg = ["svg", "rect", "text", "g", "line", "polyline", "path", "title"].includes(tag);
  const e = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag)
                : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids.flat(Infinity)) if (k !== null && k !== undefined)
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}

function windowS() { return Number($("#window").value); }

function setStatus(text) { $("#status").textContent = text; }

async function api(path, body) {
  const opts = body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const sep = path.includes("?") ? "&" : "?";
  const r = await fetch(`/api/${path}${sep}window=${windowS()}`, opts);
  const data = await r.json();
  if (!r.ok && !data.error) data.error = `HTTP ${r.status}`;
  return data;
}

function fmt(v, digits = 1) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(digits);
  return String(v);
}

function table(columns, rows, opts = {}) {
  const head = el("tr", {}, columns.map((c) => el("th", {text: c})));
  const body = rows.map((row, i) => el("tr", {class: opts.rowClass ? opts.rowClass(i) : null},
    row.map((v) => el("td", {class: typeof v === "number" ? "num" : null, text: fmt(v, 2)}))));
  return el("table", opts.attrs || {}, el("thead", {}, head), el("tbody", {}, body));
}

// -- live refresh: a page's load() runs now and every REFRESH_S while "live" -------------
let timer = null;
let busy = false;
async function refresh(load) {
  if (busy) return;
  busy = true;
  const t0 = performance.now();
  try {
    await load();
    const ms = Math.round(performance.now() - t0);
    setStatus(`updated ${new Date().toLocaleTimeString()} (${ms} ms)` +
              ($("#live").checked ? ` · live every ${REFRESH_S} s` : ""));
    document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
  } catch (err) {
    setStatus(`error: ${err}`);
  } finally {
    busy = false;
  }
}
function live(load, every = REFRESH_S) {
  refresh(load);
  clearInterval(timer);
  timer = setInterval(() => { if ($("#live").checked) refresh(load); }, every * 1000);
  $("#window").onchange = () => refresh(load);
}

// -- Job: ranks x time heatmaps -----------------------------------------------------------
function heat(t, rgb) {  // 0..1 -> white .. rgb
  const k = Math.max(0, Math.min(1, t));
  const c = rgb.map((x) => Math.round(255 + (x - 255) * k));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function heatmap(id, title, job, values, unit, rgb, flags) {
  const ranks = job.ranks;
  const cols = values.length ? values[0].length : 0;
  const cw = Math.max(14, Math.floor(900 / Math.max(cols, 1)));
  const ch = 26, left = 190, top = 8;
  const w = left + cols * cw + 10, h = top + ranks.length * ch + 30;
  const all = values.flat().filter((v) => v !== null).sort((a, b) => a - b);
  const scale = Math.max(all.length ? all[Math.floor(0.95 * (all.length - 1))] : 0, 1);
  const svg = el("svg", {id, width: w, height: h, viewBox: `0 0 ${w} ${h}`});
  ranks.forEach((r, i) => {
    const flag = flags[r.rank];
    const y = top + i * ch;
    const row = el("g", {class: `hm-row${flag ? " " + flag.cls : ""}`, "data-rank": r.rank});
    row.append(el("text", {x: 4, y: y + 17, class: `rowlabel${flag ? " " + flag.cls : ""}`,
                           text: `rank ${r.rank} @ ${r.node}`}));
    if (flag) {
      row.append(el("rect", {x: left - 74, y: y + 4, width: 70, height: 18, rx: 3,
                             fill: "#b91c1c"}));
      row.append(el("text", {x: left - 39, y: y + 17, "text-anchor": "middle", class: "badge",
                             text: flag.label}));
    }
    for (let j = 0; j < cols; j++) {
      const v = values[i][j];
      const absent = job.heatmap.absent[i][j] > 0;
      const fill = absent ? "#111827" : v === null ? "#eceff3" : heat(v / scale, rgb);
      const cell = el("rect", {x: left + j * cw, y: y + 2, width: cw - 1, height: ch - 4,
                               fill, class: absent ? "cell absent" : "cell",
                               "data-value": v === null ? "" : v});
      const ago = ((job.now_ns - (job.heatmap.t0_ns + j * job.heatmap.bucket_ns)) / 1e9);
      cell.append(el("title", {text: absent
        ? `rank ${r.rank}: missed ${job.heatmap.absent[i][j]} collective(s) the others entered`
        : `rank ${r.rank}, ${ago.toFixed(0)} s ago: ${fmt(v, 2)} ${unit}`}));
      row.append(cell);
    }
    svg.append(row);
  });
  const axisY = top + ranks.length * ch + 16;
  for (let j = 0; j < cols; j += Math.max(1, Math.floor(cols / 8))) {
    const ago = (job.now_ns - (job.heatmap.t0_ns + j * job.heatmap.bucket_ns)) / 1e9;
    svg.append(el("text", {x: left + j * cw, y: axisY, text: `-${ago.toFixed(0)} s`}));
  }
  svg.append(el("text", {x: left + cols * cw - 30, y: axisY, text: "now"}));
  const legend = el("p", {class: "legend"}, `${title}: white 0`,
    el("span", {class: "swatch", style: `background:${heat(1, rgb)}`}), `≥ ${fmt(scale, 1)} ${unit}`,
    el("span", {class: "swatch", style: "background:#111827"}), "missed collectives",
    el("span", {class: "swatch", style: "background:#eceff3"}), "no data");
  return el("div", {class: "card"}, el("h2", {text: title}), svg, legend);
}

function jobFlags(job) {
  const flags = {};
  for (const s of job.stragglers) flags[s.rank] = {cls: "straggler", label: "STRAGGLER"};
  for (const h of job.hangs) {
    for (const r of h.missing_ranks) flags[r] = {cls: "missing", label: "MISSING"};
    for (const r of h.waiting_ranks) if (!flags[r]) flags[r] = {cls: "hung", label: "WAITING"};
  }
  return flags;
}

function jobBanner(job) {
  if (job.hangs.length) {
    const h = job.hangs[0];
    return el("div", {class: "banner bad", id: "verdict"},
      `Hang: rank(s) ${h.missing_ranks.join(", ") || "none"} never entered ${h.op || "collective"}` +
      ` #${h.seq} of ${h.comm}; rank(s) ${h.waiting_ranks.join(", ")} wait ${h.age_s} s`);
  }
  if (job.stragglers.length) {
    // the verdict's sentence (probing.analyze.verdict.straggler_text), made by the server
    const s = job.stragglers[0];
    const late = s.step_ms > 0
      ? `is ${s.late_ms.toFixed(0)} ms late each ${s.step_ms.toFixed(0)} ms step`
      : `arrives ${s.lag_ms_mean.toFixed(0)} ms late`;
    return el("div", {class: "banner bad", id: "verdict"}, "Straggler: " + (s.text ||
      `rank ${s.rank} on node ${s.node} ${late} (last at ${(100 * s.last_share).toFixed(0)} % ` +
      `of ${s.op}s) on ${s.comm}; the job loses ~${(100 * s.share_of_step).toFixed(0)} % of ` +
      "its step time"));
  }
  if (!job.collectives) {
    return el("div", {class: "banner warn", id: "verdict"},
      `No collectives traced in the last ${job.window_s} s: is every rank traced? ` +
      "(probing trace --pid P --background)");
  }
  return el("div", {class: "banner ok", id: "verdict"},
    `No straggler: ${job.ranks.length} ranks, ${job.collectives} collectives in the last ` +
    `${job.window_s} s`);
}

async function loadJob() {
  const job = await api("job");
  if (job.error) { main.replaceChildren(el("div", {class: "error", text: job.error})); return; }
  const flags = jobFlags(job);
  const kids = [jobBanner(job)];
  if (job.missing.length)
    kids.push(el("div", {class: "banner warn"}, "Not heard from: " + job.missing.join("; ")));
  kids.push(heatmap("lag-heatmap", "Arrival lag per rank (ms after the first rank)", job,
                    job.heatmap.lag_ms, "ms", [214, 39, 40], flags));
  kids.push(heatmap("step-heatmap", "Step time per rank (ms between collectives)", job,
                    job.heatmap.step_ms, "ms", [37, 99, 235], flags));
  const rows = job.ranks.map((r) => [r.rank, r.node, r.collectives, r.lag_ms_mean, r.last_pct,
                                     r.step_ms, flags[r.rank] ? flags[r.rank].label : ""]);
  kids.push(el("div", {class: "card"}, el("h2", {text: "Ranks"}),
    table(["rank", "node", "collectives", "lag ms (mean)", "last %", "step ms", ""], rows,
          {attrs: {id: "ranks"},
           rowClass: (i) => (flags[job.ranks[i].rank] ? "straggler" : null)})));
  main.replaceChildren(...kids);
}

// -- Diagnose -------------------------------------------------------------------------------
async function loadDiagnose() {
  const d = await api("diagnose");
  if (d.error) { main.replaceChildren(el("div", {class: "error", text: d.error})); return; }
  const kids = [el("div", {class: `banner ${d.healthy ? "ok" : "bad"}`, id: "verdict",
                           text: d.verdict})];
  if (d.missing && d.missing.length)
    kids.push(el("div", {class: "banner warn"}, "Not heard from: " + d.missing.join("; ")));
  if (d.why && d.why.length) {
    kids.push(el("div", {class: "card"}, el("h2", {text: "Why"}), el("ul", {class: "why", id: "why"},
      d.why.map((w) => el("li", {text: w.text || JSON.stringify(w)})))));
  }
  const named = new Set(d.stragglers.map((s) => s.rank));
  const cols = ["rank", "node", "collectives", "last_pct", "lag_ms_mean", "lag_ms_p99", "count"];
  kids.push(el("div", {class: "card"}, el("h2", {text: "Evidence"}),
    table(["rank", "node", "collectives", "last %", "lag ms", "p99 ms", "count"],
          d.ranks.map((r) => cols.map((c) => r[c])),
          {attrs: {id: "evidence"}, rowClass: (i) => (named.has(d.ranks[i].rank) ? "straggler" : null)})));
  for (const [rank, lines] of Object.entries(d.stacks_by_rank || {})) {
    const site = (d.callsites || {})[rank];
    kids.push(el("div", {class: "card"}, el("h2", {text: `rank ${rank}: main thread`}),
      site ? el("p", {class: "muted", text: `issues its collectives at ${site}`}) : null,
      el("pre", {class: "stack", text: lines.join("\n")})));
  }
  const age = d.as_of_ns ? Math.max(0, Date.now() / 1000 - d.as_of_ns / 1e9) : null;
  kids.push(el("p", {class: "muted", id: "diagnosed",
                     text: `diagnosed in ${fmt(d.elapsed_s, 2)} s over the last ` +
                           `${d.window_s || windowS()} s` +
                           (age === null ? "" : `, ${age.toFixed(0)} s ago`)}));
  main.replaceChildren(...kids);
}

// -- SQL console ---------------------------------------------------------------------------
const EXAMPLE_SQL = "SELECT rank, op, count(*) AS calls, avg(dur_ns) / 1e6 AS avg_ms\n" +
                    "FROM comm.collectives GROUP BY rank, op ORDER BY rank";
function sqlPage() {
  const box = el("textarea", {id: "sql", spellcheck: "false"});
  box.value = sessionStorage.getItem("probing.sql") || EXAMPLE_SQL;
  const all = el("input", {type: "checkbox", id: "all-ranks", checked: true});
  const out = el("div", {id: "result"});
  const csv = el("a", {class: "button secondary", id: "csv", href: "#", text: "Download CSV"});
  const run = el("button", {id: "run", text: "Run (Ctrl+Enter)"});
  async function go() {
    run.disabled = true;
    sessionStorage.setItem("probing.sql", box.value);
    const q = new URLSearchParams({sql: box.value, all: all.checked ? "1" : "0"});
    csv.href = `/api/sql.csv?${q}`;
    const t0 = performance.now();
    try {
      const r = await api("sql", {sql: box.value, all: all.checked});
      if (r.error) {
        out.replaceChildren(el("div", {class: "error", id: "sql-error", text: r.error}));
      } else {
        const ms = Math.round(performance.now() - t0);
        const note = `${r.total} row${r.total === 1 ? "" : "s"} in ${ms} ms` +
                     (r.truncated ? ` (first ${r.rows.length} shown; the CSV has all)` : "");
        out.replaceChildren(el("p", {class: "muted", id: "sql-count", text: note}),
          el("div", {class: "scroll"}, table(r.columns, r.rows, {attrs: {id: "sql-table"}})));
      }
      document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
    } finally { run.disabled = false; }
  }
  run.onclick = go;
  box.onkeydown = (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) go(); };
  main.replaceChildren(el("div", {class: "card"},
    el("p", {class: "muted", text: "Read-only SQL over the probes (SELECT, WITH, SHOW, EXPLAIN). " +
                                    "Tables: SHOW TABLES; every rank's rows carry node and rank."}),
    box, el("div", {class: "toolbar"}, run,
      el("label", {}, all, " every rank (cluster)"), csv)), out);
  setStatus("");
}

// -- GPU -------------------------------------------------------------------------------------
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d",
                "#4d7c0f"];
function lineChart(title, series, key, unit, scale = 1) {
  const w = 560, h = 200, left = 56, right = 10, top = 10, bottom = 24;
  const pts = series.flatMap((s) => s.ts.map((t, i) => [t, s[key][i]]))
                    .filter((p) => p[1] !== null);
  const svg = el("svg", {width: w, height: h, class: "chart", "data-metric": key});
  if (!pts.length) {
    svg.append(el("text", {x: 20, y: 40, text: "no samples"}));
    return el("div", {class: "card"}, el("h2", {text: title}), svg);
  }
  const t0 = Math.min(...pts.map((p) => p[0])), t1 = Math.max(...pts.map((p) => p[0]));
  const vmax = Math.max(...pts.map((p) => p[1] / scale), 1e-9);
  const x = (t) => left + (w - left - right) * (t1 > t0 ? (t - t0) / (t1 - t0) : 0);
  const y = (v) => top + (h - top - bottom) * (1 - v / scale / vmax);
  svg.append(el("line", {x1: left, y1: h - bottom, x2: w - right, y2: h - bottom,
                         stroke: "#9ca3af"}));
  svg.append(el("text", {x: 4, y: top + 10, text: `${fmt(vmax, 1)} ${unit}`}));
  svg.append(el("text", {x: 4, y: h - bottom, text: "0"}));
  svg.append(el("text", {x: left, y: h - 6, text: `-${((t1 - t0) / 1e9).toFixed(0)} s`}));
  svg.append(el("text", {x: w - right - 30, y: h - 6, text: "now"}));
  series.forEach((s, i) => {
    const p = s.ts.map((t, k) => [t, s[key][k]]).filter((q) => q[1] !== null)
                  .map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    svg.append(el("polyline", {points: p, fill: "none", stroke: COLORS[i % COLORS.length],
                               "stroke-width": 1.5, class: "series"},
                  el("title", {text: `rank ${s.rank} gpu ${s.gpu}`})));
  });
  const legend = el("p", {class: "legend"}, series.map((s, i) => [
    el("span", {class: "swatch", style: `background:${COLORS[i % COLORS.length]}`}),
    `rank ${s.rank} gpu ${s.gpu}`]));
  return el("div", {class: "card"}, el("h2", {text: title}), svg, legend);
}

async function loadGpu() {
  const g = await api("gpu");
  if (g.error) { main.replaceChildren(el("div", {class: "error", text: g.error})); return; }
  if (!g.series.length) {
    main.replaceChildren(el("div", {class: "banner warn", id: "gpu-empty"},
      "No NVML samples in this window. Start sampling in every rank: " +
      "probing nvml --pid P --interval 100ms"));
    return;
  }
  main.replaceChildren(
    el("p", {class: "muted", id: "gpu-count",
             text: `${g.samples} samples from ${g.series.length} GPU series (rank × GPU)`}),
    el("div", {class: "charts"},
      lineChart("GPU utilisation", g.series, "util_gpu", "%"),
      lineChart("Memory utilisation", g.series, "util_mem", "%"),
      lineChart("Memory used", g.series, "mem_used", "GiB", 1 << 30),
      lineChart("Power", g.series, "power_w", "W"),
      lineChart("Temperature", g.series, "temp_c", "°C")));
}

// -- Timeline --------------------------------------------------------------------------------
function timelinePage() {
  const note = el("p", {class: "muted", id: "timeline-note"});
  const btn = el("button", {id: "open-timeline"}, "Open the current window in Perfetto");
  btn.onclick = async () => {
    btn.disabled = true;
    note.textContent = "exporting…";
    try {
      const r = await api("timeline", {});
      if (r.error) { note.replaceChildren(el("div", {class: "error", text: r.error})); return; }
      note.textContent = `${r.events} events from ${r.ranks} ranks (${(r.bytes / 1e6).toFixed(1)} MB)` +
                         (r.note ? `; ${r.note}` : "");
      window.location.href = "/perfetto/index.html";
    } finally { btn.disabled = false; }
  };
  main.replaceChildren(el("div", {class: "card"},
    el("p", {text: "Every rank on one timeline: collectives, CUDA calls, sync waits and NVML " +
                   "counters of the selected window, in the Perfetto UI packaged with probing " +
                   "(offline). Flows link each collective across ranks."}),
    btn, note));
  setStatus("");
}

// -- start ---------------------------------------------------------------------------------------
for (const a of document.querySelectorAll("nav a"))
  if (a.dataset.page === PAGE) a.classList.add("active");
document.title = `probing · ${PAGE}`;
if (PAGE === "job") live(loadJob);
else if (PAGE === "diagnose") live(loadDiagnose, Math.max(REFRESH_S, 5));
else if (PAGE === "gpu") live(loadGpu);
else if (PAGE === "sql") sqlPage();
else if (PAGE === "timeline") timelinePage();
