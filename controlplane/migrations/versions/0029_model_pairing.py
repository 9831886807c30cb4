"""model: the cloud model an edge model escalates to (``tierline models pair``) and how requests are resent

Revision ID: 0029_model_pairing
Revises: 0028_shadow_token_share
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0029_model_pairing"
down_revision: str | None = "0028_shadow_token_share"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("model", sa.Column("cloud_model", sa.String(length=128), nullable=True))
    op.add_column("model", sa.Column("resend", sa.String(length=16), nullable=True))


def downgrade() -> None:
    op.drop_column("model", "resend")  # plain DROP COLUMNs: no batch rebuild (see 0026)
    op.drop_column("model", "cloud_model")
