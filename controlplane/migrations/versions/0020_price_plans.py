"""price plans: named, versioned sets of prices; tenants on a plan from a moment on; per-tenant overrides

The single price book becomes the plan named ``default``: every existing price moves into it.

Revision ID: 0020_price_plans
Revises: 0019_scoped_budgets
Create Date: 2026-12-02
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0020_price_plans"
down_revision: str | None = "0019_scoped_budgets"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    plan = op.create_table(
        "price_plan",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("description", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_price_plan")),
        sa.UniqueConstraint("name", name=op.f("uq_price_plan_name")),
    )
    op.create_table(
        "tenant_plan",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_tenant_plan_tenant_id_tenant")),
        sa.ForeignKeyConstraint(["plan_id"], ["price_plan.id"], name=op.f("fk_tenant_plan_plan_id_price_plan")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenant_plan")),
    )
    op.create_index("ix_tenant_plan_tenant_from", "tenant_plan", ["tenant_id", "effective_from"], unique=False)
    with op.batch_alter_table("price") as batch:
        batch.add_column(sa.Column("per_call", sa.Numeric(precision=18, scale=6), nullable=False, server_default="0"))
        batch.add_column(sa.Column("plan_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tenant_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(batch.f("fk_price_plan_id_price_plan"), "price_plan", ["plan_id"], ["id"])
        batch.create_foreign_key(batch.f("fk_price_tenant_id_tenant"), "tenant", ["tenant_id"], ["id"])
        batch.create_index(batch.f("ix_price_plan_id"), ["plan_id"], unique=False)
        batch.create_index(batch.f("ix_price_tenant_id"), ["tenant_id"], unique=False)
    with op.batch_alter_table("price") as batch:
        batch.alter_column("per_call", server_default=None)
    with op.batch_alter_table("invoice") as batch:
        batch.add_column(sa.Column("plan", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))

    op.bulk_insert(
        plan, [{"name": "default", "description": "the price book every tenant on no plan pays", "created_at": datetime.now(UTC)}]
    )
    op.execute("UPDATE price SET plan_id = (SELECT id FROM price_plan WHERE name = 'default') WHERE tenant_id IS NULL")


def downgrade() -> None:
    with op.batch_alter_table("invoice") as batch:
        batch.drop_column("plan")
    op.execute("DELETE FROM price WHERE tenant_id IS NOT NULL")
    op.execute(
        "DELETE FROM price WHERE plan_id IS NOT NULL AND plan_id <> (SELECT id FROM price_plan WHERE name = 'default')"
    )
    with op.batch_alter_table("price") as batch:
        batch.drop_index(batch.f("ix_price_tenant_id"))
        batch.drop_index(batch.f("ix_price_plan_id"))
        batch.drop_constraint(batch.f("fk_price_tenant_id_tenant"), type_="foreignkey")
        batch.drop_constraint(batch.f("fk_price_plan_id_price_plan"), type_="foreignkey")
        batch.drop_column("tenant_id")
        batch.drop_column("plan_id")
        batch.drop_column("per_call")
    op.drop_index("ix_tenant_plan_tenant_from", table_name="tenant_plan")
    op.drop_table("tenant_plan")
    op.drop_table("price_plan")
