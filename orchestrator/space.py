"""The search space of a study, derived from the node's hardware and the model.

- ngl (GPU layers): 0..n_layer+1 where llama.cpp can offload (n_layer+1 also puts the output layer
  on the GPU); fixed at 0 on a CPU-only node.
- threads: 1..logical cores (llama.cpp uses the same count for prompt and generation here, as
  llama-bench does).
- batch: powers of two from 32 up to the smallest of the prompt length rounded up, the model's
  context and 4096 (a batch larger than the prompt processes it the same way).
- ubatch: the same powers of two, never above batch (a larger proposal is clamped to batch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from workers.hardware import Fingerprint
from workers.models import ModelInfo
from workers.trial import BenchParams

MIN_BATCH = 32
MAX_BATCH = 4096


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    values, value = [], low
    while value <= high:
        values.append(value)
        value *= 2
    return tuple(values) or (low,)


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class SearchSpace:
    """The ranges of one study. Stored with the study so a resumed study searches the same space."""

    ngl_max: int
    threads_max: int
    batch_choices: tuple[int, ...]
    flash_attn: bool = False

    @classmethod
    def for_target(cls, fp: Fingerprint, model: ModelInfo, n_prompt: int) -> SearchSpace:
        top = min(MAX_BATCH, model.context_length or MAX_BATCH, next_power_of_two(max(n_prompt, 1)))
        return cls(
            ngl_max=model.n_layer + 1 if fp.gpu_offload else 0,
            threads_max=max(fp.logical_cores or 1, 1),
            batch_choices=powers_of_two(MIN_BATCH, max(top, MIN_BATCH)),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SearchSpace:
        return cls(**{**data, "batch_choices": tuple(data["batch_choices"])})

    # -- Optuna side: names and distributions

    def suggest(self, trial) -> BenchParams:
        """Ask an Optuna trial for one configuration in this space."""
        ngl = trial.suggest_int("ngl", 0, self.ngl_max) if self.ngl_max > 0 else 0
        threads = trial.suggest_int("threads", 1, self.threads_max)
        batch = trial.suggest_categorical("batch", list(self.batch_choices))
        ubatch = trial.suggest_categorical("ubatch", list(self.batch_choices))
        flash = trial.suggest_categorical("flash_attn", [False, True]) if self.flash_attn else False
        return BenchParams(
            n_gpu_layers=ngl,
            n_threads=threads,
            n_batch=batch,
            n_ubatch=min(ubatch, batch),
            flash_attn=flash,
        )

    def optuna_params(self, params: BenchParams) -> dict:
        """The Optuna parameter values that propose ``params`` (for enqueueing known configs)."""
        values: dict = {"threads": params.n_threads, "batch": params.n_batch, "ubatch": params.n_ubatch}
        if self.ngl_max > 0:
            values["ngl"] = params.n_gpu_layers
        if self.flash_attn:
            values["flash_attn"] = params.flash_attn
        return values

    def clip(self, params: BenchParams) -> BenchParams:
        """The nearest configuration inside this space (for configs learnt elsewhere)."""
        batches = self.batch_choices

        def nearest(value: int) -> int:
            return min(batches, key=lambda b: (abs(b - value), b))

        batch = nearest(params.n_batch)
        return replace(
            params,
            n_gpu_layers=min(max(params.n_gpu_layers, 0), self.ngl_max),
            n_threads=min(max(params.n_threads, 1), self.threads_max),
            n_threads_batch=None,
            n_batch=batch,
            n_ubatch=min(nearest(params.n_ubatch), batch),
            flash_attn=params.flash_attn and self.flash_attn,
        )

    def grid(self, max_axis: int = 8) -> dict[str, list]:
        """A coarse grid over this space for the grid sampler (each axis at most ``max_axis``)."""

        def spread(low: int, high: int) -> list[int]:
            if high - low + 1 <= max_axis:
                return list(range(low, high + 1))
            step = (high - low) / (max_axis - 1)
            return sorted({round(low + i * step) for i in range(max_axis)})

        grid: dict[str, list] = {
            "threads": spread(1, self.threads_max),
            "batch": list(self.batch_choices)[-4:],
            "ubatch": [min(512, max(self.batch_choices))]
            if 512 in self.batch_choices or max(self.batch_choices) < 512
            else [self.batch_choices[0]],
        }
        if self.ngl_max > 0:
            grid["ngl"] = spread(0, self.ngl_max)
        if self.flash_attn:
            grid["flash_attn"] = [False, True]
        return grid

    def size(self) -> int:
        n = (self.ngl_max + 1) * self.threads_max * len(self.batch_choices) ** 2
        return n * (2 if self.flash_attn else 1)


def llama_cpp_python_defaults(fp: Fingerprint) -> BenchParams:
    """The configuration ``llama_cpp.Llama(model_path)`` uses when given no settings."""
    cores = fp.logical_cores or 1
    return BenchParams(
        n_gpu_layers=0,
        n_threads=max(cores // 2, 1),
        n_threads_batch=cores,
        n_batch=512,
        n_ubatch=512,
        flash_attn=False,
    )


def full_offload(fp: Fingerprint, model: ModelInfo, space: SearchSpace) -> BenchParams | None:
    """Every layer on the GPU with llama-cpp-python's other defaults: the usual hand-tuned choice.

    None where this machine cannot offload. Measured in every GPU study so the gain over it is known.
    """
    if space.ngl_max == 0:
        return None
    base = llama_cpp_python_defaults(fp)
    batch = min(base.n_batch, max(space.batch_choices))
    return replace(base, n_gpu_layers=space.ngl_max, n_batch=batch, n_ubatch=batch,
                   n_threads_batch=None)
