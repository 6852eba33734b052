"""Operators' audit: stored chat completions and the console's filters

- ``requests.metadata`` (JSONB): the request's ``metadata`` (OpenAI's: <= 16 string
  pairs), updatable through ``POST /v1/chat/completions/{id}``;
- ``requests.stored``: the client asked for ``store: true`` (its tenant's stored-completions
  list shows it); ``DELETE /v1/chat/completions/{id}`` clears it with the archive;
- ``tenants.keep_inputs``: keep every request's input of this tenant for audit;
- the indexes the console's filters and keyset paging use: each filter column followed by
  ``(ended_at, id)``, so a filtered page newest first is one index range scan.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# (index name, leading column): each followed by ended_at, id
FILTERED = (
    ("ix_requests_tenant_ended", "tenant"),
    ("ix_requests_key_ended", "api_key_id"),
    ("ix_requests_user_ended", "end_user"),
    ("ix_requests_model_ended", "model"),
    ("ix_requests_state_ended", "state"),
    ("ix_requests_error_ended", "error_code"),
    ("ix_requests_finish_ended", "finish_reason"),
)


def upgrade() -> None:
    op.add_column("requests", sa.Column("metadata", postgresql.JSONB(), nullable=True))
    op.add_column(
        "requests", sa.Column("stored", sa.Boolean(), nullable=False, server_default="false")
    )
    op.add_column(
        "tenants", sa.Column("keep_inputs", sa.Boolean(), nullable=False, server_default="false")
    )
    op.create_index("ix_requests_ended_id", "requests", ["ended_at", "id"])
    for name, column in FILTERED:
        op.create_index(name, "requests", [column, "ended_at", "id"])
    op.create_index(
        "ix_requests_metadata",
        "requests",
        ["metadata"],
        postgresql_using="gin",
        postgresql_ops={"metadata": "jsonb_path_ops"},
    )
    op.create_index(
        "ix_requests_stored",
        "requests",
        ["tenant", "created_at", "id"],
        postgresql_where=sa.text("stored"),
    )
    # the plain ended_at and tenant indexes are prefixes of the new ones
    op.drop_index("ix_requests_ended_at", table_name="requests")
    op.drop_index("ix_requests_tenant", table_name="requests")


def downgrade() -> None:
    op.create_index("ix_requests_ended_at", "requests", ["ended_at"])
    op.create_index("ix_requests_tenant", "requests", ["tenant"])
    op.drop_index("ix_requests_stored", table_name="requests")
    op.drop_index("ix_requests_metadata", table_name="requests")
    for name, _ in FILTERED:
        op.drop_index(name, table_name="requests")
    op.drop_index("ix_requests_ended_id", table_name="requests")
    op.drop_column("tenants", "keep_inputs")
    op.drop_column("requests", "stored")
    op.drop_column("requests", "metadata")
