"""usage_quarantine: device usage records beyond what the device could have done (stored, never billed)

Revision ID: 0030_usage_quarantine
Revises: 0029_model_pairing
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0030_usage_quarantine"
down_revision: str | None = "0029_model_pairing"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage_quarantine",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("model_version", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("tier", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sqlmodel.sql.sqltypes.AutoString(length=300), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_usage_quarantine_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_quarantine")),
    )
    op.create_index("ix_usage_quarantine_tenant_time", "usage_quarantine", ["tenant_id", "received_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_quarantine_tenant_time", table_name="usage_quarantine")
    op.drop_table("usage_quarantine")
