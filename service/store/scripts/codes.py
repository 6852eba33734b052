"""Every script's reply codes, named once: a script returns ``REPLY.<SCRIPT>_<CODE>``
(the prelude's ``REPLY`` table, generated from these enums by ``prelude``) and its typed
face (``service/store/scripts/<script>.py``) decodes the reply into the same enum. A
script never spells a code itself (``tests/unit/test_layout.py`` fails if one does).

The check's ``Verdict`` (and the states a cancel may answer) are the prelude's ``V`` and
``S``, from ``service/stream/lifecycle.py``.
"""

from __future__ import annotations

import enum


class CreateReply(enum.StrEnum):
    """``create.lua``."""

    OK = "ok"  # then the created event's id
    EXISTS = "EXISTS"  # another request has this id (its log or meta is there)


class ClaimReply(enum.StrEnum):
    """``claim.lua``."""

    OK = "ok"  # then epoch, events in the log, and its first entry's id and event, if any
    GONE = "gone"  # the request is unknown (expired)
    ENDED = "ended"  # it already ended
    NOT_CURRENT = "not_current"  # the caller's queue entry is not the request's current one


class AppendReply(enum.StrEnum):
    """``append.lua``, per request (each code but ``OK`` followed by a detail text)."""

    OK = "OK"  # then the entry ids
    FENCED = "FENCED"  # the caller is not the owner
    ENDED = "ENDED"  # already terminal
    GAP = "GAP"  # the log does not hold what the caller wrote: Redis lost data
    GONE = "GONE"  # Redis lost the whole request
    INVALID = "INVALID"  # not a terminal state


class ResumeReply(enum.StrEnum):
    """``record_resume.lua``."""

    OK = "ok"  # then the recovery counts
    FENCED = "fenced"  # the caller is not the owner


class ParkReply(enum.StrEnum):
    """``park.lua``."""

    PARKED = "PARKED"  # then when its resume window is over (ms)
    CONTINUED = "CONTINUED"  # a reader came back meanwhile: then the new queue entry
    FENCED = "FENCED"  # not the owner's to park


class CancelReply(enum.StrEnum):
    """``cancel.lua`` (besides these, a terminal state: ``S.CANCELLED`` with its end id
    when it ended here, any other when it had ended already)."""

    MISSING = "missing"  # no such request
    CANCELLING = "cancelling"  # running: then its owner, who aborts it
    STALE = "stale"  # parked, but its log is not the one the parked ending was made from


class LeaseReply(enum.IntEnum):
    """``lease_and_unpark.lua``."""

    ENDED = 0  # ended, or unknown: nothing to keep alive
    LEASED = 1
    UNPARKED = 2  # leased, and the request was parked: it goes on


class LeaveReply(enum.StrEnum):
    """``leave.lua``."""

    GONE = "gone"  # the request is not in Redis
    LEFT = "left"  # then the live leases left and the owner


class RequeueReply(enum.StrEnum):
    """``requeue.lua``."""

    OK = "OK"  # then the new entry id
    EXHAUSTED = "EXHAUSTED"  # lost too often: then how many takeovers it had
    REFUSED = "refused"  # not waiting behind that entry (or not the caller's)


class Admitted(enum.IntEnum):
    """``admit.lua``'s verdict (each refusal followed by the ms until a retry may pass)."""

    YES = 0
    TOO_MANY_IN_FLIGHT = 1
    OVER_RATE = 2


class UnbindReply(enum.StrEnum):
    """``unbind_idempotency.lua``."""

    UNBOUND = "unbound"
    NOT_BOUND = "not_bound"  # bound to another request, or expired


# the script each enum answers for (its codes are REPLY.<SCRIPT>_<CODE> in Lua)
REPLIES: dict[str, type[enum.Enum]] = {
    "create": CreateReply,
    "claim": ClaimReply,
    "append": AppendReply,
    "record_resume": ResumeReply,
    "park": ParkReply,
    "cancel": CancelReply,
    "lease_and_unpark": LeaseReply,
    "leave": LeaveReply,
    "requeue": RequeueReply,
    "admit": Admitted,
    "unbind_idempotency": UnbindReply,
}


def lua_table() -> str:
    """``local REPLY = {CLAIM_GONE='gone', ...}``: every code of every script."""
    items = []
    for script, codes in REPLIES.items():
        for code in codes:
            value = code.value if isinstance(code.value, int) else f"'{code.value}'"
            items.append(f"{script.upper()}_{code.name}={value}")
    return f"local REPLY = {{{', '.join(items)}}}\n"
