// The `openai` Node SDK's stored chat completions against lastevent, through the SDK's own
// methods only: create with `store: true` and `metadata`, list (filters, `after`, `limit`,
// `order`, its pages and auto-pagination), retrieve, messages.list, update, delete; and what
// a key of another tenant gets for each. The script reports what it saw (the result line,
// JSON); tests/clients/test_stored_completions_node.py checks it.
//
// env: LASTEVENT_URL, LASTEVENT_API_KEY (the tenant's key), OTHER_API_KEY (another
// tenant's), LASTEVENT_MODEL, RUN (a tag no other run uses: every request's metadata
// `run`), STORED (how many stored completions to make).
import OpenAI from "openai";
import { env } from "./common.mjs";

const run = process.env.RUN;
const count = Number(process.env.STORED || "5");
const client = new OpenAI({ baseURL: `${env.url}/v1`, apiKey: env.apiKey, maxRetries: 0 });
const other = new OpenAI({ baseURL: `${env.url}/v1`, apiKey: process.env.OTHER_API_KEY, maxRetries: 0 });
const SYSTEM = { role: "system", content: `You audit run ${run}.` };

const question = (i) => `Stored question ${i} of run ${run}: what is ${i} + ${i}?`;
const metadataOf = (i) => ({ run, i: String(i), parity: i % 2 ? "odd" : "even" });
const ids = async (pages) => {
  const out = [];
  for await (const item of pages) out.push(item.id);
  return out;
};

// what a call answered: the SDK's error class and status when it threw
async function outcome(call) {
  try {
    const value = await call();
    return { ok: true, value };
  } catch (e) {
    return { ok: false, error: e.constructor?.name ?? e.name, status: e.status ?? null, message: String(e.message) };
  }
}

// requests that must never be listed: `store` left out, and `store: false` (sent first, so
// they are recorded before the stored ones; the test checks their billing rows' times)
const unstored = [];
for (const store of [undefined, false]) {
  const c = await client.chat.completions.create({
    model: env.model,
    messages: [SYSTEM, { role: "user", content: `Not stored (${store}) in run ${run}` }],
    max_tokens: 6,
    metadata: { run, stored: "no" },
    ...(store === undefined ? {} : { store }),
  });
  unstored.push(c.id);
}

const created = [];
for (let i = 0; i < count; i++) {
  const c = await client.chat.completions.create({
    model: env.model,
    messages: [SYSTEM, { role: "user", content: question(i) }],
    max_tokens: 8,
    temperature: 0.5,
    store: true,
    metadata: metadataOf(i),
  });
  created.push({ id: c.id, model: c.model, content: c.choices[0].message.content, usage: c.usage });
}

// a streamed one, stored too
const stream = await client.chat.completions.create({
  model: env.model,
  messages: [{ role: "user", content: `Streamed and stored, run ${run}` }],
  max_tokens: 8,
  stream: true,
  store: true,
  metadata: { run, streamed: "yes" },
});
let streamedId = null;
let streamedText = "";
for await (const chunk of stream) {
  streamedId = chunk.id;
  streamedText += chunk.choices[0]?.delta?.content ?? "";
}

// the list reads Postgres: wait until the recorder wrote every stored one
const want = [...created.map((c) => c.id), streamedId];
const deadline = Date.now() + 90_000;
let listed = [];
while (Date.now() < deadline) {
  listed = await ids(client.chat.completions.list({ metadata: { run }, limit: 100 }));
  if (want.every((id) => listed.includes(id))) break;
  await new Promise((ok) => setTimeout(ok, 250));
}
const listedAt = Date.now();

// paging by hand: limit 2, the SDK's next page (`after` = the page's last id)
const pages = [];
let page = await client.chat.completions.list({ metadata: { run }, limit: 2 });
for (;;) {
  pages.push({ ids: page.data.map((c) => c.id), hasMore: page.has_more });
  if (!page.hasNextPage() || pages.length > 10) break;
  page = await page.getNextPage();
}

const filtered = {
  auto: await ids(client.chat.completions.list({ metadata: { run }, limit: 2 })),
  desc: await ids(client.chat.completions.list({ metadata: { run }, limit: 3, order: "desc" })),
  afterSecond: (await client.chat.completions.list({ metadata: { run }, after: created[1].id, limit: 2 })).data.map((c) => c.id),
  even: await ids(client.chat.completions.list({ metadata: { run, parity: "even" } })),
  model: await ids(client.chat.completions.list({ metadata: { run }, model: env.model })),
  otherModel: await ids(client.chat.completions.list({ metadata: { run }, model: "no-such-model" })),
};

const first = created[0].id;
const retrieved = await client.chat.completions.retrieve(first);
const messages = (await client.chat.completions.messages.list(first)).data;
const messagesPaged = await ids(client.chat.completions.messages.list(first, { limit: 1 }));
const streamed = await client.chat.completions.retrieve(streamedId);

// another tenant's key: nothing of this tenant exists for it
const second = created[1].id;
const foreign = {
  retrieve: await outcome(() => other.chat.completions.retrieve(second)),
  messages: await outcome(() => other.chat.completions.messages.list(second)),
  update: await outcome(() => other.chat.completions.update(second, { metadata: { run, hijacked: "yes" } })),
  delete: await outcome(() => other.chat.completions.delete(second)),
  list: await ids(other.chat.completions.list({ metadata: { run } })),
};
const secondAfter = await client.chat.completions.retrieve(second);

const updated = await client.chat.completions.update(first, {
  metadata: { ...metadataOf(0), reviewed: "yes" },
});
const afterUpdate = {
  retrieved: (await client.chat.completions.retrieve(first)).metadata,
  reviewed: await ids(client.chat.completions.list({ metadata: { run, reviewed: "yes" } })),
};

const deleted = await client.chat.completions.delete(first);
const afterDelete = {
  retrieve: await outcome(() => client.chat.completions.retrieve(first)),
  messages: await outcome(() => client.chat.completions.messages.list(first)),
  update: await outcome(() => client.chat.completions.update(first, { metadata: { run } })),
  delete: await outcome(() => client.chat.completions.delete(first)),
  list: await ids(client.chat.completions.list({ metadata: { run } })),
};

process.stdout.write(
  JSON.stringify({
    system: SYSTEM,
    questions: created.map((_, i) => question(i)),
    metadata: created.map((_, i) => metadataOf(i)),
    unstored,
    created,
    streamed: { id: streamedId, text: streamedText, retrieved: streamed },
    listed,
    listedAt,
    pages,
    filtered,
    retrieved,
    messages,
    messagesPaged,
    foreign,
    secondAfter,
    updated,
    afterUpdate,
    deleted,
    afterDelete,
  }) + "\n",
);
