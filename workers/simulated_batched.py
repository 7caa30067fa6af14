"""Batched decoding on a simulated Mac: the seconds of one llama.cpp batch that carries several
sequences (issue 22.6), built on the single-stream model of workers/simulated.py.

Every figure is simulated. The single-stream model stays as it is; a batch adds to it (rules
numbered as the code cites them):

1. A batch of one decode token costs exactly the single-stream model's generated token at that
   token's context (``simulated.predict``: its weights read, launches, dequantisation and KV cache
   read). Its time is linear in the context: a fixed part and a part per cached position (the
   slope of that time between two contexts). Every decode token in a batch reads its own
   sequence's KV cache at that per-position cost.
2. Small batches (2 to ``SMALL_BATCH_MAX`` = 8 tokens: ggml-metal's small-batch mat-vec kernels,
   llama.cpp #10581) read the weights once for all their tokens; each token past the first adds
   its own compute, ``small_batch_s_per_param_core_ghz`` x the active parameters on the GPU /
   (GPU cores x clock), fitted on public ``llama-batched-bench`` rows.
3. Larger batches run through the mat-mat kernel, whose tiles hold ``MM_TILE`` = 32 tokens: a
   step costs at least the weights read once plus one whole tile's compute
   (``tile_s_per_param_core_ghz`` per token of the tile, fitted on public rows), and at least the
   prompt model's cost per token for every token (the GPU filled: the pp model at ``n_ubatch``).
   The tile's cost scales across quantisations as the prompt rate's does (the same kernel).
   Rules 2 and 3 never make a token cheaper than a token of a prompt micro-batch.
4. So the aggregate rate rises with the batch while the one weight read per step dominates
   (bandwidth-bound) and flattens at the prompt rate once the per-token compute does
   (compute-bound). Between 8 and 9 tokens it drops (a 9-token batch pays a 32-token tile), as
   llama.cpp's kernels do.
5. A step that carries prompt tokens too (llama-server puts one chunk of prompt beside the decode
   tokens) runs as one prompt batch of all its tokens (the pp model at the chunk's depth, in
   micro-batches of ``n_ubatch``, reading the weights itself), never cheaper than rule 3's tile,
   plus each decode token's KV cache read.
6. The fit takes each fitted row's ratio to the single-stream row of the same chip, model and
   context (as ``simulated.fitted_dims`` does), so the single-stream model's error on that chip
   does not leak into the constants; rows of kernel paths llama.cpp has since replaced are kept,
   printed, and never fitted.

Modelled, not calibrated: rule 2's constant for quantisations other than q8_0, the tile's scaling
across quantisations, mixtures of experts (decoded as if each token read only its own experts; a
batch reads the union) and rule 5's mixed batch.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources

from workers import placement, simulated
from workers.errors import BadInput
from workers.hardware import Fingerprint
from workers.models import ModelInfo, arch_shape, named_as
from workers.trial import BenchParams

# Two contexts (cached positions) rule 1's line is drawn through; both above simulated.CAL_TG_CTX,
# where the single-stream model's time is linear in the context.
LINE_LOW_CTX, LINE_HIGH_CTX = 128, 1152
SMALL_BATCH_MAX = 8  # rule 2: ggml-metal's small-batch mat-vec kernels take 2 to 8 tokens
MM_TILE = 32  # rule 3: tokens in one tile of ggml-metal's mat-mat kernel
DEPTH_STEP = 64  # prompt-batch depths are rounded down to this many positions (rule 5's cache)

# A shape only the batched rows need (Qwen2.5-7B: qwen2 7B Q8_0, 7.62 B parameters, 7.54 GiB); kept
# out of the simulator's named shapes so that their outputs stay as they were.
CALIBRATION_SHAPES = {"qwen2.5-7b": arch_shape(28, 3584, 18944, 28, 4, 152064, 32768, 1e6)}


@dataclass(frozen=True)
class BatchConstants:
    """The fitted constants of batched decoding (rules 2 and 3; units in the names, core_ghz as
    simulated.py's: GPU cores x clock in Hz)."""

    small_batch_s_per_param_core_ghz: float  # rule 2: a small batch's extra token
    tile_s_per_param_core_ghz: float  # rule 3: one token of a mat-mat tile, at f16


@dataclass(frozen=True)
class StepModel:
    """Seconds of one batch of one configuration on one chip (rules 1-5)."""

    lone_token_s: float  # rule 1: a batch of one decode token at context 0
    per_position_s: float  # rule 1: each cached position a decode token reads
    weights_s: float  # rule 3: the lone token less its compute (the weights read once, launches)
    small_batch_token_s: float  # rule 2: each token past the first of a small batch
    tile_token_s: float  # rule 3: each token of a mat-mat tile
    prompt_token_s: float  # rules 2-3's floor: one token of a full prompt micro-batch
    prompt_batch_s: Callable[[int, int], float] = field(compare=False, repr=False)  # (tokens, depth) -> s

    @property
    def compute_bound_tps(self) -> float:
        """The aggregate rate the decode of many sequences flattens at (rule 4)."""
        return 1.0 / self.prompt_token_s

    def decode_s(self, tokens: int, positions: int) -> float:
        """Rules 1-3: ``tokens`` decode tokens (one per sequence) reading ``positions`` cached
        positions in all."""
        if tokens <= 0:
            return 0.0
        kv = positions * self.per_position_s
        if tokens <= SMALL_BATCH_MAX:
            return self.lone_token_s + (tokens - 1) * max(self.small_batch_token_s, self.prompt_token_s) + kv
        return max(self.weights_s + MM_TILE * self.tile_token_s, tokens * self.prompt_token_s) + kv

    def mixed_s(self, prompt_tokens: int, depth: int, decode_tokens: int, positions: int) -> float:
        """Rule 5: a prompt chunk of ``prompt_tokens`` after ``depth`` cached positions, with
        ``decode_tokens`` decode tokens reading ``positions`` cached positions beside it."""
        if prompt_tokens <= 0:
            return self.decode_s(decode_tokens, positions)
        batch = self.prompt_batch_s(prompt_tokens + decode_tokens, depth - depth % DEPTH_STEP)
        return max(self.weights_s + MM_TILE * self.tile_token_s, batch) + positions * self.per_position_s


def _token_s(chip: Fingerprint, shape: ModelInfo, params: BenchParams, ctx: int, scenario: str) -> float:
    """The single-stream model's seconds for one generated token at context ``ctx`` (rule 1)."""
    pred = simulated.predict(chip, shape, params, n_prompt=0, n_gen=2, scenario=scenario, depth=ctx - 1)
    if not pred.fits:
        raise BadInput(pred.reason)
    return 1.0 / pred.tg_tps


def gpu_active_params(shape: ModelInfo, params: BenchParams) -> float:
    """Parameters one token reads on the GPU: the offloaded layers' active weights (less the experts
    kept on the CPU) and the output projection where it is offloaded (simulated.predict's split)."""
    layers, output = placement.gpu_layers(shape, params)
    expert_active = shape.expert_params * shape.n_expert_used / shape.n_expert if shape.n_expert else 0.0
    return (layers * shape.active_layer_params - placement.experts_on_cpu(shape, params) * expert_active
            + (shape.output_params if output else 0.0))


def step_model(chip: Fingerprint, shape: ModelInfo, params: BenchParams, scenario: str = "calibrated",
               constants: BatchConstants | None = None) -> StepModel:
    """The batch costs of ``params`` on ``chip`` (BadInput where the weights alone do not fit)."""
    k = constants if constants is not None else fitted_batch()
    single = simulated.fitted_constants()
    low = _token_s(chip, shape, params, LINE_LOW_CTX, scenario)
    high = _token_s(chip, shape, params, LINE_HIGH_CTX, scenario)
    per_position = (high - low) / (LINE_HIGH_CTX - LINE_LOW_CTX)
    lone = low - per_position * LINE_LOW_CTX
    core_hz = chip.gpu_cores * simulated.GPU_CLOCK_GHZ[chip.generation] * 1e9
    gpu_params = gpu_active_params(shape, params) / core_hz
    qc = simulated.QUANT_CLASS[shape.quant]
    tile_scale = single.pp_s_per_param_core_ghz[qc] / single.pp_s_per_param_core_ghz["f16"]
    ubatch = max(1, min(params.n_ubatch, params.n_batch))
    full = simulated.predict(chip, shape, params, n_prompt=ubatch, n_gen=0, scenario=scenario)

    @cache
    def prompt_batch_s(tokens: int, depth: int) -> float:
        batch = replace(params, n_batch=max(params.n_batch, tokens))
        pred = simulated.predict(chip, shape, batch, n_prompt=tokens, n_gen=0, scenario=scenario, depth=depth)
        return tokens / pred.pp_tps

    return StepModel(
        lone_token_s=lone, per_position_s=per_position,
        weights_s=lone - gpu_params * single.dequant_s_per_param_core_ghz[qc],
        small_batch_token_s=gpu_params * k.small_batch_s_per_param_core_ghz,
        tile_token_s=gpu_params * k.tile_s_per_param_core_ghz * tile_scale,
        prompt_token_s=1.0 / full.pp_tps, prompt_batch_s=prompt_batch_s)


# ---------------------------------------------------------------- the public rows and the fit


def row_shape(name: str, quant: str) -> ModelInfo:
    """A batched row's model: the simulator's named shape, or one of ``CALIBRATION_SHAPES``."""
    if name in CALIBRATION_SHAPES:
        return named_as(CALIBRATION_SHAPES[name], name, quant)
    return simulated.model_shape(name, quant)


@cache
def batched_rows() -> list[dict]:
    """The public ``llama-batched-bench`` rows (``data/llamacpp_apple_batched.csv``), parsed."""
    text = resources.files("workers").joinpath("data/llamacpp_apple_batched.csv").read_text()
    out = []
    for row in csv.DictReader(line for line in text.splitlines() if not line.startswith("#")):
        out.append({
            **row, "chip": simulated.parse_chip(f"{row['chip']}/{row['memory_gb']}"),
            "shape": row_shape(row["model"], row["quant"]), "pp": int(row["pp"]), "tg": int(row["tg"]),
            "slots": int(row["slots"]), "s_tg": float(row["s_tg"]),
        })
    return out


def row_params(row: dict) -> BenchParams:
    """A row's configuration: every layer on the GPU, llama-batched-bench's batch sizes."""
    return BenchParams(n_gpu_layers=99, n_threads=row["chip"].p_cores, n_batch=2048, n_ubatch=512,
                       flash_attn=row["fa"])


def row_context(row: dict) -> float:
    """The mean context of a row's generated tokens (simulated.predict's: the prompt and half the
    generated tokens)."""
    return row["pp"] + row["tg"] / 2


def row_step_s(row: dict, constants: BatchConstants | None = None) -> float:
    """The predicted seconds of one decode step of a row's B sequences at their mean context."""
    steps = step_model(row["chip"], row["shape"], row_params(row), constants=constants)
    return steps.decode_s(row["slots"], round(row["slots"] * row_context(row)))


def predict_row(row: dict, constants: BatchConstants | None = None) -> float:
    """The predicted S_TG of a row: B tokens per decode step."""
    return row["slots"] / row_step_s(row, constants)


def base_row(row: dict) -> dict:
    """The single-stream row (B = 1) of the same chip, model, configuration and context."""
    key = (row["chip"].label, row["model"], row["quant"], row["fa"], row["pp"], row["tg"])
    return next(r for r in batched_rows() if r["role"] == "base"
                and (r["chip"].label, r["model"], r["quant"], r["fa"], r["pp"], r["tg"]) == key)


def _fit_terms(row: dict) -> tuple[float, float, float]:
    """A fit row's measured step time (its base row's predicted one scaled by the measured ratio,
    rule 6) and its prediction as ``fixed + slope x constant`` (rule 2 or 3, where the constant
    binds)."""
    zero = BatchConstants(0.0, 0.0)
    steps = step_model(row["chip"], row["shape"], row_params(row), constants=zero)
    ctx, slots = round(row_context(row)), row["slots"]
    lone = steps.decode_s(1, ctx)
    measured = slots * lone / (row["s_tg"] / base_row(row)["s_tg"])
    kv = slots * ctx * steps.per_position_s
    core_hz = row["chip"].gpu_cores * simulated.GPU_CLOCK_GHZ[row["chip"].generation] * 1e9
    gpu_params = gpu_active_params(row["shape"], row_params(row)) / core_hz
    if slots <= SMALL_BATCH_MAX:
        return measured, lone + kv - ctx * steps.per_position_s, (slots - 1) * gpu_params
    single = simulated.fitted_constants()
    qc = simulated.QUANT_CLASS[row["shape"].quant]
    scale = single.pp_s_per_param_core_ghz[qc] / single.pp_s_per_param_core_ghz["f16"]
    return measured, steps.weights_s + kv, MM_TILE * gpu_params * scale


def _least_squares(terms: list[tuple[float, float, float]]) -> float:
    """The constant minimising the squared relative error of ``fixed + slope x c`` against each
    measured time."""
    num = sum(slope / t * (t - fixed) / t for t, fixed, slope in terms)
    den = sum((slope / t) ** 2 for t, _, slope in terms)
    if not den:
        raise BadInput("a batched-decoding regime has no fit rows in data/llamacpp_apple_batched.csv")
    return num / den


@cache
def fitted_batch() -> BatchConstants:
    """Rule 6: least squares, in relative step time, of rule 2's constant on the fit rows of up to
    ``SMALL_BATCH_MAX`` sequences and of rule 3's on the larger ones."""
    fits = [r for r in batched_rows() if r["role"] == "fit"]
    small = [_fit_terms(r) for r in fits if r["slots"] <= SMALL_BATCH_MAX]
    large = [_fit_terms(r) for r in fits if r["slots"] > SMALL_BATCH_MAX]
    return BatchConstants(small_batch_s_per_param_core_ghz=_least_squares(small),
                          tile_s_per_param_core_ghz=_least_squares(large))
