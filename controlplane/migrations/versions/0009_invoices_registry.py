"""invoices, credit notes, budget alerts; model aliases and version tags; usage_record.invoice_id

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op


revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "budget_alert",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("period", sqlmodel.sql.sqltypes.AutoString(length=7), nullable=False),
        sa.Column("threshold", sa.Integer(), nullable=False),
        sa.Column("spent", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("budget", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_budget_alert_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_alert")),
        sa.UniqueConstraint("tenant_id", "period", "threshold", name=op.f("uq_budget_alert_tenant_id")),
    )
    with op.batch_alter_table("budget_alert", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_budget_alert_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "invoice",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("period", sqlmodel.sql.sqltypes.AutoString(length=7), nullable=False),
        sa.Column("number", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("currency", sqlmodel.sql.sqltypes.AutoString(length=3), nullable=False),
        sa.Column("subtotal", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("adjustments", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("credits", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("total", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("lines_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finalized_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("voided_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("void_reason", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_invoice_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoice")),
        sa.UniqueConstraint("number", name=op.f("uq_invoice_number")),
    )
    with op.batch_alter_table("invoice", schema=None) as batch_op:
        batch_op.create_index("ix_invoice_tenant_period", ["tenant_id", "period"], unique=False)

    op.create_table(
        "credit_note",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("invoice_id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("number", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("amount", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("currency", sqlmodel.sql.sqltypes.AutoString(length=3), nullable=False),
        sa.Column("reason", sqlmodel.sql.sqltypes.AutoString(length=1000), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["invoice_id"], ["invoice.id"], name=op.f("fk_credit_note_invoice_id_invoice")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_credit_note_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_credit_note")),
        sa.UniqueConstraint("number", name=op.f("uq_credit_note_number")),
    )
    with op.batch_alter_table("credit_note", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_credit_note_invoice_id"), ["invoice_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_credit_note_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "invoice_line",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("invoice_id", sa.Integer(), nullable=False),
        sa.Column("kind", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("usage_period", sqlmodel.sql.sqltypes.AutoString(length=7), nullable=False),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=True),
        sa.Column("tier", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("unpriced_records", sa.Integer(), nullable=False),
        sa.Column("amount", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("description", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=False),
        sa.ForeignKeyConstraint(["invoice_id"], ["invoice.id"], name=op.f("fk_invoice_line_invoice_id_invoice")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoice_line")),
    )
    with op.batch_alter_table("invoice_line", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_invoice_line_invoice_id"), ["invoice_id"], unique=False)

    op.create_table(
        "model_alias",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("updated_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["model.id"], name=op.f("fk_model_alias_model_id_model")),
        sa.ForeignKeyConstraint(
            ["version_id"], ["model_version.id"], name=op.f("fk_model_alias_version_id_model_version")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_alias")),
        sa.UniqueConstraint("model_id", "name", name=op.f("uq_model_alias_model_id")),
    )
    with op.batch_alter_table("model_alias", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_model_alias_model_id"), ["model_id"], unique=False)

    with op.batch_alter_table("model_version", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tags", sa.JSON(), nullable=False, server_default="[]"))

    with op.batch_alter_table("usage_record", schema=None) as batch_op:
        batch_op.add_column(sa.Column("invoice_id", sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f("ix_usage_record_invoice_id"), ["invoice_id"], unique=False)
        batch_op.create_foreign_key(batch_op.f("fk_usage_record_invoice_id_invoice"), "invoice", ["invoice_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("usage_record", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_usage_record_invoice_id_invoice"), type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_usage_record_invoice_id"))
        batch_op.drop_column("invoice_id")

    with op.batch_alter_table("model_version", schema=None) as batch_op:
        batch_op.drop_column("tags")

    with op.batch_alter_table("model_alias", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_model_alias_model_id"))

    op.drop_table("model_alias")
    with op.batch_alter_table("invoice_line", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_invoice_line_invoice_id"))

    op.drop_table("invoice_line")
    with op.batch_alter_table("credit_note", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_credit_note_tenant_id"))
        batch_op.drop_index(batch_op.f("ix_credit_note_invoice_id"))

    op.drop_table("credit_note")
    with op.batch_alter_table("invoice", schema=None) as batch_op:
        batch_op.drop_index("ix_invoice_tenant_period")

    op.drop_table("invoice")
    with op.batch_alter_table("budget_alert", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_budget_alert_tenant_id"))

    op.drop_table("budget_alert")
