// Debian's headless Chromium (/usr/bin/chromium, or $CHROMIUM; never a downloaded one)
// through playwright-core, in a fresh profile: what browser.mjs and console.mjs drive.
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { chromium } from "playwright-core";

// -> { profile, context, page }; the caller removes ``profile`` when it is done
export async function launch(prefix, options = {}) {
  const profile = mkdtempSync(join(tmpdir(), prefix));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
    ...options,
  });
  const page = context.pages()[0] || (await context.newPage());
  return { profile, context, page };
}
