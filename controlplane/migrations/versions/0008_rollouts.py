"""rollouts: rollouts, their events and pins; console API tokens

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-08
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_S = sqlmodel.sql.sqltypes.AutoString
_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "rollout",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("model", _S(length=128), nullable=False),
        sa.Column("baseline_version", _S(length=64), nullable=False),
        sa.Column("candidate_version", _S(length=64), nullable=False),
        sa.Column("scope", _S(length=8), nullable=False),
        sa.Column("device_selector", sa.JSON(), nullable=False),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("status", _S(length=16), nullable=False),
        sa.Column("min_step_s", sa.Float(), nullable=False),
        sa.Column("min_samples", sa.Integer(), nullable=False),
        sa.Column("checks", sa.JSON(), nullable=False),
        sa.Column("last_analysis", sa.JSON(), nullable=True),
        sa.Column("created_by", _S(length=128), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("step_started_at", _TS, nullable=True),
        sa.Column("finished_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name=op.f("fk_rollout_tenant_id_tenant")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout")),
    )
    with op.batch_alter_table("rollout") as batch:
        batch.create_index("ix_rollout_model_status", ["model", "status"], unique=False)
    op.create_table(
        "rollout_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("at", _TS, nullable=False),
        sa.Column("kind", _S(length=32), nullable=False),
        sa.Column("from_status", _S(length=16), nullable=True),
        sa.Column("to_status", _S(length=16), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("reason", _S(length=2000), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("actor", _S(length=128), nullable=False),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollout.id"], name=op.f("fk_rollout_event_rollout_id_rollout")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_event")),
    )
    with op.batch_alter_table("rollout_event") as batch:
        batch.create_index(batch.f("ix_rollout_event_rollout_id"), ["rollout_id"], unique=False)
    op.create_table(
        "rollout_pin",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("kind", _S(length=8), nullable=False),
        sa.Column("key", _S(length=128), nullable=False),
        sa.Column("arm", _S(length=16), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollout.id"], name=op.f("fk_rollout_pin_rollout_id_rollout")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_pin")),
        sa.UniqueConstraint("rollout_id", "kind", "key", name=op.f("uq_rollout_pin_rollout_id")),
    )
    with op.batch_alter_table("rollout_pin") as batch:
        batch.create_index(batch.f("ix_rollout_pin_rollout_id"), ["rollout_id"], unique=False)
    op.create_table(
        "console_token",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("name", _S(length=200), nullable=False),
        sa.Column("prefix", _S(length=16), nullable=False),
        sa.Column("token_hash", _S(length=128), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("revoked_at", _TS, nullable=True),
        sa.Column("last_used_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["console_user.id"], name=op.f("fk_console_token_user_id_console_user")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_console_token")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_console_token_token_hash")),
    )
    with op.batch_alter_table("console_token") as batch:
        batch.create_index(batch.f("ix_console_token_user_id"), ["user_id"], unique=False)


def downgrade() -> None:
    op.drop_table("console_token")
    op.drop_table("rollout_pin")
    op.drop_table("rollout_event")
    op.drop_table("rollout")
