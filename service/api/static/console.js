// The operators' console: plain DOM over the JSON routes of /v1/admin (no build step, no
// library). Served with a strict CSP (no inline script or style, same-origin connections).
//
// Everything a request holds is attacker-controlled text (prompts, answers, metadata, error
// messages, tool calls): it reaches the page through textContent and text nodes only, never
// innerHTML, and no link or URL is ever built from it.
//
// The API key lives in this module's memory and the tab's sessionStorage: never in the
// address (the fragment holds a request id at most), never in localStorage or a cookie.

const KEY_SLOT = "lastevent.console.key";
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

let apiKey = null;
let me = null; // {role, tenant, key_id}

// -- DOM helpers: text in, never markup ---------------------------------------------------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function clear(node) {
  node.replaceChildren();
  return node;
}

function json(value) {
  return el("pre", "json", JSON.stringify(value, null, 2));
}

function kvTable(table, pairs) {
  clear(table);
  for (const [name, value] of pairs) {
    const tr = el("tr");
    tr.append(el("th", "", name));
    const td = el("td");
    if (value !== null && typeof value === "object") td.append(json(value));
    else td.textContent = value === null || value === undefined ? "–" : String(value);
    tr.append(td);
    table.append(tr);
  }
}

const nowIso = () => new Date().toISOString();
const shortTime = (iso) => (iso ? String(iso).replace("T", " ").slice(0, 19) : "–");
const fmtMs = (ms) => (ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`);
const fmtInt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));

function showError(message) {
  $("error").textContent = message || "";
}

// -- the API ------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function call(path, params = {}, { signal, key = apiKey } = {}) {
  const url = new URL(path, location.origin);
  for (const [name, value] of Object.entries(params)) {
    if (value !== "" && value !== null && value !== undefined) url.searchParams.set(name, value);
  }
  const response = await fetch(url, {
    headers: { Authorization: `Bearer ${key}` },
    cache: "no-store",
    credentials: "omit",
    referrerPolicy: "no-referrer",
    signal,
  });
  if (!response.ok) {
    let body = null;
    try {
      body = await response.json();
    } catch { /* not JSON */ }
    const error = body?.error ?? {};
    throw new ApiError(response.status, error.message || response.statusText, error.code);
  }
  return response;
}

const getJson = async (path, params, options) => (await call(path, params, options)).json();

function explain(err) {
  if (err.status === 401) {
    logout("The key was refused (401): log in again.");
    return "";
  }
  return err.status ? `${err.status}${err.code ? ` ${err.code}` : ""}: ${err.message}` : String(err.message || err);
}

// -- logging in and out -------------------------------------------------------------------

async function login(key) {
  const who = await getJson("/v1/admin/me", {}, { key });
  apiKey = key;
  me = who;
  sessionStorage.setItem(KEY_SLOT, key);
  $("who").textContent = `${who.role} · tenant ${who.tenant}${who.key_id ? ` · key ${who.key_id}` : ""}`;
  $("nav").hidden = false;
  $("logout").hidden = false;
  $("nav-reconcile").hidden = who.role !== "operator";
  $("f-tenant").disabled = $("sp-tenant").disabled = who.role !== "operator";
  document.body.dataset.role = who.role;
}

function logout(message = "") {
  apiKey = null;
  me = null;
  sessionStorage.removeItem(KEY_SLOT);
  $("who").textContent = "";
  $("nav").hidden = $("logout").hidden = true;
  delete document.body.dataset.role;
  for (const id of ["rows", "r-billing", "r-input", "r-output", "replay-text", "rc-findings", "sp-rows", "sp-chart"]) clear($(id));
  history.replaceState(null, "", location.pathname);
  show("login");
  $("login-error").textContent = message;
}

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const key = $("login-key").value.trim();
  $("login-error").textContent = "";
  if (!key) return;
  try {
    await login(key);
    $("login-key").value = "";
    route();
  } catch (err) {
    $("login-error").textContent = err.status === 401 ? "That key was refused." : explain(err);
  }
});
$("logout").addEventListener("click", () => logout());

// -- views and the fragment (#list, #request=<id>, #reconcile, #spend) ---------------------

const VIEWS = ["login", "list", "request", "reconcile", "spend"];

function show(view) {
  for (const name of VIEWS) $(`view-${name}`).hidden = name !== view;
  for (const button of $("nav").querySelectorAll("button")) {
    button.classList.toggle("current", button.dataset.view === view || (view === "request" && button.dataset.view === "list"));
  }
}

function route() {
  showError("");
  if (!apiKey) return show("login");
  const hash = location.hash.slice(1);
  if (hash.startsWith("request=")) return openRequest(decodeURIComponent(hash.slice("request=".length)));
  if (hash === "reconcile" && me.role === "operator") return show("reconcile");
  if (hash === "spend") return show("spend");
  show("list");
  if ($("view-list").dataset.state === "idle") loadList();
}

for (const button of $("nav").querySelectorAll("button")) {
  button.addEventListener("click", () => {
    location.hash = button.dataset.view;
  });
}
window.addEventListener("hashchange", route);

// -- the request list ---------------------------------------------------------------------

const FILTERS = {
  tenant: "f-tenant",
  api_key: "f-api-key",
  user: "f-user",
  model: "f-model",
  state: "f-state",
  error_code: "f-error-code",
  finish_reason: "f-finish-reason",
  kind: "f-kind",
  since: "f-since",
  until: "f-until",
  limit: "f-limit",
};
const list = { cursors: [null], page: 0 };

function filterParams() {
  const params = {};
  for (const [name, id] of Object.entries(FILTERS)) {
    const value = $(id).value.trim();
    if (value && !$(id).disabled) params[name] = value;
  }
  const pair = $("f-metadata").value;
  if (pair.trim()) {
    const at = pair.indexOf("=");
    if (at < 1) throw new Error("metadata filter: key=value");
    params[`metadata[${pair.slice(0, at).trim()}]`] = pair.slice(at + 1);
  }
  return params;
}

async function loadList() {
  const section = $("view-list");
  section.dataset.state = "loading";
  $("list-status").textContent = "loading…";
  try {
    const cursor = list.cursors[list.page];
    const answer = await getJson("/v1/admin/requests", { ...filterParams(), cursor });
    renderRows(answer.data);
    list.cursors.length = list.page + 1;
    if (answer.next_cursor) list.cursors.push(answer.next_cursor);
    $("next-page").disabled = !answer.next_cursor;
    $("first-page").disabled = list.page === 0;
    const n = answer.data.length;
    $("list-status").textContent = `page ${list.page + 1} · ${n} request${n === 1 ? "" : "s"}${answer.next_cursor ? " · more" : ""}`;
    section.dataset.state = "ready";
  } catch (err) {
    clear($("rows"));
    $("list-status").textContent = explain(err);
    section.dataset.state = "error";
  }
}

function stateClass(state) {
  if (["errored", "expired", "failed"].includes(state)) return "state-bad";
  if (state === "cancelled") return "state-warn";
  return "state-ok";
}

function renderRows(rows) {
  const body = clear($("rows"));
  for (const row of rows) {
    const tr = el("tr", "row");
    tr.dataset.index = String(body.children.length);
    const cells = [
      shortTime(row.ended_at),
      null, // the id: a button
      row.tenant,
      row.api_key_id ?? "–",
      row.kind,
      row.model,
      row.state,
      row.error_code || row.finish_reason || "–",
      `${fmtInt(row.prompt_tokens)} / ${fmtInt(row.completion_tokens)}`,
      row.takeovers || row.handovers ? `${row.takeovers} / ${row.handovers}` : "–",
      row.end_user ?? "–",
      row.metadata ? Object.entries(row.metadata).map(([k, v]) => `${k}=${v}`).join(", ") : "–",
    ];
    cells.forEach((text, i) => {
      const td = el("td", i === 8 || i === 9 ? "num" : "");
      if (i === 1) {
        const open = el("button", "link", row.id);
        open.type = "button";
        td.append(open);
      } else {
        td.textContent = text;
        td.title = text;
      }
      if (i === 6) td.classList.add(stateClass(row.state));
      tr.append(td);
    });
    tr.addEventListener("click", () => {
      location.hash = `request=${encodeURIComponent(row.id)}`;
    });
    body.append(tr);
  }
  if (!rows.length) {
    const tr = el("tr");
    const td = el("td", "muted", "No requests match.");
    td.colSpan = 12;
    tr.append(td);
    body.append(tr);
  }
}

$("filters").addEventListener("submit", (event) => {
  event.preventDefault();
  list.cursors = [null];
  list.page = 0;
  loadList();
});
$("clear").addEventListener("click", () => {
  for (const id of [...Object.values(FILTERS), "f-metadata"]) if (id !== "f-limit") $(id).value = "";
  list.cursors = [null];
  list.page = 0;
  loadList();
});
$("next-page").addEventListener("click", () => {
  if (list.page + 1 < list.cursors.length) list.page += 1;
  loadList();
});
$("first-page").addEventListener("click", () => {
  list.page = 0;
  loadList();
});

// -- one request ----------------------------------------------------------------------------

let replaying = null; // the AbortController of a running replay
let shownRequest = null;

async function openRequest(id) {
  show("request");
  stopReplay();
  shownRequest = id;
  const section = $("view-request");
  section.dataset.state = "loading";
  $("r-title").textContent = id;
  $("r-status").textContent = "loading…";
  $("r-missing").hidden = true;
  $("r-body").hidden = true;
  clear($("replay-text"));
  $("replay-status").textContent = "";
  $("replay-status").dataset.state = "idle";
  try {
    const found = await getJson(`/v1/admin/requests/${encodeURIComponent(id)}`);
    if (shownRequest !== id) return;
    renderRequest(found);
    $("r-body").hidden = false;
    section.dataset.state = "ready";
  } catch (err) {
    if (shownRequest !== id) return;
    $("r-status").textContent = "";
    const missing = clear($("r-missing"));
    missing.append(el("p", "", err.status === 404 ? "No such request (or it is not visible to this key)." : explain(err)));
    missing.hidden = false;
    section.dataset.state = err.status === 404 ? "missing" : "error";
  }
}

function renderRequest({ request: row, input, output, events, live }) {
  $("r-status").textContent = live ? "still running: the billing row comes at its end" : `${row?.state ?? ""}`;
  const billing = $("r-billing");
  if (row) {
    kvTable(billing, Object.entries(row).map(([name, value]) => [name, value]));
  } else {
    kvTable(billing, [["state", "running (no billing row yet)"]]);
  }
  renderWorkers(events);
  renderTimeline(events);
  renderInput(input, row);
  renderOutput(output);
}

function renderWorkers(events) {
  const ul = clear($("r-workers"));
  events.forEach((event, index) => {
    if (!event.worker) return;
    const verb = { first: "started", takeover: "took over", handover: "was handed over", resumed: "resumed" }[event.how] ?? "appended";
    const li = el("li");
    if (event.how === "takeover" || event.how === "handover") li.append(el("span", "tag takeover", event.how));
    li.append(`worker ${event.worker} ${verb} at event ${event.id} (#${index + 1})`);
    ul.append(li);
  });
  if (!ul.children.length) ul.append(el("li", "muted", "no worker marks in the log"));
}

function renderInput(input, row) {
  const box = clear($("r-input"));
  if (!input) {
    box.append(el("p", "muted", row?.stored === false ? "No input was kept for this request (store was false)." : "No input was kept for this request."));
    return;
  }
  const shown = new Set();
  if (Array.isArray(input.messages)) {
    shown.add("messages");
    box.append(el("h3", "", "Messages"));
    for (const message of input.messages) box.append(renderMessage(message));
  }
  if (input.instructions !== undefined && input.instructions !== null) {
    shown.add("instructions");
    box.append(el("h3", "", "Instructions"), el("pre", "text", String(input.instructions)));
  }
  if (input.input !== undefined) {
    shown.add("input");
    box.append(el("h3", "", "Input"));
    box.append(typeof input.input === "string" ? el("pre", "text", input.input) : json(input.input));
  }
  for (const name of ["parameters", "metadata"]) {
    if (input[name] && typeof input[name] === "object") {
      shown.add(name);
      const given = Object.entries(input[name]).filter(([, value]) => value !== null && value !== undefined);
      if (!given.length) continue;
      box.append(el("h3", "", name === "parameters" ? "Parameters (those given)" : "Metadata"));
      const table = el("table", "kv");
      kvTable(table, given);
      box.append(table);
    }
  }
  for (const [name, value] of Object.entries(input)) {
    if (shown.has(name) || value === null || value === undefined) continue;
    box.append(el("h3", "", name.replace(/_/g, " ")), json(value));
  }
}

function renderMessage(message) {
  const box = el("div", "message");
  const who = [message.role, message.name, message.tool_call_id && `tool call ${message.tool_call_id}`].filter(Boolean).join(" · ");
  box.append(el("div", "role", who || "message"));
  const content = message.content;
  if (typeof content === "string") box.append(el("pre", "text", content));
  else if (Array.isArray(content)) {
    for (const part of content) {
      if (part && part.type === "text" && typeof part.text === "string") box.append(el("pre", "text", part.text));
      else box.append(json(part)); // images and the rest: shown as data, never loaded
    }
  } else if (content !== null && content !== undefined) box.append(json(content));
  if (message.tool_calls) box.append(json(message.tool_calls));
  return box;
}

function renderOutput(output) {
  const box = clear($("r-output"));
  if (!output || !output.length) {
    box.append(el("p", "muted", "No output kept."));
    return;
  }
  for (const choice of output) {
    box.append(el("div", "role", `choice ${choice.index} · finish reason ${choice.finish_reason ?? "–"}`));
    const text = el("pre", "text", choice.text ?? "");
    text.dataset.choice = String(choice.index);
    box.append(text);
    if (choice.tool_calls) box.append(json(choice.tool_calls));
  }
}

// -- the timeline chart (SVG through DOM calls) -------------------------------------------

function renderTimeline(events) {
  const box = clear($("r-timeline"));
  if (!events || !events.length) {
    $("r-timing").textContent = "no events";
    return;
  }
  const t0 = events[0].t_ms;
  const span = Math.max(1, events[events.length - 1].t_ms - t0);
  const firstDelta = events.find((e) => e.type === "delta");
  const gaps = events.slice(1).map((e, i) => ({ event: e, gap: e.t_ms - events[i].t_ms }));
  const deltaGaps = gaps.filter((g) => g.event.type === "delta" && g.event !== firstDelta);
  const maxGap = deltaGaps.reduce((best, g) => (g.gap > (best?.gap ?? -1) ? g : best), null);
  const ttft = firstDelta ? firstDelta.t_ms - t0 : null;
  $("r-timing").textContent = [
    `${events.length} events over ${fmtMs(span)}`,
    ttft === null ? "no token" : `time to first token ${fmtMs(ttft)}`,
    maxGap ? `longest gap between events ${fmtMs(maxGap.gap)} (before event ${maxGap.event.id})` : "",
  ].filter(Boolean).join(" · ");

  const W = 720, left = 48, right = 12, laneY = 34, gapTop = 62, gapH = 70, H = gapTop + gapH + 28;
  const x = (t) => left + ((t - t0) / span) * (W - left - right);
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "timeline of the request's events" });
  if (ttft !== null) {
    chart.append(svg("rect", { class: "ttft", x: x(t0), y: laneY - 14, width: Math.max(1, x(firstDelta.t_ms) - x(t0)), height: 28 }));
    chart.append(svg("text", { x: x(t0) + 2, y: laneY + 24 }, `TTFT ${fmtMs(ttft)}`));
  }
  chart.append(svg("line", { class: "axis", x1: left, y1: laneY, x2: W - right, y2: laneY }));
  chart.append(svg("text", { x: 0, y: laneY + 4 }, "events"));
  const workers = [];
  let worker = null;
  for (const event of events) {
    if (event.worker) {
      worker = event.worker;
      if (!workers.includes(worker)) workers.push(worker);
      if (event.how === "takeover" || event.how === "handover") {
        chart.append(svg("line", { class: "mark", x1: x(event.t_ms), y1: 8, x2: x(event.t_ms), y2: gapTop + gapH }));
        chart.append(svg("text", { class: "label", x: Math.min(x(event.t_ms) + 4, W - 150), y: 12 }, `${event.how}: ${event.worker}`));
      }
    }
    const cx = x(event.t_ms);
    if (event.type === "delta") {
      const w = `w${Math.max(0, workers.indexOf(worker)) % 6}`;
      chart.append(svg("rect", { class: w, x: cx - 0.75, y: laneY - 10, width: 1.5, height: 20 }));
    } else if (event.type === "created") {
      chart.append(svg("circle", { class: "created", cx, cy: laneY, r: 4 }));
    } else {
      chart.append(svg("rect", { class: event.type === "error" ? "err" : "end", x: cx - 4, y: laneY - 4, width: 8, height: 8 }));
    }
  }
  // the gap before each event, as a bar
  const top = Math.max(1, ...gaps.map((g) => g.gap));
  chart.append(svg("line", { class: "axis", x1: left, y1: gapTop + gapH, x2: W - right, y2: gapTop + gapH }));
  chart.append(svg("text", { x: 0, y: gapTop + 10 }, "gaps"));
  chart.append(svg("text", { x: 0, y: gapTop + 24 }, fmtMs(top)));
  for (const g of gaps) {
    const h = Math.max(1, (g.gap / top) * gapH);
    const cls = g === maxGap ? "gap max" : "gap";
    chart.append(svg("rect", { class: cls, x: x(g.event.t_ms) - 1, y: gapTop + gapH - h, width: 2, height: h }));
  }
  for (let i = 0; i <= 4; i++) {
    const t = t0 + (span * i) / 4;
    chart.append(svg("text", { x: Math.min(x(t) - 8, W - 44), y: H - 8 }, fmtMs(t - t0)));
  }
  box.append(chart);
  if (workers.length) {
    const legend = el("div", "legend");
    workers.forEach((name, i) => {
      const swatch = svg("svg", { width: 10, height: 10 });
      swatch.append(svg("rect", { class: `w${i % 6}`, width: 10, height: 10 }));
      const item = el("span");
      item.append(swatch, `worker ${name}`);
      legend.append(item);
    });
    box.append(legend);
  }
}

// -- replay: fetch with the key in a header, the body read as it arrives ---------------------

function stopReplay() {
  if (replaying) replaying.abort();
  replaying = null;
  $("replay").disabled = false;
  $("replay-stop").disabled = true;
}

async function replay() {
  const id = shownRequest;
  if (!id || replaying) return;
  const controller = new AbortController();
  replaying = controller;
  const out = clear($("replay-text"));
  const status = $("replay-status");
  $("replay").disabled = true;
  $("replay-stop").disabled = false;
  status.dataset.state = "playing";
  status.textContent = "replaying…";
  let text = "";
  try {
    const response = await call(`/v1/admin/requests/${encodeURIComponent(id)}/replay`, { speed: $("replay-speed").value, format: "text" }, { signal: controller.signal });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      text += value;
      out.append(document.createTextNode(value));
    }
    status.dataset.state = "done";
    status.textContent = `replayed ${text.length} characters`;
  } catch (err) {
    status.dataset.state = controller.signal.aborted ? "stopped" : "error";
    status.textContent = controller.signal.aborted ? "stopped" : explain(err);
  } finally {
    if (replaying === controller) {
      replaying = null;
      $("replay").disabled = false;
      $("replay-stop").disabled = true;
    }
  }
}

$("replay").addEventListener("click", replay);
$("replay-stop").addEventListener("click", stopReplay);
$("back").addEventListener("click", () => {
  location.hash = "list";
});

// -- reconcile ------------------------------------------------------------------------------

$("reconcile-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const section = $("view-reconcile");
  section.dataset.state = "loading";
  const summary = $("rc-summary");
  const findings = clear($("rc-findings"));
  summary.className = "summary";
  summary.textContent = "reconciling…";
  try {
    const found = await getJson("/v1/admin/billing/reconcile", { since: $("rc-since").value.trim(), until: $("rc-until").value.trim() || nowIso() });
    summary.className = `summary ${found.clean ? "clean" : "dirty"}`;
    summary.textContent = `${found.clean ? "clean" : "findings"}: ${fmtInt(found.checked)} requests checked`;
    for (const name of ["missing", "duplicate", "unexpected"]) {
      const ids = found[name] ?? [];
      if (!ids.length) continue;
      findings.append(el("h3", "", `${name} (${ids.length})`));
      const ul = el("ul", "plain mono");
      for (const id of ids) ul.append(el("li", "", id));
      findings.append(ul);
    }
    if (found.mismatched?.length) {
      findings.append(el("h3", "", `mismatched (${found.mismatched.length})`));
      const table = el("table", "grid");
      const head = el("tr");
      for (const name of ["request", "field", "billing row", "log"]) head.append(el("th", "", name));
      table.append(head);
      for (const m of found.mismatched) {
        const tr = el("tr");
        for (const value of [m.id, m.field, m.row, m.log]) tr.append(el("td", "", typeof value === "object" ? JSON.stringify(value) : value));
        table.append(tr);
      }
      findings.append(table);
    }
    section.dataset.state = "ready";
  } catch (err) {
    summary.textContent = explain(err);
    section.dataset.state = "error";
  }
});

// -- spend: a stacked bar per day, one colour per tenant and model; CSV export -------------

function spendParams() {
  return {
    since: $("sp-since").value.trim(),
    until: $("sp-until").value.trim() || nowIso(),
    tenant: $("sp-tenant").disabled ? "" : $("sp-tenant").value.trim(),
  };
}

let spendRows = [];

$("spend-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const section = $("view-spend");
  section.dataset.state = "loading";
  $("sp-status").textContent = "loading…";
  try {
    spendRows = (await getJson("/v1/admin/billing/spend", { ...spendParams(), format: "json" })).data;
    renderSpendTable(spendRows);
    renderSpendChart(spendRows, $("sp-metric").value);
    $("sp-status").textContent = `${spendRows.length} row${spendRows.length === 1 ? "" : "s"} (day, tenant, model)`;
    section.dataset.state = "ready";
  } catch (err) {
    $("sp-status").textContent = explain(err);
    section.dataset.state = "error";
  }
});
$("sp-metric").addEventListener("change", () => renderSpendChart(spendRows, $("sp-metric").value));

function renderSpendTable(rows) {
  const body = clear($("sp-rows"));
  for (const row of rows) {
    const tr = el("tr");
    tr.append(el("td", "", row.day), el("td", "", row.tenant), el("td", "", row.model));
    for (const name of ["requests", "prompt_tokens", "completion_tokens", "total_tokens", "wasted_tokens", "reprefill_tokens"]) {
      tr.append(el("td", "num", fmtInt(row[name])));
    }
    body.append(tr);
  }
}

function renderSpendChart(rows, metric) {
  const box = clear($("sp-chart"));
  if (!rows.length) {
    box.append(el("p", "muted", "Nothing spent in this range."));
    return;
  }
  const days = [...new Set(rows.map((r) => r.day))].sort();
  const series = [...new Set(rows.map((r) => `${r.tenant} · ${r.model}`))].sort();
  const totals = days.map((day) => rows.filter((r) => r.day === day).reduce((sum, r) => sum + Number(r[metric] || 0), 0));
  const top = Math.max(1, ...totals);
  const W = 900, H = 260, left = 70, bottom = 28, plotH = H - bottom - 14;
  const slot = (W - left - 10) / days.length;
  const barW = Math.min(60, slot * 0.7);
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${metric} per day` });
  for (let i = 0; i <= 4; i++) {
    const y = 14 + plotH - (plotH * i) / 4;
    chart.append(svg("line", { class: "axis", x1: left, y1: y, x2: W - 10, y2: y }));
    chart.append(svg("text", { x: 4, y: y + 4 }, fmtInt(Math.round((top * i) / 4))));
  }
  days.forEach((day, d) => {
    const x = left + d * slot + (slot - barW) / 2;
    let y = 14 + plotH;
    for (const row of rows.filter((r) => r.day === day)) {
      const h = (Number(row[metric] || 0) / top) * plotH;
      y -= h;
      const bar = svg("rect", { class: `s${series.indexOf(`${row.tenant} · ${row.model}`) % 8}`, x, y, width: barW, height: Math.max(0, h) });
      bar.append(svg("title", {}, `${day} · ${row.tenant} · ${row.model}: ${fmtInt(row[metric])}`));
      chart.append(bar);
    }
    chart.append(svg("text", { class: "label", x: x + barW / 2 - 32, y: H - 8 }, day));
  });
  const legend = el("div", "legend");
  series.forEach((name, i) => {
    const swatch = svg("svg", { width: 10, height: 10 });
    swatch.append(svg("rect", { class: `s${i % 8}`, width: 10, height: 10 }));
    const item = el("span");
    item.append(swatch, name);
    legend.append(item);
  });
  box.append(chart, legend);
}

$("spend-csv").addEventListener("click", async () => {
  try {
    const response = await call("/v1/admin/billing/spend", { ...spendParams(), format: "csv" });
    const given = /filename="([A-Za-z0-9._:+-]{1,120})"/.exec(response.headers.get("content-disposition") || "");
    const blob = new Blob([await response.arrayBuffer()], { type: "text/csv" });
    const url = URL.createObjectURL(blob); // our own blob: the only link the page makes
    const link = document.createElement("a");
    link.href = url;
    link.download = given ? given[1] : "spend.csv";
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
    $("sp-status").textContent = `exported ${link.download}`;
  } catch (err) {
    $("sp-status").textContent = explain(err);
  }
});

// -- start: a key from this tab's session, if any ------------------------------------------

function defaultRanges() {
  const hourAgo = new Date(Date.now() - 3600_000).toISOString();
  const dayAgo = new Date(Date.now() - 7 * 86400_000).toISOString().slice(0, 10);
  $("rc-since").value = hourAgo;
  $("sp-since").value = `${dayAgo}T00:00:00Z`;
}

async function start() {
  defaultRanges();
  const saved = sessionStorage.getItem(KEY_SLOT);
  if (saved) {
    try {
      await login(saved);
    } catch (err) {
      if (err.status === 401) sessionStorage.removeItem(KEY_SLOT);
      else showError(explain(err));
    }
  }
  route();
  document.body.dataset.ready = "1";
}

start();
