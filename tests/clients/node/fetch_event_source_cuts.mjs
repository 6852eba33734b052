// Where a cut makes @microsoft/fetch-event-source 2.0.1 lose an event: its own parser
// (getLines/getMessages, what fetchEventSource runs) fed a whole stream's bytes one at a
// time; after each byte, would a connection cut there resume after an event it never
// dispatched? (It takes an id when it parses the `id:` line, not at the event's blank
// line.) Prints, per file of RAW_FILES (JSON list of paths), how many cut positions lose
// an event, and how many events lost at each.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { getLines, getMessages } = require("@microsoft/fetch-event-source/lib/cjs/parse.js");

function lossyCuts(bytes) {
  let taken = null; // the id it would send as Last-Event-ID
  let dispatched = null; // the id of the last event it dispatched
  const feed = getLines(
    getMessages(
      (id) => { taken = id || null; },
      () => {},
      (m) => { if (m.data) dispatched = m.id || dispatched; },
    ),
  );
  let lossy = 0;
  for (let i = 0; i < bytes.length; i++) {
    feed(bytes.subarray(i, i + 1));
    if (taken !== dispatched) lossy += 1; // a cut after byte i resumes after `taken`
  }
  return { bytes: bytes.length, lossy };
}

const files = JSON.parse(process.env.RAW_FILES);
process.stdout.write(JSON.stringify(files.map((f) => lossyCuts(new Uint8Array(readFileSync(f))))) + "\n");
