"""Reading and writing the results database. Every SQL statement of fleettune lives here."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import bindparam, case, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, joinedload

from orchestrator.db.models import (
    Chip,
    Model,
    Node,
    Recommendation,
    Rollout,
    RolloutNode,
    SampleRow,
    ServedRequest,
    Study,
    Trial,
    utcnow,
)
from workers.errors import BadInput
from workers.hardware import Fingerprint
from workers.models import ModelInfo
from workers.objective import OBJECTIVES
from workers.trial import TrialResult

if TYPE_CHECKING:  # learn is the head's logic, not a dependency of the database layer
    from orchestrator.learn import RecommendationDraft


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


def fingerprint_of_chip(row: Chip) -> Fingerprint:
    """A chip row as the hardware record (what its nodes share; no node's OS).

    The row has no column for an M5 Pro/Max's second tier of performance cores (``m_cores``):
    Apple Silicon has one thread per core, so they are the logical cores past the P and E cores.
    """
    m_cores = None
    if row.vendor == "Apple" and None not in (row.logical_cores, row.p_cores, row.e_cores):
        m_cores = max(row.logical_cores - row.p_cores - row.e_cores, 0)
    return Fingerprint(
        chip=row.name, chip_key=row.key, vendor=row.vendor, p_cores=row.p_cores, e_cores=row.e_cores,
        logical_cores=row.logical_cores, gpu_cores=row.gpu_cores, gpu_name=row.gpu_name,
        gpu_memory_bytes=None, memory_bytes=row.memory_bytes, bandwidth_gbs=row.bandwidth_gbs, os=None,
        backend=row.backend, gpu_offload=row.backend != "cpu", m_cores=m_cores,
    )


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


def find_model(session: Session, sha256: str) -> Model | None:
    return session.scalar(select(Model).where(Model.sha256 == sha256))


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
    session: Session, chip_id: int, model_id: int, objective: str, n_prompt: int, n_gen: int, depth: int = 0
) -> Study | None:
    return session.scalar(
        select(Study)
        .where(
            Study.chip_id == chip_id,
            Study.model_id == model_id,
            Study.objective == objective,
            Study.n_prompt == n_prompt,
            Study.n_gen == n_gen,
            Study.depth == depth,
        )
        .order_by(Study.created_at.desc(), Study.id.desc())
    )


def list_studies(session: Session, state: str | None = None) -> list[Study]:
    query = select(Study).options(joinedload(Study.chip), joinedload(Study.model)).order_by(Study.id)
    if state:
        query = query.where(Study.state == state)
    return list(session.scalars(query))


def samples_of_unfinished_trials(session: Session, study_id: int) -> int:
    """Samples whose trial is not complete (there should be none: a sample comes with its result)."""
    return session.scalar(
        select(func.count()).select_from(SampleRow).join(Trial, SampleRow.trial_id == Trial.id)
        .where(Trial.study_id == study_id, Trial.state != "complete"))


def recommendation_versions(session: Session, study_id: int) -> int:
    return session.scalar(select(func.count()).select_from(Recommendation)
                          .where(Recommendation.study_id == study_id))


@dataclass(frozen=True)
class NewStudy:
    """A study to store: its target (chip, model), workload, objective and search settings."""

    name: str
    chip_id: int
    model_id: int
    objective: str
    n_prompt: int
    n_gen: int
    reps: int
    sampler: str
    budget: int
    space: dict
    simulated: bool
    depth: int = 0
    state: str = "running"
    message: str | None = None
    lease_owner: str | None = None  # the driver creating it holds it from the start
    lease_heartbeat: datetime | None = None
    source_sha256: str | None = None  # an imported study: the file it came from
    served: dict | None = None  # a served study's ServedWorkload (issue 22.1)

    def columns(self) -> dict:
        return {field: getattr(self, field) for field in self.__dataclass_fields__}


def add_study(session: Session, new: NewStudy) -> Study:
    study = Study(**new.columns())
    session.add(study)
    session.flush()
    return study


def add_named_study(session: Session, new: NewStudy) -> Study:
    """A new study called ``new.name``; BadInput when it exists, also when another driver created
    it since the caller looked."""
    try:
        with session.begin_nested():
            return add_study(session, new)
    except IntegrityError:
        raise BadInput(f"study {new.name!r} already exists; pass --resume to continue it") from None


def add_study_free_name(session: Session, new: NewStudy) -> Study:
    """A new study named ``new.name`` (or ``name#2``, ...), safe against another driver creating a
    study of the same name at the same instant: a name taken meanwhile is retried with the next one."""
    base = new.name
    for _ in range(100):
        name = free_study_name(session, base)
        try:
            with session.begin_nested():  # a savepoint: a clash undoes this insert only
                return add_study(session, replace(new, name=name))
        except IntegrityError:
            continue
    raise BadInput(f"could not find a free study name for {base!r}")


@dataclass(frozen=True)
class _Lease:
    """Where a lease lives: a table's row and its owner and heartbeat columns."""

    table: type
    owner: str
    heartbeat: str

    def where(self, row_id: int, owner: str | None):
        column = getattr(self.table, self.owner)
        return (self.table.id == row_id, column.is_(None) if owner is None else column == owner)


STUDY_LEASE = _Lease(Study, "lease_owner", "lease_heartbeat")
ROLLOUT_LEASE = _Lease(Model, "rollout_lease_owner", "rollout_lease_heartbeat")  # per model: its rollouts


def _acquire(session: Session, lease: _Lease, row_id: int, owner: str, stale_before: datetime,
             dead: Callable[[str], bool]) -> str | None:
    """Hold the row's lease for ``owner``; returns None when held, else the holder that keeps it.

    The lease is free when nobody holds it, when the holder's heartbeat is older than
    ``stale_before`` or when ``dead(holder)`` says the holder's process is gone. The update is
    conditional on the holder it saw, so two drivers taking over at once cannot both win.
    """
    owner_now, beat = session.execute(
        select(getattr(lease.table, lease.owner), getattr(lease.table, lease.heartbeat))
        .where(lease.table.id == row_id)
    ).one()
    if owner_now and owner_now != owner and beat is not None:
        beat = beat if beat.tzinfo else beat.replace(tzinfo=UTC)
        if beat >= stale_before and not dead(owner_now):
            return owner_now
    taken = session.execute(
        update(lease.table).where(*lease.where(row_id, owner_now))
        .values({lease.owner: owner, lease.heartbeat: utcnow()})
        .execution_options(synchronize_session=False)
    ).rowcount
    return None if taken == 1 else (owner_now or "another driver")


def _renew(session: Session, lease: _Lease, row_id: int, owner: str) -> bool:
    return session.execute(
        update(lease.table).where(*lease.where(row_id, owner))
        .values({lease.heartbeat: utcnow()}).execution_options(synchronize_session=False)
    ).rowcount == 1


def _release(session: Session, lease: _Lease, row_id: int, owner: str) -> None:
    session.execute(
        update(lease.table).where(*lease.where(row_id, owner))
        .values({lease.owner: None, lease.heartbeat: None}).execution_options(synchronize_session=False)
    )


def acquire_lease(session: Session, study_id: int, owner: str, stale_before: datetime,
                  dead: Callable[[str], bool]) -> str | None:
    """Hold the study for ``owner``; returns None when held, else the holder that keeps it (``_acquire``)."""
    return _acquire(session, STUDY_LEASE, study_id, owner, stale_before, dead)


def renew_lease(session: Session, study_id: int, owner: str) -> bool:
    """Refresh the holder's heartbeat; False when ``owner`` no longer holds the study."""
    return _renew(session, STUDY_LEASE, study_id, owner)


def release_lease(session: Session, study_id: int, owner: str) -> None:
    _release(session, STUDY_LEASE, study_id, owner)


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
    confirm_round: int | None = None  # the interleaved confirmation's round and arm (issue 20.2)
    confirm_arm: str | None = None


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
             "state": "running", "simulated": simulated, "started_at": now,
             "confirm_round": t.confirm_round, "confirm_arm": t.confirm_arm} for t in trials]
    return list(session.scalars(insert(Trial).returning(Trial.id, sort_by_parameter_order=True), rows))


def start_trial(session: Session, *, study_id: int, optuna_number: int | None, phase: str, params: dict,
                simulated: bool) -> int:
    return start_trials(session, study_id, [NewTrial(phase, params, optuna_number)], simulated=simulated)[0]


def finish_trials(session: Session, finished: list[FinishedTrial]) -> None:
    """Store a round of results and all their samples (bulk statements, the caller's transaction)."""
    if not finished:
        return
    now = utcnow()
    rows, samples, requests = [], [], []
    for f in finished:
        r = f.result
        row = {"id": f.trial_id, "state": "complete" if r.ok else "failed", "error": r.error,
               "failure_kind": None if r.ok else r.kind.value,
               "node_id": f.node_id, "objective_value": f.objective_value, "e2e_s": f.e2e_s,
               "load_s": r.load_s, "measure_s": r.measure_s, "peak_rss_bytes": r.peak_rss_bytes,
               "thermal_before": r.thermal_before, "thermal_after": r.thermal_after,
               "effective": r.effective, "kl_divergence": r.kl_divergence, "gpu_bytes": r.gpu_bytes,
               "gpu_device_bytes": r.gpu_device_bytes,
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
        if r.served is not None:
            row["served"] = {k: v for k, v in r.served.items() if k != "levels"} | {
                "levels": [{k: v for k, v in level.items() if k != "records"} for level in r.served.get("levels", [])]}
            requests += served_request_rows(f.trial_id, r.served)
        rows.append(row)
        samples += [{"trial_id": f.trial_id, "kind": s.kind, "rep": s.rep, "n_tokens": s.n_tokens,
                     "seconds": s.seconds} for s in r.samples]
    _update_trials(session, rows)
    if samples:
        session.execute(insert(SampleRow), samples)
    if requests:
        session.execute(insert(ServedRequest), requests)


_REQUEST_FIELDS = ("start_s", "prompt_tokens", "gen_tokens", "ttft_s", "e2e_s", "error", "warmup")


def served_request_rows(trial_id: int, served: dict) -> list[dict]:
    """A served trial's requests as rows of ft_served_requests (issue 22.1), level by level."""
    return [{"trial_id": trial_id, "level": i, "users": level.get("users"),
             **{name: record.get(name) for name in _REQUEST_FIELDS}}
            for i, level in enumerate(served.get("levels", [])) for record in level.get("records", [])]


def served_requests(session: Session, trial_id: int) -> list[ServedRequest]:
    return list(session.scalars(select(ServedRequest).where(ServedRequest.trial_id == trial_id)
                                .order_by(ServedRequest.id)))


def finish_trial(session: Session, trial_id: int, result: TrialResult, *, objective_value: float | None,
                 e2e_s: float | None, node_id: int | None) -> None:
    """Store a result and all its samples in one transaction (the caller's)."""
    finish_trials(session, [FinishedTrial(trial_id, result, objective_value, e2e_s, node_id)])


def set_trials_llama_bench_stats(session: Session, stats: dict[int, dict[str, tuple[float, float]]]) -> None:
    """Keep llama-bench's own mean and stddev (per kind) on imported trials, in bulk: {trial id:
    {kind: (mean, stddev)}}; each kind's median stays the one of its samples."""
    rows = []
    for trial_id, by_kind in stats.items():
        row = {"id": trial_id}
        for kind, (mean, stddev) in by_kind.items():
            row |= {f"{kind}_tps_mean": mean, f"{kind}_tps_stddev": stddev, f"{kind}_cv": stddev / mean if mean else None}
        rows.append(row)
    _update_trials(session, rows)


def _update_trials(session: Session, rows: list[dict]) -> None:
    """Bulk updates of trial rows by id: one Core executemany per set of columns (the ORM's bulk
    UPDATE by primary key costs the head more per row, for nothing this needs)."""
    table = Trial.__table__
    by_shape: dict[tuple, list[dict]] = {}
    for row in rows:
        by_shape.setdefault(tuple(sorted(row)), []).append(row)
    for columns, group in by_shape.items():
        values = {c: bindparam(c) for c in columns if c != "id"}
        statement = update(table).where(table.c.id == bindparam("trial_id_")).values(values)
        session.execute(statement, [{**row, "trial_id_": row["id"]} for row in group])


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


def _chip_matches(chip: str):
    """A chip key, or a prefix of keys up to a dash; ``%`` and ``_`` are the user's characters,
    never LIKE wildcards."""
    return or_(Chip.key == chip, Chip.key.startswith(chip + "-", autoescape=True))


def _best_first():
    """A sort key that puts each trial's best values first, by its study's objective direction
    (seconds of e2e ascending, tok/s descending)."""
    minimised = [o.name for o in OBJECTIVES.values() if not o.maximize]
    return case((Study.objective.in_(minimised), Trial.objective_value), else_=-Trial.objective_value)


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
        query = query.where(_chip_matches(flt.chip))
    if flt.model:
        ref = flt.model.lower()
        query = query.where(or_(func.lower(Model.name) == ref, Model.sha256.startswith(ref, autoescape=True)))
    if flt.study:
        query = query.where(Study.name == flt.study)
    if flt.state:
        query = query.where(Trial.state == flt.state)
    if flt.simulated is not None:
        query = query.where(Trial.simulated == flt.simulated)
    if flt.top:
        query = query.where(Trial.objective_value.is_not(None))
        query = query.order_by(_best_first(), Trial.id).limit(flt.top)
    else:
        query = query.order_by(Trial.id)
    return list(session.scalars(query).unique())


def studies_from_source(session: Session, source_sha256: str) -> list[str]:
    """Names of the studies imported from a file with these bytes (oldest first)."""
    return list(session.scalars(select(Study.name).where(Study.source_sha256 == source_sha256)
                                .order_by(Study.id)))


@dataclass(frozen=True)
class NewRecommendation:
    """A recommendation to store: what ``learn.recommend`` drafted for (chip, model, objective,
    workload), and the study it came from."""

    chip_id: int
    model_id: int
    study_id: int | None
    objective: str
    n_prompt: int
    n_gen: int
    draft: RecommendationDraft
    source: str = "study"
    depth: int = 0

    def columns(self) -> dict:
        d = self.draft
        return {
            "chip_id": self.chip_id, "model_id": self.model_id, "study_id": self.study_id,
            "objective": self.objective, "n_prompt": self.n_prompt, "n_gen": self.n_gen, "depth": self.depth,
            "baselines": d.baselines or None,
            "params": d.params.to_dict(), "expected_tps": d.expected_tps, "interval_low": d.interval_low,
            "interval_high": d.interval_high, "expected_pp_tps": d.expected_pp_tps,
            "expected_tg_tps": d.expected_tg_tps, "baseline_tps": d.baseline_tps,
            "improvement": d.improvement, "evidence": d.evidence, "simulated": d.simulated,
            "source": self.source, "claims": d.claims or None,
        }


def add_recommendation(session: Session, new: NewRecommendation) -> Recommendation:
    """Store the next version of a recommendation; an unchanged one is the latest version again."""
    fields = new.columns()
    target = [getattr(Recommendation, key) == fields[key]  # the versions of one recommendation
              for key in ("chip_id", "model_id", "objective", "n_prompt", "n_gen", "depth")]
    version = session.scalar(select(func.max(Recommendation.version)).where(*target)) or 0
    if version:
        latest = session.scalar(select(Recommendation).where(*target, Recommendation.version == version))
        if latest is not None and _same_recommendation(latest, fields):
            return latest  # nothing changed: a version counts only real changes
    rec = Recommendation(version=version + 1, **fields)
    session.add(rec)
    session.flush()
    return rec


def _same_recommendation(row: Recommendation, fields: dict) -> bool:
    """Whether ``fields`` say what ``row`` says: the same configuration, figures and evidence."""
    for key, value in fields.items():
        stored = getattr(row, key)
        if isinstance(value, float) and isinstance(stored, float):
            if abs(value - stored) > 1e-9 * max(1.0, abs(stored)):
                return False
        elif key in ("params", "evidence", "baselines", "claims"):
            if json.dumps(stored, sort_keys=True) != json.dumps(value, sort_keys=True):
                return False
        elif stored != value:
            return False
    return True


def study_recommendation(session: Session, study_id: int) -> Recommendation | None:
    """The newest recommendation a study stored (its own, even where a later study of the same
    chip, model and workload stored a newer version since), or None."""
    return session.scalar(select(Recommendation).where(Recommendation.study_id == study_id)
                          .order_by(Recommendation.version.desc(), Recommendation.id.desc()).limit(1))


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
        query = query.where(_chip_matches(chip_key))
    if objective:
        query = query.where(Recommendation.objective == objective)
    rows = list(session.scalars(query.order_by(Recommendation.version.desc())).unique())
    newest: dict[tuple, Recommendation] = {}
    for rec in rows:
        key = (rec.chip_id, rec.model_id, rec.objective, rec.n_prompt, rec.n_gen, rec.depth, rec.simulated)
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


UNFINISHED_ROLLOUT_STATES = ("running", "rolling_back", "paused")  # paused: an inconclusive canary


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


def acquire_rollout_lease(session: Session, model_id: int, owner: str, stale_before: datetime,
                          dead: Callable[[str], bool]) -> str | None:
    """Be the one driver of the model's rollouts; None when held, else the holder (``_acquire``)."""
    return _acquire(session, ROLLOUT_LEASE, model_id, owner, stale_before, dead)


def renew_rollout_lease(session: Session, model_id: int, owner: str) -> bool:
    """Refresh the heartbeat; False when ``owner`` no longer drives the model's rollouts."""
    return _renew(session, ROLLOUT_LEASE, model_id, owner)


def release_rollout_lease(session: Session, model_id: int, owner: str) -> None:
    _release(session, ROLLOUT_LEASE, model_id, owner)


def model_sha256(session: Session, model_id: int) -> str:
    return session.scalar(select(Model.sha256).where(Model.id == model_id))


def rollout_lease_holder(session: Session, model_id: int) -> tuple[str | None, datetime | None]:
    """Who holds the model's rollout lease and its last heartbeat (None, None: nobody)."""
    return tuple(session.execute(select(Model.rollout_lease_owner, Model.rollout_lease_heartbeat)
                                 .where(Model.id == model_id)).one())


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
        (study_id, json.dumps(params, sort_keys=True), node_id, value, OBJECTIVES[objective].maximize)
        for study_id, params, node_id, value, objective in rows
    ]
