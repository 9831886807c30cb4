"""Idempotency-Key claims hold a lease: claimed_at, and a token fencing the claim's holder

Revision ID: 0014_idempotency_lease
Revises: 0013_console_sessions
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0014_idempotency_lease"
down_revision: str | None = "0013_console_sessions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("idempotent_response", schema=None) as batch_op:
        batch_op.add_column(sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("claim_token", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False, server_default="")
        )
    # A claim left in progress before this revision is as old as its row: a retry takes it over once its lease ends.
    op.execute("UPDATE idempotent_response SET claimed_at = created_at")
    with op.batch_alter_table("idempotent_response", schema=None) as batch_op:
        batch_op.alter_column("claimed_at", existing_type=sa.DateTime(timezone=True), nullable=False)
        batch_op.alter_column("claim_token", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("idempotent_response", schema=None) as batch_op:
        batch_op.drop_column("claim_token")
        batch_op.drop_column("claimed_at")
