"""rollout lease: one driver of a model's rollouts at a time (start, resume, rollback), with a heartbeat

Revision ID: 0006_rollout_lease
Revises: 0005_depth
Create Date: 2026-12-01 11:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_rollout_lease"
down_revision = "0005_depth"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_models") as batch:
        batch.add_column(sa.Column("rollout_lease_owner", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("rollout_lease_heartbeat", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_models") as batch:
        batch.drop_column("rollout_lease_heartbeat")
        batch.drop_column("rollout_lease_owner")
