"""Optuna internals fleettune relies on, checked against the installed Optuna: a newer release that
changes one fails here, naming the private symbol, before a fleet breaks silently.

HeadStorage (orchestrator/db/storage.py) writes Optuna's tables through ``optuna.storages._rdb.models``;
RoundTPESampler (orchestrator/samplers.py) overrides and calls private TPE methods. Both modules list
what they rely on; pyproject pins the Optuna versions on which these checks and the storage and
sampler tests pass.
"""

from __future__ import annotations

import inspect

import numpy as np
import optuna
import pytest
from optuna.samplers import TPESampler

from orchestrator import samplers
from orchestrator.db import storage

VERSION = f"Optuna {optuna.__version__}"


def _params(func) -> list[inspect.Parameter]:
    return list(inspect.signature(func).parameters.values())


def _names(func) -> tuple[str, ...]:
    return tuple(p.name for p in _params(func))


@pytest.mark.parametrize("name", sorted(samplers.TPE_OVERRIDES))
def test_overridden_tpe_methods_keep_their_parameters(name):
    symbol = f"optuna.samplers.TPESampler.{name}"
    method = getattr(TPESampler, name, None)
    assert method is not None, f"{VERSION} has no {symbol}: RoundTPESampler overrides it"
    expected = samplers.TPE_OVERRIDES[name]
    assert _names(method) == expected, (
        f"{VERSION} changed {symbol}{_names(method)}; RoundTPESampler overrides it as {expected}")


@pytest.mark.parametrize("name", sorted(samplers.TPE_CALLS))
def test_called_tpe_methods_take_what_is_passed(name):
    symbol = f"optuna.samplers.TPESampler.{name}"
    method = getattr(TPESampler, name, None)
    assert method is not None, f"{VERSION} has no {symbol}: RoundTPESampler calls it"
    _expect_call(symbol, method, samplers.TPE_CALLS[name])


def _expect_call(symbol: str, method, passed: tuple[str, ...]) -> None:
    params = _params(method)
    head, rest = tuple(p.name for p in params[: len(passed)]), params[len(passed):]
    assert head == passed, f"{VERSION} changed {symbol}{_names(method)}; fleettune passes {passed}"
    required = [p.name for p in rest if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not required, f"{VERSION}: {symbol} now requires {required}, which fleettune does not pass"


def test_tpe_attributes_read_by_round_tpe_exist():
    sampler = TPESampler(seed=1)
    for name in samplers.TPE_ATTRIBUTES:
        assert hasattr(sampler, name), f"{VERSION}: TPESampler has no attribute {name} (RoundTPESampler reads it)"
    assert isinstance(sampler._n_ei_candidates, int), f"{VERSION}: TPESampler._n_ei_candidates is not an int"
    assert hasattr(sampler._rng, "rng"), f"{VERSION}: TPESampler._rng has no .rng (RoundTPESampler draws from it)"


def test_parzen_estimator_sample_takes_what_is_passed():
    from optuna.samplers._tpe import parzen_estimator

    cls = getattr(parzen_estimator, "_ParzenEstimator", None)
    assert cls is not None, f"{VERSION} has no optuna.samplers._tpe.parzen_estimator._ParzenEstimator"
    for name, passed in samplers.PARZEN_CALLS.items():
        _expect_call(f"optuna.samplers._tpe.parzen_estimator._ParzenEstimator.{name}", getattr(cls, name), passed)


@pytest.mark.parametrize("table", sorted(storage.COLUMNS_WRITTEN, key=lambda t: t.name), ids=lambda t: t.name)
def test_head_storage_writes_every_required_column_of_optunas_tables(table):
    written = storage.COLUMNS_WRITTEN[table]
    missing = [c for c in written if c not in table.c]
    assert not missing, f"{VERSION}: optuna.storages._rdb.models table {table.name} lost columns {missing}"
    required = [c.name for c in table.c if c.name not in written and not c.nullable and c.default is None
                and c.server_default is None and not (c.primary_key and c.autoincrement in (True, "auto"))]
    assert not required, (f"{VERSION}: optuna.storages._rdb.models table {table.name} has new required "
                          f"columns {required} that HeadStorage does not write")


@pytest.mark.parametrize(("model", "encoder"), storage.ENCODERS)
def test_value_encoders_return_a_stored_value_and_its_kind(model, encoder):
    from optuna.storages._rdb import models

    symbol = f"optuna.storages._rdb.models.{model}.{encoder}"
    func = getattr(getattr(models, model, None), encoder, None)
    assert func is not None, f"{VERSION} has no {symbol} (HeadStorage encodes values with it)"
    for value in (12.5, float("inf"), float("-inf")):
        out = func(value)
        assert isinstance(out, tuple) and len(out) == 2, f"{VERSION}: {symbol}({value}) is not (stored, kind)"


def test_frozen_trials_keep_their_private_id():
    study = optuna.create_study()
    study.tell(study.ask(), 1.0)
    assert isinstance(getattr(study.trials[0], "_trial_id", None), int), (
        f"{VERSION}: FrozenTrial._trial_id is gone (HeadStorage maps trials by it)")


def test_parzen_internals_read_by_the_table_scorer_exist():
    """orchestrator/tpe_scoring.py reads a fitted estimator's mixture and its batched distributions,
    and calls _truncnorm._log_gauss_mass, as Optuna's own log_pdf does."""
    from optuna.distributions import CategoricalDistribution, IntDistribution
    from optuna.samplers._tpe import _truncnorm
    from optuna.samplers._tpe.parzen_estimator import _ParzenEstimator, _ParzenEstimatorParameters
    from optuna.samplers._tpe.sampler import default_weights

    from orchestrator import tpe_scoring

    space = {"n": IntDistribution(1, 16, log=True), "c": CategoricalDistribution(["a", "b"])}
    params = _ParzenEstimatorParameters(1.0, True, False, default_weights, True)
    estimator = _ParzenEstimator({"n": np.array([2.0, 8.0]), "c": np.array([0, 1])}, space, params)
    for name in tpe_scoring.PARZEN_FIELDS["estimator"]:
        assert hasattr(estimator, name), f"{VERSION}: _ParzenEstimator has no {name} (tpe_scoring reads it)"
    mixture = estimator._mixture_distribution
    for name in tpe_scoring.PARZEN_FIELDS["mixture"]:
        assert hasattr(mixture, name), f"{VERSION}: the Parzen mixture has no {name} (tpe_scoring reads it)"
    discrete, categorical = mixture.distributions
    for name in tpe_scoring.PARZEN_FIELDS["discrete"]:
        assert hasattr(discrete, name), f"{VERSION}: {type(discrete).__name__} has no {name}"
    for name in tpe_scoring.PARZEN_FIELDS["categorical"]:
        assert hasattr(categorical, name), f"{VERSION}: {type(categorical).__name__} has no {name}"
    for name in tpe_scoring.TRUNCNORM_CALLS:
        _expect_call(f"optuna.samplers._tpe._truncnorm.{name}", getattr(_truncnorm, name), ("a", "b"))
