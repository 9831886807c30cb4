"""escalation policies as signed, versioned registry objects; release targets; the policy each device runs

Revision ID: 0022_escalation_policies
Revises: 0021_prepaid_credit
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0022_escalation_policies"
down_revision: str | None = "0021_prepaid_credit"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "escalation_policy",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("signal", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=False),
        sa.Column("max_quality_loss", sa.Float(), nullable=False),
        sa.Column("policy", sa.JSON(), nullable=False),
        sa.Column("data_sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("data_items", sa.Integer(), nullable=False),
        sa.Column("target", sa.JSON(), nullable=False),
        sa.Column("derived_from", sa.Integer(), nullable=True),
        sa.Column("signature", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("key_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_escalation_policy")),
        sa.UniqueConstraint("model", "version", name=op.f("uq_escalation_policy_model")),
    )
    op.create_index(op.f("ix_escalation_policy_model"), "escalation_policy", ["model"], unique=False)
    op.create_table(
        "release_target",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("version", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("target", sa.JSON(), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_release_target")),
        sa.UniqueConstraint("name", "version", name=op.f("uq_release_target_name")),
    )
    with op.batch_alter_table("device") as batch:
        batch.add_column(sa.Column("policies", sa.JSON(), nullable=False, server_default="{}"))
    with op.batch_alter_table("device") as batch:
        batch.alter_column("policies", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("device") as batch:
        batch.drop_column("policies")
    op.drop_table("release_target")
    op.drop_index(op.f("ix_escalation_policy_model"), table_name="escalation_policy")
    op.drop_table("escalation_policy")
