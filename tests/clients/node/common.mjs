// Shared by the third-party client scripts (tests/clients/test_third_party.py runs them):
// the settings from the environment, a fetch that logs every connection, a POST that is
// sent again with the same Idempotency-Key when it breaks before its headers, and the
// result line (JSON, printed last).
//
// env: LASTEVENT_URL (a CuttingProxy, or a plain one), LASTEVENT_API_KEY, LASTEVENT_MODEL,
// QUESTION, MODE (what the script is to do; each script lists its modes).
import { randomUUID } from "node:crypto";

export const env = {
  url: process.env.LASTEVENT_URL,
  apiKey: process.env.LASTEVENT_API_KEY,
  model: process.env.LASTEVENT_MODEL,
  question: process.env.QUESTION,
  mode: process.env.MODE || "",
};

export const chatBody = () =>
  JSON.stringify({ model: env.model, stream: true, messages: [{ role: "user", content: env.question }] });

// every connection the client makes: method, path, Last-Event-ID, status (or the error)
export const connections = [];

function headerOf(headers, name) {
  if (!headers) return null;
  if (typeof headers.get === "function") return headers.get(name);
  const key = Object.keys(headers).find((k) => k.toLowerCase() === name.toLowerCase());
  return key === undefined ? null : headers[key];
}

export function loggingFetch(input, init = {}) {
  const url = new URL(typeof input === "string" ? input : input.url ?? String(input));
  const entry = {
    method: init.method || "GET",
    path: url.pathname,
    token: url.searchParams.has("token"),
    lastEventId: headerOf(init.headers, "last-event-id"),
    idempotencyKey: headerOf(init.headers, "idempotency-key"),
    status: null,
    error: null,
  };
  connections.push(entry);
  return fetch(input, init).then(
    (r) => {
      entry.status = r.status;
      return r;
    },
    (e) => {
      entry.error = `${e.name}: ${e.message}`;
      throw e;
    },
  );
}

// POST the question; a POST cut before its response headers is sent again, same key.
// Returns the response headers that matter; the body is not read (another client reads
// the stream).
export async function postChat() {
  const key = `node-${randomUUID()}`;
  for (let attempt = 0; attempt < 20; attempt++) {
    let r;
    try {
      r = await loggingFetch(`${env.url}/v1/chat/completions`, {
        method: "POST",
        headers: {
          Authorization: `Bearer ${env.apiKey}`,
          "Content-Type": "application/json",
          "Idempotency-Key": key,
        },
        body: chatBody(),
      });
    } catch {
      await new Promise((ok) => setTimeout(ok, 100));
      continue;
    }
    if (r.status !== 200) throw new Error(`POST answered ${r.status}: ${await r.text()}`);
    const out = { requestId: r.headers.get("x-request-id"), token: r.headers.get("x-stream-token"), key };
    await r.body?.cancel().catch(() => {});
    return out;
  }
  throw new Error("the POST never got its response headers");
}

export function finish(result) {
  process.stdout.write(JSON.stringify({ ...result, connections }) + "\n");
}
