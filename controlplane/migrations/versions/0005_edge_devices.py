"""edge devices: enrollment tokens, device state, device events, escalation reason on usage

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_S = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.add_column(sa.Column("escalation_reason", _S(length=32), nullable=True))
    with op.batch_alter_table("device") as batch:
        batch.add_column(sa.Column("name", _S(length=128), nullable=False, server_default=""))
        batch.add_column(sa.Column("status", _S(length=16), nullable=False, server_default="active"))
        batch.add_column(sa.Column("runtime", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("versions", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("metrics", sa.JSON(), nullable=False, server_default="{}"))
    op.create_table(
        "enrollment_token",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("token_hash", _S(length=128), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("device_id", _S(length=64), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_enrollment_token_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_enrollment_token")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_enrollment_token_token_hash")),
    )
    with op.batch_alter_table("enrollment_token") as batch:
        batch.create_index(batch.f("ix_enrollment_token_tenant_id"), ["tenant_id"], unique=False)
    op.create_table(
        "device_event",
        sa.Column("id", _S(length=64), nullable=False),
        sa.Column("device_id", _S(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("kind", _S(length=16), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ingested_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["device.id"], name=op.f("fk_device_event_device_id_device")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_device_event_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_device_event")),
    )
    with op.batch_alter_table("device_event") as batch:
        batch.create_index(batch.f("ix_device_event_device_id"), ["device_id"], unique=False)
        batch.create_index(batch.f("ix_device_event_tenant_id"), ["tenant_id"], unique=False)


def downgrade() -> None:
    op.drop_table("device_event")
    op.drop_table("enrollment_token")
    with op.batch_alter_table("device") as batch:
        for column in ("metrics", "versions", "runtime", "status", "name"):
            batch.drop_column(column)
    with op.batch_alter_table("usage_record") as batch:
        batch.drop_column("escalation_reason")
