"""usage records: who counted the tokens (an upstream model server, or the gateway's tokenizer)

Revision ID: 0017_usage_source
Revises: 0016_usage_namespaces
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017_usage_source"
down_revision: str | None = "0016_usage_namespaces"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.add_column(sa.Column("usage_source", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_record") as batch:
        batch.drop_column("usage_source")
