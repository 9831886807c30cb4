"""prepaid credit: a balance per tenant, its append-only entries, holds on it, credit used on invoices

Revision ID: 0021_prepaid_credit
Revises: 0020_price_plans
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0021_prepaid_credit"
down_revision: str | None = "0020_price_plans"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "credit_account",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("balance", sa.BigInteger(), nullable=False),
        sa.Column("reserved", sa.BigInteger(), nullable=False),
        sa.Column("low_balance", sa.BigInteger(), nullable=True),
        sa.Column("low_alerted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_credit_account_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_credit_account")),
    )
    op.create_table(
        "credit_entry",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("kind", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("period", sqlmodel.sql.sqltypes.AutoString(length=7), nullable=False),
        sa.Column("reference", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("note", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_credit_entry_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_credit_entry")),
    )
    op.create_index("ix_credit_entry_tenant_period", "credit_entry", ["tenant_id", "period"], unique=False)
    with op.batch_alter_table("budget_reservation") as batch:
        batch.add_column(sa.Column("on_credit", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("budget_reservation") as batch:
        batch.alter_column("on_credit", server_default=None)
    with op.batch_alter_table("invoice") as batch:
        batch.add_column(
            sa.Column("credit_used", sa.Numeric(precision=18, scale=6), nullable=False, server_default="0")
        )
    with op.batch_alter_table("invoice") as batch:
        batch.alter_column("credit_used", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("invoice") as batch:
        batch.drop_column("credit_used")
    with op.batch_alter_table("budget_reservation") as batch:
        batch.drop_column("on_credit")
    op.drop_index("ix_credit_entry_tenant_period", table_name="credit_entry")
    op.drop_table("credit_entry")
    op.drop_table("credit_account")
