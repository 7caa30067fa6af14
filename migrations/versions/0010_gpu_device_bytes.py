"""gpu_device_bytes (issue 23.1): a trial's process as NVIDIA's driver counts it at the peak, the
CUDA context included (nvidia-smi), beside llama.cpp's own buffers (gpu_bytes)

Revision ID: 0010_gpu_device_bytes
Revises: 0009_served
Create Date: 2026-12-02 17:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_gpu_device_bytes"
down_revision = "0009_served"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_trials") as batch:
        batch.add_column(sa.Column("gpu_device_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_trials") as batch:
        batch.drop_column("gpu_device_bytes")
