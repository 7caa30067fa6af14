"""A calibrated performance model of llama.cpp on Apple Silicon: a worker backend for simulation.

There are no Macs here, so this stands in for them. Every number it produces is labelled
simulated and never mixed with real measurements. It predicts pp and tg tokens/s from physics:

- tg is memory-bound: the bytes of the weights read per token over the effective bandwidth, the GPU
  and the CPU parts one after the other, plus a per-token cost for each CPU<->GPU hand-over, plus
  the GPU's dequantisation work (cores x clock) and a per-layer launch cost.
- pp is compute-bound: GPU cores x clock against P and E cores, with batch-size efficiency
  (weights are read once per micro-batch).
- CPU threads scale with P-cores until the CPU's share of the bandwidth is used up; a thread on an
  E-core slows the whole step (llama.cpp splits work evenly, the step waits for the slowest
  thread), and more threads than cores is worse still.
- CPU threads and the GPU compete for the shared bandwidth while both are active (contention).
- A GPU share beyond the working-set limit (~75 % of RAM) fails like an out-of-memory trial.
- Fanless machines throttle under sustained load; samples carry seeded noise.
- Context depth: every generated token reads the K and V cache of every position before it (bytes
  per element from the cache type: f16 2, q8_0 34/32, q4_0 18/32), and every prompt token attends
  to the depth and the prompt before it (compute). Flash attention reads the cache at its own
  fitted efficiency; without it llama.cpp writes and reads the n_head x context score matrix in
  f32 and runs a few more kernels per layer (it is assumed to read the cache no faster than the
  flash-attention kernel: no public Metal row measures -fa 0 at a depth). Where the model's
  attention has no flash-attention kernel on the GPU (Gemma 2's logit soft-capping, at the time
  of the public row), "on" runs the attention op on the CPU: two hand-overs per layer and the
  attention's compute on CPU threads; "auto" then means off, as llama.cpp's auto does for an
  unsupported op.
- Mixture of experts: a token reads only its experts' weights; ``n_cpu_moe`` keeps the expert
  tensors of the first layers in host memory, so their bytes go through the CPU's bandwidth and
  threads; the GPU's working set shrinks by the same bytes.
- Prompt threads (``n_threads_batch``) pace the CPU part of pp; generation threads the CPU part
  of tg. Op offload (llama.cpp's default): ggml-metal's ``offload_op`` takes the matmuls of
  host-resident weights to the GPU for batches of 32 tokens or more, so a micro-batch of pp copies
  the CPU layers' weights (read and written at the bandwidth) and computes them on the GPU, with
  two hand-overs per CPU layer; off, the CPU threads compute them.

The GPU constants are fitted by least squares on public llama-bench results for M1 and M2
(``data/llamacpp_apple_m1_m2.csv``) in physical units (bandwidth, cores x clock); M3 and M4 follow
from their own bandwidth, cores and clocks. The constants of the newer dimensions (flash attention,
depth, experts) are fitted one each on the public rows of ``data/llamacpp_apple_dims.csv``
(``fitted_dims``); docs/benchmarks.md says which dimension rests on which row. ``ModelConstants``
holds every constant ``predict`` uses (default: these); ``ModelConstants.perturbed`` moves each by a
seeded factor, a simulated truth the calibrated model's prediction does not know exactly.

Scenarios: ``calibrated`` (default: llama.cpp runs CPU and GPU parts in sequence; full offload wins
on Apple Silicon) and ``seed`` (strong contention, CPU and GPU work overlapping, CPU threads
polling during GPU work: reproduces the field observation that on an M2 Ultra with 8 threads an
interior offload of about 24 of 32 layers beats full offload).
"""

from __future__ import annotations

import csv
import math
import random
import re
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from functools import cache
from importlib import resources

import numpy as np

from workers import placement
from workers.errors import BadInput
from workers.hardware import GIB, Fingerprint, apple_bins, chip_table
from workers.models import (
    ARCH_SHAPES,
    QUANT_BPW,
    SIM_SCHEME,
    ModelInfo,
    arch_shape,
    named_as,
    named_model,
    read_model_info,
)
from workers.objective import TG, Objective
from workers.objective import objective as named_objective
from workers.placement import KV_BYTES, WORKING_SET_FRACTION
from workers.trial import BenchParams, FailureKind, Sample, TrialResult, Workload

# Public figures per generation: GPU clock (GHz) and P-core clock (GHz). M5 is modelled: Apple
# publishes no clocks; these are the maxima powermetrics reports on M5 Macs (public readings: GPU
# 1578 MHz, the M4's; super cores 4608 MHz), docs/benchmarks.md "The M5 generation".
GPU_CLOCK_GHZ = {"M1": 1.278, "M2": 1.398, "M3": 1.38, "M4": 1.578, "M5": 1.578}
CPU_CLOCK_GHZ = {"M1": 3.2, "M2": 3.5, "M3": 4.05, "M4": 4.4, "M5": 4.6}
# Unified memory of each family's base configuration (override with "M2 Ultra/76/192").
BASE_MEMORY_GB = {
    "M1": 8, "M1 Pro": 16, "M1 Max": 32, "M1 Ultra": 64,
    "M2": 8, "M2 Pro": 16, "M2 Max": 32, "M2 Ultra": 64,
    "M3": 8, "M3 Pro": 18, "M3 Max": 36, "M3 Ultra": 96,
    "M4": 16, "M4 Pro": 24, "M4 Max": 36,
    "M5": 16, "M5 Pro": 24, "M5 Max": 36,
}
# How far each generation's constants rest on measurement (docs/benchmarks.md).
# M1/M2: the GPU constants are fitted on their public rows; M3/M4: that fit on their own bandwidth,
# cores and clocks, checked against public rows; M5: from Apple's specifications alone.
BASIS = {
    "M1": "calibrated", "M2": "calibrated", "M3": "checked", "M4": "checked",
    "M5": "modelled",  # public specs, no measurement
}


def basis(chip: Fingerprint) -> str:
    """How far the simulator's figures for this chip rest on measurement."""
    return BASIS.get(chip.generation or "", "modelled")
# Dequantisation cost class of each type (the fit has one constant per class).
QUANT_CLASS = {"f16": "f16", "q8_0": "q8", "q6_k": "q8", "q5_k_m": "q4", "q5_0": "q4", "q5_1": "q4",
               "q4_k_m": "q4", "q4_k_s": "q4", "q4_1": "q4", "q4_0": "q4", "q3_k_m": "q4", "q2_k": "q4"}


def fanless(chip: Fingerprint) -> bool:
    """The base chips (M1, M2, ...) ship in fanless machines, which throttle under sustained load."""
    return " " not in (chip.family or "")


def ray_label(chip: Fingerprint) -> str:
    """A simulated chip's bin as a Ray label value (no spaces or slashes): "M2_Ultra.76.192"."""
    return chip.label.replace(" ", "_").replace("/", ".")


MAX_SPEC_NUMBER = 4096  # above any Apple chip's GPU cores or memory GB


def _count(text: str, parts: list[str], index: int, what: str) -> int | None:
    """A chip spec's numeric part (GPU cores, memory GB), or None where it is left out."""
    if len(parts) <= index or not parts[index]:
        return None
    if not re.fullmatch(r"[0-9]{1,4}", parts[index]) or not 0 < int(parts[index]) <= MAX_SPEC_NUMBER:
        raise BadInput(f"bad chip {text!r}: {what} {parts[index]!r} is not a whole number from 1 to "
                       f"{MAX_SPEC_NUMBER}")
    return int(parts[index])


def parse_chip(text: str) -> Fingerprint:
    """"M2 Ultra/76" or "M2 Ultra/76/192" (family / GPU cores / memory GB) into the fingerprint a
    simulated Mac of that bin reports.

    The label form of the same, "M2_Ultra.76.192" (Ray label values allow no spaces), works too.
    """
    if "/" not in text and "." in text:
        text = text.replace("_", " ").replace(".", "/")
    parts = [p.strip() for p in text.split("/")]
    if len(parts) > 3:
        raise BadInput(f"bad chip {text!r}: expected FAMILY[/GPU cores[/memory GB]], e.g. \"M2 Ultra/76/192\"")
    family = re.sub(r"^apple\s+", "", parts[0], flags=re.I)
    gpu = _count(text, parts, 1, "GPU cores")
    bins = [b for b in chip_table() if b.family.lower() == family.lower()]
    if not bins:
        families = sorted({b.family for b in chip_table()})
        raise BadInput(f"unknown chip {text!r}; families: {', '.join(families)}")
    if gpu is not None:
        bins = [b for b in bins if b.gpu_cores == gpu]
        if not bins:
            options = ", ".join(str(b.gpu_cores) for b in apple_bins(family))
            raise BadInput(f"unknown chip {text!r}: {family} comes with {options} GPU cores")
    b = max(bins, key=lambda b: (b.gpu_cores, b.p_cores))
    memory = _count(text, parts, 2, "memory GB") or BASE_MEMORY_GB[b.family]
    return replace(b, memory_bytes=memory * GIB, os="macOS (simulated)")


def all_chips() -> list[Fingerprint]:
    return [parse_chip(f"{b.family}/{b.gpu_cores}") for b in chip_table()]


# Shapes only the simulator knows (for the public rows of the newer dimensions): the llama layout
# as ``arch_shape`` takes it, and the fields past it.
SIM_SHAPES = {
    "qwen3-0.6b": arch_shape(28, 1024, 3072, 16, 8, 151936, 40960, 1e6, tied_embeddings=True, head_dim=128),
    # logit soft-capping: no Metal flash-attention kernel at the build of the public row
    "gemma2-2b": arch_shape(26, 2304, 9216, 8, 4, 256000, 8192, 10000.0,
                            tied_embeddings=True, head_dim=256, fa_on_gpu=False),
}
NAMED_SHAPES = (*(name for name in ARCH_SHAPES if not name.startswith("tiny")), *SIM_SHAPES)


def model_shape(name: str, quant: str) -> ModelInfo:
    """A named shape at a quantisation (no file behind it)."""
    quant = quant.lower()
    if name not in NAMED_SHAPES:
        raise BadInput(f"unknown model shape {name!r}; known: {', '.join(NAMED_SHAPES)}")
    if quant not in QUANT_BPW:
        raise BadInput(f"unknown quantisation {quant!r}; known: {', '.join(QUANT_BPW)}")
    if name not in SIM_SHAPES:
        return named_model(name, quant)
    return named_as(SIM_SHAPES[name], name, quant)


def shape_from_gguf(path: str) -> ModelInfo:
    """A real GGUF file's record, with what the simulator assumes where its metadata is silent."""
    info = read_model_info(path)
    n_head = info.n_head or 1
    return replace(info, n_head=n_head, n_head_kv=info.n_head_kv or n_head, n_vocab=info.n_vocab or 32000,
                   context_length=info.context_length or 4096)


def is_sim_model(ref: str) -> bool:
    return ref.startswith(SIM_SCHEME)


def parse_sim_model(ref: str) -> ModelInfo:
    """"sim://llama3-8b/q4_k_m": a named shape and quantisation, no file behind it."""
    name, _, quant = ref.removeprefix(SIM_SCHEME).partition("/")
    return model_shape(name, quant or "q4_0")


@cache
def shape_for_path(path: str) -> ModelInfo:
    """The model a simulated node benchmarks for a trial (named, or a GGUF's metadata)."""
    return parse_sim_model(path) if is_sim_model(path) else shape_from_gguf(path)


def sim_model_info(ref: str) -> ModelInfo:
    """The model a sim:// reference names, as the orchestrator registers it."""
    return parse_sim_model(ref)


# ---------------------------------------------------------------- calibration


@dataclass(frozen=True)
class GpuConstants:
    """Fitted constants of the GPU path (units in the names)."""

    bw_inefficiency: float  # effective bandwidth = bandwidth / this
    dequant_s_per_param_core_ghz: dict  # per quant class, tg
    launch_s_per_layer: float
    pp_s_per_param_core_ghz: dict  # per quant class, pp compute
    pp_bw_inefficiency: float  # weights read once per micro-batch
    pp_launch_s_per_layer: float


@cache
def calibration_rows() -> list[dict]:
    text = resources.files("workers").joinpath("data/llamacpp_apple_m1_m2.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    out = []
    for row in rows:  # memory is not in the data; give the bins enough for F16 (as the testers had)
        chip = parse_chip(f"{row['family']}/{row['gpu_cores']}/64")
        for quant in ("f16", "q8_0", "q4_0"):
            pp, tg = row[f"{quant}_pp512"], row[f"{quant}_tg128"]
            if pp and tg:
                out.append({"chip": chip, "quant": quant, "pp512": float(pp), "tg128": float(tg)})
    return out


@cache
def fitted_constants() -> GpuConstants:
    """Least squares (relative error) of the GPU model on the public M1/M2 measurements."""
    classes = ["f16", "q8", "q4"]
    rows = calibration_rows()
    shape = {q: model_shape("llama2-7b", q) for q in ("f16", "q8_0", "q4_0")}
    a_tg, y_tg, a_pp, y_pp = [], [], [], []
    for r in rows:
        chip, s = r["chip"], shape[r["quant"]]
        core_ghz = chip.gpu_cores * GPU_CLOCK_GHZ[chip.generation] * 1e9
        read = s.bytes_of(s.n_layer * s.layer_params + s.output_params)
        one_hot = [1.0 if QUANT_CLASS[r["quant"]] == c else 0.0 for c in classes]
        t_tg = 1 / r["tg128"]
        a_tg.append([read / (chip.bandwidth_gbs * 1e9) / t_tg,
                     *[h * s.n_params / core_ghz / t_tg for h in one_hot], s.n_layer / t_tg])
        y_tg.append(1.0)
        t_pp = 1 / r["pp512"]  # seconds per prompt token at ubatch 512
        a_pp.append([*[h * s.n_params / core_ghz / t_pp for h in one_hot],
                     read / (chip.bandwidth_gbs * 1e9) / 512 / t_pp, s.n_layer / 512 / t_pp])
        y_pp.append(1.0)
    x_tg = np.linalg.lstsq(np.array(a_tg), np.array(y_tg), rcond=None)[0]
    x_pp = np.linalg.lstsq(np.array(a_pp), np.array(y_pp), rcond=None)[0]
    return GpuConstants(
        bw_inefficiency=float(x_tg[0]),
        dequant_s_per_param_core_ghz=dict(zip(classes, map(float, x_tg[1:4]), strict=True)),
        launch_s_per_layer=float(x_tg[4]),
        pp_s_per_param_core_ghz=dict(zip(classes, map(float, x_pp[0:3]), strict=True)),
        pp_bw_inefficiency=float(x_pp[3]),
        pp_launch_s_per_layer=float(x_pp[4]),
    )


@cache
def dims_rows() -> list[dict]:
    """The public rows of the newer dimensions (``data/llamacpp_apple_dims.csv``), parsed."""
    text = resources.files("workers").joinpath("data/llamacpp_apple_dims.csv").read_text()
    out = []
    for row in csv.DictReader(line for line in text.splitlines() if not line.startswith("#")):
        out.append({
            **row,
            "chip": parse_chip(f"{row['chip']}/{row['memory_gb']}"),
            "shape": model_shape(row["model"], row["quant"]),
            "n_tokens": int(row["n_tokens"]), "depth": int(row["depth"]), "ubatch": int(row["ubatch"]),
            "tps": float(row["tps"]),
        })
    return out


def dims_row_params(row: dict) -> BenchParams:
    """The configuration of a public row: every layer on the GPU, llama-bench's other defaults."""
    ub = row["ubatch"]
    return BenchParams(n_gpu_layers=99, n_threads=4, n_batch=max(2048, ub), n_ubatch=ub, flash_attn=row["fa"])


def predict_row(row: dict, dims: DimConstants | None = None) -> float:
    """The predicted tokens/s of a public row's test (pp or tg of its n_tokens at its depth)."""
    n_prompt, n_gen = (row["n_tokens"], 0) if row["test"] == "pp" else (0, row["n_tokens"])
    pred = predict(row["chip"], row["shape"], dims_row_params(row), n_prompt, n_gen, depth=row["depth"],
                   dims=dims)
    return pred.pp_tps if row["test"] == "pp" else pred.tg_tps


@cache
def fitted_dims() -> DimConstants:
    """Each constant of the newer dimensions from its one public row (see the CSV's ``role``).

    Ratio rows (flash attention, depth) are fitted so that the predicted ratio to their base row
    is the measured one: the base model's error on that chip and model does not leak into the
    constant. The expert constant is fitted on its row's absolute figure.
    """
    rows = dims_rows()
    base = {(r["chip"].label, r["model"], r["quant"], r["test"], r["n_tokens"]): r
            for r in rows if r["role"] == "base"}
    values: dict[str, float] = {}
    zero = DimConstants()
    for r in rows:
        if not r["role"].startswith("fit:"):
            continue
        name = r["role"].removeprefix("fit:")
        b = base.get((r["chip"].label, r["model"], r["quant"], r["test"], r["n_tokens"]))
        shape = r["shape"]
        L = shape.n_layer
        if name == "moe_tg_s_per_layer":
            t_pred = 1 / predict_row(r, replace(zero, **values))
            values[name] = max((1 / r["tps"] - t_pred) / L, 0.0)
            continue
        for _ in range(8):  # the base row may depend on the constant too (depth): to a fixed point
            t_base = 1 / predict_row(b, replace(zero, **values))  # the base row as the model predicts it
            target = t_base * b["tps"] / r["tps"]  # the same time scaled by the measured ratio
            if name == "nofa_pp_cycles_per_score":
                core_ghz = r["chip"].gpu_cores * GPU_CLOCK_GHZ[r["chip"].generation] * 1e9
                values[name] = (t_base - target) * core_ghz / (L * shape.n_head * CAL_PP_CTX)
            elif name == "nofa_tg_s_per_layer":
                values[name] = (t_base - target) / L
            elif name == "fa_kv_efficiency":
                # the time the extra depth adds: the cache read at the efficiency sought
                kv_per_pos = shape.kv_elements * 2 * KV_BYTES["f16"]
                extra_pos = r["depth"] - b["depth"]
                values[name] = kv_per_pos * extra_pos * L / (r["chip"].bandwidth_gbs * 1e9 * (target - t_base))
            elif name == "fa_cpu_handover_s":
                values[name] = (target - t_base) / (2 * L)
    return DimConstants(**values)


# ---------------------------------------------------------------- the model


@dataclass(frozen=True)
class Scenario:
    """How CPU and GPU interact. ``overlap`` 0: in sequence; 1: CPU and GPU parts fully overlap."""

    name: str
    contention: float  # share of GPU speed lost when every P-core thread is active beside it
    overlap: float
    poll_during_gpu: bool  # CPU threads spin (and contend) while only the GPU works
    handover_s: float = 0.25e-3
    cpu_contention: float = 0.0  # share of CPU speed lost while the GPU streams beside it
    cpu_speed: float = 1.0  # CPU throughput relative to the default constants


SCENARIOS = {
    "calibrated": Scenario("calibrated", contention=0.08, overlap=0.0, poll_during_gpu=False),
    "seed": Scenario("seed", contention=0.75, overlap=1.0, poll_during_gpu=True, handover_s=1.5e-3,
                     cpu_speed=1.2),
}

CPU_BYTES_PER_S_PER_GHZ = 2.45e9  # quantised weights one P-core thread streams through its dot products
CPU_FLOPS_PER_GHZ = 24e9  # one P-core's effective matmul throughput for batched (pp) work
E_CORE_SPEED = 0.2  # relative to a P-core
# An M5 Pro/Max "performance" core (the tier below its super cores; Fingerprint.m_cores), relative
# to a super core. Modelled, no measurement: public figures put its throughput at 0.6-0.7 of a super
# core (Apple's "up to 30 %" multithreaded gain over the M4 Pro with 6 super + 12 of them for 10 P +
# 4 E gives about 0.6; Ars Technica's review about 0.7), and E_CORE_SPEED, fitted on the field (an M2
# Max from 8 to 12 threads: 18 -> 5 tok/s), is about 0.6 of an E core's throughput ratio (about a
# third): a thread on a slower core costs more than its throughput deficit. The same discount gives
# 0.36-0.42. Above 1/3, 18 threads outrun the 6 super cores alone on CPU-bound work (18 x 0.4 = 7.2
# > 6); below it they would not. docs/benchmarks.md "The M5 generation".
M_CORE_SPEED = 0.4
CPU_BANDWIDTH_SHARE = 0.6  # the CPU clusters reach at most this share of the SoC bandwidth
OVERSUBSCRIBED_PENALTY = 1.5  # threads beyond the cores: time-slicing and cache thrash


@dataclass(frozen=True)
class Prediction:
    pp_tps: float
    tg_tps: float
    gpu_bytes: float
    fits: bool
    reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _thread_speed(chip: Fingerprint, threads: int, m: ModelConstants) -> float:
    """Aggregate speed of ``threads`` in P-core units, as the slowest thread sets the pace.

    Threads fill the fastest cores first: P (super) cores, then a second tier of performance cores
    (M5 Pro/Max, ``m_cores``, at M_CORE_SPEED), then efficiency cores (E_CORE_SPEED); llama.cpp
    splits a step's work evenly, so the slowest core a thread lands on paces every thread.
    """
    m_cores = chip.m_cores or 0
    cores = chip.p_cores + m_cores + chip.e_cores
    if threads <= chip.p_cores:
        return float(threads)
    if threads <= chip.p_cores + m_cores:
        return threads * m.m_core_speed
    slowest = m.m_core_speed if m_cores and not chip.e_cores else m.e_core_speed
    if threads <= cores:
        return threads * slowest
    return cores * slowest / m.oversubscribed_penalty * cores / threads


CAL_PP_CTX = 256  # mean position a pp512 token attends to: the context of the fitted constants
CAL_TG_CTX = 64  # the same for tg128
OP_OFFLOAD_MIN_BATCH = 32  # ggml-metal's offload_op: matmuls of host weights from this batch size up


@dataclass(frozen=True)
class DimConstants:
    """Constants of the newer dimensions, each fitted on one public row (``fitted_dims``)."""

    fa_kv_efficiency: float = 1.0  # share of the bandwidth flash attention reads the KV cache at (tg)
    nofa_tg_s_per_layer: float = 0.0  # the kernels a layer runs more without flash attention (tg)
    nofa_pp_cycles_per_score: float = 0.0  # GPU core-cycles per head x position score without FA (pp)
    fa_cpu_handover_s: float = 0.0  # one GPU<->CPU hand-over of an attention op the GPU cannot run
    moe_tg_s_per_layer: float = 0.0  # expert routing and gathering per layer per token (tg)


@dataclass(frozen=True)
class ModelConstants:
    """Every fitted or modelled constant ``predict`` uses: the simulator's truth.

    ``calibrated_constants()`` is the calibrated model (the module's constants, the fitted GPU and
    newer-dimension constants); a ``SimulatedNode`` or ``predict`` given none uses it. ``perturbed``
    moves each constant by a seeded factor: a truth that differs from the calibrated model's
    prediction, within its measured error (bench/search_efficiency.py --truths). The scenario's
    contention and hand-over time are scaled by factors (1: the scenario's own).
    """

    gpu: GpuConstants
    dims: DimConstants
    cpu_bytes_per_s_per_ghz: float = CPU_BYTES_PER_S_PER_GHZ
    cpu_flops_per_ghz: float = CPU_FLOPS_PER_GHZ
    e_core_speed: float = E_CORE_SPEED
    cpu_bandwidth_share: float = CPU_BANDWIDTH_SHARE
    oversubscribed_penalty: float = OVERSUBSCRIBED_PENALTY
    contention_factor: float = 1.0  # the scenario's ``contention`` and ``cpu_contention`` x this
    handover_factor: float = 1.0  # the scenario's ``handover_s`` x this
    m_core_speed: float = M_CORE_SPEED  # last: the factors drawn for the others stay as they were
    label: str = "calibrated"  # what this truth is, for the node's backend_info

    def scenario(self, sc: Scenario) -> Scenario:
        """The scenario as this truth runs it."""
        if (self.contention_factor, self.handover_factor) == (1.0, 1.0):
            return sc
        return replace(sc, contention=sc.contention * self.contention_factor,
                       cpu_contention=sc.cpu_contention * self.contention_factor,
                       handover_s=sc.handover_s * self.handover_factor)

    def leaves(self) -> dict[str, float]:
        """Every constant by a dotted name ("gpu.dequant_s_per_param_core_ghz.q4"), in a fixed order."""
        return dict(_leaves(self))

    def perturbed(self, seed: int, spread: float = 0.15) -> ModelConstants:
        """Each constant (every entry of the dicts too) times its own factor drawn uniformly in
        [1 - spread, 1 + spread] from ``seed``: the same seed gives the same truth."""
        rng = random.Random(f"perturbed:{seed}")
        return replace(_scaled(self, lambda: 1 + spread * (2 * rng.random() - 1)),
                       label=f"perturbed truth {seed} (+-{spread:.0%})")


def _leaves(obj, prefix: str = ""):
    """(name, value) of every float inside a constants dataclass, depth first, in field order."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float):
            yield prefix + f.name, value
        elif isinstance(value, dict):
            yield from ((f"{prefix}{f.name}.{key}", v) for key, v in value.items())
        elif is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")


def _scaled(obj, factor):
    """A copy of a constants dataclass with every float multiplied by ``factor()`` (in _leaves' order)."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float):
            changes[f.name] = value * factor()
        elif isinstance(value, dict):
            changes[f.name] = {key: v * factor() for key, v in value.items()}
        elif is_dataclass(value):
            changes[f.name] = _scaled(value, factor)
    return replace(obj, **changes)


@cache
def calibrated_constants() -> ModelConstants:
    """The calibrated model's constants: what every prediction uses unless given others."""
    return ModelConstants(fitted_constants(), fitted_dims())


def _constants(constants: ModelConstants | None, dims: DimConstants | None) -> ModelConstants:
    """The constants ``predict`` uses; ``dims`` (the newer dimensions' fit) overrides theirs."""
    if constants is None:  # while fitted_dims runs, its partial constants without the finished fit
        return calibrated_constants() if dims is None else ModelConstants(fitted_constants(), dims)
    return constants if dims is None else replace(constants, dims=dims)


def _flash(params: BenchParams, shape: ModelInfo, on_gpu: bool) -> str:
    """What flash attention does for this configuration: "on", "off" or "cpu" (on, but the GPU has
    no kernel for the model's attention, so the op runs on the CPU). "auto" is llama.cpp's: on
    where the device running the layer has the kernel, else off."""
    fa = params.flash_attn
    if fa == "auto":
        return "on" if (shape.fa_on_gpu or not on_gpu) else "off"
    if fa == "on" and on_gpu and not shape.fa_on_gpu:
        return "cpu"
    return fa


def effective_params(params: BenchParams, shape: ModelInfo, workload: Workload) -> dict:
    """The configuration the simulated llama.cpp runs (issue 20.1), resolved as llama.cpp does it:
    flash attention ``auto`` by where the layers run, GPU layers clipped to n_layer + 1, the batch
    clipped to the first test's context (depth + its tokens), the ubatch to the batch."""
    ngl = max(0, min(params.n_gpu_layers, shape.n_layer + 1))
    flash = _flash(params, shape, ngl > 0)
    n_ctx = workload.depth + (workload.n_prompt if workload.n_prompt > 0 else workload.n_gen)
    batch = min(params.n_batch, max(n_ctx, 1))
    return replace(params, n_gpu_layers=ngl, flash_attn="on" if flash == "cpu" else flash, n_batch=batch,
                   n_ubatch=min(params.n_ubatch, batch),
                   n_cpu_moe=params.n_cpu_moe if ngl > 0 else 0).to_dict()


def predict(
    chip: Fingerprint, shape: ModelInfo, params: BenchParams, n_prompt: int = 512, n_gen: int = 128,
    scenario: str = "calibrated", depth: int = 0, dims: DimConstants | None = None,
    constants: ModelConstants | None = None,
) -> Prediction:
    """Noiseless pp and tg tokens/s of one configuration (ngl beyond the model = full offload),
    measured after ``depth`` tokens already in the KV cache. ``constants``: the truth predicted
    (default: the calibrated model's, ``calibrated_constants()``)."""
    m = _constants(constants, dims)
    sc = m.scenario(SCENARIOS[scenario])
    k, d = m.gpu, m.dims
    L = shape.n_layer
    gpu_layers, out_on_gpu = placement.gpu_layers(shape, params)  # ngl beyond the model: the output too
    cpu_layers = L - gpu_layers
    moe_cpu = placement.experts_on_cpu(shape, params)  # offloaded layers whose experts stay in host memory
    expert_all = shape.expert_params
    expert_active = expert_all * shape.n_expert_used / shape.n_expert if shape.n_expert else 0.0
    layer_params, active_params = shape.layer_params, shape.active_layer_params
    out_params = shape.output_params
    # weights read per token (tg), each side
    gpu_read_params = gpu_layers * active_params - moe_cpu * expert_active + (out_params if out_on_gpu else 0.0)
    cpu_read_params = cpu_layers * active_params + moe_cpu * expert_active + (0.0 if out_on_gpu else out_params)
    gpu_bytes, cpu_bytes = shape.bytes_of(gpu_read_params), shape.bytes_of(cpu_read_params)
    # all weights of a layer are read once per micro-batch in pp (every expert is some token's)
    gpu_pp_params = gpu_layers * layer_params - moe_cpu * expert_all + (out_params if out_on_gpu else 0.0)
    cpu_pp_params = cpu_layers * layer_params + moe_cpu * expert_all + (0.0 if out_on_gpu else out_params)
    # compute per token follows the active parameters
    gpu_flop_params = gpu_read_params
    cpu_flop_params = cpu_read_params

    kv_per_pos = shape.kv_elements * (KV_BYTES[params.type_k] + KV_BYTES[params.type_v])  # per layer
    kv_f16_per_pos = shape.kv_elements * 2 * KV_BYTES["f16"]
    n_ctx = depth + n_prompt + n_gen
    need = placement.gpu_need(shape, params, n_ctx).total  # weights, KV cache and compute buffers held
    limit = chip.memory_bytes * WORKING_SET_FRACTION
    if gpu_layers and need > limit:
        return Prediction(0.0, 0.0, need, False,
                          f"out of memory: GPU share {need / GIB:.1f} GiB > working-set limit {limit / GIB:.1f} GiB")
    bw = chip.bandwidth_gbs * 1e9
    core_ghz = chip.gpu_cores * GPU_CLOCK_GHZ[chip.generation] * 1e9
    qc = QUANT_CLASS[shape.quant]
    threads = params.n_threads
    speed_tg = _thread_speed(chip, threads, m)
    speed_pp = _thread_speed(chip, params.threads_batch, m)
    cpu_ghz = CPU_CLOCK_GHZ[chip.generation]
    cpu_bw = bw * m.cpu_bandwidth_share
    fa_gpu = _flash(params, shape, on_gpu=True)

    # contention: active P-core threads take a share of the bandwidth from the GPU
    active = min(threads, chip.p_cores) / chip.p_cores
    cpu_active = cpu_layers > 0 or moe_cpu > 0 or (sc.poll_during_gpu and gpu_layers > 0)
    gpu_slowdown = 1 / (1 - sc.contention * active) if cpu_active else 1.0
    gpu_bw = bw / k.bw_inefficiency

    # attention of one generated token, as a change from the context the constants were fitted at
    ctx_tg = depth + n_gen / 2
    kv_read = kv_per_pos * ctx_tg
    kv_read_cal = kv_f16_per_pos * CAL_TG_CTX
    scores = shape.n_head * 4 * 4  # f32 scores written and read twice each, per position (no FA)
    if fa_gpu == "on":
        attn_tg = kv_read / (bw * d.fa_kv_efficiency) - kv_read_cal / gpu_bw - d.nofa_tg_s_per_layer
    else:  # the cache read no faster than the flash-attention kernel reads it, and the scores
        attn_tg = (kv_read - kv_read_cal) / (bw * d.fa_kv_efficiency) + scores * (ctx_tg - CAL_TG_CTX) / gpu_bw
        if fa_gpu == "cpu":
            attn_tg += 2 * d.fa_cpu_handover_s

    # tg: one token
    t_gpu = 0.0
    if gpu_layers:
        t_gpu = gpu_slowdown * (gpu_bytes / gpu_bw + gpu_flop_params * k.dequant_s_per_param_core_ghz[qc] / core_ghz
                                + gpu_layers * (k.launch_s_per_layer + attn_tg)
                                + (gpu_layers - moe_cpu if shape.n_expert else 0) * d.moe_tg_s_per_layer)
    cpu_kv = cpu_layers * max(kv_read - kv_read_cal, 0.0)
    t_cpu = 0.0
    if cpu_bytes:
        read = cpu_bytes + cpu_kv
        t_cpu = max(read / (speed_tg * sc.cpu_speed * m.cpu_bytes_per_s_per_ghz * cpu_ghz), read / cpu_bw)
        t_cpu /= 1 - (sc.cpu_contention if gpu_layers else 0.0)
    handovers = 0 if gpu_layers == 0 or out_on_gpu else 2
    if out_on_gpu and cpu_layers:
        handovers = 1
    handovers += 2 * moe_cpu
    t_tg = (1 - sc.overlap) * (t_gpu + t_cpu) + sc.overlap * max(t_gpu, t_cpu) + handovers * sc.handover_s

    # pp: per prompt token, batched in micro-batches of n_ubatch
    ub = max(1, min(params.n_ubatch, params.n_batch, max(n_prompt, 1)))
    ctx_pp = depth + n_prompt / 2
    gpu_s_per_flop = k.pp_s_per_param_core_ghz["f16"] / 2 / core_ghz  # attention runs in f16
    attn_flops = 4 * shape.n_head * shape.hd  # per position attended to, per layer
    nofa_scores = d.nofa_pp_cycles_per_score * shape.n_head / core_ghz  # per position, per layer
    attn_pp = attn_flops * (ctx_pp - CAL_PP_CTX) * gpu_s_per_flop - nofa_scores * CAL_PP_CTX
    cpu_attn_flops = 0.0
    if fa_gpu == "off":
        attn_pp += nofa_scores * ctx_pp
    elif fa_gpu == "cpu":  # the attention op of every GPU layer on the CPU's batch threads
        attn_pp -= attn_flops * (ctx_pp - CAL_PP_CTX) * gpu_s_per_flop
        attn_pp += 2 * d.fa_cpu_handover_s / ub
        cpu_attn_flops = gpu_layers * attn_flops * ctx_pp
    p_gpu = 0.0
    if gpu_layers:
        p_gpu = gpu_slowdown * (gpu_flop_params * k.pp_s_per_param_core_ghz[qc] / core_ghz
                                + shape.bytes_of(gpu_pp_params) * k.pp_bw_inefficiency / bw / ub
                                + gpu_layers * k.pp_launch_s_per_layer / ub
                                + gpu_layers * attn_pp)
    p_cpu = 0.0
    weight_flops, pp_handovers = 2 * cpu_flop_params, handovers
    if params.op_offload and ub >= OP_OFFLOAD_MIN_BATCH and cpu_pp_params:
        # the matmuls of host-resident weights run on the GPU, their weights copied over first
        p_gpu += (2 * shape.bytes_of(cpu_pp_params) / bw / ub
                  + cpu_flop_params * k.pp_s_per_param_core_ghz[qc] / core_ghz)
        weight_flops, pp_handovers = 0.0, handovers + 2 * cpu_layers
    cpu_pp_flops = weight_flops + cpu_layers * attn_flops * max(ctx_pp - CAL_PP_CTX, 0) + cpu_attn_flops
    if cpu_pp_flops:
        p_cpu = cpu_pp_flops / (speed_pp * sc.cpu_speed * m.cpu_flops_per_ghz * cpu_ghz)
        if weight_flops:
            p_cpu += shape.bytes_of(cpu_pp_params) / cpu_bw / ub
    t_pp = (1 - sc.overlap) * (p_gpu + p_cpu) + sc.overlap * max(p_gpu, p_cpu) + pp_handovers * sc.handover_s / ub
    return Prediction(pp_tps=1 / t_pp, tg_tps=1 / t_tg, gpu_bytes=need, fits=True)


def search_grid(chip: Fingerprint, shape: ModelInfo, batch_choices=(128, 256, 512, 1024, 2048), depth: int = 0):
    """Every configuration of the exhaustive grid (ngl x threads x batch x flash attention;
    ubatch = min(512, b)); at a depth also the KV cache types (K = V, quantized only with FA on)."""
    caches = [("f16", "f16")]
    if depth:
        caches += [("q8_0", "q8_0"), ("q4_0", "q4_0")]
    for ngl in range(shape.n_layer + 2):
        for threads in range(1, chip.p_cores + (chip.m_cores or 0) + chip.e_cores + 1):
            for batch in batch_choices:
                for fa in ("off", "on"):
                    for type_k, type_v in caches:
                        if type_v != "f16" and fa != "on":
                            continue
                        yield BenchParams(n_gpu_layers=ngl, n_threads=threads, n_batch=batch,
                                          n_ubatch=min(512, batch), flash_attn=fa, type_k=type_k, type_v=type_v)


def optimum(chip: Fingerprint, shape: ModelInfo, objective: Objective | str = TG, n_prompt: int = 512,
            n_gen: int = 128, scenario: str = "calibrated", depth: int = 0) -> tuple[BenchParams, Prediction, float]:
    """The exhaustive-grid best configuration for tg, pp or e2e (value: tok/s, or s for e2e)."""
    target = named_objective(objective)
    target.check_workload(n_prompt, n_gen)  # tg of 0 tokens has no optimum
    best = None
    for params in search_grid(chip, shape, depth=depth):
        pred = predict(chip, shape, params, n_prompt, n_gen, scenario, depth=depth)
        if not pred.fits:
            continue
        value = target.value(pred.pp_tps, pred.tg_tps, n_prompt, n_gen)
        better = best is None or target.better(value, best[2])
        if better:
            best = (params, pred, value)
    if best is None:
        raise BadInput(f"{shape.shape_name} does not fit on {chip.label} in any configuration")
    return best


# ---------------------------------------------------------------- the worker backend


@dataclass
class SimulatedNode:
    """A simulated Mac: measures through the model, with noise, heat and simulated time."""

    chip: Fingerprint
    shape_for: callable = None  # model path -> ModelInfo
    scenario: str = "calibrated"
    noise_cv: float = 0.03
    time_scale: float = 0.0  # seconds slept per simulated second (0: instant)
    heat: float = 0.0  # seconds of recent sustained load (fanless machines throttle)
    speed: float = 1.0  # relative to a healthy machine of the chip
    seed: int = 0
    trial_s: float | None = None  # every trial takes exactly this long (dispatch benchmarks)
    constants: ModelConstants | None = None  # the truth it measures (None: the calibrated model)

    THROTTLE_AFTER_S = 120.0
    THROTTLE_FACTOR = 0.75

    def backend_info(self) -> str:
        truth = f", {self.constants.label}" if self.constants is not None else ""
        return f"simulated {self.chip.label} ({self.scenario} scenario{truth})"

    def measure(self, spec) -> TrialResult:
        import time

        started = time.time()
        from pathlib import Path

        if not is_sim_model(spec.model_path) and not Path(spec.model_path).is_file():
            return TrialResult.failure(
                spec.trial_key, f"model not on node ({spec.model_path}); run `fleettune model push`",
                FailureKind.MODEL_MISSING, simulated=True,
            )
        try:
            shape = self.shape_for(spec.model_path) if self.shape_for else model_shape("llama2-7b", "q4_0")
        except BadInput as exc:
            return TrialResult.failure(spec.trial_key, str(exc), FailureKind.BAD_CONFIG, simulated=True)
        w: Workload = spec.workload
        if spec.served is not None:  # workers/simulated_served.measure serves it (agent.run_trial)
            return TrialResult.failure(spec.trial_key, "a served trial on a simulated Mac is measured by "
                                       "workers.simulated_served.measure", FailureKind.WORKER_ERROR, simulated=True)
        pred = predict(self.chip, shape, spec.params, w.n_prompt, w.n_gen, self.scenario,
                       depth=getattr(w, "depth", 0), constants=self.constants)
        if not pred.fits:
            return TrialResult.failure(spec.trial_key, pred.reason, FailureKind.OUT_OF_MEMORY, simulated=True,
                                       started_at=started, finished_at=time.time())
        rng = random.Random(f"{self.seed}:{spec.trial_key}:{spec.params}")
        throttle = self.THROTTLE_FACTOR if (fanless(self.chip) and self.heat > self.THROTTLE_AFTER_S) else 1.0
        load_s = shape.weight_bytes / 5e9  # load from SSD at ~5 GB/s
        samples, sim_seconds = [], load_s
        for kind, n_tokens, rate in (("pp", w.n_prompt, pred.pp_tps), ("tg", w.n_gen, pred.tg_tps)):
            if n_tokens <= 0:
                continue
            for rep in range(w.reps):
                noisy = rate * self.speed * throttle * math.exp(rng.gauss(0, self.noise_cv))
                seconds = n_tokens / noisy
                samples.append(Sample(kind, rep, n_tokens, seconds))
                sim_seconds += seconds
        self.heat = max(0.0, self.heat - spec.cooldown_s * 2) + sim_seconds
        if self.trial_s:
            time.sleep(self.trial_s)  # a fixed trial duration; not synchronisation
        elif self.time_scale > 0:
            time.sleep(sim_seconds * self.time_scale)  # the trial's duration, scaled; not synchronisation
        return TrialResult(
            trial_key=spec.trial_key, ok=True, samples=samples, load_s=load_s,
            peak_rss_bytes=int(pred.gpu_bytes), gpu_bytes=int(pred.gpu_bytes), thermal_before="nominal",
            thermal_after="fair" if throttle < 1 else "nominal", started_at=started,
            finished_at=time.time(), measure_s=sim_seconds, simulated=True,
            backend_info=self.backend_info(), effective=effective_params(spec.params, shape, w),
            kl_divergence=simulated_kl(spec.params) if spec.measure_kl else None,
        )


def simulated_kl(params: BenchParams) -> float | None:
    """A stand-in KL divergence of a quantized KV cache (issue 20.4; the simulator has no logits):
    the orders of magnitude llama-perplexity reports for 7B models (q8_0 ~0.001, q4_0 ~0.02 per cache)."""
    cost = {"f16": 0.0, "q8_0": 0.001, "q4_0": 0.02}
    total = cost[params.type_k] + cost[params.type_v]
    return total or None


def with_memory(chip: Fingerprint, memory_gb: float) -> Fingerprint:
    return replace(chip, memory_bytes=int(memory_gb * GIB))
