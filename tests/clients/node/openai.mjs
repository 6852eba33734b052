// The `openai` Node SDK streaming a chat completion from lastevent. It cannot resume: a
// broken connection is an error (or, before the response headers, a new POST).
//
// MODE=whole: through a plain proxy (or straight to the API): the whole answer.
// MODE=cut: through a cutting proxy: what the SDK does when the connection breaks.
// MODE=keyed: as whole, with an Idempotency-Key header of our own (the SDK sends none),
//   so that a POST it sends again after a broken connection is the same request.
import OpenAI from "openai";
import { randomUUID } from "node:crypto";
import { connections, env, finish, loggingFetch } from "./common.mjs";

const client = new OpenAI({ baseURL: `${env.url}/v1`, apiKey: env.apiKey, fetch: loggingFetch });
let text = "";
let chunks = 0;
let finishReason = null;
let error = null;
let requestId = null;
const key = `node-${randomUUID()}`;
try {
  const { data: stream, response } = await client.chat.completions
    .create(
      { model: env.model, stream: true, messages: [{ role: "user", content: env.question }] },
      env.mode === "keyed" ? { headers: { "Idempotency-Key": key } } : {},
    )
    .withResponse();
  requestId = response.headers.get("x-request-id");
  for await (const chunk of stream) {
    chunks += 1;
    const choice = chunk.choices?.[0];
    text += choice?.delta?.content ?? "";
    finishReason = choice?.finish_reason ?? finishReason;
  }
} catch (e) {
  error = { name: e.constructor?.name ?? e.name, message: String(e.message ?? e) };
}
finish({ requestId, key, text, chunks, finishReason, error });
