"""budget reservations with leases; tenant webhook URL; webhook deliveries for tenant events

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "budget_reservation",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("period", sqlmodel.sql.sqltypes.AutoString(length=7), nullable=False),
        sa.Column("amount", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_budget_reservation_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_reservation")),
    )
    with op.batch_alter_table("budget_reservation", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_budget_reservation_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_budget_reservation_expires_at"), ["expires_at"], unique=False)

    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_url", sqlmodel.sql.sqltypes.AutoString(length=2048), nullable=True))

    with op.batch_alter_table("webhook_delivery", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "event",
                sqlmodel.sql.sqltypes.AutoString(length=32),
                nullable=False,
                server_default="job.completed",
            )
        )
        batch_op.add_column(sa.Column("payload", sa.JSON(), nullable=True))
        batch_op.alter_column("job_id", existing_type=sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True)
    with op.batch_alter_table("webhook_delivery", schema=None) as batch_op:
        batch_op.alter_column("event", server_default=None)


def downgrade() -> None:
    op.execute(
        "DELETE FROM webhook_attempt WHERE delivery_id IN (SELECT id FROM webhook_delivery WHERE job_id IS NULL)"
    )
    op.execute("DELETE FROM webhook_delivery WHERE job_id IS NULL")
    with op.batch_alter_table("webhook_delivery", schema=None) as batch_op:
        batch_op.alter_column("job_id", existing_type=sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False)
        batch_op.drop_column("payload")
        batch_op.drop_column("event")

    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.drop_column("webhook_url")

    with op.batch_alter_table("budget_reservation", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_budget_reservation_expires_at"))
        batch_op.drop_index(batch_op.f("ix_budget_reservation_tenant_id"))
    op.drop_table("budget_reservation")
