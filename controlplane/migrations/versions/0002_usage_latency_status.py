"""usage records: status, latency, time to first token, rollout arm

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.add_column(
            sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False, server_default="ok")
        )
        batch.add_column(sa.Column("latency_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("ttft_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("rollout_arm", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.drop_column("rollout_arm")
        batch.drop_column("ttft_ms")
        batch.drop_column("latency_ms")
        batch.drop_column("status")
