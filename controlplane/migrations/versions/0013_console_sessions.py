"""console sessions kept on the server (revocable); sign-in attempts counted in the database

Revision ID: 0013_console_sessions
Revises: 0012
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0013_console_sessions"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "console_session",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("client", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("user_agent", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["console_user.id"], name=op.f("fk_console_session_user_id_console_user")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_console_session")),
        sa.UniqueConstraint("session_hash", name=op.f("uq_console_session_session_hash")),
    )
    with op.batch_alter_table("console_session", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_console_session_user_id"), ["user_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_console_session_expires_at"), ["expires_at"], unique=False)

    op.create_table(
        "console_login_attempt",
        sa.Column("key", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_console_login_attempt")),
    )
    with op.batch_alter_table("console_login_attempt", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_console_login_attempt_window_start"), ["window_start"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("console_login_attempt", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_console_login_attempt_window_start"))
    op.drop_table("console_login_attempt")
    with op.batch_alter_table("console_session", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_console_session_expires_at"))
        batch_op.drop_index(batch_op.f("ix_console_session_user_id"))
    op.drop_table("console_session")
