"""Transfer to hardware (or models) the fleet has not measured: predict a configuration and its speed.

What the fleet knows is its recommendations: per (chip, model, objective), the best confirmed
configuration and its speed. Each becomes an example with hardware and model features (P/E cores,
GPU cores, bandwidth, memory, model bytes, layers, bits per weight). Bayesian ridge regressions
(scikit-learn) learn, over those features, the offload fraction (ngl / layers), threads relative to
P-cores, the batch (log2) and the speed (log tok/s, whose predictive deviation gives the interval).
The physical feature that carries most of it is bandwidth over model bytes: generation is
memory-bound. Simulated and real examples are never mixed in one model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from workers.errors import BadInput
from workers.hardware import Fingerprint
from workers.models import ModelInfo
from workers.trial import BenchParams

MIN_EXAMPLES = 2
BATCH_RANGE = (32, 4096)
SPEED_FEATURES = [0, 1, 2]  # of features(): bandwidth / model bytes, bandwidth, GPU cores


def comparable(hw: Fingerprint) -> bool:
    """Whether a machine can be placed among Apple's bins: it states a bandwidth and its cores (a
    CUDA or CPU-only machine states no bandwidth)."""
    return bool(hw.bandwidth_gbs and (hw.p_cores or hw.logical_cores))


def describable(model: ModelInfo) -> bool:
    """Whether the model's size and layers are known (not so for one imported from llama-bench)."""
    return model.size_bytes > 0 and model.n_layer > 0 and model.n_params > 0


def cores(hw: Fingerprint) -> tuple[int, int]:
    """P and E cores as the model counts them: a machine without core tiers has only P-cores."""
    return hw.p_cores or hw.logical_cores or 0, hw.e_cores or 0


def features(hw: Fingerprint, model: ModelInfo) -> list[float]:
    """The numbers a configuration is chosen from: the hardware and the model it runs."""
    if not describable(model):
        raise BadInput(f"model {model.name}: its size and layer count are unknown (imported?); "
                       "register the GGUF file to predict for it")
    p_cores, e_cores = cores(hw)
    model_bytes = float(model.size_bytes)
    memory_gb = hw.memory_gb or 16.0
    bits_per_weight = model.size_bytes * 8 / model.n_params
    return [
        math.log(hw.bandwidth_gbs * 1e9 / model_bytes),  # tokens/s ceiling of generation
        math.log(hw.bandwidth_gbs),
        math.log((hw.gpu_cores or 0) + 1),
        float(p_cores),
        float(e_cores),
        math.log(memory_gb * 1024**3 / model_bytes),  # room to spare (offload limit)
        float(model.n_layer),
        bits_per_weight,
    ]


@dataclass(frozen=True)
class Example:
    key: str  # chip key
    hardware: Fingerprint
    model: ModelInfo
    params: BenchParams
    expected_tps: float


@dataclass(frozen=True)
class Prediction:
    params: BenchParams
    expected_tps: float
    interval: tuple[float, float]  # about 95 % of the predictive distribution
    nearest: list[tuple[str, BenchParams]] = field(default_factory=list)  # known chips, closest first
    n_examples: int = 0


class ConfigPredictor:
    """From features to a configuration (offload fraction, threads / P-cores, log2 batch) and a
    speed (log tok/s with a predictive deviation)."""

    def __init__(self, examples: list[Example]) -> None:
        if len(examples) < MIN_EXAMPLES:
            raise BadInput(f"too little evidence to predict from: {len(examples)} recommendation(s); "
                           f"tune at least {MIN_EXAMPLES} chips first")
        from sklearn.linear_model import BayesianRidge
        from sklearn.neighbors import KNeighborsRegressor
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        self.examples = examples
        x = np.array([features(e.hardware, e.model) for e in examples])
        configs = np.array([
            [e.params.n_gpu_layers / (e.model.n_layer + 1) for e in examples],
            [e.params.n_threads / max(cores(e.hardware)[0], 1) for e in examples],
            [math.log2(e.params.n_batch) for e in examples],
            [math.log2(e.params.n_ubatch) for e in examples],
        ]).T
        # The configuration: what the most similar known chips run (distance-weighted neighbours),
        # so a chip unlike any other gets its neighbours' choice, never a linear extrapolation.
        self._config = make_pipeline(StandardScaler(), KNeighborsRegressor(
            n_neighbors=min(3, len(examples)), weights="distance")).fit(x, configs)
        # The speed: log tok/s is close to linear in the physics (bandwidth over model bytes, GPU
        # cores); a Bayesian ridge on those gives a mean and a predictive deviation.
        self._speed = make_pipeline(StandardScaler(), BayesianRidge()).fit(
            x[:, SPEED_FEATURES], np.array([math.log(e.expected_tps) for e in examples]))
        self._scaled = self._config[0].transform(x)  # the examples in the neighbours' own scale

    def predict(self, hw: Fingerprint, model: ModelInfo, k_nearest: int = 2) -> Prediction:
        x = np.array([features(hw, model)])
        offload, threads, batch, ubatch = self._config.predict(x)[0]
        scaled = self._speed[:-1].transform(x[:, SPEED_FEATURES])
        mean, std = self._speed[-1].predict(scaled, return_std=True)
        speed, sigma = float(mean[0]), float(std[0])
        n_layer = model.n_layer
        ngl = round(min(max(offload, 0.0), 1.0) * (n_layer + 1)) if hw.gpu_cores else 0
        p_cores, e_cores = cores(hw)
        n_threads = int(min(max(round(threads * max(p_cores, 1)), 1),
                            max(p_cores + (hw.m_cores or 0) + e_cores, 1)))
        n_batch = _power_of_two(batch)
        params = BenchParams(n_gpu_layers=ngl, n_threads=n_threads, n_batch=n_batch,
                             n_ubatch=min(_power_of_two(ubatch), n_batch))
        return Prediction(
            params=params, expected_tps=math.exp(speed),
            interval=(math.exp(speed - 1.96 * sigma), math.exp(speed + 1.96 * sigma)),
            nearest=[(e.key, e.params) for e in self.nearest(x, k_nearest)],
            n_examples=len(self.examples),
        )

    def nearest(self, x: np.ndarray, k: int) -> list[Example]:
        """The known chips most like the one of features ``x`` (standardised feature distance), one
        example each."""
        z = self._config[0].transform(x)[0]
        distances = np.sum((self._scaled - z) ** 2, axis=1)
        out, seen = [], set()
        for i in np.argsort(distances, kind="stable"):
            example = self.examples[i]
            if example.key not in seen:
                seen.add(example.key)
                out.append(example)
            if len(out) == k:
                break
        return out


def _power_of_two(log2_value: float) -> int:
    low, high = (int(math.log2(b)) for b in BATCH_RANGE)
    return 2 ** int(min(max(round(log2_value), low), high))
