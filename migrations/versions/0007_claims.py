"""claims (issue 20): a trial's effective configuration, its place in the interleaved confirmation
and its KL divergence; a recommendation's claims (ratios with intervals, the A/A noise)

Revision ID: 0007_claims
Revises: 0006_rollout_lease
Create Date: 2026-12-01 11:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_claims"
down_revision = "0006_rollout_lease"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_trials") as batch:
        batch.add_column(sa.Column("effective", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("confirm_round", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("confirm_arm", sa.String(40), nullable=True))
        batch.add_column(sa.Column("kl_divergence", sa.Float(), nullable=True))
    with op.batch_alter_table("ft_recommendations") as batch:
        batch.add_column(sa.Column("claims", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_recommendations") as batch:
        batch.drop_column("claims")
    with op.batch_alter_table("ft_trials") as batch:
        batch.drop_column("kl_divergence")
        batch.drop_column("confirm_arm")
        batch.drop_column("confirm_round")
        batch.drop_column("effective")
