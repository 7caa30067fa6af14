"""rollouts: a rollout's plan and verdict, and each node's applied configuration

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 15:25:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_rollouts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("objective", sa.String(length=10), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("canary_share", sa.Float(), nullable=False),
        sa.Column("tolerance", sa.Float(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["ft_models.id"], name=op.f("fk_ft_rollouts_model_id_ft_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_rollouts")),
    )
    op.create_table(
        "ft_rollout_nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("ray_node_id", sa.String(length=64), nullable=False),
        sa.Column("chip_key", sa.String(length=120), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("previous", sa.JSON(), nullable=True),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("measured_tps", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["rollout_id"], ["ft_rollouts.id"],
                                name=op.f("fk_ft_rollout_nodes_rollout_id_ft_rollouts"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_rollout_nodes")),
    )
    op.create_index(op.f("ix_ft_rollout_nodes_rollout_id"), "ft_rollout_nodes", ["rollout_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_ft_rollout_nodes_rollout_id"), table_name="ft_rollout_nodes")
    op.drop_table("ft_rollout_nodes")
    op.drop_table("ft_rollouts")
