"""gpu_bytes (issue 23.1): a trial's peak GPU memory, llama.cpp's own buffers on GPU devices

Revision ID: 0008_gpu_bytes
Revises: 0007_claims
Create Date: 2026-12-01 16:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_gpu_bytes"
down_revision = "0007_claims"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_trials") as batch:
        batch.add_column(sa.Column("gpu_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_trials") as batch:
        batch.drop_column("gpu_bytes")
