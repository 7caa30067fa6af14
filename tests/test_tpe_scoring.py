"""TPE's acquisition from per-fit tables (orchestrator/tpe_scoring.py) against Optuna's own.

Past ``RoundTPESampler.TABLE_KERNELS`` kernels the candidates are scored from tables instead of
Optuna's ``log_pdf``: the same density (kernels merged, distinct candidates scored once), so the
same proposals; these tests hold it to that, on a study the size of a large fleet's.
"""

from __future__ import annotations

import numpy as np
import optuna
import pytest
from optuna.samplers import TPESampler
from optuna.trial import TrialState

from orchestrator.samplers import RoundTPESampler
from orchestrator.tpe_scoring import DiscreteScorer


def suggest(trial) -> None:
    """A space like fleettune's: integers (one on a log scale), categoricals, one conditional."""
    trial.suggest_int("ngl", 0, 33)
    trial.suggest_int("threads", 1, 16, log=True)
    fa = trial.suggest_categorical("fa", ["off", "on", "auto"])
    trial.suggest_categorical("type_k", ["f16", "q8_0", "q4_0"])
    if fa == "on":
        trial.suggest_categorical("type_v", ["f16", "q8_0", "q4_0"])


def value(params: dict) -> float:
    return -abs(params["ngl"] - 30) - abs(params["threads"] - 4) + (params["fa"] == "on") + 0.01 * len(params)


@pytest.fixture(scope="module")
def large_study() -> tuple[optuna.Study, RoundTPESampler]:
    """600 trials (TPE's own, so the kernels bunch as in a real study), 64 running."""
    sampler = RoundTPESampler(n_startup_trials=10, multivariate=True, constant_liar=True, seed=3)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for _ in range(600):
        trial = study.ask()
        suggest(trial)
        study.tell(trial, value(trial.params))
    for _ in range(64):
        suggest(study.ask())
    return study, sampler


def fitted(study: optuna.Study, sampler: RoundTPESampler):
    """(below, above) estimators of the study's relative space, as a fit builds them."""
    from optuna.samplers._tpe.sampler import _split_trials

    space = sampler.infer_relative_search_space(study, None)
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    below, above = _split_trials(study, trials, sampler._gamma(600))
    return space, (TPESampler._build_parzen_estimator(sampler, study, space, below, True),
                   TPESampler._build_parzen_estimator(sampler, study, space, above, False))


def test_table_density_is_optunas_density(large_study):
    study, sampler = large_study
    space, (below, above) = fitted(study, sampler)
    assert len(above._mixture_distribution.weights) > RoundTPESampler.TABLE_KERNELS
    samples = below.sample(np.random.RandomState(0), 24 * 16)
    for estimator in (below, above):
        scorer = DiscreteScorer.build(estimator, space)
        assert scorer is not None
        assert scorer.n_kernels < len(estimator._mixture_distribution.weights)  # identical kernels merged
        np.testing.assert_allclose(scorer.log_pdf(samples), estimator.log_pdf(samples), rtol=0, atol=1e-9)


def test_round_tpe_scores_as_optuna_past_the_table_threshold(large_study):
    study, sampler = large_study
    space, (below, above) = fitted(study, sampler)
    samples = below.sample(np.random.RandomState(1), 24 * 16)
    ours = sampler._compute_acquisition_func(samples, below, above)
    assert sampler._scorers  # the tables were used
    theirs = TPESampler._compute_acquisition_func(sampler, samples, below, above)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-9)
    picks = ours.reshape(16, 24).argmax(axis=1)
    assert (picks == theirs.reshape(16, 24).argmax(axis=1)).all()  # the same proposals


def test_kept_internal_values_are_optunas(large_study):
    study, sampler = large_study
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    for space in (sampler.infer_relative_search_space(study, None),
                  {"type_v": optuna.distributions.CategoricalDistribution(["f16", "q8_0", "q4_0"])}):
        for _ in range(2):  # the second read comes from the kept table
            ours = sampler._get_internal_repr(trials, space, study)
            theirs = TPESampler._get_internal_repr(sampler, trials, space, study)
            assert ours.keys() == theirs.keys()
            for name in ours:
                np.testing.assert_array_equal(ours[name], theirs[name])
                assert ours[name].dtype.kind == theirs[name].dtype.kind


def test_a_continuous_parameter_is_left_to_optuna():
    from optuna.distributions import FloatDistribution
    from optuna.samplers._tpe.parzen_estimator import _ParzenEstimator, _ParzenEstimatorParameters
    from optuna.samplers._tpe.sampler import default_weights

    space = {"x": FloatDistribution(0.0, 1.0)}
    params = _ParzenEstimatorParameters(1.0, True, False, default_weights, True)
    estimator = _ParzenEstimator({"x": np.linspace(0, 1, 300)}, space, params)
    assert DiscreteScorer.build(estimator, space) is None
