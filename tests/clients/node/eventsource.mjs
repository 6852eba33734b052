// npm `eventsource` (the WHATWG EventSource for Node) reading a lastevent stream through
// a cutting proxy: the POST by fetch, then `new EventSource(eventsUrl?token=...)` -- what
// a browser does, since an EventSource cannot send an Authorization header.
//
// MODE=close: the page closes the EventSource at [DONE].
// MODE=until-204: it never closes it: after [DONE] the stream ends, EventSource
//   reconnects with the last id, the server answers 204, and EventSource stops for good.
import { EventSource } from "eventsource";
import { connections, env, finish, loggingFetch, postChat } from "./common.mjs";

const { requestId, token } = await postChat();
const url = `${env.url}/v1/requests/${encodeURIComponent(requestId)}/events?token=${encodeURIComponent(token)}`;
const events = []; // [lastEventId, data] of every message dispatched
const errors = [];
let doneAt = null; // connections made when [DONE] arrived
const opened = connections.length;

const es = new EventSource(url, { fetch: loggingFetch });
await new Promise((resolve) => {
  es.onmessage = (e) => {
    events.push([e.lastEventId, e.data]);
    if (e.data === "[DONE]") {
      doneAt = connections.length;
      if (env.mode === "close") {
        es.close();
        resolve();
      }
    }
  };
  es.onerror = (e) => {
    errors.push(e.code ?? e.message ?? "error");
    if (es.readyState === es.CLOSED) resolve(); // a 204 (or a refusal): it will not reconnect
  };
});
// nothing keeps the process alive now unless EventSource still has a timer or a
// connection: the test sees that as a timeout
finish({
  requestId,
  events,
  errors,
  readyState: es.readyState,
  posts: opened,
  doneAt,
});
