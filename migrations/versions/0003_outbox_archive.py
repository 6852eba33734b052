"""billing columns (tenant, api key, dispatched_at) and the log archive

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "requests", sa.Column("tenant", sa.String(128), server_default="default", nullable=False)
    )
    op.add_column("requests", sa.Column("api_key_id", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(op.f("ix_requests_tenant"), "requests", ["tenant"])
    op.create_table(
        "archives",
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), server_default="default", nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.Column("raw_bytes", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_archives")),
    )
    op.create_index(op.f("ix_archives_tenant"), "archives", ["tenant"])
    op.create_index(op.f("ix_archives_ended_at"), "archives", ["ended_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_archives_ended_at"), table_name="archives")
    op.drop_index(op.f("ix_archives_tenant"), table_name="archives")
    op.drop_table("archives")
    op.drop_index(op.f("ix_requests_tenant"), table_name="requests")
    op.drop_column("requests", "dispatched_at")
    op.drop_column("requests", "api_key_id")
    op.drop_column("requests", "tenant")
