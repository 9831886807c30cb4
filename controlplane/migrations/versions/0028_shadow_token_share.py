"""shadow samples: an LM sample's token agreement (the share of the edge's tokens the cloud chose too)

Revision ID: 0028_shadow_token_share
Revises: 0027_policy_rollouts
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028_shadow_token_share"
down_revision: str | None = "0027_policy_rollouts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("shadow_sample", sa.Column("token_agreement", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("shadow_sample", "token_agreement")  # a plain DROP COLUMN: no batch rebuild (see 0026)
