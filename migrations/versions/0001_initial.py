"""initial schema: chips, nodes, models, studies, trials, samples, recommendations

Revision ID: 0001
Revises:
Create Date: 2026-11-29 11:20:11.695938
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_chips",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=120), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("vendor", sa.String(length=40), nullable=True),
        sa.Column("family", sa.String(length=60), nullable=True),
        sa.Column("p_cores", sa.Integer(), nullable=True),
        sa.Column("e_cores", sa.Integer(), nullable=True),
        sa.Column("logical_cores", sa.Integer(), nullable=True),
        sa.Column("gpu_cores", sa.Integer(), nullable=True),
        sa.Column("gpu_name", sa.String(length=200), nullable=True),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("bandwidth_gbs", sa.Float(), nullable=True),
        sa.Column("backend", sa.String(length=20), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_chips")),
        sa.UniqueConstraint("key", name=op.f("uq_ft_chips_key")),
    )
    op.create_table(
        "ft_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("architecture", sa.String(length=60), nullable=False),
        sa.Column("n_layer", sa.Integer(), nullable=False),
        sa.Column("n_params", sa.BigInteger(), nullable=False),
        sa.Column("file_type", sa.String(length=40), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("context_length", sa.Integer(), nullable=True),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("path_mtime", sa.Float(), nullable=True),
        sa.Column("added_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_models")),
        sa.UniqueConstraint("sha256", name=op.f("uq_ft_models_sha256")),
    )
    op.create_table(
        "ft_nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("ray_node_id", sa.String(length=64), nullable=True),
        sa.Column("chip_id", sa.Integer(), nullable=False),
        sa.Column("os", sa.String(length=120), nullable=True),
        sa.Column("llama_build", sa.Text(), nullable=True),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.Column("fingerprint", sa.JSON(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["chip_id"], ["ft_chips.id"], name=op.f("fk_ft_nodes_chip_id_ft_chips")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_nodes")),
        sa.UniqueConstraint("ray_node_id", name=op.f("uq_ft_nodes_ray_node_id")),
    )
    op.create_table(
        "ft_studies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("chip_id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("objective", sa.String(length=10), nullable=False),
        sa.Column("n_prompt", sa.Integer(), nullable=False),
        sa.Column("n_gen", sa.Integer(), nullable=False),
        sa.Column("reps", sa.Integer(), nullable=False),
        sa.Column("sampler", sa.String(length=20), nullable=False),
        sa.Column("budget", sa.Integer(), nullable=False),
        sa.Column("space", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["chip_id"], ["ft_chips.id"], name=op.f("fk_ft_studies_chip_id_ft_chips")
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["ft_models.id"], name=op.f("fk_ft_studies_model_id_ft_models")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_studies")),
        sa.UniqueConstraint("name", name=op.f("uq_ft_studies_name")),
    )
    op.create_table(
        "ft_recommendations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("chip_id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=True),
        sa.Column("objective", sa.String(length=10), nullable=False),
        sa.Column("n_prompt", sa.Integer(), nullable=False),
        sa.Column("n_gen", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("expected_tps", sa.Float(), nullable=False),
        sa.Column("interval_low", sa.Float(), nullable=False),
        sa.Column("interval_high", sa.Float(), nullable=False),
        sa.Column("expected_pp_tps", sa.Float(), nullable=True),
        sa.Column("expected_tg_tps", sa.Float(), nullable=True),
        sa.Column("baseline_tps", sa.Float(), nullable=True),
        sa.Column("improvement", sa.Float(), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.Column("source", sa.String(length=20), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["chip_id"], ["ft_chips.id"], name=op.f("fk_ft_recommendations_chip_id_ft_chips")
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["ft_models.id"], name=op.f("fk_ft_recommendations_model_id_ft_models")
        ),
        sa.ForeignKeyConstraint(
            ["study_id"],
            ["ft_studies.id"],
            name=op.f("fk_ft_recommendations_study_id_ft_studies"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_recommendations")),
        sa.UniqueConstraint(
            "chip_id",
            "model_id",
            "objective",
            "n_prompt",
            "n_gen",
            "version",
            name=op.f("uq_ft_recommendations_chip_id"),
        ),
    )
    op.create_table(
        "ft_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("optuna_number", sa.Integer(), nullable=True),
        sa.Column("node_id", sa.Integer(), nullable=True),
        sa.Column("phase", sa.String(length=20), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("objective_value", sa.Float(), nullable=True),
        sa.Column("pp_tps_median", sa.Float(), nullable=True),
        sa.Column("pp_tps_mean", sa.Float(), nullable=True),
        sa.Column("pp_tps_stddev", sa.Float(), nullable=True),
        sa.Column("pp_cv", sa.Float(), nullable=True),
        sa.Column("tg_tps_median", sa.Float(), nullable=True),
        sa.Column("tg_tps_mean", sa.Float(), nullable=True),
        sa.Column("tg_tps_stddev", sa.Float(), nullable=True),
        sa.Column("tg_cv", sa.Float(), nullable=True),
        sa.Column("e2e_s", sa.Float(), nullable=True),
        sa.Column("load_s", sa.Float(), nullable=True),
        sa.Column("measure_s", sa.Float(), nullable=True),
        sa.Column("peak_rss_bytes", sa.BigInteger(), nullable=True),
        sa.Column("thermal_before", sa.String(length=40), nullable=True),
        sa.Column("thermal_after", sa.String(length=40), nullable=True),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"], ["ft_nodes.id"], name=op.f("fk_ft_trials_node_id_ft_nodes")
        ),
        sa.ForeignKeyConstraint(
            ["study_id"],
            ["ft_studies.id"],
            name=op.f("fk_ft_trials_study_id_ft_studies"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_trials")),
        sa.UniqueConstraint("study_id", "optuna_number", name=op.f("uq_ft_trials_study_id")),
    )
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_ft_trials_study_id"), ["study_id"], unique=False)

    op.create_table(
        "ft_samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=4), nullable=False),
        sa.Column("rep", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_id"],
            ["ft_trials.id"],
            name=op.f("fk_ft_samples_trial_id_ft_trials"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ft_samples")),
    )
    with op.batch_alter_table("ft_samples", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_ft_samples_trial_id"), ["trial_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("ft_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ft_samples_trial_id"))

    op.drop_table("ft_samples")
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ft_trials_study_id"))

    op.drop_table("ft_trials")
    op.drop_table("ft_recommendations")
    op.drop_table("ft_studies")
    op.drop_table("ft_nodes")
    op.drop_table("ft_models")
    op.drop_table("ft_chips")
