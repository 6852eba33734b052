"""Reconciliation and usage export (`lastevent billing`, and the console's reconcile).

The invariant `lastevent billing reconcile` checks, for requests whose terminal
event falls in [since, until):

    every outbox entry (one per terminal event, written atomically with it) has
    exactly one row in ``requests`` with the same request id, state, finish_reason,
    token counts and last event id -- and every row has its outbox entry.

The outbox keeps entries for ``LASTEVENT_OUTBOX_RETENTION_S`` (default 7 days); older
ranges can only be checked row-side. Where the hot log still exists, its terminal
event is compared too.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
from typing import Any

from service.ledger.ledger import Ledger, row_values
from service.store.log import RedisLog
from service.store.outbox import Outbox
from service.stream.events import End

COMPARED = (
    "state",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "wasted_tokens",
    "takeovers",
    "handovers",
    "reprefill_tokens",
    "end_user",
    "last_event_id",
)


@dataclasses.dataclass
class Report:
    checked: int = 0
    missing: list[str] = dataclasses.field(default_factory=list)
    duplicate: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[tuple[str, str, Any, Any]] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.duplicate or self.mismatched or self.unexpected)

    def lines(self) -> list[str]:
        out = [f"checked {self.checked} terminal events"]
        out += [f"MISSING row for {rid}" for rid in self.missing]
        out += [f"DUPLICATE terminal events for {rid}" for rid in self.duplicate]
        out += [
            f"MISMATCH {rid}: {f} is {got!r}, log says {want!r}"
            for rid, f, got, want in self.mismatched
        ]
        out += [f"UNEXPECTED row {rid}: no terminal event in the outbox" for rid in self.unexpected]
        out.append("clean" if self.clean else "NOT clean")
        return out


def _ms(t: dt.datetime) -> int:
    return int(t.timestamp() * 1000)


async def reconcile(
    outbox: Outbox, log: RedisLog, ledger: Ledger, since: dt.datetime, until: dt.datetime
) -> Report:
    report = Report()
    expected: dict[str, dict[str, Any]] = {}
    for summary, end_id in await outbox.ended_between(_ms(since), _ms(until)):
        if summary.request_id in expected:
            report.duplicate.append(summary.request_id)
        expected[summary.request_id] = row_values(summary, end_id)
    report.checked = len(expected)
    rows = {r.id: r for r in await ledger.rows_between(since, until)}
    for rid, want in expected.items():
        row = rows.get(rid) or await ledger.get(rid)
        if row is None:
            report.missing.append(rid)
            continue
        for field in COMPARED:
            if getattr(row, field) != want[field]:
                report.mismatched.append((rid, field, getattr(row, field), want[field]))
        last = await log.last(rid)
        if last is not None and isinstance(last[1], End):
            end = last[1]
            if (end.completion_tokens, end.state) != (row.completion_tokens, row.state):
                report.mismatched.append(
                    (
                        rid,
                        "hot log end",
                        (row.completion_tokens, row.state),
                        (end.completion_tokens, end.state),
                    )
                )
    report.unexpected = sorted(set(rows) - set(expected))
    return report


EXPORT_FIELDS = (
    "tenant",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "wasted_tokens",
    "reprefill_tokens",
)


async def export_usage(
    ledger: Ledger, since: dt.datetime, until: dt.datetime
) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in await ledger.usage_by_tenant(since, until)]


SPEND_FIELDS = ("day", *EXPORT_FIELDS)
_FORMULA = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet would run a cell starting so


def csv_text(rows: list[dict[str, Any]], fields: tuple[str, ...] = SPEND_FIELDS) -> str:
    """``rows`` as CSV with a header; a text cell a spreadsheet would read as a formula
    is quoted with a leading ``'`` (tenant and model names are text, never formulas).
    The console's spend export and ``lastevent billing export`` both write this."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(fields), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(
            {
                k: f"'{v}" if isinstance(v, str) and v.startswith(_FORMULA) else v
                for k, v in row.items()
                if k in fields
            }
        )
    return out.getvalue()
