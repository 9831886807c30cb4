"""edge releases in the database: each published version's manifest and the publish log

Revision ID: 0025_edge_release_log
Revises: 0024_tensor_row_prices
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0025_edge_release_log"
down_revision: str | None = "0024_tensor_row_prices"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "edge_release",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("version", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("manifest", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_edge_release")),
        sa.UniqueConstraint("name", "version", name=op.f("uq_edge_release_name")),
    )
    op.create_table(
        "edge_publish",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("version", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_edge_publish")),
    )
    op.create_index(op.f("ix_edge_publish_name"), "edge_publish", ["name"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_edge_publish_name"), table_name="edge_publish")
    op.drop_table("edge_publish")
    op.drop_table("edge_release")
