"""Reading and writing the results database. Every SQL statement of fleettune lives here."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.orm import Session, joinedload

from orchestrator.db.models import (
    Chip,
    Model,
    Node,
    Recommendation,
    Rollout,
    RolloutNode,
    SampleRow,
    Study,
    Trial,
    utcnow,
)
from workers.errors import BadInput
from workers.hardware import Fingerprint
from workers.models import ModelInfo
from workers.trial import TrialResult


def _ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


# ---------------------------------------------------------------- chips, nodes, models


def upsert_chip(session: Session, fp: Fingerprint) -> Chip:
    if not fp.chip_key:
        raise BadInput("this node's chip is unknown (its fingerprint has no chip)")
    chip = session.scalar(select(Chip).where(Chip.key == fp.chip_key))
    if chip is None:
        chip = Chip(key=fp.chip_key)
        session.add(chip)
    chip.name = fp.chip
    chip.vendor = fp.vendor
    chip.family = fp.family
    chip.p_cores, chip.e_cores, chip.logical_cores = fp.p_cores, fp.e_cores, fp.logical_cores
    chip.gpu_cores, chip.gpu_name = fp.gpu_cores, fp.gpu_name
    chip.memory_bytes, chip.bandwidth_gbs, chip.backend = fp.memory_bytes, fp.bandwidth_gbs, fp.backend
    session.flush()
    return chip


def upsert_node(
    session: Session,
    *,
    ray_node_id: str,
    hostname: str,
    fingerprint: Fingerprint,
    llama_build: str | None,
    simulated: bool,
) -> Node:
    chip = upsert_chip(session, fingerprint)
    node = session.scalar(select(Node).where(Node.ray_node_id == ray_node_id))
    if node is None:
        node = Node(ray_node_id=ray_node_id, hostname=hostname, chip=chip, fingerprint={})
        session.add(node)
    node.hostname, node.chip = hostname, chip
    node.os = fingerprint.os
    node.llama_build = llama_build
    node.simulated = simulated
    node.fingerprint = fingerprint.to_dict()
    node.last_seen = utcnow()
    session.flush()
    return node


def upsert_model(session: Session, info: ModelInfo, mtime: float | None = None) -> Model:
    model = session.scalar(select(Model).where(Model.sha256 == info.sha256))
    if model is None:
        model = Model(sha256=info.sha256)
        session.add(model)
    model.name, model.architecture = info.name, info.architecture
    model.n_layer, model.n_params, model.file_type = info.n_layer, info.n_params, info.file_type
    model.size_bytes, model.context_length = info.size_bytes, info.context_length
    if info.path:
        model.path = info.path
    if mtime is not None:
        model.path_mtime = mtime
    session.flush()
    return model


def list_models(session: Session) -> list[Model]:
    return list(session.scalars(select(Model).order_by(Model.added_at, Model.id)))


def model_by_path(session: Session, path: str) -> Model | None:
    return session.scalar(select(Model).where(Model.path == path))


def find_models(session: Session, ref: str) -> list[Model]:
    """Models whose name equals ``ref`` (case-insensitive) or whose sha256 starts with it."""
    ref_l = ref.lower()
    clauses = [func.lower(Model.name) == ref_l]
    if len(ref_l) >= 6 and all(c in "0123456789abcdef" for c in ref_l):
        clauses.append(Model.sha256.startswith(ref_l))
    return list(session.scalars(select(Model).where(or_(*clauses))))


def model_info_of(row: Model) -> ModelInfo:
    return ModelInfo(
        sha256=row.sha256,
        path=row.path or "",
        name=row.name,
        architecture=row.architecture,
        n_layer=row.n_layer,
        n_params=row.n_params,
        file_type=row.file_type,
        size_bytes=row.size_bytes,
        context_length=row.context_length,
    )


# ---------------------------------------------------------------- studies and trials


def get_study(session: Session, name: str) -> Study | None:
    return session.scalar(
        select(Study).options(joinedload(Study.chip), joinedload(Study.model)).where(Study.name == name)
    )


def free_study_name(session: Session, base: str) -> str:
    """``base``, or ``base#2``, ``base#3``, ... the first that no study has."""
    taken = set(session.scalars(select(Study.name).where(Study.name.startswith(base))))
    if base not in taken:
        return base
    n = 2
    while f"{base}#{n}" in taken:
        n += 1
    return f"{base}#{n}"


def latest_study(
    session: Session, chip_id: int, model_id: int, objective: str, n_prompt: int, n_gen: int
) -> Study | None:
    return session.scalar(
        select(Study)
        .where(
            Study.chip_id == chip_id,
            Study.model_id == model_id,
            Study.objective == objective,
            Study.n_prompt == n_prompt,
            Study.n_gen == n_gen,
        )
        .order_by(Study.created_at.desc(), Study.id.desc())
    )


def add_study(session: Session, **fields) -> Study:
    study = Study(**fields)
    session.add(study)
    session.flush()
    return study


def set_study_state(session: Session, study_id: int, state: str, message: str | None = None) -> None:
    study = session.get(Study, study_id)
    study.state = state
    study.message = message
    study.updated_at = utcnow()


@dataclass(frozen=True)
class NewTrial:
    """A trial row about to be dispatched."""

    phase: str
    params: dict
    optuna_number: int | None = None


@dataclass(frozen=True)
class FinishedTrial:
    """A trial's result with what the study derived from it, ready to store."""

    trial_id: int
    result: TrialResult
    objective_value: float | None
    e2e_s: float | None
    node_id: int | None


def start_trials(session: Session, study_id: int, trials: list[NewTrial], *, simulated: bool) -> list[int]:
    """Insert running rows for a round of trials in one statement; returns their ids in order."""
    if not trials:
        return []
    now = utcnow()
    rows = [{"study_id": study_id, "optuna_number": t.optuna_number, "phase": t.phase, "params": t.params,
             "state": "running", "simulated": simulated, "started_at": now} for t in trials]
    return list(session.scalars(insert(Trial).returning(Trial.id, sort_by_parameter_order=True), rows))


def start_trial(session: Session, *, study_id: int, optuna_number: int | None, phase: str, params: dict,
                simulated: bool) -> int:
    return start_trials(session, study_id, [NewTrial(phase, params, optuna_number)], simulated=simulated)[0]


def finish_trials(session: Session, finished: list[FinishedTrial]) -> None:
    """Store a round of results and all their samples (bulk statements, the caller's transaction)."""
    if not finished:
        return
    now = utcnow()
    rows, samples = [], []
    for f in finished:
        r = f.result
        row = {"id": f.trial_id, "state": "complete" if r.ok else "failed", "error": r.error,
               "node_id": f.node_id, "objective_value": f.objective_value, "e2e_s": f.e2e_s,
               "load_s": r.load_s, "measure_s": r.measure_s, "peak_rss_bytes": r.peak_rss_bytes,
               "thermal_before": r.thermal_before, "thermal_after": r.thermal_after,
               "finished_at": _ts(r.finished_at) or now}
        if r.simulated:
            row["simulated"] = True
        if r.started_at is not None:
            row["started_at"] = _ts(r.started_at)
        for kind in ("pp", "tg"):
            stats = r.stats(kind)
            row |= {f"{kind}_tps_median": stats.median if stats else None,
                    f"{kind}_tps_mean": stats.mean if stats else None,
                    f"{kind}_tps_stddev": stats.stddev if stats else None,
                    f"{kind}_cv": stats.cv if stats else None}
        rows.append(row)
        samples += [{"trial_id": f.trial_id, "kind": s.kind, "rep": s.rep, "n_tokens": s.n_tokens,
                     "seconds": s.seconds} for s in r.samples]
    by_shape: dict[tuple, list[dict]] = {}  # one executemany per set of columns
    for row in rows:
        by_shape.setdefault(tuple(sorted(row)), []).append(row)
    for group in by_shape.values():
        session.execute(update(Trial), group)
    if samples:
        session.execute(insert(SampleRow), samples)


def finish_trial(session: Session, trial_id: int, result: TrialResult, *, objective_value: float | None,
                 e2e_s: float | None, node_id: int | None) -> None:
    """Store a result and all its samples in one transaction (the caller's)."""
    finish_trials(session, [FinishedTrial(trial_id, result, objective_value, e2e_s, node_id)])


def set_trial_llama_bench_stats(session: Session, trial_id: int, stats: dict[str, tuple[float, float]]) -> None:
    """Keep llama-bench's own mean and stddev (per kind) on an imported trial."""
    trial = session.get(Trial, trial_id)
    for kind, (mean, stddev) in stats.items():
        setattr(trial, f"{kind}_tps_mean", mean)
        setattr(trial, f"{kind}_tps_stddev", stddev)
        setattr(trial, f"{kind}_cv", stddev / mean if mean else None)
        if getattr(trial, f"{kind}_tps_median") is None:
            setattr(trial, f"{kind}_tps_median", mean)


def fail_running_trials(session: Session, study_id: int, reason: str) -> list[int]:
    """Mark trials left RUNNING (e.g. by a killed driver) as failed; returns their Optuna numbers."""
    rows = list(session.scalars(select(Trial).where(Trial.study_id == study_id, Trial.state == "running")))
    for row in rows:
        row.state, row.error, row.finished_at = "failed", reason, utcnow()
    return [r.optuna_number for r in rows if r.optuna_number is not None]


def study_trials(session: Session, study_id: int, phase: str | None = None) -> list[Trial]:
    query = select(Trial).where(Trial.study_id == study_id).options(joinedload(Trial.samples))
    if phase:
        query = query.where(Trial.phase == phase)
    return list(session.scalars(query.order_by(Trial.id)).unique())


# ---------------------------------------------------------------- queries for the CLI


@dataclass(frozen=True)
class ResultFilter:
    chip: str | None = None
    model: str | None = None
    study: str | None = None
    state: str | None = "complete"
    top: int | None = None
    simulated: bool | None = None


def query_trials(session: Session, flt: ResultFilter) -> list[Trial]:
    query = (
        select(Trial)
        .join(Study)
        .join(Chip, Study.chip_id == Chip.id)
        .join(Model, Study.model_id == Model.id)
        .options(joinedload(Trial.study).joinedload(Study.chip), joinedload(Trial.study).joinedload(Study.model),
                 joinedload(Trial.node))
    )
    if flt.chip:
        query = query.where(or_(Chip.key == flt.chip, Chip.key.startswith(flt.chip + "-")))
    if flt.model:
        ref = flt.model.lower()
        query = query.where(or_(func.lower(Model.name) == ref, Model.sha256.startswith(ref)))
    if flt.study:
        query = query.where(Study.name == flt.study)
    if flt.state:
        query = query.where(Trial.state == flt.state)
    if flt.simulated is not None:
        query = query.where(Trial.simulated == flt.simulated)
    if flt.top:
        query = query.where(Trial.objective_value.is_not(None))
        query = query.order_by(Trial.objective_value.desc(), Trial.id).limit(flt.top)
    else:
        query = query.order_by(Trial.id)
    return list(session.scalars(query).unique())


def add_recommendation(session: Session, **fields) -> Recommendation:
    version = (
        session.scalar(
            select(func.max(Recommendation.version)).where(
                Recommendation.chip_id == fields["chip_id"],
                Recommendation.model_id == fields["model_id"],
                Recommendation.objective == fields["objective"],
                Recommendation.n_prompt == fields["n_prompt"],
                Recommendation.n_gen == fields["n_gen"],
            )
        )
        or 0
    )
    rec = Recommendation(version=version + 1, **fields)
    session.add(rec)
    session.flush()
    return rec


def latest_recommendations(
    session: Session, model_ids: list[int], chip_key: str | None = None, objective: str | None = None
) -> list[Recommendation]:
    """The newest version per (chip, model, workload), real measurements before simulated ones."""
    query = (
        select(Recommendation)
        .join(Chip, Recommendation.chip_id == Chip.id)
        .options(joinedload(Recommendation.chip), joinedload(Recommendation.model))
        .where(Recommendation.model_id.in_(model_ids))
    )
    if chip_key:
        query = query.where(or_(Chip.key == chip_key, Chip.key.startswith(chip_key + "-")))
    if objective:
        query = query.where(Recommendation.objective == objective)
    rows = list(session.scalars(query.order_by(Recommendation.version.desc())).unique())
    newest: dict[tuple, Recommendation] = {}
    for rec in rows:
        key = (rec.chip_id, rec.model_id, rec.objective, rec.n_prompt, rec.n_gen, rec.simulated)
        newest.setdefault(key, rec)
    return sorted(newest.values(), key=lambda r: (r.chip.key, r.simulated, r.objective))


def chip_by_key(session: Session, key: str) -> Chip | None:
    return session.scalar(select(Chip).where(Chip.key == key))


def completed_studies(session: Session, model_sha256: str | None = None) -> list[Study]:
    query = select(Study).options(joinedload(Study.chip)).where(Study.state == "complete")
    if model_sha256:
        query = query.join(Model, Study.model_id == Model.id).where(Model.sha256 == model_sha256)
    return list(session.scalars(query.order_by(Study.id)))


def all_latest_recommendations(session: Session, objective: str, simulated: bool) -> list[Recommendation]:
    """The newest recommendation of every (chip, model, workload) for one objective and kind."""
    model_ids = list(session.scalars(select(Recommendation.model_id).distinct()))
    return [r for r in latest_recommendations(session, model_ids, None, objective) if r.simulated == simulated]


def active_rollout_config(session: Session, model_id: int, chip_key: str) -> dict | None:
    """The configuration the chip's nodes run for the model: the newest promoted rollout's."""
    query = (select(Rollout).where(Rollout.model_id == model_id, Rollout.state == "promoted")
             .order_by(Rollout.id.desc()))
    for rollout in session.scalars(query):
        if chip_key in rollout.plan:
            return rollout.plan[chip_key]
    return None


def current_chip_configs(session: Session, model_sha256: str | None = None) -> dict[str, dict]:
    """Per chip key, the configuration its nodes should run: the newest promoted rollout's (of
    ``model_sha256`` only, when given)."""
    query = select(Rollout).where(Rollout.state == "promoted").order_by(Rollout.id)
    if model_sha256:
        query = query.join(Model, Rollout.model_id == Model.id).where(Model.sha256 == model_sha256)
    current: dict[str, dict] = {}
    for rollout in session.scalars(query):  # oldest first: newer rollouts overwrite
        current.update(rollout.plan)
    return current


def rolled_out_models(session: Session) -> list[str]:
    """The sha256 of every model some rollout was promoted for."""
    return list(session.scalars(select(Model.sha256).join(Rollout, Rollout.model_id == Model.id)
                                .where(Rollout.state == "promoted").distinct()))


UNFINISHED_ROLLOUT_STATES = ("running", "rolling_back")


def unfinished_rollout(session: Session, model_sha256: str) -> Rollout | None:
    return session.scalar(select(Rollout).join(Model, Rollout.model_id == Model.id)
                          .where(Model.sha256 == model_sha256, Rollout.state.in_(UNFINISHED_ROLLOUT_STATES))
                          .order_by(Rollout.id.desc()))


def latest_rollout(session: Session) -> Rollout | None:
    return session.scalar(select(Rollout).order_by(Rollout.id.desc()))


def get_rollout(session: Session, rollout_id: int) -> Rollout:
    rollout = session.get(Rollout, rollout_id)
    if rollout is None:
        raise BadInput(f"no rollout {rollout_id}")
    return rollout


def list_rollouts(session: Session) -> list[Rollout]:
    return list(session.scalars(select(Rollout).options(joinedload(Rollout.model)).order_by(Rollout.id)))


def create_rollout(session: Session, *, model_id: int, objective: str, source: str, canary_share: float,
                   tolerance: float, plan: dict[str, dict], nodes: list[tuple[str, str, int]]) -> int:
    """A new running rollout: ``plan`` is chip key -> payload (its version and rollout_id set here to
    the rollout's id), ``nodes`` (ray node id, chip key, stage). Returns its id."""
    rollout = Rollout(model_id=model_id, objective=objective, source=source, state="running",
                      canary_share=canary_share, tolerance=tolerance, plan={})
    session.add(rollout)
    session.flush()
    payloads = {chip: {**payload, "rollout_id": rollout.id, "version": rollout.id}
                for chip, payload in plan.items()}
    rollout.plan = payloads  # a new dict: SQLAlchemy does not see a JSON value change in place
    for node_id, chip_key, stage in nodes:
        rollout.nodes.append(RolloutNode(ray_node_id=node_id, chip_key=chip_key, stage=stage,
                                         config=payloads[chip_key], state="pending"))
    session.flush()
    return rollout.id


def rollout_nodes(session: Session, rollout_id: int) -> list[RolloutNode]:
    return list(session.scalars(select(RolloutNode).where(RolloutNode.rollout_id == rollout_id)
                                .order_by(RolloutNode.id)))


def set_rollout_node(session: Session, row_id: int, **fields) -> None:
    session.execute(update(RolloutNode).where(RolloutNode.id == row_id).values(**fields, updated_at=utcnow()))


def record_intent(session: Session, row_id: int, previous: dict | None) -> None:
    """Write-ahead: the node's config before the apply, recorded before the apply is sent."""
    set_rollout_node(session, row_id, state="intent", previous=previous, intent_at=utcnow())


def set_rollout_state(session: Session, rollout_id: int, state: str, message: str | None = None) -> None:
    session.execute(update(Rollout).where(Rollout.id == rollout_id)
                    .values(state=state, message=message, updated_at=utcnow()))


def pending_restores(session: Session, ray_node_id: str | None = None) -> list[RolloutNode]:
    """Rollback steps that could not reach their node yet (optionally: of one node)."""
    query = select(RolloutNode).where(RolloutNode.state == "restore_pending")
    if ray_node_id:
        query = query.where(RolloutNode.ray_node_id == ray_node_id)
    return list(session.scalars(query.order_by(RolloutNode.id)))


def rollout_nodes_left_to_restore(session: Session, rollout_id: int) -> int:
    return session.scalar(select(func.count()).select_from(RolloutNode).where(
        RolloutNode.rollout_id == rollout_id, RolloutNode.state == "restore_pending")) or 0


# ---------------------------------------------------------------- fleet


def list_nodes(session: Session) -> list[Node]:
    return list(session.scalars(select(Node).options(joinedload(Node.chip)).order_by(Node.id)))


def trials_per_node(session: Session) -> dict[int, int]:
    rows = session.execute(
        select(Trial.node_id, func.count()).where(Trial.node_id.is_not(None), Trial.state == "complete")
        .group_by(Trial.node_id)
    )
    return {node_id: n for node_id, n in rows}


def comparable_results(session: Session) -> list[tuple]:
    """(study, configuration, node, objective value, maximise?) of every complete trial with a node."""
    import json

    rows = session.execute(
        select(Trial.study_id, Trial.params, Trial.node_id, Trial.objective_value, Study.objective)
        .join(Study, Trial.study_id == Study.id)
        .where(Trial.state == "complete", Trial.node_id.is_not(None), Trial.objective_value.is_not(None))
    )
    return [
        (study_id, json.dumps(params, sort_keys=True), node_id, value, objective != "e2e")
        for study_id, params, node_id, value, objective in rows
    ]
