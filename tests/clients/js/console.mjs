// The operators' console (/console) in real headless Chromium (Debian's /usr/bin/chromium
// through playwright-core), run by tests/clients/test_console.py: `node console.mjs MODE`
// with its inputs in the environment; prints one JSON line (the result) last.
//
// operator: log in, page through the list, filter it, open a request that was taken over,
//   replay it at the original speed, reconcile, show spend and export it as CSV.
// tenant: log in with a tenant's key: the rows it sees; another tenant's request opened by
//   its id; its own request.
// hostile: log in, list, filter and open a request whose prompt, answer and metadata are
//   markup and SSE-looking lines; replay it; what every view shows, and whether anything ran.
//
// Every mode also reports where the key can be found (the address, localStorage, cookies,
// sessionStorage), the page's console errors and its CSP violations, and the calls of
// window.pwned() -- a function only an injected script would call.
import { readFileSync, rmSync } from "node:fs";
import { join } from "node:path";

import { launch } from "./chromium.mjs";

const env = process.env;
const TIMEOUT_MS = 120_000; // a safety net only: every wait below is for an event
const KEY = env.CONSOLE_KEY;

const { profile, context, page } = await launch("lastevent-console-", {
  acceptDownloads: true,
  viewport: { width: 1280, height: 900 },
});
const consoleLines = [];
const pwned = [];
page.on("console", (m) => consoleLines.push(`${m.type()}: ${m.text()} (${m.location().url || "-"})`));
page.on("pageerror", (e) => consoleLines.push(`pageerror: ${e.message}`));
await page.exposeFunction("pwned", (what) => pwned.push(String(what)));
await page.addInitScript(() => {
  window.__violations = [];
  document.addEventListener("securitypolicyviolation", (e) => {
    window.__violations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sample || ""}`);
  });
});

const wait = (fn, arg) => page.waitForFunction(fn, arg, { timeout: TIMEOUT_MS, polling: 100 });
const texts = (selector) => page.$$eval(selector, (nodes) => nodes.map((n) => n.textContent));

async function login() {
  await page.goto(`${env.BASE_URL}/console`, { waitUntil: "load" });
  await wait(() => document.body.dataset.ready === "1");
  await page.fill("#login-key", KEY);
  await page.click("#login");
  await wait(() => ["ready", "error"].includes(document.getElementById("view-list").dataset.state));
  return page.textContent("#who");
}

async function listed() {
  await wait(() => ["ready", "error"].includes(document.getElementById("view-list").dataset.state));
  return {
    status: await page.textContent("#list-status"),
    ids: await texts("#rows tr.row td:nth-child(2)"),
    rows: await page.$$eval("#rows tr.row", (trs) => trs.map((tr) => [...tr.cells].map((td) => td.textContent))),
    next: !(await page.isDisabled("#next-page")),
  };
}

async function filter(fields) {
  await page.click("#clear");
  await listed();
  for (const [id, value] of Object.entries({ "f-limit": "50", ...fields })) {
    if (id === "f-kind") await page.selectOption(`#${id}`, value);
    else await page.fill(`#${id}`, value);
  }
  await page.evaluate(() => (document.getElementById("view-list").dataset.state = "loading"));
  await page.click("#apply");
  return listed();
}

async function openRow(id) {
  await page.evaluate(() => (document.getElementById("view-request").dataset.state = "loading"));
  await page.click(`#rows tr.row:has(td:nth-child(2) button:text-is("${id}"))`);
  await wait(() => ["ready", "missing", "error"].includes(document.getElementById("view-request").dataset.state));
  return shownRequest();
}

async function openById(id) {
  await page.evaluate((rid) => {
    document.getElementById("view-request").dataset.state = "loading";
    location.hash = `request=${encodeURIComponent(rid)}`;
  }, id);
  await wait(() => ["ready", "missing", "error"].includes(document.getElementById("view-request").dataset.state));
  return shownRequest();
}

async function shownRequest() {
  return page.evaluate(() => {
    const text = (id) => document.getElementById(id).textContent;
    const billing = {};
    for (const tr of document.querySelectorAll("#r-billing tr")) billing[tr.cells[0].textContent] = tr.cells[1].textContent;
    return {
      state: document.getElementById("view-request").dataset.state,
      missing: document.getElementById("r-missing").hidden ? "" : text("r-missing"),
      title: text("r-title"),
      billing,
      workers: [...document.querySelectorAll("#r-workers li")].map((li) => li.textContent),
      timing: text("r-timing"),
      timeline: document.querySelectorAll("#r-timeline svg rect").length,
      input: text("r-input"),
      messages: [...document.querySelectorAll("#r-input .message pre.text")].map((p) => p.textContent),
      output: [...document.querySelectorAll("#r-output pre.text")].map((p) => p.textContent),
      body: document.getElementById("r-body").hidden ? "" : text("r-body"),
    };
  });
}

async function replay(speed) {
  await page.selectOption("#replay-speed", speed);
  const started = Date.now();
  await page.click("#replay");
  await wait(() => ["done", "error"].includes(document.getElementById("replay-status").dataset.state));
  return {
    status: await page.textContent("#replay-status"),
    text: await page.textContent("#replay-text"),
    ms: Date.now() - started,
  };
}

async function view(name) {
  await page.click(`#nav button[data-view="${name}"]`);
  await wait((n) => !document.getElementById(`view-${n}`).hidden, name);
}

async function submitAndWait(section, button) {
  await page.evaluate((s) => (document.getElementById(s).dataset.state = "loading"), section);
  await page.click(button);
  await wait((s) => ["ready", "error"].includes(document.getElementById(s).dataset.state), section);
}

async function shot(name) {
  if (env.SCREENSHOTS) await page.screenshot({ path: join(env.SCREENSHOTS, name), fullPage: true });
}

async function exposure() {
  return page.evaluate((key) => {
    const local = Object.keys(localStorage).map((k) => `${k}=${localStorage.getItem(k)}`).join("\n");
    const session = Object.keys(sessionStorage).map((k) => sessionStorage.getItem(k));
    return {
      href: location.href,
      inHref: location.href.includes(key) || location.href.includes(encodeURIComponent(key)),
      inLocalStorage: local.includes(key),
      inCookie: document.cookie.includes(key),
      inSessionStorage: session.includes(key),
      title: document.title,
      violations: window.__violations,
      injected: document.querySelectorAll("img, iframe, object, embed, a[href], script:not([src='/static/console.js']), [onerror], [onload]").length,
      flag: window.__hostile === undefined ? null : String(window.__hostile),
    };
  }, KEY);
}

async function operator() {
  const who = await login();
  const first = await listed();
  const paged = [await filter({ "f-limit": "2" })];
  await page.evaluate(() => (document.getElementById("view-list").dataset.state = "loading"));
  await page.click("#next-page");
  paged.push(await listed());
  const byTenant = await filter({ "f-tenant": env.TENANT, "f-since": env.SINCE, "f-until": env.UNTIL });
  const byMetadata = await filter({ "f-tenant": env.TENANT, "f-metadata": env.METADATA, "f-kind": "chat" });
  const byUser = await filter({ "f-user": env.END_USER });
  await filter({});
  await shot("console-list.png");
  await filter({ "f-metadata": env.METADATA });
  const opened = await openRow(env.TAKEN_ID);
  const replayed = await replay("1");
  await shot("console-request.png");
  await view("reconcile");
  await page.fill("#rc-since", env.SINCE);
  await page.fill("#rc-until", env.UNTIL);
  await submitAndWait("view-reconcile", "#reconcile");
  const reconciled = {
    summary: await page.textContent("#rc-summary"),
    findings: await page.textContent("#rc-findings"),
  };
  await view("spend");
  await page.fill("#sp-since", env.SINCE);
  await page.fill("#sp-until", env.UNTIL);
  await submitAndWait("view-spend", "#spend");
  const spend = {
    status: await page.textContent("#sp-status"),
    rows: await page.$$eval("#sp-rows tr", (trs) => trs.map((tr) => [...tr.cells].map((td) => td.textContent))),
    bars: await page.$$eval("#sp-chart svg rect", (rs) => rs.length),
    legend: await texts("#sp-chart .legend span"),
  };
  await shot("console-spend.png");
  const [download] = await Promise.all([page.waitForEvent("download", { timeout: TIMEOUT_MS }), page.click("#spend-csv")]);
  const saved = join(profile, "spend.csv");
  await download.saveAs(saved);
  const csv = { name: download.suggestedFilename(), text: readFileSync(saved, "utf8") };
  return { who, first, paged, byTenant, byMetadata, byUser, opened, replayed, reconciled, spend, csv, exposure: await exposure() };
}

async function tenant() {
  const who = await login();
  const first = await listed();
  const reconcileShown = await page.isVisible("#nav-reconcile");
  const other = await openById(env.OTHER_ID);
  const own = await openById(env.OWN_ID);
  return { who, first, reconcileShown, other, own, exposure: await exposure() };
}

async function hostile() {
  await login();
  const first = await listed();
  const byMetadata = await filter({ "f-metadata": env.METADATA });
  const opened = await openRow(env.HOSTILE_ID);
  const replayed = await replay("max");
  await page.reload({ waitUntil: "load" }); // the session's key, the fragment's request
  await wait(() => document.getElementById("view-request").dataset.state === "ready");
  const reopened = await shownRequest();
  return { first, byMetadata, opened, replayed, reopened, exposure: await exposure() };
}

const modes = { operator, tenant, hostile };
const mode = process.argv[2];
try {
  if (!modes[mode]) throw new Error(`mode: one of ${Object.keys(modes).join(", ")}`);
  const result = await modes[mode]();
  console.log(JSON.stringify({ ...result, pwned, console: consoleLines }));
} catch (e) {
  console.error(`${e.stack || e}\nbrowser console:\n${consoleLines.join("\n")}`);
  process.exitCode = 1;
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
