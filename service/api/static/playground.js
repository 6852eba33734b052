// The playground (/playground): a chat box that streams through the JS client.
//
// Where the API key may go (issue 41: a link must not hand the key to another origin):
// - The key is kept for this tab only (sessionStorage, with the origin it was typed for):
//   never in localStorage, a cookie or the address, gone when the tab closes, not seen by
//   another tab. A key an older page left in localStorage is removed.
// - The key is sent only to the origin it was typed for. The address bar may name the
//   server (`?baseUrl=`) only when that is this page's own origin; another origin there is
//   ignored (and said so), never used. A server on another origin must be typed into the
//   "Server" field by the user, and the key field then empties: the key must be typed
//   again for that server (a key is never carried from one origin to another).
// - `?apiKey=` is not read: a link must not choose the key either (the prompts would go
//   to the tenant of whoever made the link).
import { LastEvent } from "/static/lastevent.js";

const $ = (id) => document.getElementById(id);
const KEY_SLOT = "lastevent.playground.key"; // sessionStorage: {"origin": ..., "key": ...}
const SERVER_SLOT = "lastevent.playground.baseUrl"; // sessionStorage: what the user typed
const MODEL_SLOT = "lastevent.model"; // localStorage: not a secret
for (const old of ["lastevent.apiKey", "lastevent.baseUrl"]) localStorage.removeItem(old);

// The origin the client's requests to server `base` go to (what fetch resolves them
// against, not what the text looks like), or null: not an http(s) server.
function requestOrigin(base) {
  try {
    const url = new URL(`${base.trim().replace(/\/+$/, "")}/v1/models`, location.href);
    return url.protocol === "http:" || url.protocol === "https:" ? url.origin : null;
  } catch {
    return null;
  }
}

function savedKey() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(KEY_SLOT) || "null");
    return saved && typeof saved.key === "string" && typeof saved.origin === "string" ? saved : null;
  } catch {
    return null;
  }
}

// The key for the server now in the field: only the one typed for that server's origin.
function keyForServer() {
  const origin = requestOrigin($("base-url").value);
  const saved = savedKey();
  return origin && saved && saved.origin === origin ? saved.key : "";
}

const params = new URLSearchParams(location.search);
const asked = params.get("baseUrl");
if (asked !== null && asked.trim() !== "" && requestOrigin(asked) !== location.origin) {
  $("notice").textContent =
    `Ignored the server named in the address (${asked}): another server must be typed in the "Server" field, and its key with it.`;
}
$("base-url").value =
  asked !== null && requestOrigin(asked) === location.origin ? asked : sessionStorage.getItem(SERVER_SLOT) ?? "";
$("api-key").value = keyForServer();
$("model").value = params.get("model") ?? localStorage.getItem(MODEL_SLOT) ?? "";

$("base-url").addEventListener("input", () => {
  sessionStorage.setItem(SERVER_SLOT, $("base-url").value);
  $("api-key").value = keyForServer(); // another origin: empty, the key is typed again
  const saved = savedKey();
  const origin = requestOrigin($("base-url").value);
  $("notice").textContent =
    saved && origin !== saved.origin ? `The key typed for ${saved.origin} is not sent to ${origin ?? "this server"}: type its own key.` : "";
});
$("api-key").addEventListener("input", () => {
  const origin = requestOrigin($("base-url").value);
  const key = $("api-key").value.trim();
  if (origin && key) sessionStorage.setItem(KEY_SLOT, JSON.stringify({ origin, key }));
  else sessionStorage.removeItem(KEY_SLOT);
});
$("model").addEventListener("change", () => localStorage.setItem(MODEL_SLOT, $("model").value));

let current = null;
const page = { reconnects: 0, state: "idle", done: false }; // tests read window.playground
window.playground = page;

function client() {
  return new LastEvent({ baseUrl: $("base-url").value.trim(), apiKey: keyForServer() || null });
}

async function guessModel() {
  if ($("model").value) return;
  const key = keyForServer();
  try {
    const r = await fetch(`${$("base-url").value.trim().replace(/\/+$/, "")}/v1/models`, {
      headers: key ? { Authorization: `Bearer ${key}` } : {},
    });
    if (r.ok) $("model").value = (await r.json()).data?.[0]?.id ?? "";
  } catch { /* the user types one */ }
}
$("api-key").addEventListener("change", guessModel);
$("base-url").addEventListener("change", guessModel);
guessModel();

function log(line) {
  const li = document.createElement("li");
  li.textContent = `${new Date().toLocaleTimeString()}  ${line}`;
  $("log").prepend(li);
}

function show(stream) {
  page.state = stream.state;
  page.reconnects = stream.reconnects;
  $("result").className = `card state-${stream.state}`;
  $("state").textContent = stream.state;
  $("reconnects").textContent = String(stream.reconnects);
  $("request-id").textContent = stream.requestId ?? "-";
  $("last-event-id").textContent = stream.lastEventId || "-";
}

async function send() {
  const question = $("question").value;
  if (!question.trim() || current) return;
  await guessModel();
  $("answer").textContent = "";
  $("error").textContent = "";
  $("log").textContent = "";
  Object.assign(page, { reconnects: 0, state: "connecting", done: false, answer: "", error: null });
  const stream = client().chat.stream(
    { model: $("model").value.trim(), messages: [{ role: "user", content: question }] },
    {
      onState: () => show(stream),
      onReconnect: (info) => {
        log(`reconnect #${info.attempt} in ${info.delayMs} ms after ${info.lastEventId || "the start"} (${info.error?.message ?? info.error})`);
        show(stream);
      },
    },
  );
  current = stream;
  $("send").disabled = true;
  $("drop").disabled = $("cancel").disabled = false;
  show(stream);
  try {
    for await (const delta of stream) {
      $("answer").textContent += delta;
      page.answer = stream.text;
      show(stream);
    }
    log(`end: ${stream.finishReason ?? stream.state} after ${stream.reconnects} reconnects`);
  } catch (err) {
    page.error = `${err.name}: ${err.message}`;
    $("error").textContent = `${err.code ? `${err.code}: ` : ""}${err.message}`;
  } finally {
    page.answer = stream.text;
    show(stream);
    page.done = true;
    current = null;
    $("send").disabled = false;
    $("drop").disabled = $("cancel").disabled = true;
  }
}

$("send").addEventListener("click", send);
$("question").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.metaKey || e.ctrlKey)) send();
});
$("drop").addEventListener("click", () => {
  if (!current) return;
  log("connection dropped (button)");
  current.drop();
});
$("cancel").addEventListener("click", async () => {
  if (!current) return;
  try {
    await current.cancel();
    log("cancelled");
  } catch (err) {
    $("error").textContent = err.message;
  }
});
