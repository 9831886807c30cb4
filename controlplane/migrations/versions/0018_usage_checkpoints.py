"""usage checkpoints: a streamed request's usage so far, durable before its tokens are sent

Revision ID: 0018_usage_checkpoints
Revises: 0017_usage_source
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0018_usage_checkpoints"
down_revision: str | None = "0017_usage_source"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage_checkpoint",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("device_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=True),
        sa.Column("rollout_arm", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
        sa.Column("escalation_reason", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("reservation_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("period", sqlmodel.sql.sqltypes.AutoString(length=7), nullable=True),
        sa.Column("reserved", sa.Numeric(precision=18, scale=6), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_usage_checkpoint_tenant_id_tenant")),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_key.id"], name=op.f("fk_usage_checkpoint_api_key_id_api_key")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_checkpoint")),
    )
    with op.batch_alter_table("usage_checkpoint", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_usage_checkpoint_expires_at"), ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("usage_checkpoint", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_usage_checkpoint_expires_at"))
    op.drop_table("usage_checkpoint")
