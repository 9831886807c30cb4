"""usage records: the source's own time of a record booked at a clamped time

Revision ID: 0016_usage_namespaces
Revises: 0015_money_micros
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016_usage_namespaces"
down_revision: str | None = "0015_money_micros"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.add_column(sa.Column("reported_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.drop_column("reported_at")
