"""price book, budget periods, rating stamped on usage records

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_S = sqlmodel.sql.sqltypes.AutoString
_MONEY = sa.Numeric(18, 6)


def upgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.add_column(sa.Column("price_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("cost", _MONEY, nullable=True))
    op.create_table(
        "price",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", _S(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("tier", _S(length=8), nullable=True),
        sa.Column("currency", _S(length=3), nullable=False),
        sa.Column("prompt_per_mtok", _MONEY, nullable=False),
        sa.Column("completion_per_mtok", _MONEY, nullable=False),
        sa.Column("cached_per_mtok", _MONEY, nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_price")),
    )
    with op.batch_alter_table("price") as batch:
        batch.create_index(batch.f("ix_price_model"), ["model"], unique=False)
    op.create_table(
        "budget_period",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("period", _S(length=7), nullable=False),
        sa.Column("spent", _MONEY, nullable=False),
        sa.Column("reserved", _MONEY, nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_budget_period_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("tenant_id", "period", name=op.f("pk_budget_period")),
    )


def downgrade() -> None:
    op.drop_table("budget_period")
    op.drop_table("price")
    with op.batch_alter_table("usage_record") as batch:
        batch.drop_column("cost")
        batch.drop_column("price_id")
