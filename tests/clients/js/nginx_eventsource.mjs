// test_nginx.py: Debian's headless Chromium opens PAGE_URL (eventsource.html: a plain
// EventSource with a stream token) whose API is nginx over HTTPS with a test CA's
// certificate (ignoreHTTPSErrors: the browser does not know that CA), and waits until the
// EventSource is CLOSED. Prints one JSON line: the page's result.
import { rmSync } from "node:fs";

import { launch } from "./chromium.mjs";

const TIMEOUT_MS = 100_000; // a safety net only: the wait is for the page's end
const { profile, context, page } = await launch("lastevent-nginx-", { ignoreHTTPSErrors: true });
const lines = [];
page.on("console", (m) => lines.push(`${m.type()}: ${m.text()}`));
try {
  await page.goto(process.env.PAGE_URL, { waitUntil: "load" });
  await page.waitForFunction(() => window.result.closed || window.result.failure, null, {
    timeout: TIMEOUT_MS,
    polling: 100,
  });
  const result = await page.evaluate(() => ({ ...window.result }));
  console.log(JSON.stringify({ result, console: lines }));
} catch (e) {
  const shown = await page.evaluate(() => JSON.stringify(window.result)).catch((err) => `${err}`);
  console.error(`${e.stack || e}\npage: ${shown}\nbrowser console:\n${lines.join("\n")}`);
  process.exitCode = 1;
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
