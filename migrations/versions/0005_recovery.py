"""requests.takeovers, handovers, reprefill_tokens: what continuing a request on another
worker cost (apart from its usage)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

COLUMNS = ("takeovers", "handovers", "reprefill_tokens")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("requests", sa.Column(name, sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    for name in reversed(COLUMNS):
        op.drop_column("requests", name)
