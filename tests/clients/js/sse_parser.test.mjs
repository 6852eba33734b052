// The JS client's SSE parser against the WHATWG rules, fed whole, in every two-piece
// split and byte by byte (node --test; run by tests/clients/test_js_client.py).
import assert from "node:assert/strict";
import { test } from "node:test";

import { SSEParser } from "../../../service/api/static/lastevent.js";

function parse(pieces, lastEventId = "") {
  const events = [];
  const retries = [];
  const p = new SSEParser({ lastEventId, onEvent: (e) => events.push(e), onRetry: (ms) => retries.push(ms) });
  for (const piece of pieces) p.feed(piece);
  const committed = p.lastEventId;
  p.end();
  return { events, retries, lastEventId: committed };
}

// the same result however the stream is split into pieces
function same(text, expected) {
  const whole = parse([text]);
  assert.deepEqual(whole, expected);
  assert.deepEqual(parse([...text]), expected, "byte by byte");
  for (let i = 1; i < text.length; i++) assert.deepEqual(parse([text.slice(0, i), text.slice(i)]), expected, `split at ${i}`);
}

const ev = (data, id = "", event = "message") => ({ data, event, id });

test("fields split at the first colon, one optional space dropped", () => {
  same("data:a:b\n\ndata: c\n\ndata:  d\n\n", { events: [ev("a:b"), ev("c"), ev(" d")], retries: [], lastEventId: "" });
});

test("data lines are joined with LF; dispatch on a blank line only", () => {
  same("data: one\ndata: two\ndata\n\n", { events: [ev("one\ntwo\n")], retries: [], lastEventId: "" });
});

test("CR, LF and CRLF line ends, CRLF split across pieces", () => {
  same("data: a\r\n\r\ndata: b\r\rdata: c\n\n", { events: [ev("a"), ev("b"), ev("c")], retries: [], lastEventId: "" });
  assert.deepEqual(parse(["data: a\r", "\n", "\r", "\n"]).events, [ev("a")]);
});

test("comments are ignored, also between the lines of one event", () => {
  same(": ping\ndata: a\n: ping\ndata: b\n\n: ping\n", { events: [ev("a\nb")], retries: [], lastEventId: "" });
});

test("id is taken when its event is dispatched, and kept for later events", () => {
  same("data: a\nid: 1-0\n\ndata: b\n\nid: 2-0\ndata: c\n\n", {
    events: [ev("a", "1-0"), ev("b", "1-0"), ev("c", "2-0")],
    retries: [],
    lastEventId: "2-0",
  });
});

test("an event the stream ends inside is not delivered and its id is not taken", () => {
  for (const tail of ["data: {\"cho", "data: {\"x\": 1}\n", "data: {\"x\": 1}\nid: 3-0", "data: {\"x\": 1}\nid: 3-0\n", "id: 3-0\ndata: x\n"]) {
    const r = parse(["data: a\nid: 2-0\n\n", tail]);
    assert.deepEqual(r.events, [ev("a", "2-0")], tail);
    assert.equal(r.lastEventId, "2-0", tail);
  }
});

test("the starting id carries over to a new connection", () => {
  assert.deepEqual(parse(["data: x\n\n"], "9-1").events, [ev("x", "9-1")]);
});

test("retry takes digits only; event names; unknown fields and empty events", () => {
  same("retry: 250\nretry: 1x\nevent: ping\ndata: p\n\nfoo: bar\n\nid: 5-0\n\n", {
    events: [ev("p", "", "ping")],
    retries: [250],
    lastEventId: "5-0",
  });
});

test("an id with NUL is ignored; a leading BOM is dropped", () => {
  same("\ufeffid: a\0b\ndata: x\n\n", { events: [ev("x")], retries: [], lastEventId: "" });
});

test("a field without a colon is a name with an empty value", () => {
  same("data\ndata\n\n", { events: [ev("\n")], retries: [], lastEventId: "" });
});
