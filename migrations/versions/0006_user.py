"""requests.end_user: the ``user`` a request named (OpenAI's end-user id)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("end_user", sa.String(256), nullable=True))


def downgrade() -> None:
    op.drop_column("requests", "end_user")
