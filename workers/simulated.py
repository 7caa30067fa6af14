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

The GPU constants are fitted by least squares on public llama-bench results for M1 and M2
(``data/llamacpp_apple_m1_m2.csv``) in physical units (bandwidth, cores x clock); M3 and M4 follow
from their own bandwidth, cores and clocks.

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
from dataclasses import asdict, dataclass, replace
from functools import cache
from importlib import resources

import numpy as np

from workers.errors import BadInput
from workers.hardware import GIB, Fingerprint, apple_bins, chip_table
from workers.models import (
    ARCH_SHAPES,
    QUANT_BPW,
    SIM_SCHEME,
    ModelInfo,
    named_model,
    read_model_info,
)
from workers.trial import BenchParams, FailureKind, Sample, TrialResult, Workload

# Public figures per generation: GPU clock (GHz) and P-core clock (GHz).
GPU_CLOCK_GHZ = {"M1": 1.278, "M2": 1.398, "M3": 1.38, "M4": 1.578}
CPU_CLOCK_GHZ = {"M1": 3.2, "M2": 3.5, "M3": 4.05, "M4": 4.4}
# Unified memory of each family's base configuration (override with "M2 Ultra/76/192").
BASE_MEMORY_GB = {
    "M1": 8, "M1 Pro": 16, "M1 Max": 32, "M1 Ultra": 64,
    "M2": 8, "M2 Pro": 16, "M2 Max": 32, "M2 Ultra": 64,
    "M3": 8, "M3 Pro": 18, "M3 Max": 36, "M3 Ultra": 96,
    "M4": 16, "M4 Pro": 24, "M4 Max": 36,
}
# Dequantisation cost class of each type (the fit has one constant per class).
QUANT_CLASS = {"f16": "f16", "q8_0": "q8", "q6_k": "q8", "q5_k_m": "q4", "q5_0": "q4", "q5_1": "q4",
               "q4_k_m": "q4", "q4_k_s": "q4", "q4_1": "q4", "q4_0": "q4", "q3_k_m": "q4", "q2_k": "q4"}
WORKING_SET_FRACTION = 0.75


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


NAMED_SHAPES = tuple(name for name in ARCH_SHAPES if name != "tiny")


def model_shape(name: str, quant: str) -> ModelInfo:
    """A named shape at a quantisation (no file behind it)."""
    quant = quant.lower()
    if name not in NAMED_SHAPES:
        raise BadInput(f"unknown model shape {name!r}; known: {', '.join(NAMED_SHAPES)}")
    if quant not in QUANT_BPW:
        raise BadInput(f"unknown quantisation {quant!r}; known: {', '.join(QUANT_BPW)}")
    return named_model(name, quant)


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
                     *[h * s.weight_params / core_ghz / t_tg for h in one_hot], s.n_layer / t_tg])
        y_tg.append(1.0)
        t_pp = 1 / r["pp512"]  # seconds per prompt token at ubatch 512
        a_pp.append([*[h * s.weight_params / core_ghz / t_pp for h in one_hot],
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


def _thread_speed(chip: Fingerprint, threads: int) -> float:
    """Aggregate speed of ``threads`` in P-core units, as the slowest thread sets the pace."""
    cores = chip.p_cores + chip.e_cores
    if threads <= chip.p_cores:
        return float(threads)
    if threads <= cores:
        return threads * E_CORE_SPEED
    return cores * E_CORE_SPEED / OVERSUBSCRIBED_PENALTY * cores / threads


def predict(
    chip: Fingerprint, shape: ModelInfo, params: BenchParams, n_prompt: int = 512, n_gen: int = 128,
    scenario: str = "calibrated",
) -> Prediction:
    """Noiseless pp and tg tokens/s of one configuration (ngl beyond the model = full offload)."""
    sc = SCENARIOS[scenario]
    k = fitted_constants()
    L = shape.n_layer
    ngl = max(0, min(params.n_gpu_layers, L + 1))
    gpu_layers = min(ngl, L)
    cpu_layers = L - gpu_layers
    out_on_gpu = ngl > L
    layer_bytes = shape.bytes_of(shape.layer_params)
    out_bytes = shape.bytes_of(shape.output_params)
    gpu_bytes = gpu_layers * layer_bytes + (out_bytes if out_on_gpu else 0.0)
    cpu_bytes = cpu_layers * layer_bytes + (0.0 if out_on_gpu else out_bytes)
    gpu_params = gpu_layers * shape.layer_params + (shape.output_params if out_on_gpu else 0.0)
    cpu_params = shape.n_layer * shape.layer_params + shape.output_params - gpu_params
    kv_bytes = 2 * L * (n_prompt + n_gen) * shape.n_embd * shape.n_head_kv / shape.n_head * 2
    need = gpu_bytes + (kv_bytes * gpu_layers / L if L else 0) + params.n_ubatch * shape.n_embd * 64
    limit = chip.memory_bytes * WORKING_SET_FRACTION
    if gpu_layers and need > limit:
        return Prediction(0.0, 0.0, need, False,
                          f"out of memory: GPU share {need / GIB:.1f} GiB > working-set limit {limit / GIB:.1f} GiB")
    bw = chip.bandwidth_gbs * 1e9
    core_ghz = chip.gpu_cores * GPU_CLOCK_GHZ[chip.generation] * 1e9
    qc = QUANT_CLASS[shape.quant]
    threads = params.n_threads
    speed_tg = _thread_speed(chip, threads)
    speed_pp = _thread_speed(chip, params.threads_batch)
    cpu_ghz = CPU_CLOCK_GHZ[chip.generation]
    cpu_bw = bw * CPU_BANDWIDTH_SHARE

    # contention: active P-core threads take a share of the bandwidth from the GPU
    active = min(threads, chip.p_cores) / chip.p_cores
    cpu_active = cpu_layers > 0 or (sc.poll_during_gpu and gpu_layers > 0)
    gpu_slowdown = 1 / (1 - sc.contention * active) if cpu_active else 1.0
    gpu_bw = bw / k.bw_inefficiency

    # tg: one token
    t_gpu = 0.0
    if gpu_layers:
        t_gpu = gpu_slowdown * (gpu_bytes / gpu_bw + gpu_params * k.dequant_s_per_param_core_ghz[qc] / core_ghz
                                + gpu_layers * k.launch_s_per_layer)
    t_cpu = 0.0
    if cpu_bytes:
        t_cpu = max(cpu_bytes / (speed_tg * sc.cpu_speed * CPU_BYTES_PER_S_PER_GHZ * cpu_ghz),
                    cpu_bytes / cpu_bw)
        t_cpu /= 1 - (sc.cpu_contention if gpu_layers else 0.0)
    handovers = 0 if ngl == 0 or out_on_gpu else 2
    if out_on_gpu and cpu_layers:
        handovers = 1
    t_tg = (1 - sc.overlap) * (t_gpu + t_cpu) + sc.overlap * max(t_gpu, t_cpu) + handovers * sc.handover_s

    # pp: per prompt token, batched in micro-batches of n_ubatch
    ub = max(1, min(params.n_ubatch, params.n_batch, max(n_prompt, 1)))
    p_gpu = 0.0
    if gpu_layers:
        p_gpu = gpu_slowdown * (gpu_params * k.pp_s_per_param_core_ghz[qc] / core_ghz
                                + gpu_bytes * k.pp_bw_inefficiency / bw / ub
                                + gpu_layers * k.pp_launch_s_per_layer / ub)
    p_cpu = 0.0
    if cpu_params:
        flops = 2 * cpu_params
        p_cpu = flops / (speed_pp * sc.cpu_speed * CPU_FLOPS_PER_GHZ * cpu_ghz) + cpu_bytes / cpu_bw / ub
    t_pp = (1 - sc.overlap) * (p_gpu + p_cpu) + sc.overlap * max(p_gpu, p_cpu) + handovers * sc.handover_s / ub
    return Prediction(pp_tps=1 / t_pp, tg_tps=1 / t_tg, gpu_bytes=need, fits=True)


def search_grid(chip: Fingerprint, shape: ModelInfo, batch_choices=(128, 256, 512, 1024, 2048)):
    """Every configuration of the exhaustive grid (ngl x threads x batch; ubatch = min(512, b))."""
    for ngl in range(shape.n_layer + 2):
        for threads in range(1, chip.p_cores + chip.e_cores + 1):
            for batch in batch_choices:
                yield BenchParams(n_gpu_layers=ngl, n_threads=threads, n_batch=batch,
                                  n_ubatch=min(512, batch))


def optimum(chip: Fingerprint, shape: ModelInfo, objective: str = "tg", n_prompt: int = 512,
            n_gen: int = 128, scenario: str = "calibrated") -> tuple[BenchParams, Prediction, float]:
    """The exhaustive-grid best configuration for tg, pp or e2e (value: tok/s, or s for e2e)."""
    from workers.objective import objective as named_objective

    named_objective(objective).check_workload(n_prompt, n_gen)  # tg of 0 tokens has no optimum
    best = None
    for params in search_grid(chip, shape):
        pred = predict(chip, shape, params, n_prompt, n_gen, scenario)
        if not pred.fits:
            continue
        value = _objective(pred, objective, n_prompt, n_gen)
        better = best is None or (value < best[2] if objective == "e2e" else value > best[2])
        if better:
            best = (params, pred, value)
    if best is None:
        raise BadInput(f"{shape.shape_name} does not fit on {chip.label} in any configuration")
    return best


def _objective(pred: Prediction, objective: str, n_prompt: int, n_gen: int) -> float:
    if objective == "tg":
        return pred.tg_tps
    if objective == "pp":
        return pred.pp_tps
    return n_prompt / pred.pp_tps + n_gen / pred.tg_tps


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

    THROTTLE_AFTER_S = 120.0
    THROTTLE_FACTOR = 0.75

    def backend_info(self) -> str:
        return f"simulated {self.chip.label} ({self.scenario} scenario)"

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
        pred = predict(self.chip, shape, spec.params, w.n_prompt, w.n_gen, self.scenario)
        if not pred.fits:
            return TrialResult.failure(spec.trial_key, pred.reason, FailureKind.OUT_OF_MEMORY, simulated=True,
                                       started_at=started, finished_at=time.time())
        rng = random.Random(f"{self.seed}:{spec.trial_key}:{spec.params}")
        throttle = self.THROTTLE_FACTOR if (fanless(self.chip) and self.heat > self.THROTTLE_AFTER_S) else 1.0
        samples, sim_seconds = [], shape.weight_bytes / 5e9  # load from SSD at ~5 GB/s
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
            trial_key=spec.trial_key, ok=True, samples=samples, load_s=shape.weight_bytes / 5e9,
            peak_rss_bytes=int(pred.gpu_bytes), thermal_before="nominal",
            thermal_after="fair" if throttle < 1 else "nominal", started_at=started,
            finished_at=time.time(), measure_s=sim_seconds, simulated=True,
            backend_info=self.backend_info(),
        )


def with_memory(chip: Fingerprint, memory_gb: float) -> Fingerprint:
    return replace(chip, memory_bytes=int(memory_gb * GIB))
