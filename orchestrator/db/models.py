"""The results database's tables (SQLAlchemy 2 declarative models).

Schema changes go through Alembic (``migrations/``); these classes and the newest migration must
describe the same schema (a test compares them).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Chip(Base):
    """A kind of machine; nodes with one ``key`` are interchangeable for benchmarking."""

    __tablename__ = "ft_chips"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(120), unique=True)
    name: Mapped[str | None] = mapped_column(String(200))
    vendor: Mapped[str | None] = mapped_column(String(40))
    family: Mapped[str | None] = mapped_column(String(60))
    p_cores: Mapped[int | None] = mapped_column(Integer)
    e_cores: Mapped[int | None] = mapped_column(Integer)
    logical_cores: Mapped[int | None] = mapped_column(Integer)
    gpu_cores: Mapped[int | None] = mapped_column(Integer)
    gpu_name: Mapped[str | None] = mapped_column(String(200))
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    bandwidth_gbs: Mapped[float | None] = mapped_column(Float)
    backend: Mapped[str] = mapped_column(String(20))


class Node(Base):
    """One machine that has run (or can run) trials."""

    __tablename__ = "ft_nodes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    ray_node_id: Mapped[str | None] = mapped_column(String(64), unique=True)
    chip_id: Mapped[int] = mapped_column(ForeignKey("ft_chips.id"))
    os: Mapped[str | None] = mapped_column(String(120))
    llama_build: Mapped[str | None] = mapped_column(Text)
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    fingerprint: Mapped[dict] = mapped_column(JSON)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    chip: Mapped[Chip] = relationship()


class Model(Base):
    """One GGUF file, identified by its sha256."""

    __tablename__ = "ft_models"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    architecture: Mapped[str] = mapped_column(String(60))
    n_layer: Mapped[int] = mapped_column(Integer)
    n_params: Mapped[int] = mapped_column(BigInteger)
    file_type: Mapped[str] = mapped_column(String(40))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    context_length: Mapped[int | None] = mapped_column(Integer)
    path: Mapped[str | None] = mapped_column(Text)
    path_mtime: Mapped[float | None] = mapped_column(Float)
    added_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the one driver of this model's rollouts (start, resume, rollback) and its heartbeat (issue 24.4)
    rollout_lease_owner: Mapped[str | None] = mapped_column(String(64))
    rollout_lease_heartbeat: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Study(Base):
    """One search: (chip, model, workload, objective) and the Optuna study that drives it."""

    __tablename__ = "ft_studies"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    chip_id: Mapped[int] = mapped_column(ForeignKey("ft_chips.id"))
    model_id: Mapped[int] = mapped_column(ForeignKey("ft_models.id"))
    objective: Mapped[str] = mapped_column(String(10))
    n_prompt: Mapped[int] = mapped_column(Integer)
    n_gen: Mapped[int] = mapped_column(Integer)
    depth: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # tokens in the cache first
    reps: Mapped[int] = mapped_column(Integer)
    sampler: Mapped[str] = mapped_column(String(20))
    budget: Mapped[int] = mapped_column(Integer)
    space: Mapped[dict] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(20), default="running")
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the driver that holds the study (one at a time) and when it last said it is alive
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_heartbeat: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # an imported study: the sha256 of the file it came from (an import recognises a file it has)
    source_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    # a served study (issue 22.1): how its trials load the server (workers.trial.ServedWorkload)
    served: Mapped[dict | None] = mapped_column(JSON)
    chip: Mapped[Chip] = relationship()
    model: Mapped[Model] = relationship()


class Trial(Base):
    """One measured configuration (or its failure), with summaries of its samples."""

    __tablename__ = "ft_trials"
    __table_args__ = (UniqueConstraint("study_id", "optuna_number"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("ft_studies.id", ondelete="CASCADE"), index=True)
    optuna_number: Mapped[int | None] = mapped_column(Integer)
    node_id: Mapped[int | None] = mapped_column(ForeignKey("ft_nodes.id"))
    phase: Mapped[str] = mapped_column(String(20), default="search")
    params: Mapped[dict] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(20), default="running")
    error: Mapped[str | None] = mapped_column(Text)
    failure_kind: Mapped[str | None] = mapped_column(String(20))  # workers.trial.FailureKind value
    objective_value: Mapped[float | None] = mapped_column(Float)
    pp_tps_median: Mapped[float | None] = mapped_column(Float)
    pp_tps_mean: Mapped[float | None] = mapped_column(Float)
    pp_tps_stddev: Mapped[float | None] = mapped_column(Float)
    pp_cv: Mapped[float | None] = mapped_column(Float)
    tg_tps_median: Mapped[float | None] = mapped_column(Float)
    tg_tps_mean: Mapped[float | None] = mapped_column(Float)
    tg_tps_stddev: Mapped[float | None] = mapped_column(Float)
    tg_cv: Mapped[float | None] = mapped_column(Float)
    e2e_s: Mapped[float | None] = mapped_column(Float)
    load_s: Mapped[float | None] = mapped_column(Float)
    measure_s: Mapped[float | None] = mapped_column(Float)
    peak_rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    thermal_before: Mapped[str | None] = mapped_column(String(40))
    thermal_after: Mapped[str | None] = mapped_column(String(40))
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    effective: Mapped[dict | None] = mapped_column(JSON)  # what llama.cpp ran (issue 20.1)
    confirm_round: Mapped[int | None] = mapped_column(Integer)  # the confirmation's round (issue 20.2)
    confirm_arm: Mapped[str | None] = mapped_column(String(40))  # its arm: a candidate, a baseline, A/A
    kl_divergence: Mapped[float | None] = mapped_column(Float)  # against the f16 KV cache (issue 20.4)
    gpu_bytes: Mapped[int | None] = mapped_column(BigInteger)  # llama.cpp's GPU buffers at the peak (issue 23.1)
    # the trial's process as the GPU's driver counts it at the peak, CUDA context included (issue 23.1)
    gpu_device_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # a served trial (issue 22.1): each level's figures and /metrics, the server's build and argv
    served: Mapped[dict | None] = mapped_column(JSON)
    study: Mapped[Study] = relationship()
    node: Mapped[Node | None] = relationship()
    samples: Mapped[list[SampleRow]] = relationship(
        back_populates="trial", cascade="all, delete-orphan", order_by="SampleRow.id"
    )


class SampleRow(Base):
    """Every timed repetition of every trial."""

    __tablename__ = "ft_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("ft_trials.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(4))
    rep: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(Integer)
    seconds: Mapped[float] = mapped_column(Float)
    trial: Mapped[Trial] = relationship(back_populates="samples")


class ServedRequest(Base):
    """Every request of every served trial, as the load loop timed it (workers/slo.py's record)."""

    __tablename__ = "ft_served_requests"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("ft_trials.id", ondelete="CASCADE"), index=True)
    level: Mapped[int] = mapped_column(Integer)  # the trial's level of load (capacity searches have several)
    users: Mapped[int | None] = mapped_column(Integer)  # its concurrency (None: Poisson arrivals)
    start_s: Mapped[float] = mapped_column(Float)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    gen_tokens: Mapped[int] = mapped_column(Integer)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    e2e_s: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    warmup: Mapped[bool] = mapped_column(Boolean, default=False)


class Recommendation(Base):
    """The learned best configuration for (chip, model, workload), versioned."""

    __tablename__ = "ft_recommendations"
    __table_args__ = (
        UniqueConstraint("chip_id", "model_id", "objective", "n_prompt", "n_gen", "depth", "version"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    chip_id: Mapped[int] = mapped_column(ForeignKey("ft_chips.id"))
    model_id: Mapped[int] = mapped_column(ForeignKey("ft_models.id"))
    study_id: Mapped[int | None] = mapped_column(ForeignKey("ft_studies.id", ondelete="SET NULL"))
    objective: Mapped[str] = mapped_column(String(10))
    n_prompt: Mapped[int] = mapped_column(Integer)
    n_gen: Mapped[int] = mapped_column(Integer)
    depth: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    version: Mapped[int] = mapped_column(Integer)
    params: Mapped[dict] = mapped_column(JSON)
    expected_tps: Mapped[float] = mapped_column(Float)
    interval_low: Mapped[float] = mapped_column(Float)
    interval_high: Mapped[float] = mapped_column(Float)
    expected_pp_tps: Mapped[float | None] = mapped_column(Float)
    expected_tg_tps: Mapped[float | None] = mapped_column(Float)
    baseline_tps: Mapped[float | None] = mapped_column(Float)  # llama-cpp-python's defaults
    improvement: Mapped[float | None] = mapped_column(Float)
    baselines: Mapped[dict | None] = mapped_column(JSON)  # every baseline measured: name -> its value
    evidence: Mapped[list] = mapped_column(JSON)
    claims: Mapped[dict | None] = mapped_column(JSON)  # ratios with intervals, A/A noise (issue 20.3)
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    source: Mapped[str] = mapped_column(String(20), default="study")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    chip: Mapped[Chip] = relationship()
    model: Mapped[Model] = relationship()


class Rollout(Base):
    """Putting a model's recommended configurations into service: plan, stages, verdict."""

    __tablename__ = "ft_rollouts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("ft_models.id"))
    objective: Mapped[str] = mapped_column(String(10))
    # running | paused (an inconclusive canary) | rolling_back (some node still to restore) | promoted
    # | rolled_back
    state: Mapped[str] = mapped_column(String(20), default="running")
    source: Mapped[str] = mapped_column(String(20), default="recommendation", server_default="recommendation")
    canary_share: Mapped[float] = mapped_column(Float)
    tolerance: Mapped[float] = mapped_column(Float)
    plan: Mapped[dict] = mapped_column(JSON)  # chip key -> the configuration payload
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    model: Mapped[Model] = relationship()
    nodes: Mapped[list[RolloutNode]] = relationship(order_by="RolloutNode.id", cascade="all, delete-orphan")


class RolloutNode(Base):
    """One node in a rollout: its stage (0 = canary), the config it gets and the one it had."""

    __tablename__ = "ft_rollout_nodes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("ft_rollouts.id", ondelete="CASCADE"), index=True)
    ray_node_id: Mapped[str] = mapped_column(String(64))
    chip_key: Mapped[str] = mapped_column(String(120))
    stage: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict] = mapped_column(JSON)
    previous: Mapped[dict | None] = mapped_column(JSON)
    # pending | intent (previous recorded, apply under way) | applied | verified | failed
    # | restore_pending (rollback could not reach it) | rolled_back | kept (held another config) | cancelled
    state: Mapped[str] = mapped_column(String(20), default="pending")
    intent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # previous is known
    measured_tps: Mapped[float | None] = mapped_column(Float)
    analysis: Mapped[dict | None] = mapped_column(JSON)  # the canary's served-traffic figures
    reason: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
