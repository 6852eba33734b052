// lastevent.js -- a resumable-stream client for lastevent, in one file: ESM, no
// dependencies, fetch-based (browsers, Node 18+, React Native / Expo with a streaming fetch).
//
//   import { LastEvent } from "./lastevent.js";
//   const client = new LastEvent({ baseUrl: "http://127.0.0.1:8000", apiKey: "sk-..." });
//   for await (const text of client.chat.stream({ model, messages })) out.textContent += text;
//
// A stream yields the answer's text deltas (strings). When the connection breaks it
// reconnects to GET /v1/requests/{id}/events with Last-Event-ID (exponential backoff with
// jitter, starting from the server's `retry:`), so the text it yields is the whole answer,
// each piece once. The POST carries an Idempotency-Key: a POST cut before its response
// headers is sent again with the same key and the server answers the same request.
// Served by the API at /static/lastevent.js; packaged as @lastevent/client (clients/js).

const DONE = "[DONE]";
const RETRYABLE_STATUS = new Set([429, 502, 503, 504]);

/** An error the server sent (an HTTP error status or an in-band `{"error": ...}` event),
 * or the client's own (`code` "reconnect_failed", "aborted", "no_stream"). */
export class LastEventError extends Error {
  constructor(message, { status = null, code = null, type = null, param = null, requestId = null, body = null, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = "LastEventError";
    this.status = status; // HTTP status, null for an in-band error
    this.code = code; // e.g. "idempotency_key_reused", "log_lost", "rate_limited"
    this.type = type; // e.g. "invalid_request_error", "server_error"
    this.param = param;
    this.requestId = requestId;
    this.body = body; // the parsed error body, if any
  }

  static fromBody(body, extra = {}) {
    const e = (body && typeof body === "object" && body.error) || {};
    const message = typeof e === "string" ? e : e.message || `request failed (${extra.status ?? "in band"})`;
    return new LastEventError(message, { code: e.code ?? null, type: e.type ?? null, param: e.param ?? null, body, ...extra });
  }
}

// ---------------------------------------------------------------------------------------
// Server-sent events, as the WHATWG HTML spec parses them (section 9.2.6): lines end with
// CRLF, LF or CR (also split across chunks); a line starting with ":" is a comment; a field
// name ends at the first colon and one space after it is dropped; `data` lines are joined
// with "\n"; a blank line dispatches. An event that the stream ends inside (no blank line
// yet) is never dispatched, and its `id:` is not taken: `lastEventId` changes only when an
// event is dispatched.

export class SSEParser {
  /** `onEvent({ data, event, id })` for each dispatched event; `onRetry(ms)` for `retry:`. */
  constructor({ onEvent, onRetry, lastEventId = "" } = {}) {
    this.onEvent = onEvent || (() => {});
    this.onRetry = onRetry || (() => {});
    this.lastEventId = lastEventId; // the id of the last dispatched event (or the initial one)
    this._idBuffer = lastEventId;
    this._data = [];
    this._event = "";
    this._line = "";
    this._afterCR = false; // the previous chunk ended with CR: a leading LF belongs to it
    this._started = false;
  }

  /** Feed decoded text (any split: mid-line, mid-CRLF). */
  feed(text) {
    if (!this._started && text.length) {
      this._started = true;
      if (text.charCodeAt(0) === 0xfeff) text = text.slice(1); // one leading BOM
    }
    let start = 0;
    if (this._afterCR && text[0] === "\n") start = 1;
    this._afterCR = false;
    for (let i = start; i < text.length; i++) {
      const c = text[i];
      if (c !== "\n" && c !== "\r") continue;
      this._lineDone(this._line + text.slice(start, i));
      this._line = "";
      if (c === "\r") {
        if (i + 1 === text.length) this._afterCR = true;
        else if (text[i + 1] === "\n") i++;
      }
      start = i + 1;
    }
    this._line += text.slice(start);
  }

  /** The stream ended: whatever was not dispatched is dropped (spec: "discarded"). */
  end() {
    this._line = "";
    this._data = [];
    this._event = "";
    this._idBuffer = this.lastEventId;
    this._afterCR = false;
  }

  _lineDone(line) {
    if (line === "") return this._dispatch();
    if (line[0] === ":") return; // a comment (keepalive)
    const colon = line.indexOf(":");
    let field = line;
    let value = "";
    if (colon >= 0) {
      field = line.slice(0, colon);
      value = line.slice(colon + 1);
      if (value[0] === " ") value = value.slice(1);
    }
    switch (field) {
      case "data":
        this._data.push(value);
        break;
      case "event":
        this._event = value;
        break;
      case "id":
        if (!value.includes("\0")) this._idBuffer = value;
        break;
      case "retry":
        if (/^[0-9]+$/.test(value)) this.onRetry(parseInt(value, 10));
        break;
      default: // unknown fields are ignored
    }
  }

  _dispatch() {
    this.lastEventId = this._idBuffer;
    const data = this._data;
    const event = this._event || "message";
    this._data = [];
    this._event = "";
    if (data.length === 0) return; // nothing to deliver (spec: empty data buffer)
    this.onEvent({ data: data.join("\n"), event, id: this.lastEventId });
  }
}

// A streaming UTF-8 decoder for runtimes without TextDecoder (older Hermes).
class Utf8Decoder {
  constructor() {
    this._rest = [];
  }
  decode(bytes = new Uint8Array(0), { stream = false } = {}) {
    const all = this._rest.length ? Uint8Array.from([...this._rest, ...bytes]) : bytes;
    let end = all.length;
    if (stream) {
      // keep back an incomplete sequence at the end
      let i = end - 1;
      let back = 0;
      while (i >= 0 && back < 3 && (all[i] & 0xc0) === 0x80) {
        i--;
        back++;
      }
      if (i >= 0) {
        const b = all[i];
        const need = b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : b >= 0xc0 ? 2 : 1;
        if (end - i < need) end = i;
      }
    }
    this._rest = Array.from(all.subarray(end));
    let out = "";
    for (let i = 0; i < end; ) {
      const b = all[i];
      let cp;
      let n;
      if (b < 0x80) [cp, n] = [b, 1];
      else if (b >= 0xf0) [cp, n] = [b & 0x07, 4];
      else if (b >= 0xe0) [cp, n] = [b & 0x0f, 3];
      else if (b >= 0xc0) [cp, n] = [b & 0x1f, 2];
      else [cp, n] = [0xfffd, 1];
      for (let k = 1; k < n; k++) cp = (cp << 6) | ((all[i + k] ?? 0) & 0x3f);
      out += n > 1 && i + n > end ? "\ufffd" : String.fromCodePoint(cp);
      i += n;
    }
    return out;
  }
}

function makeDecoder() {
  return typeof TextDecoder === "function" ? new TextDecoder("utf-8") : new Utf8Decoder();
}

// ---------------------------------------------------------------------------------------

function newIdempotencyKey() {
  const c = globalThis.crypto;
  if (c && typeof c.randomUUID === "function") return c.randomUUID();
  const bytes = new Uint8Array(16);
  if (c && typeof c.getRandomValues === "function") c.getRandomValues(bytes);
  else for (let i = 0; i < 16; i++) bytes[i] = Math.floor(Math.random() * 256);
  bytes[6] = (bytes[6] & 0x0f) | 0x40;
  bytes[8] = (bytes[8] & 0x3f) | 0x80;
  const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(abortError(signal));
    const timer = setTimeout(done, ms);
    function done() {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }
    function onAbort() {
      clearTimeout(timer);
      reject(abortError(signal));
    }
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

function abortError(signal) {
  const reason = signal?.reason;
  if (reason instanceof Error) return reason;
  const e = new Error("the stream was aborted");
  e.name = "AbortError";
  return e;
}

async function errorFrom(response, requestId) {
  let body = null;
  let text = "";
  try {
    text = await response.text();
    body = JSON.parse(text);
  } catch {
    body = text ? { error: { message: text } } : null;
  }
  const retryAfter = response.headers.get("retry-after");
  const err = LastEventError.fromBody(body, { status: response.status, requestId });
  err.retryAfterS = retryAfter !== null && /^[0-9.]+$/.test(retryAfter) ? Number(retryAfter) : null;
  return err;
}

/** The SSE body of a response, as decoded text pieces (a fetch without streaming bodies,
 * like React Native's own, gives the whole text at the end: still correct, not live). */
async function* bodyText(response, signal) {
  const decoder = makeDecoder();
  const body = response.body;
  if (body && typeof body.getReader === "function") {
    const reader = body.getReader();
    const onAbort = () => reader.cancel().catch(() => {});
    signal?.addEventListener("abort", onAbort, { once: true });
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const text = decoder.decode(value, { stream: true });
        if (text) yield text;
      }
    } finally {
      signal?.removeEventListener("abort", onAbort);
      reader.cancel().catch(() => {});
    }
    const rest = decoder.decode();
    if (rest) yield rest;
  } else {
    yield await response.text();
  }
}

/**
 * One streamed answer: async-iterable (yields text deltas, strings), with its state.
 *
 * Properties: `requestId`, `lastEventId`, `streamToken`, `reconnects` (reconnections made),
 * `state` ("connecting" | "streaming" | "reconnecting" | "done" | "cancelled" | "error"),
 * `finishReason`, `usage`, `text` (all text so far).
 * Methods: `drop()` (break the current connection: the stream resumes), `cancel()`
 * (POST /v1/requests/{id}/cancel), `abort()` (stop reading; the request runs on),
 * `collect()` (read to the end, resolve with the whole text).
 */
export class LastEventStream {
  constructor(client, { path = null, body = null, requestId = null, lastEventId = "", streamToken = null, options = {} }) {
    this._client = client;
    this._path = path;
    this._body = body;
    this.requestId = requestId;
    this.lastEventId = lastEventId || "";
    this.streamToken = streamToken;
    this.idempotencyKey = body ? options.idempotencyKey || newIdempotencyKey() : null;
    this.reconnects = 0;
    this.state = "connecting";
    this.finishReason = null;
    this.usage = null;
    this.text = "";
    this._opts = options;
    this._retryMs = client.retryMs;
    this._connection = null; // the AbortController of the current connection
    this._stop = new AbortController(); // abort(): the whole stream
    this._started = false;
    this._idWaiters = [];
    if (options.signal) {
      if (options.signal.aborted) this._stop.abort(options.signal.reason);
      else options.signal.addEventListener("abort", () => this.abort(options.signal.reason), { once: true });
    }
  }

  [Symbol.asyncIterator]() {
    if (this._started) throw new LastEventError("a stream can be read once", { code: "already_read" });
    this._started = true;
    return this._run();
  }

  /** Read to the end; the whole text. */
  async collect() {
    for await (const _ of this) {
      // this.text accumulates
    }
    return this.text;
  }

  /** Break the current connection, as a network would: the stream reconnects and resumes. */
  drop() {
    this._connection?.abort(new DroppedConnection());
  }

  /** Stop reading now (the server keeps the answer for a later resume). */
  abort(reason) {
    this._stop.abort(reason);
  }

  /** Cancel the request on the server (POST /v1/requests/{id}/cancel); the stream then
   * ends with finish_reason "cancelled". Waits for the request id if the POST is out. */
  async cancel() {
    const id = this.requestId || (await new Promise((resolve, reject) => this._idWaiters.push({ resolve, reject })));
    return this._client.requests.cancel(id, { streamToken: this.streamToken });
  }

  _setState(state) {
    if (this.state === state) return;
    this.state = state;
    this._opts.onState?.(state, this);
  }

  _learn(response) {
    const rid = response.headers.get("x-request-id");
    if (rid && !this.requestId) {
      this.requestId = rid;
      for (const waiter of this._idWaiters.splice(0)) waiter.resolve(rid);
    }
    const token = response.headers.get("x-stream-token");
    if (token) this.streamToken = token;
  }

  async _open(signal) {
    const c = this._client;
    const headers = { Accept: "text/event-stream" };
    if (this.lastEventId) headers["Last-Event-ID"] = this.lastEventId;
    if (!this.requestId) {
      if (c.apiKey) headers.Authorization = `Bearer ${c.apiKey}`;
      headers["Content-Type"] = "application/json";
      headers["Idempotency-Key"] = this.idempotencyKey;
      return c._fetch(c._url(this._path), { method: "POST", headers, body: JSON.stringify(this._body), signal });
    }
    let query = "";
    if (c.apiKey) headers.Authorization = `Bearer ${c.apiKey}`;
    else if (this.streamToken) query = `?token=${encodeURIComponent(this.streamToken)}`;
    const url = c._url(`/v1/requests/${encodeURIComponent(this.requestId)}/events${query}`);
    return c._fetch(url, { method: "GET", headers, signal });
  }

  async *_run() {
    const stop = this._stop.signal;
    // consecutive connections that brought no event: `failures` got no answer (network
    // error before the headers, 429/5xx), `answered` got a 200 and broke before an event
    // (a browser may drop what arrived just before a reset: the server is there)
    let failures = 0;
    let answered = 0;
    let lastError = null;
    try {
      for (;;) {
        if (stop.aborted) throw abortError(stop);
        const connection = new AbortController();
        const onStop = () => connection.abort(stop.reason);
        stop.addEventListener("abort", onStop, { once: true });
        this._connection = connection;
        let events = 0;
        let waitS = null;
        let ok = false;
        try {
          let response;
          try {
            response = await this._open(connection.signal);
          } catch (err) {
            if (stop.aborted) throw abortError(stop);
            throw new Broken(err); // no response headers: sent again (same Idempotency-Key)
          }
          this._learn(response);
          if (response.status === 204) {
            // the client has it all (Last-Event-ID at the end): a clean end
            this._finish();
            return;
          }
          if (!response.ok) {
            const err = await errorFrom(response, this.requestId);
            if (!RETRYABLE_STATUS.has(response.status)) throw err;
            waitS = err.retryAfterS;
            throw new Broken(err);
          }
          ok = true;
          this._setState("streaming");
          const queue = [];
          let ended = false;
          let inBand = null;
          const parser = new SSEParser({
            lastEventId: this.lastEventId,
            onRetry: (ms) => (this._retryMs = ms),
            onEvent: (ev) => queue.push(ev),
          });
          try {
            for await (const piece of bodyText(response, connection.signal)) {
              parser.feed(piece);
              while (queue.length) {
                const ev = queue.shift();
                events++;
                failures = answered = 0;
                this.lastEventId = ev.id; // a whole event: a resume starts after it
                if (ev.data === DONE) {
                  ended = true;
                  break;
                }
                let chunk;
                try {
                  chunk = JSON.parse(ev.data);
                } catch {
                  continue; // not JSON: not ours to read
                }
                if (chunk && chunk.error) {
                  inBand = LastEventError.fromBody(chunk, { requestId: this.requestId });
                  break;
                }
                const delta = this._read(chunk);
                if (delta) {
                  this.text += delta;
                  yield delta;
                }
              }
              if (ended || inBand) break;
            }
          } catch (err) {
            if (stop.aborted) throw abortError(stop);
            parser.end();
            throw new Broken(err); // cut mid-body: resume after the last whole event
          }
          parser.end();
          if (stop.aborted) throw abortError(stop);
          if (inBand) throw inBand;
          // a body that ends after the answer's finish with nothing new is an end too (a
          // server that answers a resume at the end with an empty stream rather than 204)
          if (ended || (this.finishReason !== null && events === 0)) {
            this._finish();
            return;
          }
          throw new Broken(new Error("the stream ended before [DONE]"));
        } catch (err) {
          if (!(err instanceof Broken)) throw err;
          const dropped = connection.signal.reason instanceof DroppedConnection;
          lastError = dropped ? connection.signal.reason : err.cause;
          if (events === 0 && ok) answered++;
          else if (events === 0) failures++;
          const max = this._client.maxRetries;
          if (failures > max || failures + answered > 4 * max) {
            const n = failures + answered;
            throw new LastEventError(`gave up after ${n} connections without progress: ${describe(lastError)}`, {
              code: "reconnect_failed",
              requestId: this.requestId,
              cause: lastError,
            });
          }
          const delayMs = this._delay(failures, answered, waitS, lastError);
          this._setState("reconnecting");
          this.reconnects++;
          this._opts.onReconnect?.({
            attempt: this.reconnects,
            failures: failures + answered,
            delayMs,
            requestId: this.requestId,
            lastEventId: this.lastEventId,
            error: lastError,
          });
          await sleep(delayMs, stop);
        } finally {
          stop.removeEventListener("abort", onStop);
          connection.abort(); // closes the connection if it is still open
          if (this._connection === connection) this._connection = null;
        }
      }
    } catch (err) {
      if (this.state !== "done" && this.state !== "cancelled") this._setState("error");
      for (const waiter of this._idWaiters.splice(0)) waiter.reject(err);
      throw err;
    }
  }

  /** The wait before a reconnection: the server's `retry:`, doubled for each connection in
   * a row that got no answer (capped), with jitter (50-100 %); a `Retry-After` wins. A
   * connection dropped on purpose (drop()) reconnects at once. */
  _delay(failures, answered, retryAfterS, error) {
    if (error instanceof DroppedConnection && failures + answered <= 1) return 0;
    if (retryAfterS !== null && retryAfterS !== undefined) return retryAfterS * 1000;
    const base = Math.min(this._client.maxRetryDelayMs, this._retryMs * 2 ** Math.max(0, failures - 1));
    return Math.round(base * (0.5 + Math.random() / 2));
  }

  _read(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    let text = "";
    for (const choice of chunk.choices || []) {
      const d = choice.delta ? choice.delta.content : choice.text;
      if (typeof d === "string") text += d;
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
    }
    this._opts.onChunk?.(chunk, this);
    return text;
  }

  _finish() {
    this._setState(this.finishReason === "cancelled" ? "cancelled" : "done");
  }
}

class Broken extends Error {
  constructor(cause) {
    super("connection broken", { cause });
    this.cause = cause;
  }
}

class DroppedConnection extends Error {
  constructor() {
    super("connection dropped on purpose (drop())");
    this.name = "DroppedConnection";
  }
}

function describe(err) {
  return err ? `${err.name || "Error"}: ${err.message}` : "unknown error";
}

/**
 * new LastEvent({ baseUrl, apiKey?, fetch?, retryMs?, maxRetries?, maxRetryDelayMs? })
 *
 * - `baseUrl`: the API ("" or omitted: this page's origin).
 * - `apiKey`: sent as `Authorization: Bearer`. Without one (a browser that must not hold a
 *   key), requests carry no Authorization and reconnects use the stream token the POST
 *   answered (`?token=`), or one given to `requests.stream()`.
 * - `fetch`: a fetch whose response bodies stream (default: globalThis.fetch; on React
 *   Native pass `fetch` from "expo/fetch").
 * - `retryMs` (1000, until the server's `retry:` says), `maxRetryDelayMs` (30000),
 *   `maxRetries` (8): after that many connections in a row that got no answer (or four
 *   times as many that got a 200 but no event), LastEventError "reconnect_failed".
 */
export class LastEvent {
  constructor({ baseUrl = "", apiKey = null, fetch: fetchImpl = null, retryMs = 1000, maxRetries = 8, maxRetryDelayMs = 30000 } = {}) {
    this.baseUrl = String(baseUrl).replace(/\/+$/, "");
    this.apiKey = apiKey;
    this.retryMs = retryMs;
    this.maxRetries = maxRetries;
    this.maxRetryDelayMs = maxRetryDelayMs;
    const f = fetchImpl || globalThis.fetch;
    if (typeof f !== "function") throw new LastEventError("no fetch: pass one as `fetch`", { code: "no_fetch" });
    this._fetch = (url, init) => f(url, init); // unbound window.fetch throws "Illegal invocation"
    const client = this;
    this.chat = {
      /** POST /v1/chat/completions, streamed: yields text deltas. `options`: idempotencyKey,
       * signal, onReconnect(info), onChunk(chunk), onState(state). */
      stream(params, options = {}) {
        return new LastEventStream(client, { path: "/v1/chat/completions", body: { ...params, stream: true }, options });
      },
    };
    this.completions = {
      /** POST /v1/completions, streamed: yields text deltas. */
      stream(params, options = {}) {
        return new LastEventStream(client, { path: "/v1/completions", body: { ...params, stream: true }, options });
      },
    };
    this.requests = {
      /** Follow a request that exists (another tab's, a previous app run's): from the start,
       * or after `lastEventId`; `streamToken` authenticates without an API key. */
      stream(requestId, { lastEventId = "", streamToken = null, ...options } = {}) {
        return new LastEventStream(client, { requestId, lastEventId, streamToken, options });
      },
      /** GET /v1/requests/{id}: state, finish_reason, usage. */
      async get(requestId, { streamToken = null } = {}) {
        return client._json("GET", `/v1/requests/${encodeURIComponent(requestId)}`, { streamToken, requestId });
      },
      /** POST /v1/requests/{id}/cancel (idempotent): the request's state. */
      async cancel(requestId, { streamToken = null } = {}) {
        return client._json("POST", `/v1/requests/${encodeURIComponent(requestId)}/cancel`, { streamToken, requestId });
      },
    };
  }

  _url(path) {
    return this.baseUrl + path;
  }

  /** One JSON call; both (status, cancel) are idempotent, so a broken connection or a
   * 429/5xx is tried again (backoff with jitter, `Retry-After` honoured). */
  async _json(method, path, { streamToken, requestId }) {
    const headers = { Accept: "application/json" };
    let query = "";
    if (this.apiKey) headers.Authorization = `Bearer ${this.apiKey}`;
    else if (streamToken) query = `?token=${encodeURIComponent(streamToken)}`;
    for (let attempt = 0; ; attempt++) {
      let waitS = null;
      let error;
      try {
        const response = await this._fetch(this._url(path + query), { method, headers });
        if (response.ok) return await response.json();
        error = await errorFrom(response, requestId);
        if (!RETRYABLE_STATUS.has(response.status)) throw error;
        waitS = error.retryAfterS;
      } catch (err) {
        if (err instanceof LastEventError && !RETRYABLE_STATUS.has(err.status)) throw err;
        error = err;
      }
      if (attempt >= this.maxRetries) throw error;
      const base = Math.min(this.maxRetryDelayMs, this.retryMs * 2 ** attempt);
      await sleep(waitS !== null ? waitS * 1000 : Math.round(base * (0.5 + Math.random() / 2)));
    }
  }
}

export default LastEvent;
