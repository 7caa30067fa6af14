"""Samplers by name. Each is an Optuna sampler; a new one is one entry (or one class) here.

- ``auto`` (default): ``gp`` where torch is installed and the chip has at most ``GP_MAX_NODES``
  nodes, else ``tpe`` (both reach 98 % of the optimum within 15 trials in the simulated fleet; gp in
  fewer, but each of its proposals costs 0.1-0.3 s of the head's time, see docs/benchmarks.md).
- ``tpe``: multivariate TPE with the constant liar, so trials running in parallel on several nodes
  of a chip are not proposed twice; its model is fitted once per scheduling round
  (``RoundTPESampler``), so a large fleet does not make the head refit it for every idle node.
- ``gp``: Optuna's Gaussian-process sampler (needs torch).
- ``random``, ``grid``: baselines; the grid is a coarse one over the study's space.
- ``seed-scan``: the hand method people use today: threads at ngl 0, then ngl at the best threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from orchestrator.space import SearchSpace
from orchestrator.tpe_scoring import DiscreteScorer
from workers.errors import BadInput
from workers.knobs import optuna_name

SAMPLER_NAMES = ("auto", "tpe", "gp", "random", "grid", "seed-scan")
log = logging.getLogger(__name__)
DEFAULT_SAMPLER = "auto"  # gp for small fleets where torch is installed (fewest trials), else tpe


GP_MAX_NODES = 16  # auto: gp only for chips with at most this many nodes (bench/sampler_cost.py)


def resolve_sampler(name: str, n_nodes: int = 1) -> str:
    """The sampler "auto" stands for: gp with torch installed and a chip of at most GP_MAX_NODES
    nodes (GP refits on every proposal, 0.1-0.3 s: fine beside 10-60 s trials on a few Macs, the
    bottleneck of a large fleet), else tpe."""
    if name != "auto":
        return name
    if n_nodes > GP_MAX_NODES:
        return "tpe"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "tpe"
    return "gp"


NGL, THREADS, BATCH, UBATCH = (optuna_name(f) for f in ("n_gpu_layers", "n_threads", "n_batch", "n_ubatch"))

class SeedScanSampler(BaseSampler):
    """Scan threads at ngl 0 (default batch), then ngl at the best threads, then repeat the best.

    Reproduces the shell-loop method so its result can be compared with the smarter samplers.
    """

    def __init__(self, space: SearchSpace, direction: str = "maximize", max_ngl_steps: int = 12):
        self.space = space
        self.maximize = direction == "maximize"
        batch = 512 if 512 in space.batch_choices else max(space.batch_choices)
        self.batch = batch
        self.thread_scan = [
            {NGL: space.ngl_min, THREADS: t, BATCH: batch, UBATCH: batch}
            for t in range(1, space.threads_max + 1)
        ]
        if space.ngl_max > 0:
            step = max(1, -(-(space.ngl_max + 1) // max_ngl_steps))
            self.ngl_values = sorted({*range(space.ngl_min, space.ngl_max + 1, step), space.ngl_max})
        else:
            self.ngl_values = [0]
        self._plans: dict[int, dict] = {}
        self._fallback = optuna.samplers.RandomSampler(seed=0)  # for parameters the scan leaves open

    def plan_length(self) -> int:
        return len(self.thread_scan) + len(self.ngl_values)

    def _best(self, trials: list[FrozenTrial], only: Callable[[FrozenTrial], bool]) -> FrozenTrial | None:
        done = [t for t in trials if t.state == TrialState.COMPLETE and only(t)]
        if not done:
            return None
        pick = max if self.maximize else min
        return pick(done, key=lambda t: t.value)

    def _plan(self, study: optuna.Study, trial: FrozenTrial) -> dict:
        if trial.number in self._plans:
            return self._plans[trial.number]
        trials = study.get_trials(deepcopy=False)
        index = sum(1 for t in trials if t.number < trial.number)
        if index < len(self.thread_scan):
            plan = self.thread_scan[index]
        else:
            best_t = self._best(trials, lambda t: t.params.get(NGL, 0) == 0)
            threads = best_t.params[THREADS] if best_t else max(1, self.space.threads_max // 2)
            k = index - len(self.thread_scan)
            if k < len(self.ngl_values):
                plan = {NGL: self.ngl_values[k], THREADS: threads, BATCH: self.batch, UBATCH: self.batch}
            else:
                best = self._best(trials, lambda t: True)
                plan = dict(best.params) if best else self.thread_scan[0]
        self._plans[trial.number] = plan
        return plan

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict:
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        plan = self._plan(study, trial)
        if param_name in plan:
            return plan[param_name]
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)


# Optuna's private TPE internals RoundTPESampler relies on (tests/test_optuna_private.py checks them
# against the installed Optuna; pyproject pins the versions they hold on). Overridden methods: their
# exact parameters. Called methods: the positional parameters passed. Attributes read.
TPE_OVERRIDES = {
    "_sample": ("self", "study", "trial", "search_space"),
    "_build_parzen_estimator": ("self", "study", "search_space", "trials", "handle_below"),
    "_compute_acquisition_func": ("self", "samples", "mpe_below", "mpe_above"),
    "_get_internal_repr": ("self", "trials", "search_space", "study"),
}
TPE_CALLS = {"_get_params": ("self", "trial", "study")}
TPE_ATTRIBUTES = ("_n_ei_candidates", "_rng")  # _rng.rng: a numpy RandomState
PARZEN_CALLS = {"sample": ("self", "rng", "size")}  # the estimators _build_parzen_estimator returns


class RoundTPESampler(optuna.samplers.TPESampler):
    """TPE that fits its two Parzen estimators once per round of asks, not once per ask.

    Fitting reads every trial of the study (about 5 us each), so at a thousand trials and 256 idle
    nodes per second the fits alone would outrun the head (bench/dispatch_throughput.py). Between
    two results nothing the fit depends on changes except the trials just asked, which the constant
    liar would add as bad observations: the round's asks share one fit and each draws its own
    candidates from it. A result told to the study (``after_trial``) starts a new round.

    The draws of a round are made together, as many as the previous round needed (one, in a small
    fleet): scoring candidates against a thousand-kernel mixture costs about half as much per
    proposal in one array operation as in one per proposal.
    """

    MAX_BATCH = 16  # more at once costs more per proposal at 2000 trials, not less (its arrays outgrow the cache)
    # above this many kernels in the "above" mixture (about as many trials), candidates are scored
    # from tables (orchestrator/tpe_scoring.py): the same density, a fraction of the cost; below it
    # the arithmetic is Optuna's own, so a small study is Optuna's TPE to the last bit
    TABLE_KERNELS = 256

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._fits: dict[tuple[str, ...], tuple] = {}  # search space -> (below, above) estimators
        self._drawn: dict[tuple[str, ...], list[dict]] = {}  # proposals drawn, not yet handed out
        self._building: dict[bool, object] = {}
        self._asked = 0  # proposals handed out since the last fit
        self._batch = 1  # proposals drawn at once: what the previous round used
        self._wanted = 0  # proposals the study loop said it is about to ask (``expect``)
        self._space: dict | None = None  # the relative search space, inferred once per round
        self._scorers: dict[int, tuple[object, DiscreteScorer | None]] = {}  # id(estimator) -> it, its scorer
        self._reprs: dict[tuple, tuple] = {}  # (study, space) -> (values, known, present) by trial number

    def infer_relative_search_space(self, study, trial):
        if self._space is None:
            self._space = super().infer_relative_search_space(study, trial)
        return dict(self._space)

    def _build_parzen_estimator(self, study, search_space, trials, handle_below):
        estimator = super()._build_parzen_estimator(study, search_space, trials, handle_below)
        self._building[handle_below] = estimator
        return estimator

    def expect(self, count: int) -> None:
        """The study loop is about to ask ``count`` proposals in a row: draw that many together,
        no more (what is drawn and not asked before the next result is thrown away)."""
        self._wanted = max(count, 0)

    def _sample(self, study, trial, search_space):
        key = tuple(search_space)
        self._asked += 1
        wanted, self._wanted = self._wanted, max(self._wanted - 1, 0)
        if key not in self._fits:
            self._building = {}
            params = super()._sample(study, trial, search_space)  # fits, and records the fit
            self._fits[key] = (self._building[True], self._building[False])
            return params
        if not self._drawn.get(key):
            count = min(wanted, self.MAX_BATCH) if wanted else self._batch
            self._drawn[key] = self._draw(*self._fits[key], search_space, count)
        return self._drawn[key].pop()

    def _draw(self, below, above, search_space, count: int) -> list[dict]:
        """``count`` proposals, each the best of its own ``n_ei_candidates`` samples."""
        n = self._n_ei_candidates
        samples = below.sample(self._rng.rng, n * count)
        scores = np.asarray(self._compute_acquisition_func(samples, below, above)).reshape(count, n)
        best = np.arange(count) * n + scores.argmax(axis=1)
        return [{name: dist.to_external_repr(samples[name][i].item()) for name, dist in search_space.items()}
                for i in best]

    def _get_internal_repr(self, trials, search_space, study):
        """Optuna's, from a table of finished trials' values by trial number: every fit reads every
        trial again (3.7 ms at 2000 trials), and a finished trial's parameters never change; running
        trials are read each time, as Optuna does."""
        names = (study._study_id, *search_space)  # trial numbers are a study's own
        values, known, present = self._reprs.get(names, (np.empty((0, len(search_space))), np.zeros(0, bool),
                                                         np.zeros(0, bool)))
        numbers = np.fromiter((t.number for t in trials), dtype=np.intp, count=len(trials))
        size = int(numbers.max()) + 1 if len(numbers) else 0
        if size > len(known):  # room for the new trial numbers
            grow = max(size, 2 * len(known)) - len(known)
            values = np.vstack([values, np.zeros((grow, len(search_space)))])
            known, present = np.append(known, np.zeros(grow, bool)), np.append(present, np.zeros(grow, bool))
        for i in np.flatnonzero(~known[numbers]):
            trial = trials[i]
            row = self._internal_row(trial, search_space, study)
            present[trial.number] = row is not None
            if row is not None:
                values[trial.number] = row
            known[trial.number] = trial.state.is_finished()
        self._reprs[names] = (values, known, present)
        rows = values[numbers[present[numbers]]]
        return {name: rows[:, j].astype(int) if isinstance(dist, CategoricalDistribution) else rows[:, j]
                for j, (name, dist) in enumerate(search_space.items())}

    def _internal_row(self, trial, search_space, study) -> tuple | None:
        """A trial's internal values over ``search_space``; None where it lacks one of them."""
        params = self._get_params(trial, study)
        if not search_space.keys() <= params.keys():
            return None
        return tuple(dist.to_internal_repr(params[name]) for name, dist in search_space.items())

    def _compute_acquisition_func(self, samples, mpe_below, mpe_above):
        if len(mpe_above._mixture_distribution.weights) > self.TABLE_KERNELS:
            below, above = self._scorer(mpe_below), self._scorer(mpe_above)
            if below is not None and above is not None:
                return below.log_pdf(samples) - above.log_pdf(samples)
        return super()._compute_acquisition_func(samples, mpe_below, mpe_above)

    def _scorer(self, estimator) -> DiscreteScorer | None:
        """The tables of a fitted estimator, built at its first scoring (None: a continuous space)."""
        if id(estimator) not in self._scorers:  # the estimator is kept with it: its id stays its own
            self._scorers[id(estimator)] = (estimator, DiscreteScorer.build(estimator, estimator._search_space))
        return self._scorers[id(estimator)][1]

    def after_trial(self, study, trial, state, values) -> None:
        self._scorers.clear()
        if self._fits:
            self._batch = min(max(self._asked - 1, 1), self.MAX_BATCH)
        self._fits.clear()
        self._drawn.clear()
        self._space = None
        self._asked = self._wanted = 0
        super().after_trial(study, trial, state, values)


class BudgetedGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid, without its ``study.stop()`` once the grid is covered.

    ``GridSampler.after_trial`` stops the study when the last grid point is told, which in an
    ask-and-tell loop raises RuntimeError inside ``tell`` and leaves that trial RUNNING. The study
    loop stops by its own budget (at most the grid's size), so the stop is not needed.
    """

    def after_trial(self, study, trial, state, values) -> None:
        return None


class OnceWarnedGPSampler(optuna.samplers.GPSampler):
    """Optuna's GP sampler that says once per study, not at every trial, which dimension it samples
    at random (issue 20.6): a conditional dimension (the V cache type, n_cpu_moe) is outside the
    space a Gaussian process models."""

    def __init__(self, **kw) -> None:
        super().__init__(warn_independent_sampling=False, **kw)
        self._said: set[str] = set()

    def sample_independent(self, study, trial, param_name, param_distribution):
        startup = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < self._n_startup_trials
        if not startup and param_name not in self._said:  # past the random start, as Optuna's own warning
            self._said.add(param_name)
            log.warning("gp sampler: %r is sampled at random (a conditional dimension the Gaussian "
                        "process cannot model); said once per study", param_name)
        return super().sample_independent(study, trial, param_name, param_distribution)


def make_sampler(name: str, space: SearchSpace, budget: int, direction: str, seed: int | None) -> BaseSampler:
    """The sampler called ``name`` for a study over ``space`` with ``budget`` trials."""
    name = resolve_sampler(name)
    if name == "tpe":
        return RoundTPESampler(
            n_startup_trials=min(10, max(3, budget // 3)),
            multivariate=True,
            constant_liar=True,
            seed=seed,
        )
    if name == "gp":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise BadInput("sampler gp needs torch: pip install 'fleettune[gp]'") from None
        return OnceWarnedGPSampler(seed=seed, n_startup_trials=min(10, max(3, budget // 3)))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return BudgetedGridSampler(space.grid(), seed=seed)
    if name == "seed-scan":
        return SeedScanSampler(space, direction)
    raise BadInput(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLER_NAMES)}")


def grid_size(space: SearchSpace) -> int:
    size = 1
    for values in space.grid().values():
        size *= len(values)
    return size
