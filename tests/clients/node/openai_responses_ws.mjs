// The `openai` Node SDK's own Responses WebSocket (`ResponsesWS`, with its `ws` package)
// through a proxy that cuts connections: two responses on two lanes (`stream_id`), and on
// every reconnect the SDK's `onReconnecting` names what it has of each response still in
// flight (lastevent's `resume` query parameter), so the new socket streams the rest.
// Prints every event it got (parsed) and how many reconnects it made.
import OpenAI from "openai";
import { ResponsesWS } from "openai/resources/responses/ws";
import { env, finish } from "./common.mjs";

const FINAL = new Set(["response.completed", "response.incomplete", "response.failed"]);
const LANES = ["a", "b"];

const client = new OpenAI({ baseURL: `${env.url}/v1`, apiKey: env.apiKey, maxRetries: 0 });

// the README's recipe, as it is printed there (and the test's own bookkeeping)
const current = new Map(), seen = new Map(); // lane -> id; id -> [sequence, lane]
let reconnects = 0;
const events = [];
const errors = [];
const ws = new ResponsesWS(client, {
  reconnect: {
    maxRetries: 50,
    initialDelay: 50,
    maxDelay: 200,
    onReconnecting: () => {
      reconnects += 1;
      return {
        parameters: seen.size
          ? { resume: [...seen].map(([id, [n, lane]]) => `${id}:${n}${lane ? `:${lane}` : ""}`).join(",") }
          : {},
      };
    },
  },
});
ws.on("event", (event) => {
  if (event.type === "response.created") current.set(event.stream_id, event.response.id);
  const id = current.get(event.stream_id);
  if (id === undefined || typeof event.sequence_number !== "number") return;
  seen.set(id, [event.sequence_number, event.stream_id]);
  if (["response.completed", "response.incomplete", "response.failed"].includes(event.type)) {
    seen.delete(id);
    current.delete(event.stream_id);
  }
});

const done = new Promise((resolve, reject) => {
  let ended = 0;
  ws.on("error", (e) => errors.push(String(e.message ?? e)));
  ws.on("close", () => reject(new Error(`closed: ${errors.join("; ")}`)));
  ws.on("event", (event) => {
    events.push(event);
    if (FINAL.has(event.type) && ++ended === LANES.length) resolve();
  });
});

const questions = { a: env.question, b: process.env.QUESTION_B };
for (const lane of LANES) {
  ws.send({ type: "response.create", model: env.model, input: questions[lane], stream_id: lane });
}
let error = null;
try {
  await done;
} catch (e) {
  error = String(e.message ?? e);
}
ws.close();
finish({ events, reconnects, error, errors });
