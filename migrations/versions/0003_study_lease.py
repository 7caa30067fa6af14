"""study lease (one driver per study, with a heartbeat), the source file of imported studies,
and a failed trial's kind

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 07:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_studies") as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("lease_heartbeat", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("source_sha256", sa.String(length=64), nullable=True))
        batch.create_index(batch.f("ix_ft_studies_source_sha256"), ["source_sha256"], unique=False)
    with op.batch_alter_table("ft_trials") as batch:
        batch.add_column(sa.Column("failure_kind", sa.String(length=20), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_trials") as batch:
        batch.drop_column("failure_kind")
    with op.batch_alter_table("ft_studies") as batch:
        batch.drop_index(batch.f("ix_ft_studies_source_sha256"))
        batch.drop_column("source_sha256")
        batch.drop_column("lease_heartbeat")
        batch.drop_column("lease_owner")
