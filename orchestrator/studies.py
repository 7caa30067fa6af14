"""Studies: one Optuna study per (chip, model, workload, objective), run over Ray, stored in the DB.

A study is one round loop (``StudyRunner._drive``) run over three sources of jobs in turn: the
baselines (llama-cpp-python's defaults and llama.cpp's own, so the gain over each is known), the
search (a first design of full offload, llama.cpp's defaults inside the space and the warm-start
configurations, then the sampler's proposals) and the confirmation (the top configurations, both
baselines and an A/A arm in interleaved rounds on one node, ``ConfirmRounds``, issue 20.2). Every round of the loop is the same four steps,
in one place:

    propose   (the source gives as many jobs as the chip has idle nodes)
    store     (one transaction: the last round's results, Optuna's state, the new trials' rows)
    dispatch  (each job to a node of the chip, one benchmark per node)
    collect   (a few finished results at a time; each settled with its source)

as Optuna's own ``study/_optimize.py`` runs its loop over the study's public ``ask``/``tell``.
A round's results and what Optuna was told about them are written in the same transaction, so a
driver killed at any instant leaves both tables agreeing; ``--resume`` finishes what it left.

The head owns the database; workers get a ``TrialSpec`` and return a ``TrialResult``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from orchestrator import dispatch, learn, lease
from orchestrator.db import Database, repo
from orchestrator.db.session import DatabaseUnavailable, engine_kwargs, retrying
from orchestrator.db.storage import HeadStorage
from orchestrator.dispatch import Dispatcher
from orchestrator.samplers import SAMPLER_NAMES, grid_size, make_sampler, resolve_sampler
from orchestrator.space import (
    SearchSpace,
    compact_cache,
    full_offload,
    llama_cpp_defaults,
    llama_cpp_python_defaults,
    moe_layout,
    obvious_slots,
    predicted_optimum,
    without_prompt_cache,
)
from orchestrator.stopping import StopRequest
from workers import agent, placement
from workers.errors import BadInput, FleettuneError
from workers.hardware import Fingerprint
from workers.knobs import SERVER_FIELDS
from workers.knobs import check_on_node as validate_params
from workers.llamatools import FitPlacement
from workers.models import ModelInfo
from workers.objective import CAPACITY, OBJECTIVES, TG, Objective, e2e_seconds, objective
from workers.trial import (
    BenchParams,
    FailureKind,
    ServedWorkload,
    TrialResult,
    TrialSpec,
    Workload,
    validate_workload,
)

POLL_S = 0.5
ROUND_RESULTS = 16  # results collected per round before idle nodes get new trials
# proposals made ahead of need while results are awaited: one for every AHEAD_EVERY running
# trials, at most AHEAD_MAX, and none below AHEAD_MIN_RUNNING (a small fleet's head has time to
# make every proposal with every result in)
AHEAD_EVERY = 2
AHEAD_MAX = 128
AHEAD_MIN_RUNNING = 32
NO_NODE_GRACE_S = 30.0
# llama-fit-params on a node (it loads no weights, only sizes them): its own limit, and the way there and back
FIT_PLAN_TIMEOUT_S = agent.PLAN_FIT_TIMEOUT_S + 30.0
MAX_NODE_LOSSES = 3  # a configuration lost with this many nodes is failed, not measured again
DEFAULT_TRIALS = 30
ORPHANED = "orphaned: the driver stopped"
# issue 20.2: the interleaved confirmation runs at least CONFIRM_MIN_ROUNDS rounds and stops when the
# winner's ratio over each baseline is known to within +-CONFIRM_HALF_WIDTH (log scale, ~ +-2.5 %),
# or after its budget of rounds (StudyConfig.confirm_rounds)
CONFIRM_MIN_ROUNDS = 3
CONFIRM_MAX_ROUNDS = 5  # the default budget of rounds; FLEETTUNE_CONFIRM_ROUNDS sets another
CONFIRM_HALF_WIDTH = 0.025
# issue 20.6: a proposal of a configuration that failed before is told a penalised value, not run;
# a sampler that proposes only such configurations this many times in a row ends the search
MAX_FAILED_PROPOSALS = 25
PENALISED = "penalised"  # the Optuna user attribute of a trial told a penalised value
REPEAT_OF = "repeat_of"  # the Optuna user attribute of a trial llama.cpp ran as an earlier one


def failure_budget(budget: int) -> int:
    """Failed search trials a study accepts before it pauses (issue 20.6): the budget, at least 5."""
    return max(5, budget)

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger(__name__)


class StudyPaused(FleettuneError):
    """The study stopped before its budget (a signal, no node of the chip left, the database
    away); ``--resume`` continues it."""


def _finite_positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    import math

    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise BadInput(f"{name} {value!r}: must be a finite number {bound}")


def check_depth(workload: Workload, model: ModelInfo) -> None:
    """A depth is a whole number of tokens >= 0 whose cache, with the prompt and the generated
    tokens after it, fits the model's context (llama.cpp would refuse the context otherwise)."""
    depth = workload.depth
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise BadInput(f"--depth {depth!r}: must be a whole number of tokens >= 0")
    total = depth + workload.n_prompt + workload.n_gen
    if model.context_length and total > model.context_length:
        raise BadInput(f"--depth {depth}: {depth}+{workload.n_prompt}+{workload.n_gen} tokens exceed "
                       f"{model.name}'s context of {model.context_length}")



def default_confirm_rounds() -> int:
    """The confirmation's default budget of rounds: ``$FLEETTUNE_CONFIRM_ROUNDS``, else
    CONFIRM_MAX_ROUNDS (a whole number of at least CONFIRM_MIN_ROUNDS; BadInput otherwise)."""
    text = os.environ.get("FLEETTUNE_CONFIRM_ROUNDS", "").strip()
    if not text:
        return CONFIRM_MAX_ROUNDS
    if not text.isdigit() or int(text) < CONFIRM_MIN_ROUNDS:
        raise BadInput(f"FLEETTUNE_CONFIRM_ROUNDS={text!r}: a whole number of rounds, at least {CONFIRM_MIN_ROUNDS}")
    return int(text)

@dataclass(frozen=True)
class StudyConfig:
    """What the user asked for. ``None`` means "not given": a new study takes the default, a
    resumed one keeps what it was created with."""

    model: ModelInfo
    objective: Objective | str = TG
    workload: Workload = field(default_factory=Workload)
    n_trials: int | None = None
    sampler: str = "auto"
    name: str | None = None
    resume: bool = False
    seed: int | None = None
    timeout_s: float = 600.0
    cooldown_s: float = 0.0
    confirm_top: int = 3
    warm_start: tuple[BenchParams, ...] = ()  # measured first, before the sampler proposes
    reps: int | None = None  # overrides workload.reps when given
    allow_lossy: bool = False  # issue 20.4: search the K/V cache types (they change the outputs)
    confirm_rounds: int = field(default_factory=lambda: default_confirm_rounds())  # issue 20.2: budget of rounds
    gpu_budget: str | None = None  # issue 23.1: "8GiB"; configurations estimated over it are not loaded
    served: ServedWorkload | None = None  # issue 22.1: how a served objective's trials load llama-server

    def __post_init__(self) -> None:
        if isinstance(self.objective, str) and self.objective in OBJECTIVES:
            object.__setattr__(self, "objective", objective(self.objective))
        if self.reps is not None:
            object.__setattr__(self, "workload", replace(self.workload, reps=self.reps))
        if isinstance(self.objective, Objective) and self.objective.served:
            served = self.served or ServedWorkload()
            object.__setattr__(self, "served", replace(served, capacity=self.objective is CAPACITY))

    @property
    def target_objective(self) -> Objective:
        return objective(self.objective)

    def validate(self) -> None:
        """Every value checked before anything is written."""
        obj = objective(self.objective)
        if self.sampler not in SAMPLER_NAMES:
            raise BadInput(f"unknown sampler {self.sampler!r}; choose one of {', '.join(SAMPLER_NAMES)}")
        if self.n_trials is not None and (not isinstance(self.n_trials, int) or self.n_trials < 1):
            raise BadInput(f"trials {self.n_trials}: must be >= 1")
        _finite_positive("--timeout", self.timeout_s)
        _finite_positive("--cooldown", self.cooldown_s, zero_ok=True)
        if self.confirm_top < 0:
            raise BadInput(f"--confirm-top {self.confirm_top}: must be >= 0")
        if not isinstance(self.confirm_rounds, int) or self.confirm_rounds < CONFIRM_MIN_ROUNDS:
            raise BadInput(f"--confirm-rounds {self.confirm_rounds}: must be >= {CONFIRM_MIN_ROUNDS}")
        if self.workload.reps < 1:
            raise BadInput(f"--reps {self.workload.reps}: must be >= 1")
        if self.gpu_budget is not None:
            placement.parse_positive_size(self.gpu_budget)
        obj.check_workload(self.workload.n_prompt, self.workload.n_gen)
        if obj.served:
            self.served.validate(self.workload.n_prompt)
            if self.workload.depth:
                raise BadInput("--depth is for one stream (llama-bench -d); a served study's requests bring their prompts")
        elif self.served is not None:
            raise BadInput(f"served load options are for the served objectives (goodput, capacity, throughput), "
                           f"not {obj.name}")
        check_depth(self.workload, self.model)
        validate_workload(self.workload, self.model)


@dataclass(frozen=True)
class ChipTarget:
    """The chip a study runs on: its fingerprint and the DB ids of its known nodes."""

    fingerprint: Fingerprint
    node_ids: dict[str, int]  # ray node id -> nodes.id
    simulated: bool = False
    ray_nodes: tuple[str, ...] = ()  # the chip's Ray node ids, known before its rows are recorded

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
    baseline_params: BenchParams  # llama-cpp-python's defaults
    baselines: dict[str, BenchParams] = field(default_factory=dict)  # every baseline, by name


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def default_study_name(chip_key: str, model: ModelInfo, objective: Objective | str, workload: Workload,
                       served: ServedWorkload | None = None) -> str:
    depth = f"-d{workload.depth}" if workload.depth else ""
    load = ""
    if served is not None:  # a served study: its load and SLO are part of what it is
        load = "-" + (f"max{served.max_users}" if served.capacity else
                      f"r{served.rate:g}" if served.rate else f"u{served.users}") + f"-{served.slo}"
    return (f"{chip_key}/{model.name}-{model.sha256[:8]}/{objective}-p{workload.n_prompt}-g{workload.n_gen}"
            f"{depth}{load}")


# ---------------------------------------------------------------- jobs and their sources


@dataclass
class Job:
    """One measurement the loop runs: a configuration, maybe pinned to a node, maybe an Optuna
    trial; ``losses`` counts the nodes lost under it so far."""

    phase: str
    params: BenchParams
    node: str | None = None
    trial: optuna.trial.Trial | None = None
    losses: int = 0
    row_id: int | None = None
    settled: bool = False
    arm: str | None = None  # a baseline's name; the interleaved confirmation's arm and round (issue 20.2)
    round: int | None = None
    refused: str | None = None  # why it may not be loaded (issue 23.1): failed with this, never dispatched


class JobSource(Protocol):
    """Where a phase's jobs come from, and what a result means to it."""

    phase: str
    total: int

    def take(self, n: int) -> list[Job]:
        """Up to ``n`` jobs to start now (fewer, or none, when the phase has no more)."""

    def ahead(self, running: int) -> bool:
        """Prepare one job ahead of need while results are awaited; False when there is none."""

    def settle(self, job: Job, finished: repo.FinishedTrial) -> None:
        """Account for a job's result (tell Optuna, measure a lost job again...)."""

    def abandon(self, job: Job) -> None:
        """A job that will not finish (the study is pausing): fail it where it is tracked."""

    def release(self) -> list[Job]:
        """Jobs prepared but never dispatched, to be abandoned when the loop stops."""

    def done_count(self) -> int: ...

    def failed_count(self) -> int: ...


class _Counted:
    """What every job source counts: results that gave a value, and those that failed; by default a
    source prepares nothing ahead that it would have to release."""

    _done = 0
    _failed = 0

    def release(self) -> list[Job]:
        return []

    def done_count(self) -> int:
        return self._done

    def failed_count(self) -> int:
        return self._failed


class FixedJobs(_Counted):
    """A fixed list of named configurations (the baselines). A job lost with its node runs again on
    any node of the chip, at most ``MAX_NODE_LOSSES`` times; one that ``refuse`` says may not be
    loaded (issue 23.1: over the GPU budget) is failed with that reason, never dispatched."""

    def __init__(self, phase: str, jobs: list[tuple[str, BenchParams]], alive: Callable[[], list[str]],
                 refuse: Callable[[BenchParams], str | None] | None = None):
        self.phase = phase
        self.pending = [Job(phase, params, arm=name) for name, params in jobs]
        self.total = len(self.pending)
        self.alive = alive
        self.refuse = refuse or (lambda params: None)
        self._done = self._failed = 0

    def take(self, n: int) -> list[Job]:
        batch, self.pending = self.pending[:n], self.pending[n:]
        if batch:
            alive = set(self.alive())
            for job in batch:  # a job pinned to a node that is gone runs on any node of the chip
                if job.node not in alive:
                    job.node = None
                job.refused = self.refuse(job.params)
        return batch

    def ahead(self, running: int) -> bool:
        return False

    def settle(self, job: Job, finished: repo.FinishedTrial) -> None:
        job.settled = True
        if finished.result.kind is FailureKind.NODE_LOST and job.losses + 1 < MAX_NODE_LOSSES:
            self.pending.append(Job(self.phase, job.params, None, losses=job.losses + 1, arm=job.arm))
        elif finished.objective_value is None:
            self._failed += 1
        else:
            self._done += 1

    def abandon(self, job: Job) -> None:
        job.settled = True


class SamplerJobs(_Counted):
    """The search: trials asked of the Optuna study (queued configurations first), until
    ``budget`` of them complete. A trial lost with its node is failed in Optuna and its
    configuration queued again, at most ``MAX_NODE_LOSSES`` times."""

    phase = "search"

    def __init__(self, study: optuna.Study, space: SearchSpace, budget: int,
                 failed: set[str] | None = None, seen: dict[str, int] | None = None,
                 refuse: Callable[[BenchParams], str | None] | None = None) -> None:
        self.study, self.space, self.total = study, space, budget
        self.refuse = refuse or (lambda params: None)  # why a configuration must not be loaded (issue 23.1)
        # counted once here, then kept up to date locally: re-reading the study every round costs
        # the head a database read per trial, which a large fleet of short trials notices
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        self._done = sum(t.state == TrialState.COMPLETE and PENALISED not in t.user_attrs for t in trials)
        self.maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        values = [t.value for t in trials if t.state == TrialState.COMPLETE and PENALISED not in t.user_attrs]
        self.worst = (min if self.maximize else max)(values) if values else None
        self.failed = set(failed or ())  # configurations (as asked for) that failed: never run again
        self.seen = dict(seen or {})  # identities measured (issue 20.1) -> the first Optuna trial number
        self._failed = 0  # failures of configurations (not lost nodes, not pauses) in this run
        self.running = 0
        self.proposals: list[Job] = []  # asked ahead, for the next nodes to finish
        self.losses: dict[str, int] = {}  # configuration -> nodes lost under it

    def room(self) -> int:
        return self.total - self._done - self.running - len(self.proposals)

    def _expect(self, count: int) -> None:
        """Tell a sampler that draws proposals in batches how many are asked now (RoundTPESampler)."""
        expect = getattr(self.study.sampler, "expect", None)
        if expect is not None:
            expect(count)

    def penalty(self) -> float:
        """The value a failed configuration is told (issue 20.6): half the worst measured rate, or
        twice the worst time; every sampler (GP included) learns to avoid it from a value."""
        if self.worst is None:
            return 0.0 if self.maximize else 1e9
        return self.worst * 0.5 if self.maximize else self.worst * 2

    def _propose(self) -> Job | None:
        """The sampler's next configuration that has not failed before (issue 20.6) and may be
        loaded (issue 23.1: within the GPU budget); one it proposes that may not is told the
        penalised value at once, never dispatched. None: it proposes nothing else."""
        for _ in range(MAX_FAILED_PROPOSALS):
            trial = self.study.ask()
            params = self.space.suggest(trial)
            key = learn.config_key(params)
            reason = "failed before" if key in self.failed else self.refuse(params)
            if reason is None:
                return Job("search", params, trial=trial, losses=self.losses.get(key, 0))
            trial.set_user_attr(PENALISED, reason)
            self.study.tell(trial, self.penalty())
        log.warning("the %s sampler proposed only configurations that failed before or may not be loaded "
                    "(%d in a row); the search ends with %d trials", self.study.sampler.__class__.__name__,
                    MAX_FAILED_PROPOSALS, self._done)
        self.total = self._done + self.running + len(self.proposals)
        return None

    def take(self, n: int) -> list[Job]:
        if self._failed >= failure_budget(self.total):
            raise StudyPaused(f"{self._failed} trials failed (the failure budget is {failure_budget(self.total)}); "
                              f"see `fleettune results --state failed`")
        batch, self.proposals = self.proposals[:n], self.proposals[n:]
        self.running += len(batch)
        self._expect(min(n - len(batch), self.room()))
        while len(batch) < n and self.room() > 0:
            job = self._propose()
            if job is None:
                break
            batch.append(job)
            self.running += 1
        return batch

    def ahead(self, running: int) -> bool:
        if running < AHEAD_MIN_RUNNING:
            return False  # a small fleet always gets fresh proposals
        if len(self.proposals) >= min(AHEAD_MAX, running // AHEAD_EVERY) or self.room() <= 0:
            return False
        self._expect(1)  # one at a time: a result may arrive before the next, and stop them
        job = self._propose()
        if job is None:
            return False
        self.proposals.append(job)
        return True

    def settle(self, job: Job, finished: repo.FinishedTrial) -> None:
        self.running -= 1
        job.settled = True
        if finished.objective_value is None:
            kind = finished.result.kind
            key = learn.config_key(job.params)
            if kind in (FailureKind.NODE_LOST, FailureKind.INTERRUPTED):  # nothing said of the configuration
                self.study.tell(job.trial, state=TrialState.FAIL)
                if kind is FailureKind.NODE_LOST:
                    self.losses[key] = job.losses + 1
                    if job.losses + 1 < MAX_NODE_LOSSES:  # measured again, on another node
                        self.study.enqueue_trial(self.space.optuna_params(job.params))
                        return
                    self.failed.add(key)
                    self._failed += 1
                return
            # the configuration's own failure: remembered, and told as a penalised value (issue 20.6)
            self.failed.add(key)
            job.trial.set_user_attr(PENALISED, kind.value if kind else "failed")
            self.study.tell(job.trial, self.penalty())
            self._failed += 1
        else:
            effective = finished.result.effective
            if effective is not None:  # the sampler is told a repeat of what llama.cpp ran (issue 20.1)
                first = self.seen.setdefault(learn.identity(job.params, effective), job.trial.number)
                if first != job.trial.number:
                    job.trial.set_user_attr(REPEAT_OF, first)
            value = finished.objective_value
            if self.worst is None or (value < self.worst if self.maximize else value > self.worst):
                self.worst = value
            self.study.tell(job.trial, value)
            self._done += 1

    def abandon(self, job: Job) -> None:
        if job in self.proposals:
            self.proposals.remove(job)
        elif not job.settled:
            self.running -= 1
        job.settled = True
        self.study.tell(job.trial, state=TrialState.FAIL)

    def release(self) -> list[Job]:
        return list(self.proposals)


class ConfirmRounds(_Counted):
    """The interleaved confirmation (issue 20.2): the candidates, both baselines and llama.cpp's
    defaults once more (the A/A arm: the machine's own noise) measured one at a time, in rounds whose
    order rotates (A B C, B C A, C A B, ...) so that drift over time and the position in a round touch
    every arm alike. Every arm of a round runs on one node, after a warm-up on that node; successive
    rounds take the chip's nodes in turn, so a ratio (paired within its round) never mixes two
    nodes, and each configuration is measured on several nodes (``fleet status`` compares nodes on
    them). Rounds go on until the winner's ratio over each baseline is narrow enough
    (``CONFIRM_HALF_WIDTH``) after ``CONFIRM_MIN_ROUNDS``, or until ``max_rounds``. A job lost with
    its node runs again on another node."""

    phase = "confirm"

    def __init__(self, arms: list[tuple[str, BenchParams]], nodes: list[str], alive: Callable[[], list[str]],
                 rate: Callable[[TrialResult], float | None], max_rounds: int, first_round: int = 1,
                 values: dict[int, dict[str, float | None]] | None = None) -> None:
        self.arms, self.nodes, self.alive, self.rate = arms, list(nodes), alive, rate
        self.max_rounds = max_rounds
        self.values: dict[int, dict[str, float | None]] = dict(values or {})  # round -> arm -> rate
        self.round = first_round - 1
        self.first_round = first_round
        self.queue: list[tuple[str, BenchParams, int]] = []
        self.warmed: set[str | None] = set()  # nodes that ran this confirmation's warm-up
        self.round_node: dict[int, str | None] = {}
        self.running = False
        rounds = max(max_rounds - len(self.values), 0)
        self.total = min(max(len(self.nodes), 1), rounds) + len(arms) * rounds
        self._done = self._failed = 0

    def _narrow(self) -> bool:
        """Whether the winner-to-be's ratio over each baseline is known closely enough."""
        from orchestrator.pairedstats import ratio_interval

        order = sorted(self.values)

        def interval(a: str, b: str):
            return ratio_interval([self.values[i].get(a) for i in order], [self.values[i].get(b) for i in order])

        names = [name for name, _ in self.arms]
        candidates = [n for n in names if n.startswith(learn.CANDIDATE)]
        baselines = [n for n in (*learn.OTHER_BASELINES, learn.LLAMA_CPP) if n in names]
        reference = learn.reference_arm(self.values) or names[0]
        if not candidates:
            noise = learn.noise_arm(reference)
            pairs = [(noise, reference)] if noise in names else []
        else:
            best = max(candidates, key=lambda a: _ranked(interval(a, reference).ratio))
            pairs = [(best, b) for b in baselines]
        return all(interval(a, b).half_width <= CONFIRM_HALF_WIDTH for a, b in pairs)

    def _next(self) -> tuple[str, BenchParams, int] | None:
        if self.queue:
            return self.queue.pop(0)
        done_rounds = len(self.values)
        if done_rounds >= self.max_rounds or (done_rounds >= CONFIRM_MIN_ROUNDS and self._narrow()):
            return None
        self.round += 1
        shift = (self.round % learn.ROUND_GENERATION - 1) % len(self.arms)
        self.queue = [(name, params, self.round) for name, params in self.arms[shift:] + self.arms[:shift]]
        self.values.setdefault(self.round, {})
        return self.queue.pop(0)

    def take(self, n: int) -> list[Job]:
        if self.running or n <= 0 or not self.arms:
            return []
        item = self._next()
        if item is None:
            return []
        name, params, round_ = item
        node = self._node_for(round_)
        if node not in self.warmed:  # the node's first job of this confirmation: its warm-up first
            self.queue.insert(0, item)
            name, params = learn.WARMUP_ARM, self.arms[0][1]
        self.running = True
        return [Job(self.phase, params, node, arm=name, round=round_)]

    def _node_for(self, round_: int) -> str | None:
        """The node of a round: the chip's nodes in turn, round by round; a round keeps its node
        while it is alive (its ratios are paired on one node), and moves to another when it is gone."""
        alive = sorted(self.alive())
        node = self.round_node.get(round_)
        if node is not None and node in alive:
            return node
        pool = [n for n in self.nodes if n in alive] or alive
        node = pool[(round_ - self.first_round) % len(pool)] if pool else None
        self.round_node[round_] = node
        return node

    def ahead(self, running: int) -> bool:
        return False

    def settle(self, job: Job, finished: repo.FinishedTrial) -> None:
        job.settled = True
        self.running = False
        if finished.result.kind is FailureKind.NODE_LOST and job.losses + 1 < MAX_NODE_LOSSES:
            self.queue.insert(0, (job.arm or "", job.params, job.round or 0))
            return
        if job.arm == learn.WARMUP_ARM:
            self.warmed.add(job.node)  # a warm-up is never repeated (a lost node's round moves on)
            return
        value = self.rate(finished.result) if finished.objective_value is not None else None
        self.values.setdefault(job.round or 0, {})[job.arm or ""] = value
        if value is None:
            self._failed += 1
        else:
            self._done += 1

    def abandon(self, job: Job) -> None:
        job.settled = True
        self.running = False


def _medians(result: TrialResult, target: Objective) -> dict[str, float | None]:
    """The median of each kind of sample the objective combines (pp, tg, or a served kind)."""
    return {kind: stats.median if (stats := result.stats(kind)) else None for kind in target.kinds}


def _ranked(ratio: float) -> float:
    """A ratio as a sort key: an infinite one (the baseline scored 0) first, none at all (nan) last."""
    return -float("inf") if math.isnan(ratio) else ratio


# ---------------------------------------------------------------- the runner


def over_gpu_budget(result: TrialResult, budget: int | None) -> str | None:
    """Why a measured trial is over the study's GPU budget (issue 23.1), or None: the driver's count
    for its process (CUDA context included) where there is one, and llama.cpp's own buffers."""
    if not budget:
        return None
    gib = 1024**3
    if (result.gpu_device_bytes or 0) > budget:
        return (f"over the GPU budget: the GPU's driver counted {result.gpu_device_bytes / gib:.2f} GiB for the "
                f"trial (llama.cpp's buffers and the CUDA context) > {budget / gib:.2f} GiB")
    if (result.gpu_bytes or 0) > budget:
        return (f"over the GPU budget: llama.cpp allocated {result.gpu_bytes / gib:.2f} GiB on the GPU "
                f"> {budget / gib:.2f} GiB")
    return None


class StudyRunner:
    """Runs one study to its budget; safe to interrupt, kill and resume."""

    def __init__(
        self,
        db: Database,
        dispatcher: Dispatcher,
        cfg: StudyConfig,
        target: ChipTarget,
        alive_nodes: Callable[[], list[str]] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        self.db, self.dispatcher, self.cfg, self.target = db, dispatcher, cfg, target
        # the chip's live nodes: the dispatcher's own list unless a caller gives another
        self.alive_nodes = alive_nodes or (lambda: dispatcher.alive_nodes(target.key))
        self.on_progress = on_progress or (lambda p: None)
        self.stop = stop if stop is not None else StopRequest()
        self.objective = cfg.target_objective
        self.direction = self.objective.direction.value
        self.served = cfg.served if self.objective.served else None
        defaults = llama_cpp_defaults(target.fingerprint, cfg.model, cfg.workload.n_prompt)
        if self.served is None:
            self.baseline = llama_cpp_python_defaults(target.fingerprint)
            self.baselines = {  # measured in every study, in this order
                learn.LLAMA_CPP_PYTHON: self.baseline,
                learn.LLAMA_CPP: defaults,
            }
        else:  # issue 22.5: llama-server's own defaults (-b 2048 -ub 512 whatever the prompt), and
            # prepare adds the single-stream recommendation
            self.baseline = llama_cpp_defaults(target.fingerprint, cfg.model)
            self.baselines = {learn.LLAMA_CPP: self.baseline}
        self.study_id: int | None = None
        self.name = ""
        self.space: SearchSpace | None = None
        self.budget = cfg.n_trials or DEFAULT_TRIALS
        self.workload = cfg.workload
        self.sampler = cfg.sampler  # resolved ("auto" -> gp or tpe) by prepare
        self.no_node_grace_s = NO_NODE_GRACE_S
        self.owner = lease.new_owner()
        self.finished_already = False  # a resumed study that had nothing left to do
        self.fit_source: str | None = None  # where the --fit baseline's placement came from (issue 23.3)
        self.fit_by_llama = False  # llama.cpp planned it: its own estimate is not second-guessed by ours
        # issue 23.1: what the GPU's driver held for a trial beyond the estimate of its buffers (the
        # CUDA context and pools, and the estimate's own error: ~1 % low for the H200's MoE, 160 MiB
        # at its budget's edge), the most any trial of this run showed; added to the estimate before loading
        self.device_overhead_bytes = 0
        self._beat_at = 0.0
        self._best_at: int | None = None
        self._best_cached: tuple[float | None, BenchParams | None] = (None, None)
        self._best_number: int | None = None
        self._optuna_id: int | None = None

    # ---------------------------------------------------------------- setup

    def prepare(self) -> None:
        """Create or resume the study rows and take its lease; raises BadInput before writing
        anything on a clash (a name taken, a study held by another driver, another workload)."""
        cfg, fp = self.cfg, self.target.fingerprint
        cfg.validate()
        for params in self.baselines.values():
            validate_params(params, fp, cfg.model)
        budget = placement.parse_budget(cfg.gpu_budget, fp) if cfg.gpu_budget else None
        if self.served is not None:
            space = SearchSpace.for_served(fp, cfg.model, cfg.workload.n_prompt, cfg.workload.n_gen, self.served,
                                           moe_layout(cfg.model), lossy=cfg.allow_lossy, gpu_budget=budget)
            single = self._single_stream_recommendation()
            if single is not None and learn.config_key(single) != learn.config_key(self.baselines[learn.LLAMA_CPP]):
                validate_params(single, fp, cfg.model)
                self.baselines[learn.SINGLE_STREAM] = single
        else:
            space = SearchSpace.for_target(fp, cfg.model, cfg.workload.n_prompt, self.objective,
                                           moe_layout(cfg.model), depth=cfg.workload.depth, lossy=cfg.allow_lossy,
                                           gpu_budget=budget)
        # one transaction, retried whole when the database is busy or another driver created the
        # same chip or model row at the same instant (SQLite refuses a stale writer, PostgreSQL a
        # duplicate key; the next attempt finds the row)
        existing = retrying(lambda: self._study_rows(space), conflicts=True)
        if self.served is None:
            self._set_fit_baseline(resumed=existing is not None)
        # Optuna creates its own tables on a database's first use: two drivers starting at once
        # race to stamp its version (a duplicate key for one of them); the second attempt finds it
        self.optuna_study = retrying(self._optuna_study, conflicts=True)
        # a grid covers it all, and a seed scan is llama-bench's own loop, scanned as it is
        if existing is None and self.sampler not in ("grid", "seed-scan"):
            self._enqueue_starts()
        self._reconcile_optuna()
        self.storage.flush()

    def _single_stream_recommendation(self) -> BenchParams | None:
        """The chip's newest tg recommendation for this model (issue 22.5: the single-stream
        recommendation served as it is, llama-server deciding its own knobs); None where none exists."""
        with self.db.session() as s:
            model = repo.find_model(s, self.cfg.model.sha256)
            if model is None:
                return None
            recs = repo.latest_recommendations(s, [model.id], self.target.key, str(TG))
            if not recs or recs[0].simulated != self.target.simulated:
                return None
            params = BenchParams.from_dict(recs[0].params)
        return replace(params, **{name: None for name in SERVER_FIELDS})

    def _fit_baseline(self, budget: int | None) -> BenchParams | None:
        """llama.cpp's ``--fit`` placement of its defaults for the study's GPU budget (the user's, or
        the GPU's working set), where the defaults do not fit it (issue 23.3); None where they fit
        (--fit changes nothing: one configuration, measured once) or the node has no GPU. The
        placement is llama.cpp's own (llama-fit-params on a node of the chip) where a node answers
        with one, else ``placement.fit`` (common/fit.cpp on fleettune's estimate); ``fit_source``
        says which, and why."""
        fp, w = self.target.fingerprint, self.cfg.workload
        room = budget or placement.gpu_working_set(fp)
        if not fp.gpu_offload or not room:
            return None
        defaults = self.baselines[learn.LLAMA_CPP]
        n_ctx = w.depth + w.n_prompt + w.n_gen
        estimated = placement.fit(self.cfg.model, defaults, n_ctx, room)
        if estimated is not None and learn.config_key(estimated) == learn.config_key(defaults):
            return None  # they fit: nothing to ask a node
        fitted = self._llama_fit(defaults, n_ctx, budget) or estimated
        if fitted is None:  # not even one layer fits: everything on the CPU
            fitted = replace(defaults, n_gpu_layers=0, n_cpu_moe=0)
        return None if learn.config_key(fitted) == learn.config_key(defaults) else fitted

    def _llama_fit(self, defaults: BenchParams, n_ctx: int, budget: int | None) -> BenchParams | None:
        """``defaults`` placed by llama-fit-params on a node of the chip (``agent.plan_fit``), or
        None where no node gives a placement: a simulated chip, no llama-fit-params there, no
        cluster to ask."""
        estimate = "fleettune's estimate of llama.cpp's --fit"
        nodes = self.target.ray_nodes or tuple(self.target.node_ids)
        if self.target.simulated or not nodes:
            self.fit_source = f"{estimate} (no real node to ask)"
            return None
        node = nodes[0]
        try:
            answer = dispatch.ask_nodes(agent.plan_fit, [node], FIT_PLAN_TIMEOUT_S,
                                        args=lambda _: (self.cfg.model.path, n_ctx, budget))[node]
        except Exception as exc:  # noqa: BLE001 - no cluster to ask (a test's dispatcher): the estimate stands in
            answer = exc
        if isinstance(answer, Exception) or "error" in answer:
            why = answer.get("error") if isinstance(answer, dict) else f"{type(answer).__name__}: {answer}"
            self.fit_source = f"{estimate} ({why})"
            return None
        fitted = FitPlacement(int(answer["n_ctx"]), int(answer["n_gpu_layers"]), tuple(answer["overrides"]))
        self.fit_source = f"llama-fit-params on node {node[:12]}: {' '.join(fitted.llama_bench_args())}"
        self.fit_by_llama = True
        return placement.from_llama_fit(fitted, defaults, self.cfg.model)

    def _set_fit_baseline(self, resumed: bool) -> None:
        """The --fit baseline. A resumed study keeps the placement it measured first, whatever --fit
        would place now (the node's free memory, or which planner answers, may differ), and asks no
        node for it: one --fit baseline per study, the one its claims and ``verify`` name. Otherwise
        it is planned for the study's budget (the stored one on resume: a resume without
        --gpu-budget keeps it)."""
        first = learn.stored_baselines(self._phase_trials("baseline")).get(learn.FIT) if resumed else None
        if first is not None:
            self.baselines[learn.FIT] = first
            self.fit_source = "the placement this study measured first, kept on resume"
            return
        fitted = self._fit_baseline(self.space.gpu_budget_bytes or None)
        if fitted is not None:
            self.baselines[learn.FIT] = fitted

    def _study_rows(self, space: SearchSpace):
        """Create or take over the study's row; returns the row that existed, if one did."""
        cfg, fp = self.cfg, self.target.fingerprint
        self.finished_already = False
        with self.db.session() as s:
            chip = repo.upsert_chip(s, fp)  # rolled back with the rest if a check below fails
            model = repo.upsert_model(s, cfg.model, _mtime(cfg.model.path))
            existing = None
            if cfg.name:
                existing = repo.get_study(s, cfg.name)
            elif cfg.resume:
                existing = repo.latest_study(
                    s, chip.id, model.id, str(self.objective), cfg.workload.n_prompt, cfg.workload.n_gen,
                    cfg.workload.depth,
                )
            if existing is not None and not cfg.resume:
                raise BadInput(f"study {cfg.name!r} already exists; pass --resume to continue it")
            if existing is None and cfg.resume:
                raise BadInput("no study to resume for this chip, model and workload")
            if existing is not None:
                self._resume(s, existing, chip, model, space)
            else:
                self._create(s, space, chip, model)
        return existing

    def _resume(self, s, existing, chip, model, space: SearchSpace) -> None:
        cfg = self.cfg
        self._check_same(existing, chip, model)
        self.study_id, self.name = existing.id, existing.name
        if existing.served is not None:  # its load and SLO are what it was created with
            self.served = ServedWorkload.from_dict(existing.served)
        # what the study was created with, unless an option names another now
        self.sampler = existing.sampler if cfg.sampler == "auto" else cfg.sampler
        self.space = SearchSpace.from_dict(existing.space)
        if cfg.gpu_budget is not None and space.gpu_budget_bytes != self.space.gpu_budget_bytes:
            kept = f"{self.space.gpu_budget_bytes / 1024**3:.2f} GiB" if self.space.gpu_budget_bytes else "none"
            raise BadInput(f"study {existing.name!r} was created with a GPU budget of {kept}; "
                           f"--gpu-budget {cfg.gpu_budget} would change it: start a new study")
        self.budget = cfg.n_trials or existing.budget
        if self.sampler == "grid":
            self.budget = min(self.budget, grid_size(self.space))
        if cfg.reps is None:
            self.workload = replace(cfg.workload, reps=existing.reps)
        if existing.state == "complete" and self.budget <= existing.budget and self.sampler == existing.sampler:
            self.finished_already = True  # resuming a finished study changes nothing
            return
        self._take_lease(s, existing.id)
        existing.budget, existing.sampler, existing.reps = self.budget, self.sampler, self.workload.reps
        repo.fail_running_trials(s, existing.id, ORPHANED)
        repo.set_study_state(s, existing.id, "running")

    def _create(self, s, space: SearchSpace, chip, model) -> None:
        cfg = self.cfg
        self.space = space
        self.sampler = resolve_sampler(cfg.sampler, len(self.alive_nodes()))
        if self.sampler == "grid":
            self.budget = min(self.budget, grid_size(space))
        new = repo.NewStudy(
            name=cfg.name or default_study_name(self.target.key, cfg.model, self.objective, cfg.workload,
                                                self.served),
            chip_id=chip.id, model_id=model.id, objective=str(self.objective),
            n_prompt=cfg.workload.n_prompt, n_gen=cfg.workload.n_gen, depth=cfg.workload.depth,
            reps=self.workload.reps,
            sampler=self.sampler, budget=self.budget, space=space.to_dict(),
            simulated=self.target.simulated, lease_owner=self.owner, lease_heartbeat=repo.utcnow(),
            served=self.served.to_dict() if self.served else None,
        )
        study = repo.add_named_study(s, new) if cfg.name else repo.add_study_free_name(s, new)
        self.study_id, self.name = study.id, study.name

    def _take_lease(self, s, study_id: int) -> None:
        holder = repo.acquire_lease(s, study_id, self.owner, lease.stale_before(), lease.holder_is_gone)
        if holder is not None:
            raise BadInput(f"study {self.name!r} is being run by another driver ({lease.describe(holder)}); "
                           f"wait for it, or stop it first")

    def _enqueue_starts(self) -> None:
        """A new study first measures full offload (where the GPU can take layers), llama.cpp's
        defaults as the space can say them, at a depth the same with flash attention on and the
        most compact KV cache, and, on an Apple Silicon chip, the calibrated model's predicted
        optimum; then the warm start configurations; then lets its sampler propose; each
        distinct config once.

        The first design is where the optimum usually is on Apple Silicon (every layer on the
        GPU): bench/search_efficiency.py measures what each part of it saves."""
        fp, w = self.target.fingerprint, self.cfg.workload
        defaults = self.baselines[learn.LLAMA_CPP]
        if self.served is not None:  # issue 22: the defaults, the obvious one slot per user (with and
            # without the host prompt cache, which this load can never hit), the single stream
            obvious = obvious_slots(defaults, self.space)
            starts = [defaults, obvious, without_prompt_cache(obvious, self.space),
                      self.baselines.get(learn.SINGLE_STREAM)]
        else:
            reference = full_offload(fp, self.cfg.model, self.space)
            compact = compact_cache(defaults, self.space) if w.depth else None
            prediction = predicted_optimum(fp, self.cfg.model, w.n_prompt, w.n_gen, w.depth, self.objective)
            starts = [reference, defaults, self.baselines.get(learn.FIT), compact, prediction]
        seen = set()
        for params in [p for p in (*starts, *self.cfg.warm_start) if p is not None]:
            values = self.space.optuna_params(self.space.clip(params))
            key = tuple(sorted(values.items()))
            if key not in seen:
                seen.add(key)
                self.optuna_study.enqueue_trial(values)

    def _enqueue_edge(self) -> None:
        """Under a GPU budget llama.cpp's defaults do not fit: the placement with the most on the GPU
        that the estimate lets in beside what the driver was seen to hold (``placement.fit`` with that
        overhead as its margin, not --fit's 1 GiB; llama.cpp's defaults otherwise) is measured next.
        On grids measured on the H200 it was the optimum's placement or next to it, and a study
        without it did not get there in 6 trials (docs/benchmarks.md, "Against measured
        landscapes"). Where the space searches the micro-batch, the largest smaller one that puts
        more on the GPU is measured too (its compute buffer is smaller). Asked again whenever the
        overhead seen grows."""
        budget = self.space.gpu_budget_bytes if self.space is not None else 0
        if not budget or self.served is not None or self.space.ngl_max <= 0:
            return
        w, defaults, model = self.cfg.workload, self.baselines[learn.LLAMA_CPP], self.cfg.model
        n_ctx = w.depth + w.n_prompt + w.n_gen

        def edge_at(ubatch: int) -> BenchParams | None:
            return placement.fit(model, replace(defaults, n_ubatch=ubatch), n_ctx, budget,
                                 margin=self.device_overhead_bytes)

        def on_gpu(params: BenchParams | None) -> float:
            return placement.gpu_need(model, params, n_ctx).weights if params is not None else -1.0

        edges = [edge_at(defaults.n_ubatch)]
        if self.space.tune_batch:  # the largest smaller micro-batch whose compute buffer buys weights
            smaller = (edge_at(ub) for ub in sorted(self.space.batch_choices, reverse=True) if ub < defaults.n_ubatch)
            edges.append(next((e for e in smaller if on_gpu(e) > on_gpu(edges[0])), None))
        for edge in edges:
            if edge is not None and learn.config_key(edge) != learn.config_key(defaults):
                self.optuna_study.enqueue_trial(self.space.optuna_params(self.space.clip(edge)), skip_if_exists=True)

    def _check_same(self, study, chip, model) -> None:
        cfg = self.cfg
        same = (
            study.chip_id == chip.id
            and study.model_id == model.id
            and study.objective == str(self.objective)
            and (study.n_prompt, study.n_gen, study.depth or 0)
            == (cfg.workload.n_prompt, cfg.workload.n_gen, cfg.workload.depth)
            and (study.served is None) == (self.served is None)
        )
        if not same:
            depth = f" d{study.depth}" if study.depth else ""
            raise BadInput(
                f"study {study.name!r} is for another chip, model or workload "
                f"({study.chip.key}, {study.model.name}, {study.objective} p{study.n_prompt} g{study.n_gen}{depth})"
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
        if self.finished_already:
            return self._outcome("complete", *self._latest_recommendation())
        try:
            measured = {learn.config_key(BenchParams.from_dict(r.params))
                        for r in self._phase_trials("baseline", complete_only=True)}
            tried = {learn.config_key(BenchParams.from_dict(r.params)) for r in self._phase_trials("baseline")
                     if r.failure_kind in (FailureKind.OVER_BUDGET.value, FailureKind.OUT_OF_MEMORY.value)}  # not again
            missing = [(name, p) for name, p in self.baselines.items()
                       if learn.config_key(p) not in measured | tried]
            if missing:  # a study resumed from before the second baseline measures it now
                self._drive(FixedJobs("baseline", missing, self.alive_nodes, refuse=self._refusal))
            self._drive(SamplerJobs(self.optuna_study, self.space, self.budget, *self._search_memory(),
                                    refuse=self._refusal))
            confirm = self._confirm_rounds()
            if confirm is not None:
                self._drive(confirm)
            draft, version = self._recommend()
            self._finish()
        except KeyboardInterrupt:
            self._pause("interrupted; `fleettune tune --resume` continues")
            raise StudyPaused(f"study {self.name} paused; run the same tune command with --resume") from None
        except DatabaseUnavailable as exc:
            self._pause(str(exc))
            raise StudyPaused(f"study {self.name} paused: {exc}; `tune --resume` continues") from None
        except StudyPaused as exc:
            self._pause(str(exc))
            raise
        return self._outcome("complete", draft, version)

    def _refusal(self, params: BenchParams) -> str | None:
        """Why ``params`` must not be loaded (issue 23.1's GPU budget; a served config whose KV cache
        or weights cannot fit the node, issue 22.3), or None."""
        w, model, fp = self.cfg.workload, self.cfg.model, self.target.fingerprint
        fit = self.baselines.get(learn.FIT)
        if self.fit_by_llama and fit is not None and learn.config_key(params) == learn.config_key(fit):
            return None  # llama.cpp's own plan for the budget; its measured buffers still decide (over budget)
        if self.served is not None:
            budget = self.space.gpu_budget_bytes or placement.gpu_working_set(fp)
            return placement.served_memory_problem(model, params, fp.memory_bytes, budget,
                                                   discrete_gpu=bool(fp.gpu_memory_bytes))
        return self.space.over_budget(params, model, w.depth + w.n_prompt + w.n_gen, self.device_overhead_bytes)

    def _outcome(self, state, draft, version) -> StudyOutcome:
        complete, failed = self._counts()
        return StudyOutcome(self.name, state, complete, failed, draft, version, self.baseline,
                            dict(self.baselines))

    def _transaction(self, work: Callable[[Any], Any], *, conflicts: bool = False) -> Any:
        """``work(session)`` in one transaction, retried while the database is away, that also
        proves this driver still holds the study (the lease is the fence: a driver that lost it
        writes nothing more). ``conflicts``: also retried when another driver inserted the same
        unique row first (the next attempt reads it)."""
        def attempt():
            with self.db.session() as s:
                if not repo.renew_lease(s, self.study_id, self.owner):
                    raise StudyPaused(f"study {self.name} was taken over by another driver")
                out = work(s)
            self._beat_at = time.monotonic()
            return out

        return retrying(attempt, should_stop=lambda: bool(self.stop), conflicts=conflicts)

    def _pause(self, message: str) -> None:
        """Record the pause and let go of the study; best effort when the database is away."""
        def work(s):
            if repo.renew_lease(s, self.study_id, self.owner):  # not when another driver took over
                repo.set_study_state(s, self.study_id, "paused", message)
                repo.release_lease(s, self.study_id, self.owner)

        try:
            retrying(lambda: self._in_session(work), window_s=5.0)
        except Exception as exc:  # noqa: BLE001 - the pause must not fail (DatabaseUnavailable included)
            log.warning("could not record the pause of %s: %s", self.name, exc)

    def _finish(self) -> None:
        def work(s):
            repo.set_study_state(s, self.study_id, "complete", None)
            repo.release_lease(s, self.study_id, self.owner)

        self._transaction(work)

    def _in_session(self, work):
        with self.db.session() as s:
            return work(s)

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

    def _spec(self, job: Job) -> TrialSpec:
        return TrialSpec(
            model_path=self.cfg.model.path,
            model_sha256=self.cfg.model.sha256,
            params=job.params,
            workload=self.workload,
            timeout_s=self.cfg.timeout_s,
            cooldown_s=self.cfg.cooldown_s,
            trial_key=f"{job.phase}-{job.row_id}",
            measure_kl=bool(self.space.cache_types),  # lossy knobs searched: their cost too (issue 20.4)
            served=self.served,
        )

    def _accounted_gpu_bytes(self, params: BenchParams, result: TrialResult) -> int | None:
        """What the driver's count of a trial is measured beyond, for the overhead a budget adds to
        the estimate: with layers on the GPU, fleettune's estimate (its own error is then in the
        overhead, as it must be at the budget's edge); at -ngl 0, where the estimate counts nothing
        and no budget applies, llama.cpp's own buffers (op offload's compute buffer, 180-395 MiB on
        the H200, held by no configuration with layers on the GPU beside its own: counted beyond
        the estimate it made the overhead 1.13 GiB where every GPU trial's was 0.59-0.65, issue 23
        lease 4); None where llama.cpp reported none."""
        if params.n_gpu_layers > 0:
            w = self.workload
            return int(placement.gpu_need(self.cfg.model, params, w.depth + w.n_prompt + w.n_gen).total)
        return result.gpu_bytes

    def _finished(self, job: Job, result: TrialResult) -> repo.FinishedTrial:
        """A result with its objective value (None for a failed trial) and end-to-end seconds."""
        value = e2e = None
        if result.ok:
            w = self.workload
            pp_m = result.pp.median if result.pp else None
            tg_m = result.tg.median if result.tg else None
            value = self.objective.value_of(_medians(result, self.objective), w.n_prompt, w.n_gen)
            budget = self.space.gpu_budget_bytes if self.space else 0
            over = over_gpu_budget(result, budget)
            accounted = self._accounted_gpu_bytes(job.params, result)
            if result.gpu_device_bytes and accounted is not None:
                overhead = result.gpu_device_bytes - accounted
                if overhead > self.device_overhead_bytes:
                    self.device_overhead_bytes = overhead
                    self._enqueue_edge()
            if value is None:
                result.ok, result.error = False, "no samples for the objective"
                result.failure_kind = FailureKind.NO_SAMPLES.value
            elif over:  # issue 23.1: whatever its speed
                result.ok, value = False, None
                result.error = over
                result.failure_kind = FailureKind.OVER_BUDGET.value
            else:
                e2e = e2e_seconds(pp_m, tg_m, w.n_prompt, w.n_gen)
        return repo.FinishedTrial(job.row_id, result, value, e2e, self.target.node_ids.get(result.node_id or ""))

    def _store(self, finished: list[repo.FinishedTrial], jobs: list[Job]) -> None:
        """One transaction: results in, rows for the jobs about to be dispatched, and what Optuna
        was told and asked since the last one. Gives each job its row id."""
        if not finished and not jobs and not self.storage.pending():
            return
        new = [repo.NewTrial(j.phase, j.params.to_dict(), j.trial.number if j.trial else None, j.round, j.arm)
               for j in jobs]

        def work(s):
            repo.finish_trials(s, finished)
            ids = repo.start_trials(s, self.study_id, new, simulated=self.target.simulated)
            self.storage.flush(s)
            return ids

        for job, row_id in zip(jobs, self._transaction(work), strict=True):
            job.row_id = row_id

    def _check_stop(self) -> None:
        if self.stop:
            raise StudyPaused(f"study {self.name} paused ({self.stop.reason}); run the same tune "
                              f"command with --resume")

    def _beat(self) -> None:
        """Refresh the lease while a long round waits for its results."""
        if time.monotonic() - self._beat_at >= lease.HEARTBEAT_S:
            self._transaction(lambda s: None)

    def _wait_for_any(self, inflight: dict) -> list:
        """Finished refs; pauses the study on a stop request, or when the chip has had no node
        for a grace period."""
        no_node_since = None
        while True:
            self._check_stop()
            done = self.dispatcher.wait(list(inflight), POLL_S)
            if done:
                return done
            self._beat()
            if self.alive_nodes():
                no_node_since = None
                continue
            no_node_since = no_node_since or time.monotonic()
            if time.monotonic() - no_node_since > self.no_node_grace_s:
                raise StudyPaused(f"no node of chip {self.target.key} is left; study {self.name} paused")

    def _drive(self, source: JobSource) -> None:
        """The study loop: propose, store, dispatch, collect, until the source has no more jobs.

        Each round costs the head one transaction (its results and the next trials' rows) however
        many trials it holds, so a large fleet of short trials makes larger rounds, not more work
        per trial. A round collects at most ``ROUND_RESULTS`` results: when many nodes finish at
        once, the first of them are busy again before the last are collected.
        """
        inflight: dict = {}  # ray ref -> job
        ready: list = []  # refs known to have finished, not yet collected
        collected: list[tuple[Job, repo.FinishedTrial]] = []  # stored with the next round
        try:
            while True:
                self._check_stop()
                # propose: as many jobs as the chip has idle nodes
                jobs = source.take(max(max(len(self.alive_nodes()), 1) - len(inflight), 0))
                # store: the last round's results and the new jobs' rows, in one transaction
                self._store([f for _, f in collected], jobs)
                collected = []
                # dispatch (a job that may not be loaded fails here, with its reason)
                for job in jobs:
                    if job.refused:
                        refused = TrialResult.failure(f"{job.phase}-{job.row_id}", job.refused,
                                                      FailureKind.OVER_BUDGET, simulated=self.target.simulated)
                        finished = repo.FinishedTrial(job.row_id, refused, None, None, None)
                        collected.append((job, finished))
                        source.settle(job, finished)
                        continue
                    inflight[self.dispatcher.submit(self._spec(job), self.target.key, job.node)] = job
                if not inflight:
                    if collected:
                        self._store([f for _, f in collected], [])
                        collected = []
                        continue  # the source may have more
                    return
                self._emit(source, inflight)
                # while no result is in, propose ahead for the next nodes to finish
                while not ready and source.ahead(len(inflight)):
                    ready = self.dispatcher.wait(list(inflight), 0)
                if not ready:
                    ready = self._wait_for_any(inflight)
                # collect: a few results at a time, so their nodes get new trials while the rest wait
                chunk, ready = ready[:ROUND_RESULTS], ready[ROUND_RESULTS:]
                for ref in chunk:
                    job = inflight[ref]
                    finished = self._finished(job, self.dispatcher.result(ref, f"{job.phase}-{job.row_id}"))
                    collected.append((job, finished))
                    del inflight[ref]
                    source.settle(job, finished)
                    self._emit(source, inflight, finished.result)
                    if finished.result.kind is FailureKind.MODEL_CHANGED:  # every later trial fails alike (issue 24)
                        raise StudyPaused(f"study {self.name} paused: {finished.result.error}")
        except BaseException:
            self._abandon(source, inflight, collected)
            raise

    def _abandon(self, source: JobSource, inflight: dict, collected: list) -> None:
        """Cancel running trials and mark them failed (interrupted), in the DB and in Optuna;
        results already collected are stored as they are, told to Optuna as they are. When the
        database is away this gives up: the resumed study fails the rows left running and
        measures those configurations again."""
        finished = []
        for job, result in collected:
            if not job.settled:
                source.settle(job, result)
            finished.append(result)
        for ref, job in inflight.items():
            self.dispatcher.cancel(ref)
            interrupted = TrialResult.failure(f"{job.phase}-{job.row_id}", "interrupted", FailureKind.INTERRUPTED)
            finished.append(repo.FinishedTrial(job.row_id, interrupted, None, None, None))
            source.abandon(job)
        for job in source.release():
            source.abandon(job)  # asked ahead, never dispatched
        try:
            self._store(finished, [])
        except (DatabaseUnavailable, StudyPaused) as exc:
            log.warning("study %s: results not stored (%s); they are measured again on resume", self.name, exc)

    def _records(self) -> tuple[list[learn.TrialRecord], dict[int, float]]:
        from orchestrator.schedules import trial_records

        with self.db.session() as s:
            rows = repo.study_trials(s, self.study_id)
            values = {r.id: r.objective_value for r in rows
                      if r.state == "complete" and r.objective_value is not None}
            return trial_records(rows), values

    def _search_memory(self) -> tuple[set[str], dict[str, int]]:
        """What the search remembers from the stored trials: configurations that failed on their own
        (issue 20.6; not a lost node, an interruption or an orphan) and the identities measured
        (issue 20.1), each with its first Optuna trial."""
        failed, seen = set(), {}
        own = {k.value for k in FailureKind} - {FailureKind.NODE_LOST.value, FailureKind.INTERRUPTED.value}
        for r in self._phase_trials("search"):
            if r.state == "failed" and r.failure_kind in own:
                failed.add(learn.config_key(BenchParams.from_dict(r.params)))
            elif r.state == "complete" and r.effective and r.optuna_number is not None:
                seen.setdefault(learn.identity(BenchParams.from_dict(r.params), r.effective), r.optuna_number)
        return failed, seen

    def _fits_gpu(self, params: BenchParams) -> bool:
        """Whether ``params`` fit the study's budget (else the GPU's working set) by the estimate
        beside the overhead the driver was seen to hold."""
        limit = self.space.gpu_budget_bytes or placement.gpu_working_set(self.target.fingerprint) or 0
        w = self.workload
        return replace(self.space, gpu_budget_bytes=limit).over_budget(
            params, self.cfg.model, w.depth + w.n_prompt + w.n_gen, self.device_overhead_bytes) is None

    def _decided(self, params: BenchParams) -> BenchParams:
        """``params`` with every knob the study did not search at llama.cpp's defaults (issue 20.5):
        a tg study does not pin batch sizes (under a budget, only where llama.cpp's would not fit),
        a study without lossy knobs keeps the f16 cache."""
        space, defaults = self.space, self.baselines[learn.LLAMA_CPP]
        out = params
        with_defaults_batch = replace(out, n_batch=defaults.n_batch, n_ubatch=defaults.n_ubatch)
        if not space.tune_batch:
            out = with_defaults_batch
        elif not self.objective.needs_prompt and self._fits_gpu(with_defaults_batch):
            out = with_defaults_batch  # searched as a memory knob only: pinned where it buys memory
        if not space.threads_batch:
            out = replace(out, n_threads_batch=None)
        if not space.cache_types:
            out = replace(out, type_k="f16", type_v="f16")
        if not space.op_offload:
            out = replace(out, op_offload=True)
        if not space.cpu_moe_max:
            out = replace(out, n_cpu_moe=0)
        return out

    def _confirm_arms(self) -> list[tuple[str, BenchParams]]:
        """The arms of the confirmation: llama.cpp's defaults first, the top configurations of the
        search (by identity, each with only the knobs the study decided; one that llama.cpp ran as a
        baseline is that baseline, never its rival), llama-cpp-python's defaults and the A/A arm."""
        records, values = self._records()
        top = learn.top_configs(records, values, self.objective, self.cfg.confirm_top)
        identity = {learn.config_key(r.params): r.key for r in records}
        baseline_ids = {identity.get(learn.config_key(p), learn.config_key(p)) for p in self.baselines.values()}
        taken = {learn.config_key(p) for p in self.baselines.values()}
        candidates: list[tuple[str, BenchParams]] = []
        for params in top:
            decided = self._decided(params)
            key = learn.config_key(decided)
            if identity.get(learn.config_key(params)) in baseline_ids or key in taken:
                continue
            taken.add(key)
            candidates.append((f"{learn.CANDIDATE}{len(candidates) + 1}", decided))
        baseline_rows = [r for r in records if r.phase == "baseline"]
        named = list(self.baselines.items())
        if baseline_rows and all(r.confirm_arm for r in baseline_rows):  # each row names its baseline
            measured = {r.confirm_arm for r in baseline_rows if r.trial_id in values}
            named = [(name, params) for name, params in named if name in measured]  # failed ones (over the budget) not
        reference = next((n for n in learn.REFERENCES if n in dict(named)), learn.LLAMA_CPP)
        reference_params = dict(named).get(reference, self.baselines[learn.LLAMA_CPP])
        others = [(name, params) for name, params in named if name != reference]
        return [(reference, reference_params), *candidates, *others, (learn.noise_arm(reference), reference_params)]

    def _confirm_rounds(self) -> ConfirmRounds | None:
        """The confirmation's source. A study resumed during its confirmation keeps its arms and
        the rounds it measured; one whose search went on after it confirms afresh, in the next
        generation of round numbers (``learn.ROUND_GENERATION``), the claims resting on that one."""
        rows = [r for r in self._phase_trials("confirm") if r.confirm_arm and r.confirm_arm != learn.WARMUP_ARM]
        if rows and any(r.id > rows[-1].id for r in self._phase_trials("search")):
            generation, rows = max(r.confirm_round for r in rows) // learn.ROUND_GENERATION + 1, []
        elif rows:
            generation = max(r.confirm_round for r in rows) // learn.ROUND_GENERATION
            rows = [r for r in rows if r.confirm_round // learn.ROUND_GENERATION == generation]
        else:
            generation = 0
        w = self.workload

        def rate(result: TrialResult) -> float | None:
            return self.objective.rate_of(_medians(result, self.objective), w.n_prompt, w.n_gen)

        values: dict[int, dict[str, float | None]] = {}
        if rows:
            arms = list({r.confirm_arm: BenchParams.from_dict(r.params) for r in rows}.items())
            for r in rows:
                if r.state == "complete":
                    samples = [learn.Sample(x.kind, x.rep, x.n_tokens, x.seconds) for x in r.samples]
                    values.setdefault(r.confirm_round, {})[r.confirm_arm] = learn.trial_rate(
                        samples, self.objective, w.n_prompt, w.n_gen)
        else:
            arms = self._confirm_arms()
        first = max(values, default=generation * learn.ROUND_GENERATION) + 1
        return ConfirmRounds(arms, sorted(self.alive_nodes()), self.alive_nodes, rate,
                             self.cfg.confirm_rounds, first, values)

    def _draft(self) -> learn.RecommendationDraft | None:
        records, _ = self._records()
        w = self.workload
        draft = learn.recommend(records, self.objective, w.n_prompt, w.n_gen, self.baselines)
        if draft is not None and draft.claims and learn.FIT in self.baselines and self.fit_source:
            draft.claims["fit_source"] = self.fit_source  # whose --fit the claims are over (issue 23.3)
        return draft

    def _recommend(self) -> tuple[learn.RecommendationDraft | None, int | None]:
        draft = self._draft()
        if draft is None:
            return None, None
        w = self.workload

        def work(s):
            study = repo.get_study(s, self.name)
            new = repo.NewRecommendation(study.chip_id, study.model_id, study.id, str(self.objective),
                                         w.n_prompt, w.n_gen, draft, depth=w.depth)
            return repo.add_recommendation(s, new).version

        # another study of this chip, model and workload may store the same next version at the
        # same instant (PostgreSQL refuses the second: a unique key); the retry reads its version
        return draft, self._transaction(work, conflicts=True)

    def _latest_recommendation(self) -> tuple[learn.RecommendationDraft | None, int | None]:
        """A finished study's recommendation as it stands, written by no one."""
        draft = self._draft()
        with self.db.session() as s:
            study = repo.get_study(s, self.name)
            recs = repo.latest_recommendations(s, [study.model_id], study.chip.key, str(self.objective))
            versions = [r.version for r in recs
                        if (r.n_prompt, r.n_gen, r.depth) == (study.n_prompt, study.n_gen, study.depth)]
        return draft, max(versions, default=None)

    def _emit(self, source: JobSource, inflight: dict, last: TrialResult | None = None) -> None:
        best_value = best_params = None
        if source.phase == "search":
            best_value, best_params = self._best(source.done_count())
        running = [job.params for job in inflight.values()]
        self.on_progress(Progress(source.phase, source.done_count(), source.total, source.failed_count(),
                                  best_value, best_params, running, last))

    def _best(self, n_complete: int) -> tuple[float | None, BenchParams | None]:
        """The best search trial so far, looked up again only when a trial completed (from the
        head's storage: ``Study.best_trial`` deep-copies it, once per result), its configuration
        rebuilt only when another trial became the best."""
        if self._best_at != n_complete:
            self._best_at = n_complete
            if self._optuna_id is None:
                self._optuna_id = self.storage.get_study_id_from_name(self.name)
            try:
                best = self.storage.get_best_trial(self._optuna_id)
            except ValueError:
                self._best_cached, self._best_number = (None, None), None
            else:
                if best.number != self._best_number:
                    self._best_number = best.number
                    self._best_cached = best.value, self.space.suggest(optuna.trial.FixedTrial(best.params))
        return self._best_cached
