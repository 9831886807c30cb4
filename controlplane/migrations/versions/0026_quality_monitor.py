"""live quality monitor: shadow samples, quality alerts, a tenant's shadow share

Revision ID: 0026_quality_monitor
Revises: 0025_edge_release_log
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0026_quality_monitor"
down_revision: str | None = "0025_edge_release_log"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "shadow_sample",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("usage_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("device_group", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("agrees", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_shadow_sample_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_shadow_sample")),
    )
    op.create_index(op.f("ix_shadow_sample_usage_id"), "shadow_sample", ["usage_id"], unique=False)
    op.create_index("ix_shadow_sample_group", "shadow_sample", ["model", "policy_version", "device_group"])
    op.create_table(
        "quality_alert",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("device_group", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        sa.Column("num_agreements", sa.Integer(), nullable=False),
        sa.Column("upper_bound", sa.Float(), nullable=False),
        sa.Column("promised", sa.Float(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("proposed_threshold", sa.Float(), nullable=True),
        sa.Column("proposed_policy", sa.JSON(), nullable=True),
        sa.Column("accepted_version", sa.Integer(), nullable=True),
        sa.Column("resolved_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quality_alert")),
    )
    op.create_index(op.f("ix_quality_alert_model"), "quality_alert", ["model"], unique=False)
    with op.batch_alter_table("tenant") as batch:
        batch.add_column(sa.Column("shadow_share", sa.Float(), nullable=True))


def downgrade() -> None:
    # A plain ALTER TABLE ... DROP COLUMN (SQLite has it since 3.35): a batch rebuild would drop and recreate the
    # tenant table, which SQLite refuses while other tables' rows reference it (foreign keys are on).
    op.drop_column("tenant", "shadow_share")
    op.drop_index(op.f("ix_quality_alert_model"), table_name="quality_alert")
    op.drop_table("quality_alert")
    op.drop_index("ix_shadow_sample_group", table_name="shadow_sample")
    op.drop_index(op.f("ix_shadow_sample_usage_id"), table_name="shadow_sample")
    op.drop_table("shadow_sample")
