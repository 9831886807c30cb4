"""model versions: a serving spec (an ``openai`` backend answers the version instead of the built-in engine)

Revision ID: 0023_version_serving
Revises: 0022_escalation_policies
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023_version_serving"
down_revision: str | None = "0022_escalation_policies"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("model_version") as batch:
        batch.add_column(sa.Column("serving", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("model_version") as batch:
        batch.drop_column("serving")
