"""usage records: cost as integer micros (BIGINT), so sums of it are exact on SQLite too

Revision ID: 0015_money_micros
Revises: 0012
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_money_micros"
down_revision: str | None = "0014_idempotency_lease"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MONEY = sa.Numeric(18, 6)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("usage_record", "cost", type_=sa.BigInteger(), postgresql_using="round(cost * 1000000)::bigint")
        return
    # SQLite keeps NUMERIC as a float; rounding recovers the 6-decimal value the column was declared with.
    op.execute("UPDATE usage_record SET cost = CAST(round(cost * 1000000) AS INTEGER) WHERE cost IS NOT NULL")
    with op.batch_alter_table("usage_record") as batch:
        batch.alter_column("cost", type_=sa.BigInteger(), existing_nullable=True)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("usage_record", "cost", type_=_MONEY, postgresql_using="cost::numeric / 1000000")
        return
    with op.batch_alter_table("usage_record") as batch:
        batch.alter_column("cost", type_=_MONEY, existing_nullable=True)
    op.execute("UPDATE usage_record SET cost = cost / 1000000.0 WHERE cost IS NOT NULL")
