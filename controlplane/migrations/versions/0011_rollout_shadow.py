"""rollout shadow step: the mirrored sample's share and agreement bound on a rollout; shadow samples

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rollout", schema=None) as batch_op:
        batch_op.add_column(sa.Column("shadow_sample", sa.Float(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("shadow_min_agreement", sa.Float(), nullable=False, server_default="0.9"))
    op.create_table(
        "rollout_shadow_sample",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("positions", sa.Integer(), nullable=False),
        sa.Column("matches", sa.Integer(), nullable=False),
        sa.Column("agreement", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["rollout_id"], ["rollout.id"], name=op.f("fk_rollout_shadow_sample_rollout_id_rollout")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_shadow_sample")),
    )
    with op.batch_alter_table("rollout_shadow_sample", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rollout_shadow_sample_rollout_id"), ["rollout_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("rollout_shadow_sample", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollout_shadow_sample_rollout_id"))
    op.drop_table("rollout_shadow_sample")
    with op.batch_alter_table("rollout", schema=None) as batch_op:
        batch_op.drop_column("shadow_min_agreement")
        batch_op.drop_column("shadow_sample")
