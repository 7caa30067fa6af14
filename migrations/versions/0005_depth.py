"""depth: a study's workload is (prompt, generated, depth); a recommendation keeps every baseline

Revision ID: 0005_depth
Revises: 0004_serve
Create Date: 2026-11-30 11:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_depth"
down_revision = "0004_serve"
branch_labels = None
depends_on = None

OLD_KEY = ["chip_id", "model_id", "objective", "n_prompt", "n_gen", "version"]
NEW_KEY = ["chip_id", "model_id", "objective", "n_prompt", "n_gen", "depth", "version"]


def upgrade() -> None:
    with op.batch_alter_table("ft_studies") as batch:
        batch.add_column(sa.Column("depth", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("ft_recommendations") as batch:
        batch.add_column(sa.Column("depth", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("baselines", sa.JSON(), nullable=True))
        batch.drop_constraint("uq_ft_recommendations_chip_id", type_="unique")
        batch.create_unique_constraint("uq_ft_recommendations_chip_id", NEW_KEY)


def downgrade() -> None:
    with op.batch_alter_table("ft_recommendations") as batch:
        batch.drop_constraint("uq_ft_recommendations_chip_id", type_="unique")
        batch.create_unique_constraint("uq_ft_recommendations_chip_id", OLD_KEY)
        batch.drop_column("baselines")
        batch.drop_column("depth")
    with op.batch_alter_table("ft_studies") as batch:
        batch.drop_column("depth")
