"""The Postgres schema. Alembic migrations (``migrations/``) create it; nothing else does."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, column_property, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class RequestRow(Base):
    """One row per accepted request, written once from its terminal event."""

    __tablename__ = "requests"
    # the console's filters: each column, then (ended_at, id) -- a filtered page newest
    # first is one index range scan (keyset paging); migration 0007
    __table_args__ = (
        Index("ix_requests_ended_id", "ended_at", "id"),
        *(
            Index(f"ix_requests_{name}_ended", column, "ended_at", "id")
            for name, column in (
                ("tenant", "tenant"),
                ("key", "api_key_id"),
                ("user", "end_user"),
                ("model", "model"),
                ("state", "state"),
                ("error", "error_code"),
                ("finish", "finish_reason"),
            )
        ),
        Index(
            "ix_requests_metadata",
            "metadata",
            postgresql_using="gin",
            postgresql_ops={"metadata": "jsonb_path_ops"},
        ),
        # a tenant's stored chat completions (``store: true``), in the order they were made
        Index("ix_requests_stored", "tenant", "created_at", "id", postgresql_where=text("stored")),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), server_default="default")
    api_key_id: Mapped[str | None] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(8))
    model: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    dispatched_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    first_token_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    state: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    total_tokens: Mapped[int] = mapped_column(Integer)
    wasted_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    # the cost of recovery: times another worker continued it after its worker was lost
    # / after a stopping worker handed it over; prompt + logged tokens prefilled again
    takeovers: Mapped[int] = mapped_column(Integer, server_default="0")
    handovers: Mapped[int] = mapped_column(Integer, server_default="0")
    reprefill_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    error_code: Mapped[str | None] = mapped_column(String(64))
    end_user: Mapped[str | None] = mapped_column(String(256))  # the request's ``user``
    worker_id: Mapped[str | None] = mapped_column(Text)
    last_event_id: Mapped[str | None] = mapped_column(String(48))
    recorded_ms: Mapped[int] = mapped_column(BigInteger)  # when the row was written (ms)
    # the request's ``metadata`` (<= 16 string pairs); the client asked ``store: true``
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB)
    stored: Mapped[bool] = mapped_column(Boolean, server_default="false")


class ArchiveRow(Base):
    """A finished request's whole log (ids, timestamps, payloads), zlib-compressed msgpack."""

    __tablename__ = "archives"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), server_default="default", index=True)
    ended_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), index=True)
    events: Mapped[int] = mapped_column(Integer)
    raw_bytes: Mapped[int] = mapped_column(Integer)  # size before compression
    data: Mapped[bytes] = mapped_column(LargeBinary)


class TenantRow(Base):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    # keep every request's input for audit, whatever ``store`` says (migration 0007)
    keep_inputs: Mapped[bool] = mapped_column(Boolean, server_default="false")
    created_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )


class ApiKeyRow(Base):
    """An API key: its public id, its tenant, and a SHA-256 of its secret."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16), server_default="user")
    models: Mapped[str | None] = mapped_column(Text)  # comma-separated; NULL: every model
    created_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    # the key's tenant keeps every request's input (read with the key: one query)
    keep_inputs: Mapped[bool] = column_property(
        select(TenantRow.keep_inputs)
        .where(TenantRow.name == tenant)
        .scalar_subquery()
        .label("keep_inputs")
    )
