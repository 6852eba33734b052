"""Every size a request may have beyond the body's own bound, in one place: what the API
checks before any chat template or tokenizer runs (a 400 naming the field), and what a
worker checks again before it compiles a grammar. Pure: the API and the workers read it.

    field                                   bound
    messages / Responses input items        MAX_MESSAGES (a previous_response_id chain too)
    a message's tool_calls                  MAX_TOOL_CALLS
    a tool call's id / tool_call_id /       1 to MAX_CALL_ID_CHARS printable ASCII, no space
      a Responses item's call_id
    a Responses input item's id             ITEM_ID: [A-Za-z0-9_-], 1 to 128
    a Responses input item's status         ITEM_STATUSES (OpenAI's)
    a message's name                        NAME: [A-Za-z0-9_-], 1 to 64 (OpenAI's)
    tools                                   MAX_TOOLS (OpenAI's 128)
    a tool definition (JSON)                MAX_TOOL_BYTES
    a JSON schema (response_format, text)   MAX_SCHEMA_BYTES
    the grammar an engine compiles          MAX_GRAMMAR_BYTES (a forced tool_choice's schema
                                            is made of every tool's parameters)
    a previous_response_id chain's input    the body's bound (LASTEVENT_MAX_BODY_BYTES), as
                                            if sent whole in one body

Everything else a request carries is bounded by the body size (one string each: content,
instructions, arguments) or by its schema (metadata, user, stop).
"""

from __future__ import annotations

import re

MAX_MESSAGES = 2048
MAX_TOOL_CALLS = 128
MAX_CALL_ID_CHARS = 256
MAX_TOOLS = 128
MAX_TOOL_BYTES = 16_384
MAX_SCHEMA_BYTES = 16_384
MAX_GRAMMAR_BYTES = 65_536

CALL_ID = rf"^[\x21-\x7e]{{1,{MAX_CALL_ID_CHARS}}}$"
ITEM_ID = r"^[A-Za-z0-9_-]{1,128}$"
NAME = r"^[A-Za-z0-9_-]{1,64}$"
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
ITEM_STATUSES = ("in_progress", "completed", "incomplete")

_CALL_ID = re.compile(CALL_ID)
_ITEM_ID = re.compile(ITEM_ID)
_FUNCTION_NAME = re.compile(FUNCTION_NAME)


def call_id_ok(value: object) -> bool:
    """A tool call's id as it may be templated and stored."""
    return isinstance(value, str) and _CALL_ID.fullmatch(value) is not None


def item_id_ok(value: object) -> bool:
    """A Responses input item's ``id`` (OpenAI's look: ``msg_...``, ``fc_...``)."""
    return isinstance(value, str) and _ITEM_ID.fullmatch(value) is not None


def function_name_ok(value: object) -> bool:
    return isinstance(value, str) and _FUNCTION_NAME.fullmatch(value) is not None
