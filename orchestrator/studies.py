"""Studies: one Optuna study per (chip, model, workload, objective), run over Ray, stored in the DB.

A study runs in three phases: ``baseline`` (llama-cpp-python's defaults, measured so the gain is
known), ``search`` (the sampler's trials, as many in parallel as the chip has idle nodes) and
``confirm`` (the top configurations and the baseline measured again in one round). The confirmed
evidence becomes a recommendation row.

The head owns the database; workers get a ``TrialSpec`` and return a ``TrialResult``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from orchestrator import learn
from orchestrator.db import Database, repo
from orchestrator.db.session import engine_kwargs
from orchestrator.dispatch import Dispatcher
from orchestrator.samplers import (
    SAMPLER_NAMES,
    grid_size,
    make_sampler,
    resolve_sampler,
)
from orchestrator.space import SearchSpace, full_offload, llama_cpp_python_defaults
from orchestrator.storage import HeadStorage
from workers.bench import validate_params, validate_workload
from workers.errors import BadInput, FleettuneError
from workers.hardware import Fingerprint
from workers.models import ModelInfo
from workers.trial import BenchParams, TrialResult, TrialSpec, Workload

POLL_S = 0.5
ROUND_RESULTS = 16  # results collected per round before idle nodes get new trials
# proposals made ahead of need while results are awaited: one for every AHEAD_EVERY running
# trials, at most AHEAD_MAX, and none below AHEAD_MIN_RUNNING (a small fleet's head has time to
# make every proposal with every result in)
AHEAD_EVERY = 2
AHEAD_MAX = 128
AHEAD_MIN_RUNNING = 32
NO_NODE_GRACE_S = 30.0
ORPHANED = "orphaned: the driver stopped"

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger(__name__)


class StudyPaused(FleettuneError):
    """The study stopped before its budget (Ctrl-C, no node of the chip left); --resume continues."""


@dataclass(frozen=True)
class StudyConfig:
    """What the user asked for."""

    model: ModelInfo
    objective: str = "tg"
    workload: Workload = field(default_factory=Workload)
    n_trials: int = 30
    sampler: str = "auto"
    name: str | None = None
    resume: bool = False
    seed: int | None = None
    timeout_s: float = 600.0
    cooldown_s: float = 0.0
    confirm_top: int = 3
    warm_start: tuple[BenchParams, ...] = ()  # measured first, before the sampler proposes

    def validate(self) -> None:
        if self.objective not in learn.OBJECTIVES:
            raise BadInput(f"unknown objective {self.objective!r}; choose one of tg, pp, e2e")
        if self.sampler not in SAMPLER_NAMES:
            raise BadInput(f"unknown sampler {self.sampler!r}; choose one of {', '.join(SAMPLER_NAMES)}")
        if self.n_trials < 1:
            raise BadInput(f"trials {self.n_trials}: must be >= 1")
        if self.objective == "tg" and self.workload.n_gen < 1:
            raise BadInput("objective tg needs --gen-tokens >= 1")
        if self.objective == "pp" and self.workload.n_prompt < 1:
            raise BadInput("objective pp needs --prompt-tokens >= 1")
        validate_workload(self.workload, self.model)


@dataclass(frozen=True)
class ChipTarget:
    """The chip a study runs on: its fingerprint and the DB ids of its known nodes."""

    fingerprint: Fingerprint
    node_ids: dict[str, int]  # ray node id -> nodes.id
    simulated: bool = False

    @property
    def key(self) -> str:
        return self.fingerprint.chip_key or ""


@dataclass
class Progress:
    """A snapshot for progress displays."""

    phase: str
    done: int
    total: int
    failed: int = 0
    best_value: float | None = None
    best_params: BenchParams | None = None
    running: list[BenchParams] = field(default_factory=list)
    last: TrialResult | None = None


@dataclass(frozen=True)
class StudyOutcome:
    name: str
    state: str
    n_complete: int
    n_failed: int
    recommendation: learn.RecommendationDraft | None
    recommendation_version: int | None
    baseline_params: BenchParams


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def default_study_name(chip_key: str, model: ModelInfo, objective: str, workload: Workload) -> str:
    return f"{chip_key}/{model.name}-{model.sha256[:8]}/{objective}-p{workload.n_prompt}-g{workload.n_gen}"


class StudyRunner:
    """Runs one study to its budget; safe to interrupt and resume."""

    def __init__(
        self,
        db: Database,
        dispatcher: Dispatcher,
        cfg: StudyConfig,
        target: ChipTarget,
        alive_nodes: Callable[[], list[str]],
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        self.db, self.dispatcher, self.cfg, self.target = db, dispatcher, cfg, target
        self.alive_nodes = alive_nodes
        self.on_progress = on_progress or (lambda p: None)
        self.direction = learn.DIRECTIONS[cfg.objective]
        self.baseline = llama_cpp_python_defaults(target.fingerprint)
        self.study_id: int | None = None
        self.name = ""
        self.space: SearchSpace | None = None
        self.budget = cfg.n_trials
        self.sampler = cfg.sampler  # resolved ("auto" -> gp or tpe) by prepare
        self.no_node_grace_s = NO_NODE_GRACE_S
        self._best_at: int | None = None
        self._best_cached: tuple[float | None, BenchParams | None] = (None, None)

    # ---------------------------------------------------------------- setup

    def prepare(self) -> None:
        """Create or resume the study rows; raises BadInput before writing anything on a clash."""
        cfg, fp = self.cfg, self.target.fingerprint
        cfg.validate()
        validate_params(self.baseline, fp, cfg.model)
        space = SearchSpace.for_target(fp, cfg.model, cfg.workload.n_prompt)
        with self.db.session() as s:
            chip = repo.upsert_chip(s, fp)  # rolled back with the rest if a check below fails
            model = repo.upsert_model(s, cfg.model, _mtime(cfg.model.path))
            existing = None
            if cfg.name:
                existing = repo.get_study(s, cfg.name)
            elif cfg.resume:
                existing = repo.latest_study(
                    s, chip.id, model.id, cfg.objective, cfg.workload.n_prompt, cfg.workload.n_gen
                )
            if existing is not None and not cfg.resume:
                raise BadInput(f"study {cfg.name!r} already exists; pass --resume to continue it")
            if existing is None and cfg.resume:
                raise BadInput("no study to resume for this chip, model and workload")
            if existing is not None:
                self._check_same(existing, chip, model)
                self.study_id, self.name = existing.id, existing.name
                # as resolved when the study was created, unless another one is asked for now
                self.sampler = existing.sampler if cfg.sampler == "auto" else cfg.sampler
                self.space = SearchSpace.from_dict(existing.space)
                self.budget = max(cfg.n_trials, 1)
                existing.budget = self.budget
                repo.fail_running_trials(s, existing.id, ORPHANED)
                repo.set_study_state(s, existing.id, "running")
            else:
                self.name = cfg.name or repo.free_study_name(s, default_study_name(
                    self.target.key, cfg.model, cfg.objective, cfg.workload))
                self.space = space
                self.sampler = resolve_sampler(cfg.sampler, len(self.alive_nodes()))
                if cfg.sampler == "grid":
                    self.budget = min(self.budget, grid_size(space))
                study = repo.add_study(
                    s,
                    name=self.name,
                    chip_id=chip.id,
                    model_id=model.id,
                    objective=cfg.objective,
                    n_prompt=cfg.workload.n_prompt,
                    n_gen=cfg.workload.n_gen,
                    reps=cfg.workload.reps,
                    sampler=self.sampler,
                    budget=self.budget,
                    space=space.to_dict(),
                    simulated=self.target.simulated,
                )
                self.study_id = study.id
        self.optuna_study = self._optuna_study()
        if existing is None and self.sampler != "grid":  # a grid covers it all
            self._enqueue_starts()
        self._reconcile_optuna()
        self.storage.flush()

    def _enqueue_starts(self) -> None:
        """A new study first measures full offload (where the GPU can take layers), then the warm
        start configurations, then lets its sampler propose; each distinct config once."""
        reference = full_offload(self.target.fingerprint, self.cfg.model, self.space)
        seen = set()
        for params in [p for p in (reference, *self.cfg.warm_start) if p is not None]:
            values = self.space.optuna_params(self.space.clip(params))
            key = tuple(sorted(values.items()))
            if key not in seen:
                seen.add(key)
                self.optuna_study.enqueue_trial(values)

    def _check_same(self, study, chip, model) -> None:
        cfg = self.cfg
        same = (
            study.chip_id == chip.id
            and study.model_id == model.id
            and study.objective == cfg.objective
            and (study.n_prompt, study.n_gen) == (cfg.workload.n_prompt, cfg.workload.n_gen)
        )
        if not same:
            raise BadInput(
                f"study {study.name!r} is for another chip, model or workload "
                f"({study.chip.key}, {study.model.name}, {study.objective} p{study.n_prompt} g{study.n_gen})"
            )

    def _optuna_study(self) -> optuna.Study:
        self.storage = HeadStorage(RDBStorage(self.db.url_string, engine_kwargs=engine_kwargs(self.db.url)))
        sampler = make_sampler(self.sampler, self.space, self.budget, self.direction, self.cfg.seed)
        return optuna.create_study(
            study_name=self.name,
            storage=self.storage,
            sampler=sampler,
            direction=self.direction,
            load_if_exists=True,
        )

    def _reconcile_optuna(self) -> None:
        """Settle Optuna trials a stopped driver left RUNNING, from what the database recorded.

        A result stored before the driver died is told to Optuna (kept once, not measured again);
        a trial with no stored result is failed.
        """
        running = self.optuna_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not running:
            return
        with self.db.session() as s:
            stored = {r.optuna_number: r for r in repo.study_trials(s, self.study_id, "search")}
        for t in running:
            row = stored.get(t.number)
            if row is not None and row.state == "complete" and row.objective_value is not None:
                self.storage.set_trial_state_values(t._trial_id, TrialState.COMPLETE, [row.objective_value])
            else:
                self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)

    # ---------------------------------------------------------------- running

    def run(self) -> StudyOutcome:
        if self.study_id is None:
            self.prepare()
        try:
            if not self._phase_trials("baseline", complete_only=True):
                self._run_fixed("baseline", [(self.baseline, None)])
            self._search()
            self._confirm()
            draft, version = self._recommend()
        except KeyboardInterrupt:
            self._set_state("paused", "interrupted; `fleettune tune --resume` continues")
            raise StudyPaused(f"study {self.name} paused; run the same tune command with --resume") from None
        except StudyPaused as exc:
            self._set_state("paused", str(exc))
            raise
        counts = self._counts()
        self._set_state("complete", None)
        return StudyOutcome(self.name, "complete", counts[0], counts[1], draft, version, self.baseline)

    def _set_state(self, state: str, message: str | None) -> None:
        with self.db.session() as s:
            repo.set_study_state(s, self.study_id, state, message)

    def _phase_trials(self, phase: str, complete_only: bool = False):
        with self.db.session() as s:
            rows = repo.study_trials(s, self.study_id, phase)
        return [r for r in rows if r.state == "complete"] if complete_only else rows

    def _counts(self) -> tuple[int, int]:
        rows = self._phase_trials("search")
        return (
            sum(r.state == "complete" for r in rows),
            sum(r.state == "failed" for r in rows),
        )

    def _spec(self, params: BenchParams, key: str) -> TrialSpec:
        return TrialSpec(
            model_path=self.cfg.model.path,
            model_sha256=self.cfg.model.sha256,
            params=params,
            workload=self.cfg.workload,
            timeout_s=self.cfg.timeout_s,
            cooldown_s=self.cfg.cooldown_s,
            trial_key=key,
        )

    def _evaluate(self, result: TrialResult) -> tuple[float | None, float | None]:
        """A result's objective value (None for a failed trial) and end-to-end seconds."""
        if not result.ok:
            return None, None
        w = self.cfg.workload
        pp_m = result.pp.median if result.pp else None
        tg_m = result.tg.median if result.tg else None
        value = learn.objective_value(self.cfg.objective, pp_m, tg_m, w.n_prompt, w.n_gen)
        if value is None:
            result.ok, result.error = False, "no samples for the objective"
            return None, None
        return value, learn.e2e_seconds(pp_m, tg_m, w.n_prompt, w.n_gen)

    def _finished(self, row_id: int, result: TrialResult) -> repo.FinishedTrial:
        value, e2e = self._evaluate(result)
        return repo.FinishedTrial(row_id, result, value, e2e, self.target.node_ids.get(result.node_id or ""))

    def _commit(self, finished: list[repo.FinishedTrial], new: list[repo.NewTrial]) -> list[int]:
        """One transaction: results in, rows for the trials about to be dispatched, and what Optuna
        was told and asked since the last one. Returns the new rows' ids."""
        if not finished and not new and not self.storage.pending():
            return []
        with self.db.session() as s:
            repo.finish_trials(s, finished)
            ids = repo.start_trials(s, self.study_id, new, simulated=self.target.simulated)
            self.storage.flush(s)
        return ids

    def _wait_for_any(self, inflight: dict) -> list:
        """Finished refs; pauses the study when the chip has had no node for a grace period."""
        no_node_since = None
        while True:
            done = self.dispatcher.wait(list(inflight), POLL_S)
            if done:
                return done
            if self.alive_nodes():
                no_node_since = None
                continue
            no_node_since = no_node_since or time.monotonic()
            if time.monotonic() - no_node_since > self.no_node_grace_s:
                for ref in inflight:
                    self.dispatcher.cancel(ref)
                raise StudyPaused(f"no node of chip {self.target.key} is left; study {self.name} paused")

    def _run_fixed(self, phase: str, jobs: list[tuple[BenchParams, str | None]]) -> None:
        """Measure fixed configurations (baseline, confirmation), in parallel over the chip's nodes.

        A job pinned to a node that is gone runs on any node of the chip instead.
        """
        pending = list(jobs)
        inflight: dict = {}  # ref -> (row id, params, None: no Optuna trial)
        try:
            while pending or inflight:
                alive = self.alive_nodes()
                slots = max(len(alive), 1) - len(inflight)
                batch, pending = pending[:max(slots, 0)], pending[max(slots, 0):]
                row_ids = self._commit([], [repo.NewTrial(phase, p.to_dict()) for p, _ in batch])
                for (params, node), row_id in zip(batch, row_ids, strict=True):
                    spec = self._spec(params, f"{phase}-{row_id}")
                    ref = self.dispatcher.submit(spec, self.target.key, node if node in alive else None)
                    inflight[ref] = (row_id, params, None)
                self._emit(phase, len(jobs) - len(pending) - len(inflight), len(jobs), inflight)
                results = []
                for ref in self._wait_for_any(inflight):
                    row_id, params, _ = inflight.pop(ref)
                    results.append((row_id, params, self.dispatcher.result(ref, f"{phase}-{row_id}")))
                self._commit([self._finished(row_id, result) for row_id, _, result in results], [])
                for _, params, result in results:
                    if not result.ok and result.error == "node lost":
                        pending.append((params, None))  # measure it again on another node
                    self._emit(phase, len(jobs) - len(pending) - len(inflight), len(jobs),
                               inflight, last=result)
        except BaseException:
            self._abandon(inflight, [])
            raise

    def _search(self) -> None:
        """Ask the sampler for as many trials as the chip has idle nodes, a round at a time.

        Each round costs the head one transaction (its results and the next trials' rows) however
        many trials it holds, so a large fleet of short trials makes larger rounds, not more work
        per trial. A round collects at most ``ROUND_RESULTS`` results: when many nodes finish at
        once, the first of them are busy again before the last are collected.
        """
        study = self.optuna_study
        inflight: dict = {}  # ref -> (row id, params, Optuna trial)
        ready: list = []  # refs known to have finished, not yet collected
        proposals: list = []  # (Optuna trial, params) asked ahead, for the next nodes to finish
        results: list[repo.FinishedTrial] = []  # collected, written with the next round's starts
        # counted once here, then kept up to date locally: re-reading the study every round costs
        # the head a database read per trial, which a large fleet of short trials notices
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        complete = sum(t.state == TrialState.COMPLETE for t in trials)
        failed = len(trials) - complete

        def room() -> int:
            return self.budget - complete - len(inflight) - len(proposals)

        def propose() -> tuple:
            trial = study.ask()
            return trial, self.space.suggest(trial)

        try:
            while True:
                if failed >= max(5, self.budget):
                    raise StudyPaused(f"{failed} trials failed; see `fleettune results --study "
                                      f"'{self.name}' --state failed`")
                slots = max(len(self.alive_nodes()), 1) - len(inflight)
                asked, proposals = proposals[:max(slots, 0)], proposals[max(slots, 0):]
                while len(asked) < slots and room() > len(asked):
                    asked.append(propose())
                row_ids = self._commit(results, [repo.NewTrial("search", params.to_dict(), trial.number)
                                                 for trial, params in asked])
                results = []
                for (trial, params), row_id in zip(asked, row_ids, strict=True):
                    ref = self.dispatcher.submit(self._spec(params, f"search-{row_id}"), self.target.key)
                    inflight[ref] = (row_id, params, trial)
                if not inflight:
                    return
                self._emit("search", complete, self.budget, inflight, failed)
                # while no result is in, propose ahead for the next nodes to finish, so they need
                # not wait for the sampler; only in a large fleet, where one result more or less
                # changes little of what the sampler knows (small fleets always get fresh proposals)
                ahead = min(AHEAD_MAX, len(inflight) // AHEAD_EVERY) if len(inflight) >= AHEAD_MIN_RUNNING else 0
                while not ready and len(proposals) < ahead and room() > 0:
                    ready = self.dispatcher.wait(list(inflight), 0)
                    if not ready:
                        proposals.append(propose())
                if not ready:
                    ready = self._wait_for_any(inflight)
                # a few results at a time, so their nodes get new trials while the rest wait
                chunk, ready = ready[:ROUND_RESULTS], ready[ROUND_RESULTS:]
                round_results = []
                for ref in chunk:
                    row_id, params, trial = inflight.pop(ref)
                    finished = self._finished(row_id, self.dispatcher.result(ref, f"search-{row_id}"))
                    if finished.objective_value is None:
                        study.tell(trial, state=TrialState.FAIL)
                        failed += 1
                    else:
                        study.tell(trial, finished.objective_value)
                        complete += 1
                    round_results.append((finished, params))
                results = [f for f, _ in round_results]
                for finished, params in round_results:
                    if finished.result.error == "node lost":
                        study.enqueue_trial(self.space.optuna_params(params))  # asked again elsewhere
                    self._emit("search", complete, self.budget, inflight, failed, last=finished.result)
        except BaseException:
            for trial, _ in proposals:
                study.tell(trial, state=TrialState.FAIL)  # asked ahead, never dispatched
            self._abandon(inflight, results)
            raise

    def _abandon(self, inflight: dict, collected: list[repo.FinishedTrial]) -> None:
        """Cancel running trials and mark them failed (interrupted), in the DB and in Optuna;
        results already collected are stored as they are."""
        finished = list(collected)
        for ref, (row_id, _, trial) in inflight.items():
            self.dispatcher.cancel(ref)
            finished.append(repo.FinishedTrial(row_id, TrialResult.failure("", "interrupted"), None, None, None))
            if trial is not None:
                self.optuna_study.tell(trial, state=TrialState.FAIL)
        self._commit(finished, [])

    def _records(self) -> tuple[list[learn.TrialRecord], dict[int, float]]:
        from orchestrator.schedules import trial_records

        with self.db.session() as s:
            rows = repo.study_trials(s, self.study_id)
            values = {r.id: r.objective_value for r in rows
                      if r.state == "complete" and r.objective_value is not None}
            return trial_records(rows), values

    def _confirm(self) -> None:
        """Measure the top configurations and the baseline again, in one round.

        Where the chip has two or more nodes, every configuration is confirmed on two different
        nodes (pairs rotating over the chip's nodes), so one node's quirks cannot pick the winner
        and every node gets compared with a peer on the same configuration.
        """
        records, values = self._records()
        top = learn.top_configs(records, values, self.cfg.objective, self.cfg.confirm_top)
        if not top:
            return
        confirmed = {learn.config_key(BenchParams.from_dict(r.params))
                     for r in self._phase_trials("confirm", complete_only=True)}
        nodes = sorted(self.alive_nodes()) or [None]
        configs = [p for p in [*top, self.baseline] if learn.config_key(p) not in confirmed]
        jobs = []
        for i, params in enumerate(configs):  # pairs rotate so every node is compared with a peer
            pair = {nodes[i % len(nodes)], nodes[(i + 1) % len(nodes)]}
            jobs += [(params, node) for node in sorted(pair, key=str)]
        if jobs:
            self._run_fixed("confirm", jobs)

    def _recommend(self) -> tuple[learn.RecommendationDraft | None, int | None]:
        records, _ = self._records()
        w = self.cfg.workload
        draft = learn.recommend(records, self.cfg.objective, w.n_prompt, w.n_gen)
        if draft is None:
            return None, None
        with self.db.session() as s:
            study = repo.get_study(s, self.name)
            rec = repo.add_recommendation(
                s,
                chip_id=study.chip_id,
                model_id=study.model_id,
                study_id=study.id,
                objective=self.cfg.objective,
                n_prompt=w.n_prompt,
                n_gen=w.n_gen,
                params=draft.params.to_dict(),
                expected_tps=draft.expected_tps,
                interval_low=draft.interval_low,
                interval_high=draft.interval_high,
                expected_pp_tps=draft.expected_pp_tps,
                expected_tg_tps=draft.expected_tg_tps,
                baseline_tps=draft.baseline_tps,
                improvement=draft.improvement,
                evidence=draft.evidence,
                simulated=draft.simulated,
            )
            version = rec.version
        return draft, version

    def _emit(self, phase, done, total, inflight, failed=0, last=None) -> None:
        best_value = best_params = None
        if phase == "search":
            best_value, best_params = self._best(done)
        running = [params for _, params, _ in inflight.values()]
        self.on_progress(Progress(phase, done, total, failed, best_value, best_params, running, last))

    def _best(self, n_complete: int) -> tuple[float | None, BenchParams | None]:
        """The best search trial so far, looked up again only when a trial completed."""
        if self._best_at != n_complete:
            try:
                best = self.optuna_study.best_trial
                self._best_cached = best.value, self.space.suggest(optuna.trial.FixedTrial(best.params))
            except ValueError:
                self._best_cached = None, None
            self._best_at = n_complete
        return self._best_cached
