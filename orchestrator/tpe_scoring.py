"""TPE's acquisition over an all-discrete space, from tables built once per fit.

TPE scores each candidate by the log-density of two Parzen mixtures ("below" and "above"), one
kernel per trial. Optuna's ``_MixtureOfProductDistribution.log_pdf`` recomputes every kernel's
truncated-Gaussian masses on each call, for every candidate, and the "above" mixture has a kernel
for nearly every trial: late in a 2000-trial study that scoring is most of the head's time
(docs/benchmarks.md, "Dispatch throughput"). Where every parameter is discrete (integers with a
step, categoricals: fleettune's spaces), a kernel's density on a parameter takes one of a few
values, so this module tabulates them once per fit (grid value x kernel), merges kernels whose
parameters are identical on every dimension (summing their weights: the same mixture), and scores
each distinct candidate once. The density is the same as Optuna's (``tests/test_tpe_scoring.py``
compares them to 1e-9); only the arithmetic's order differs.

Relies on Optuna's private Parzen internals, listed in ``PARZEN_FIELDS`` and checked by
``tests/test_optuna_private.py``.
"""

from __future__ import annotations

import numpy as np
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.samplers._tpe import _truncnorm

# what is read of an Optuna _ParzenEstimator and its mixture's batched distributions
PARZEN_FIELDS = {
    "estimator": ("_mixture_distribution", "_search_space"),
    "mixture": ("weights", "distributions"),
    "categorical": ("weights",),
    "discrete": ("mu", "sigma", "low", "high", "step", "adapted_low", "adapted_high", "is_log"),
}
TRUNCNORM_CALLS = ("_log_gauss_mass",)
MAX_GRID = 4096  # values of one integer parameter tabulated; a wider one is scored by Optuna


class DiscreteScorer:
    """The log-density of one fitted Parzen mixture at discrete candidates, from per-dimension tables."""

    def __init__(self, names: list[str], lows: list[float], steps: list[float], tables: list[np.ndarray],
                 log_weights: np.ndarray) -> None:
        self.names, self.lows, self.steps = names, lows, steps
        self.tables = tables  # per dimension: (grid values, merged kernels) log-density
        self.log_weights = log_weights  # (merged kernels,)

    @classmethod
    def build(cls, estimator, search_space: dict[str, BaseDistribution]) -> DiscreteScorer | None:
        """The scorer of ``estimator`` (an Optuna ``_ParzenEstimator`` over ``search_space``), or None
        where a parameter is continuous or too wide to tabulate."""
        mixture = estimator._mixture_distribution
        names, lows, steps, tables, keys = [], [], [], [], []
        for (name, dist), batched in zip(search_space.items(), mixture.distributions, strict=True):
            if isinstance(dist, CategoricalDistribution):
                table, key = _categorical_table(batched.weights)
                low, step = 0.0, 1.0
            elif isinstance(dist, IntDistribution) and (dist.high - dist.low) // dist.step + 1 <= MAX_GRID:
                table, key = _discrete_table(batched)
                low, step = float(batched.low), float(batched.step)
            else:
                return None
            names.append(name)
            lows.append(low)
            steps.append(step)
            tables.append(table)
            keys.append(key)
        # kernels identical on every dimension are one kernel with their weights summed
        first, merged = _unique_rows(np.stack(keys, axis=1))
        weights = np.bincount(merged, weights=mixture.weights, minlength=len(first))
        with np.errstate(divide="ignore"):
            log_weights = np.log(weights)
        return cls(names, lows, steps, [t[:, first] for t in tables], log_weights)

    @property
    def n_kernels(self) -> int:
        return len(self.log_weights)

    def log_pdf(self, samples: dict[str, np.ndarray]) -> np.ndarray:
        """Log-density at each candidate (``samples``: internal representations, as TPE draws them)."""
        index = np.stack([np.rint((samples[name] - low) / step).astype(np.intp)
                          for name, low, step in zip(self.names, self.lows, self.steps, strict=True)], axis=1)
        first, inverse = _unique_rows(index)
        distinct = index[first]
        total = np.broadcast_to(self.log_weights, (len(distinct), self.n_kernels)).copy()
        for d, table in enumerate(self.tables):
            total += table[distinct[:, d]]
        top = total.max(axis=1)
        top[np.isneginf(top)] = 0  # no kernel has mass there: -inf, not nan
        with np.errstate(divide="ignore"):
            scores = np.log(np.exp(total - top[:, None]).sum(axis=1)) + top
        return scores[inverse]


def _unique_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the index of each distinct row's first occurrence, each row's distinct number): what
    ``np.unique(axis=0)`` gives, by a lexicographic sort of the columns (several times faster)."""
    if len(matrix) == 0:
        return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
    order = np.lexsort(matrix.T[::-1])
    ordered = matrix[order]
    new = np.empty(len(matrix), dtype=bool)
    new[0] = True
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    inverse = np.empty(len(matrix), dtype=np.intp)
    inverse[order] = np.cumsum(new) - 1
    return order[new], inverse


def _categorical_table(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(choices x kernels) log-probabilities, and each kernel's key (its row among distinct rows)."""
    with np.errstate(divide="ignore"):
        return np.log(weights).T, _unique_rows(weights)[1]


def _discrete_table(d) -> tuple[np.ndarray, np.ndarray]:
    """(grid values x kernels) log-mass of each kernel's truncated Gaussian on each value's step, as
    Optuna's log_pdf computes it, once per distinct (mu, sigma)."""
    first, key = _unique_rows(np.stack([d.mu, d.sigma], axis=1))
    mu, sigma = d.mu[first], d.sigma[first]
    grid = d.low + d.step * np.arange(int(round((d.high - d.low) / d.step)) + 1)
    left, right = grid - d.step / 2, grid + d.step / 2
    if d.is_log:
        left, right = np.log(left), np.log(right)
    mass = _truncnorm._log_gauss_mass((left[:, None] - mu) / sigma, (right[:, None] - mu) / sigma)
    norm = _truncnorm._log_gauss_mass((d.adapted_low - mu) / sigma, (d.adapted_high - mu) / sigma)
    return (mass - norm)[:, key], key
