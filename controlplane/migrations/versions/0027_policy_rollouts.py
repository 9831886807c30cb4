"""policy rollouts: a rollout's kind (a model version or an escalation policy version)

Revision ID: 0027_policy_rollouts
Revises: 0026_quality_monitor
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0027_policy_rollouts"
down_revision: str | None = "0026_quality_monitor"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rollout") as batch_op:
        batch_op.add_column(
            sa.Column("kind", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False, server_default="model")
        )


def downgrade() -> None:
    with op.batch_alter_table("rollout") as batch_op:
        batch_op.drop_column("kind")
