// Real headless Chromium (Debian's /usr/bin/chromium, never a downloaded one) through
// playwright-core, run by tests/clients/test_browser.py: `node browser.mjs MODE`;
// prints one JSON line (the result) last.
//
// playground: open /playground, type the question, press Send, press "Drop the
//   connection" once mid-answer, wait for the end; the answer shown, the state shown.
// eventsource: open a page of another origin (PAGE_URL) that follows an answer with a
//   plain EventSource and a stream token; wait until the EventSource is CLOSED.
// attacker: the playground with a key saved, then a link that names another server
//   (ATTACKER_URL, `?baseUrl=...&model=`) in the same tab: Send; then that server typed into
//   the "Server" field: Send; then a new tab. What each showed, the storage of each tab,
//   and the page's CSP violations.
import { rmSync } from "node:fs";

import { launch } from "./chromium.mjs";

const env = process.env;
const TIMEOUT_MS = 100_000; // a safety net only: every wait below is for an event

const { profile, context, page } = await launch("lastevent-chromium-", {
  viewport: { width: 1000, height: 860 },
});
const consoleLines = [];
page.on("console", (m) => consoleLines.push(`${m.type()}: ${m.text()}`));
page.on("pageerror", (e) => consoleLines.push(`pageerror: ${e.message}`));
await context.addInitScript(() => {
  window.__violations = [];
  document.addEventListener("securitypolicyviolation", (e) => {
    window.__violations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sample || ""}`);
  });
});

async function playground() {
  await page.goto(env.PAGE_URL, { waitUntil: "load" });
  await page.fill("#api-key", env.LASTEVENT_API_KEY);
  await page.fill("#model", env.LASTEVENT_MODEL);
  await page.fill("#question", env.QUESTION);
  await page.click("#send");
  // mid-answer: some text shown, the end not yet there
  await page.waitForFunction(() => (window.playground.answer || "").length > 60, null, { timeout: TIMEOUT_MS });
  const before = await page.evaluate(() => ({ ...window.playground }));
  await page.click("#drop");
  await page.waitForFunction(() => window.playground.done, null, { timeout: TIMEOUT_MS, polling: 100 });
  const after = await page.evaluate(() => ({ ...window.playground }));
  const shown = {
    answer: await page.textContent("#answer"),
    state: await page.textContent("#state"),
    reconnects: Number(await page.textContent("#reconnects")),
    error: await page.textContent("#error"),
    log: await page.$$eval("#log li", (lis) => lis.map((li) => li.textContent)),
  };
  if (env.SCREENSHOT) {
    await page.fill("#api-key", ""); // nothing secret in a picture
    await page.screenshot({ path: env.SCREENSHOT, fullPage: true });
  }
  return { before, after, shown };
}

async function eventsource() {
  await page.goto(env.PAGE_URL, { waitUntil: "load" });
  await page.waitForFunction(() => window.result.closed || window.result.failure, null, { timeout: TIMEOUT_MS, polling: 100 });
  return { result: await page.evaluate(() => ({ ...window.result })) };
}

// what the playground shows and keeps, in page ``p``
function kept(p) {
  return p.evaluate(() => ({
    server: document.getElementById("base-url").value,
    key: document.getElementById("api-key").value,
    notice: document.getElementById("notice")?.textContent ?? null, // (none before issue 41)
    answer: window.playground.answer ?? null,
    error: window.playground.error ?? null,
    sessionStorage: Object.fromEntries(Object.entries(sessionStorage)),
    localStorage: Object.fromEntries(Object.entries(localStorage)),
    cookie: document.cookie,
    violations: window.__violations,
  }));
}

async function sendAndWait(p, question) {
  await p.evaluate(() => (window.playground.done = false));
  await p.fill("#question", question);
  await p.click("#send");
  await p.waitForFunction(() => window.playground.done, null, { timeout: TIMEOUT_MS, polling: 100 });
}

async function attacker() {
  const link = `${env.PAGE_URL}?${new URLSearchParams({ baseUrl: env.ATTACKER_URL, model: "" })}`;
  // a key saved: the one an older playground left in localStorage, and typed in this tab
  await page.goto(env.PAGE_URL, { waitUntil: "load" });
  await page.evaluate((key) => localStorage.setItem("lastevent.apiKey", key), env.LASTEVENT_API_KEY);
  await page.fill("#api-key", env.LASTEVENT_API_KEY);
  await page.press("#api-key", "Tab"); // a change event, as a person leaving the field
  const saved = await kept(page);
  // the link, in the same tab (its sessionStorage holds the key)
  await page.goto(link, { waitUntil: "load" });
  await sendAndWait(page, env.QUESTION);
  const linked = await kept(page);
  // the other server typed in by the user: the key is not carried over
  await page.fill("#base-url", env.ATTACKER_URL);
  await page.press("#base-url", "Tab");
  const typedBeforeSend = await kept(page);
  await sendAndWait(page, env.QUESTION);
  const typed = await kept(page);
  // a new tab: nothing of the key
  const tab = await context.newPage();
  await tab.goto(env.PAGE_URL, { waitUntil: "load" });
  const newTab = await kept(tab);
  return { saved, linked, typedBeforeSend, typed, newTab };
}

const modes = { playground, eventsource, attacker };
const mode = process.argv[2];
try {
  if (!modes[mode]) throw new Error(`mode: one of ${Object.keys(modes).join(", ")}`);
  const result = await modes[mode]();
  console.log(JSON.stringify({ ...result, console: consoleLines }));
} catch (e) {
  // what the page showed when the wait ran out: its state and its log of reconnects
  const shown = await page
    .evaluate(() => JSON.stringify({ state: window.playground || window.result, log: [...document.querySelectorAll("#log li")].map((li) => li.textContent) }))
    .catch((err) => `(page not readable: ${err})`);
  console.error(`${e.stack || e}\npage: ${shown}\nbrowser console:\n${consoleLines.join("\n")}`);
  process.exitCode = 1;
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
