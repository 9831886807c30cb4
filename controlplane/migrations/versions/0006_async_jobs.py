"""async jobs and webhooks: jobs, tenants' webhook secrets, webhook deliveries and their attempts

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_S = sqlmodel.sql.sqltypes.AutoString
_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "job",
        sa.Column("id", _S(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("endpoint", _S(length=32), nullable=False),
        sa.Column("model", _S(length=256), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("status", _S(length=16), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("webhook_url", _S(length=2048), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("available_at", _TS, nullable=False),
        sa.Column("started_at", _TS, nullable=True),
        sa.Column("finished_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_job_tenant_id_tenant")),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_key.id"], name=op.f("fk_job_api_key_id_api_key")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job")),
    )
    with op.batch_alter_table("job") as batch:
        batch.create_index("ix_job_tenant_created", ["tenant_id", "created_at"], unique=False)
        batch.create_index("ix_job_status_available", ["status", "available_at"], unique=False)
    op.create_table(
        "webhook_secret",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("secret", _S(length=128), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_webhook_secret_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_webhook_secret")),
    )
    op.create_table(
        "webhook_delivery",
        sa.Column("id", _S(length=64), nullable=False),
        sa.Column("job_id", _S(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("url", _S(length=2048), nullable=False),
        sa.Column("status", _S(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("available_at", _TS, nullable=False),
        sa.Column("finished_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], name=op.f("fk_webhook_delivery_job_id_job")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_webhook_delivery_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_delivery")),
        sa.UniqueConstraint("job_id", name=op.f("uq_webhook_delivery_job_id")),
    )
    with op.batch_alter_table("webhook_delivery") as batch:
        batch.create_index(batch.f("ix_webhook_delivery_tenant_id"), ["tenant_id"], unique=False)
        batch.create_index("ix_webhook_delivery_status_available", ["status", "available_at"], unique=False)
    op.create_table(
        "webhook_attempt",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("delivery_id", _S(length=64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", _S(length=500), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=True),
        sa.Column("at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["delivery_id"], ["webhook_delivery.id"], name=op.f("fk_webhook_attempt_delivery_id_webhook_delivery")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_attempt")),
    )
    with op.batch_alter_table("webhook_attempt") as batch:
        batch.create_index(batch.f("ix_webhook_attempt_delivery_id"), ["delivery_id"], unique=False)


def downgrade() -> None:
    op.drop_table("webhook_attempt")
    op.drop_table("webhook_delivery")
    op.drop_table("webhook_secret")
    op.drop_table("job")
