"""per-tenant and per-key rate limits

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


def upgrade() -> None:
    for table in ("tenant", "api_key"):
        with op.batch_alter_table(table) as batch:
            for name in COLUMNS:
                batch.add_column(sa.Column(name, sa.Integer(), nullable=True))


def downgrade() -> None:
    for table in ("tenant", "api_key"):
        with op.batch_alter_table(table) as batch:
            for name in reversed(COLUMNS):
                batch.drop_column(name)
