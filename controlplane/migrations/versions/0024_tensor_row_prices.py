"""tensor row prices: a fee per input row on prices, and the rows a usage record billed

Revision ID: 0024_tensor_row_prices
Revises: 0023_version_serving
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024_tensor_row_prices"
down_revision: str | None = "0023_version_serving"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("price") as batch:
        batch.add_column(sa.Column("per_row", sa.Numeric(precision=18, scale=6), nullable=False, server_default="0"))
    with op.batch_alter_table("price") as batch:
        batch.alter_column("per_row", server_default=None)
    with op.batch_alter_table("usage_record") as batch:  # the default stays: raw inserts that predate it store 0
        batch.add_column(sa.Column("rows", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.drop_column("rows")
    with op.batch_alter_table("price") as batch:
        batch.drop_column("per_row")
