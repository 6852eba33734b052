// The `openai` Node SDK's own resume of a background response (the Responses API):
// `responses.create({background: true, stream: true})`, and after every broken
// connection `responses.retrieve(id, {stream: true, starting_after: <last sequence
// number>})`, until the response's final event. Through a proxy that cuts connections.
import OpenAI from "openai";
import { env, finish, loggingFetch } from "./common.mjs";

const client = new OpenAI({
  baseURL: `${env.url}/v1`,
  apiKey: env.apiKey,
  fetch: loggingFetch,
  maxRetries: 0,
});
const FINAL = new Set(["response.completed", "response.incomplete", "response.failed"]);
const sequence = [];
let text = "";
let id = null;
let status = null;
let error = null;
let resumes = 0;
for (let attempt = 0; attempt < 200 && status === null; attempt += 1) {
  try {
    let stream;
    if (id === null) {
      // a POST cut before its headers made a request we cannot name: a new one
      const made = await client.responses
        .create({ model: env.model, input: env.question, background: true, stream: true })
        .withResponse();
      id = made.response.headers.get("x-request-id");
      stream = made.data;
    } else {
      const after = sequence.length ? { starting_after: sequence[sequence.length - 1] } : {};
      stream = await client.responses.retrieve(id, { stream: true, ...after });
      resumes += 1;
    }
    for await (const event of stream) {
      sequence.push(event.sequence_number);
      if (event.type === "response.output_text.delta") text += event.delta;
      if (FINAL.has(event.type)) status = event.response.status;
    }
  } catch (e) {
    error = { name: e.constructor?.name ?? e.name, message: String(e.message ?? e) };
  }
}
finish({ id, text, status, sequence, resumes, lastError: error });
