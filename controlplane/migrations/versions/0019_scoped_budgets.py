"""budgets per API key, project, end user and tenant (day, month, total); projects; keys in a project

Revision ID: 0019_scoped_budgets
Revises: 0018_usage_checkpoints
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0019_scoped_budgets"
down_revision: str | None = "0018_usage_checkpoints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "project",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_project_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_project")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_project_tenant_id")),
    )
    with op.batch_alter_table("project") as batch:
        batch.create_index(batch.f("ix_project_tenant_id"), ["tenant_id"], unique=False)

    with op.batch_alter_table("api_key") as batch:
        batch.add_column(sa.Column("project_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(batch.f("fk_api_key_project_id_project"), "project", ["project_id"], ["id"])
        batch.create_index(batch.f("ix_api_key_project_id"), ["project_id"], unique=False)

    op.create_table(
        "budget",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("scope", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("ref", sqlmodel.sql.sqltypes.AutoString(length=256), nullable=False),
        sa.Column("period", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("is_hard", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_budget_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget")),
        sa.UniqueConstraint("tenant_id", "scope", "ref", "period", name=op.f("uq_budget_tenant_id")),
    )
    with op.batch_alter_table("budget") as batch:
        batch.create_index(batch.f("ix_budget_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "budget_window",
        sa.Column("budget_id", sa.Integer(), nullable=False),
        sa.Column("subject", sqlmodel.sql.sqltypes.AutoString(length=256), nullable=False),
        sa.Column("window", sqlmodel.sql.sqltypes.AutoString(length=10), nullable=False),
        sa.Column("spent", sa.BigInteger(), nullable=False),
        sa.Column("reserved", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["budget_id"], ["budget.id"], name=op.f("fk_budget_window_budget_id_budget")),
        sa.PrimaryKeyConstraint("budget_id", "subject", "window", name=op.f("pk_budget_window")),
    )

    with op.batch_alter_table("budget_reservation") as batch:
        batch.add_column(sa.Column("windows", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("budget_reservation") as batch:
        batch.drop_column("windows")
    op.drop_table("budget_window")
    with op.batch_alter_table("budget") as batch:
        batch.drop_index(batch.f("ix_budget_tenant_id"))
    op.drop_table("budget")
    with op.batch_alter_table("api_key") as batch:
        batch.drop_index(batch.f("ix_api_key_project_id"))
        batch.drop_constraint(batch.f("fk_api_key_project_id_project"), type_="foreignkey")
        batch.drop_column("project_id")
    with op.batch_alter_table("project") as batch:
        batch.drop_index(batch.f("ix_project_tenant_id"))
    op.drop_table("project")
