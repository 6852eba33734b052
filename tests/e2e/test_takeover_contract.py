"""Takeover of what issue 15 added to the log: a worker killed (-9, for real) in the
middle of a tool call's argument string, and one killed while it wrote two choices.
The next worker rebuilds each choice -- its parser state, its call ids -- from the log,
and every client sees what one uninterrupted run would have shown."""

from __future__ import annotations

import json
import signal
from typing import Any

import httpx
from httpx_sse import ServerSentEvent

from service.store.keys import Keys
from service.stream import events as ev
from tests.e2e.conftest import Stack
from tests.e2e.helpers import chat_body, ledger_row
from tests.e2e.test_chat_contract import TIME, WEATHER, hermes
from tests.e2e.test_takeover import (  # noqa: F401 - the fixtures
    Stream,
    assert_whole,
    freeze_when,
    now,
    owner_of,
    proc_named,
    reconcile_clean,
    stack,
    start_streams,
    store,
    takeover_db,
)

LONG_ARGS = {"city": "Zürich " * 20 + "東京 🤖", "unit": "°C"}
CALLS = "Checking. " + hermes("get_weather", LONG_ARGS) + hermes("get_time", {"zone": "UTC"})


def logged_arguments(st: Stack, rid: str) -> str:
    """The tool-call argument text the log holds so far (every call's, joined)."""
    entries = store(st).xrange(Keys(st.settings.key_prefix, st.settings.partitions).log(rid))
    found = (ev.decode(fields[b"e"]) for _, fields in entries)
    return "".join(p.arguments for e in found if isinstance(e, ev.Delta) for p in e.tools or ())


def choices_of(events: list[ServerSentEvent]) -> dict[int, dict[str, Any]]:
    """Per choice index: its content, its calls (id, name, arguments), its finish."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if not e.data.startswith("{"):
            continue
        for c in json.loads(e.data)["choices"]:
            choice = out.setdefault(c["index"], {"content": "", "calls": {}, "finish": None})
            delta = c["delta"]
            choice["content"] += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                call = choice["calls"].setdefault(tc["index"], ["", "", ""])
                if "id" in tc:
                    call[0], call[1] = tc["id"], tc["function"]["name"]
                call[2] += tc["function"].get("arguments", "")
            choice["finish"] = c["finish_reason"] or choice["finish"]
    return out


def test_killed_inside_an_argument_string_the_call_goes_on(stack: Stack) -> None:  # noqa: F811
    st, since = stack, now()
    procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
    st.start_api()
    clients = start_streams(st, [Stream(CALLS, {"tools": [WEATHER, TIME]})])
    clients.wait_started()
    [s] = clients.streams
    owner = proc_named(st, procs, owner_of(st, s.request_id))
    # frozen (then killed) once the log holds part of the first call's "Zürich ..." string
    freeze_when(
        st, procs[owner], s.request_id, lambda _: 15 < len(logged_arguments(st, s.request_id)) < 100
    )
    procs[owner].send_signal(signal.SIGKILL)
    procs[owner].wait()
    clients.join()
    [choice] = choices_of(s.events).values()
    assert choice["content"] == "Checking."
    calls = [choice["calls"][k] for k in sorted(choice["calls"])]
    assert [(name, json.loads(args)) for _, name, args in calls] == [
        ("get_weather", LONG_ARGS),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len({cid for cid, _, _ in calls}) == 2
    assert choice["finish"] == "tool_calls"
    assert_whole(st, s, "Checking.", takeovers=1, finish="tool_calls")
    reconcile_clean(st, since)


def test_killed_while_writing_two_choices_both_go_on(stack: Stack) -> None:  # noqa: F811
    st, since = stack, now()
    procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
    st.start_api()
    question = "Two choices, one log: " + "Zürich 東京 🤖 " * 12
    clients = start_streams(st, [Stream(question, {"n": 2})])
    clients.wait_started()
    [s] = clients.streams
    owner = proc_named(st, procs, owner_of(st, s.request_id))
    freeze_when(st, procs[owner], s.request_id, lambda t: len(t) > 40)
    procs[owner].send_signal(signal.SIGKILL)
    procs[owner].wait()
    clients.join()
    choices = choices_of(s.events)
    assert sorted(choices) == [0, 1]
    for c in choices.values():
        assert c["content"] == question and c["finish"] == "stop"
    assert s.events[-1].data == "[DONE]"
    one = httpx.post(
        f"{st.url}/v1/chat/completions", json=chat_body(st.model, question), timeout=60
    )
    row = ledger_row(st.settings.database_url or "", s.request_id, timeout_s=60)
    assert row is not None and row["state"] == "finished" and row["takeovers"] == 1, row
    # each choice billed once: no token of the killed worker's counted twice, none lost
    assert row["completion_tokens"] == 2 * one.json()["usage"]["completion_tokens"], row
    reconcile_clean(st, since)


def test_a_stopping_worker_hands_over_two_choices(stack: Stack) -> None:  # noqa: F811
    """SIGTERM while a worker writes two choices: both are handed over together, and the
    next worker finishes each from its own deltas -- both whole, one handover."""
    st, since = stack, now()
    slow = {"worker_drain_s": 0.2, "scripted_tokens_per_s": 15.0}
    procs = {"a": st.start_worker("a", **slow)}
    st.start_api()
    question = "Handed over with two choices: " + "Zürich 東京 🤖 " * 8
    clients = start_streams(st, [Stream(question, {"n": 2})])
    clients.wait_started()
    [s] = clients.streams
    st.start_worker("b", **slow)
    procs["a"].send_signal(signal.SIGTERM)
    assert procs["a"].wait(timeout=60) == 0, st.tail("a")
    clients.join()
    choices = choices_of(s.events)
    assert sorted(choices) == [0, 1]
    for c in choices.values():
        assert c["content"] == question and c["finish"] == "stop"
    row = ledger_row(st.settings.database_url or "", s.request_id, timeout_s=60)
    assert row is not None and row["state"] == "finished" and row["handovers"] == 1, row
    reconcile_clean(st, since)
