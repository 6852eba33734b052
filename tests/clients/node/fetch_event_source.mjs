// @microsoft/fetch-event-source 2.0.1 reading a lastevent stream through a cutting proxy.
// It takes an event's id when it parses the `id:` line (not when the event is
// dispatched, as the standard says), and sends the same request again with it as
// Last-Event-ID after an error.
//
// MODE=post: fetchEventSource("/v1/chat/completions", {method: "POST", body,
//   Idempotency-Key}): every reconnect is the same POST again with Last-Event-ID.
// MODE=events: the POST by fetch, then fetchEventSource on /v1/requests/{id}/events with
//   the Authorization header.
// MODE=post/dispatched, events/dispatched: the same, with the workaround for its early
//   id: a `fetch` option that sends the id of the last event onmessage got instead.
import { fetchEventSource } from "@microsoft/fetch-event-source";
import { randomUUID } from "node:crypto";
import { connections, chatBody, env, finish, loggingFetch, postChat } from "./common.mjs";

// it is written for browsers: its timers are window's, and it listens to the page's
// visibility (never hidden here; openWhenHidden keeps it from listening at all)
globalThis.window ??= globalThis;
globalThis.document ??= { hidden: false, addEventListener() {}, removeEventListener() {} };

class Fatal extends Error {}
class Again extends Error {}

const [how, fix] = env.mode.split("/");
const auth = { Authorization: `Bearer ${env.apiKey}` };
let url;
let init;
let requestId = null;
if (how === "post") {
  url = `${env.url}/v1/chat/completions`;
  init = {
    method: "POST",
    headers: { ...auth, "Content-Type": "application/json", "Idempotency-Key": `node-${randomUUID()}` },
    body: chatBody(),
  };
} else {
  ({ requestId } = await postChat());
  url = `${env.url}/v1/requests/${encodeURIComponent(requestId)}/events`;
  init = { headers: auth };
}

const events = [];
const errors = [];
let lastDispatched = null; // the id of the last event onmessage got
function dispatchedFetch(input, init) {
  const headers = { ...init.headers };
  delete headers["last-event-id"];
  if (lastDispatched) headers["last-event-id"] = lastDispatched;
  return loggingFetch(input, { ...init, headers });
}
let doneAt = null;
let ended204 = false;
const opened = connections.length;
const stop = new AbortController();

try {
  await fetchEventSource(url, {
    ...init,
    signal: stop.signal,
    openWhenHidden: true,
    fetch: fix === "dispatched" ? dispatchedFetch : loggingFetch,
    async onopen(r) {
      requestId ??= r.headers.get("x-request-id");
      if (r.status === 204) {
        // the end, when [DONE] itself was lost to the early id (GET only: the same POST
        // again at the terminal event is not answered 204 by the server)
        doneAt ??= connections.length;
        ended204 = true;
        throw new Fatal("204: nothing more");
      }
      if (r.ok && (r.headers.get("content-type") || "").startsWith("text/event-stream")) return;
      if (r.status >= 400 && r.status < 500 && r.status !== 429) {
        throw new Fatal(`${r.status}: ${await r.text()}`);
      }
      throw new Again(`status ${r.status}`);
    },
    onmessage(m) {
      if (!m.data) return; // a blank line after a lone field
      events.push([m.id, m.data]);
      lastDispatched = m.id || lastDispatched;
      if (m.data === "[DONE]") {
        doneAt = connections.length;
        stop.abort();
      }
    },
    onclose() {
      if (doneAt === null) throw new Again("the stream ended before [DONE]");
    },
    onerror(err) {
      errors.push(String(err.message ?? err));
      if (err instanceof Fatal) throw err; // stop
      return undefined; // again, after the server's retry: (it keeps the last one)
    },
  });
} catch (err) {
  if (!(err instanceof Fatal && ended204)) throw err;
}
finish({ requestId, events, errors, ended204, posts: opened, doneAt });
