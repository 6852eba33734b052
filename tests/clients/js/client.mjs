// The JS client (service/api/static/lastevent.js) against a real stack, run by
// tests/clients/test_js_client.py: `node client.mjs MODE`; prints one JSON line (the
// result) last. Every request the client makes goes through a logging fetch, so the
// test sees each connection's method, path, Last-Event-ID, Idempotency-Key and status.
//
// env: LASTEVENT_URL (usually a CuttingProxy), LASTEVENT_DIRECT_URL (the API itself),
// LASTEVENT_API_KEY, LASTEVENT_MODEL, QUESTION.
import { LastEvent, LastEventError, SSEParser } from "../../../service/api/static/lastevent.js";

const env = process.env;
const model = env.LASTEVENT_MODEL;
const question = env.QUESTION;
const requests = [];

function loggingFetch(url, init = {}) {
  const headers = init.headers || {};
  const u = new URL(url);
  const entry = {
    method: init.method || "GET",
    path: u.pathname,
    token: u.searchParams.has("token"),
    authorization: "Authorization" in headers,
    lastEventId: headers["Last-Event-ID"] ?? null,
    idempotencyKey: headers["Idempotency-Key"] ?? null,
    status: null,
    requestId: null,
    error: null,
  };
  requests.push(entry);
  return fetch(url, init).then(
    (r) => {
      entry.status = r.status;
      entry.requestId = r.headers.get("x-request-id");
      entry.replayed = r.headers.get("idempotent-replayed");
      return r;
    },
    (e) => {
      entry.error = `${e.name}: ${e.message}`;
      throw e;
    },
  );
}

const client = (opts = {}) => new LastEvent({ baseUrl: env.LASTEVENT_URL, apiKey: env.LASTEVENT_API_KEY, fetch: loggingFetch, ...opts });
const messages = (content) => [{ role: "user", content }];

function summary(stream, extra = {}) {
  return {
    text: stream.text,
    requestId: stream.requestId,
    reconnects: stream.reconnects,
    state: stream.state,
    finishReason: stream.finishReason,
    streamToken: Boolean(stream.streamToken),
    ...extra,
  };
}

function errorOf(e) {
  if (!(e instanceof LastEventError)) throw e;
  return { name: e.name, status: e.status, code: e.code, type: e.type, message: e.message };
}

// The whole answer through the cutting proxy: every delta once, in order.
async function resume() {
  const reconnects = [];
  const states = [];
  const stream = client().chat.stream(
    { model, messages: messages(question) },
    { onReconnect: (info) => reconnects.push({ ...info, error: String(info.error) }), onState: (s) => states.push(s) },
  );
  const deltas = [];
  for await (const delta of stream) {
    if (typeof delta !== "string") throw new Error(`a delta that is not a string: ${JSON.stringify(delta)}`);
    deltas.push(delta);
  }
  const requestsAtEnd = requests.length;
  return summary(stream, { joined: deltas.join(""), reconnectInfo: reconnects, states, requestsAtEnd });
}

// Same Idempotency-Key + same body: the same request; another body: 422; the POST with
// Last-Event-ID: the rest after it.
async function idempotent() {
  const key = `test-${Date.now()}-${Math.random().toString(16).slice(2)}`;
  const c = client();
  const body = { model, messages: messages(question) };
  const ids = []; // [lastEventId, text so far] after each delta
  const first = c.chat.stream(body, { idempotencyKey: key });
  for await (const _ of first) ids.push([first.lastEventId, first.text]);
  const again = c.chat.stream(body, { idempotencyKey: key });
  await again.collect();
  let reused = null;
  try {
    await c.chat.stream({ model, messages: messages(`${question} (another body)`) }, { idempotencyKey: key }).collect();
  } catch (e) {
    reused = errorOf(e);
  }
  // a raw POST with the key and Last-Event-ID (straight to the API: one connection)
  const [midId, before] = ids[Math.floor(ids.length / 2)];
  const r = await fetch(`${env.LASTEVENT_DIRECT_URL}/v1/chat/completions`, {
    method: "POST",
    headers: {
      Authorization: `Bearer ${env.LASTEVENT_API_KEY}`,
      "Content-Type": "application/json",
      "Idempotency-Key": key,
      "Last-Event-ID": midId,
    },
    body: JSON.stringify({ ...body, stream: true }),
  });
  let rest = "";
  const parser = new SSEParser({
    onEvent: (ev) => {
      if (ev.data === "[DONE]") return;
      for (const ch of JSON.parse(ev.data).choices || []) rest += ch.delta?.content || "";
    },
  });
  parser.feed(await r.text());
  return {
    first: summary(first),
    again: summary(again),
    reused,
    resumedPost: { status: r.status, requestId: r.headers.get("x-request-id"), before, rest },
  };
}

// A keyed client starts the answer and stops reading; a client with no API key follows
// the same request with the stream token alone (?token=), through the cutting proxy.
async function token() {
  const c = client({ baseUrl: env.LASTEVENT_DIRECT_URL });
  const first = c.chat.stream({ model, messages: messages(question) });
  for await (const _ of first) if (first.text.length > 40) break; // a return: stops reading
  const keyless = client({ apiKey: null });
  const rest = keyless.requests.stream(first.requestId, { lastEventId: first.lastEventId, streamToken: first.streamToken });
  await rest.collect();
  const status = await keyless.requests.get(first.requestId, { streamToken: first.streamToken });
  let noToken = null;
  try {
    await client({ apiKey: null }).requests.stream(first.requestId).collect();
  } catch (e) {
    noToken = errorOf(e);
  }
  return { before: first.text, rest: summary(rest), status, noToken };
}

// cancel(): the answer ends "cancelled", its text a prefix of the question.
async function cancel() {
  const stream = client().chat.stream({ model, messages: messages(question) });
  let cancelled = null;
  for await (const _ of stream) {
    if (cancelled === null && stream.text.length > 20) cancelled = await stream.cancel();
  }
  return summary(stream, { cancelled });
}

// drop(): each drop breaks the connection; the stream resumes at once.
async function drop() {
  const stream = client().chat.stream({ model, messages: messages(question) });
  let drops = 0;
  let seen = 0;
  for await (const _ of stream) {
    if (++seen % 25 === 0 && drops < 3) {
      stream.drop();
      drops++;
    }
  }
  return summary(stream, { drops });
}

// an answer whose engine fails: the in-band error is a LastEventError
async function inband() {
  const stream = client().chat.stream({ model, messages: messages(question) });
  let error = null;
  try {
    await stream.collect();
  } catch (e) {
    error = errorOf(e);
  }
  return summary(stream, { error });
}

// an HTTP error before the stream: a LastEventError with the status and code
async function rejected() {
  let error = null;
  try {
    await client().chat.stream({ model: "no-such-model", messages: messages("hi") }).collect();
  } catch (e) {
    error = errorOf(e);
  }
  return { error };
}

const modes = { resume, idempotent, token, cancel, drop, inband, rejected };
const mode = process.argv[2];
if (!modes[mode]) throw new Error(`mode: one of ${Object.keys(modes).join(", ")}`);
const result = await modes[mode]();
console.log(JSON.stringify({ ...result, requests }));
