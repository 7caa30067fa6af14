"""serve: write-ahead intent and canary analysis on rollout nodes, a rollout's source (recommendation or pin)

Revision ID: 0004_serve
Revises: 0003
Create Date: 2026-11-30 07:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_serve"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_rollout_nodes") as batch:
        # set once the node's previous config was read and recorded, before the apply (write-ahead)
        batch.add_column(sa.Column("intent_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("analysis", sa.JSON(), nullable=True))
    with op.batch_alter_table("ft_rollouts") as batch:
        batch.add_column(sa.Column("source", sa.String(length=20), nullable=False,
                                   server_default="recommendation"))


def downgrade() -> None:
    with op.batch_alter_table("ft_rollouts") as batch:
        batch.drop_column("source")
    with op.batch_alter_table("ft_rollout_nodes") as batch:
        batch.drop_column("analysis")
        batch.drop_column("intent_at")
