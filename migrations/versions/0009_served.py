"""served trials (issue 22.1): a study's served workload, every served request, each trial's levels

Revision ID: 0009_served
Revises: 0008_gpu_bytes
Create Date: 2026-12-01 19:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_served"
down_revision = "0008_gpu_bytes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_studies") as batch:
        batch.add_column(sa.Column("served", sa.JSON(), nullable=True))
    with op.batch_alter_table("ft_trials") as batch:
        batch.add_column(sa.Column("served", sa.JSON(), nullable=True))
    op.create_table(
        "ft_served_requests",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("ft_trials.id", ondelete="CASCADE"), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("users", sa.Integer(), nullable=True),
        sa.Column("start_s", sa.Float(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("gen_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("e2e_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("warmup", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_ft_served_requests_trial_id", "ft_served_requests", ["trial_id"])


def downgrade() -> None:
    op.drop_index("ix_ft_served_requests_trial_id", table_name="ft_served_requests")
    op.drop_table("ft_served_requests")
    with op.batch_alter_table("ft_trials") as batch:
        batch.drop_column("served")
    with op.batch_alter_table("ft_studies") as batch:
        batch.drop_column("served")
