"""Search efficiency on the simulated fleet and on grids measured on a device: trials until a
study's pick is within 2 % of the true optimum, in the search space of today's llama.cpp (flash
attention off/on/auto, K and V cache types, n_threads_batch where the objective has a prompt,
n_cpu_moe where experts do not fit).

For every chip bin x model: the true optimum by exhaustive enumeration on the noiseless model, over
every configuration llama.cpp accepts (threads up to every logical core, whatever the space
searches); then studies with measurement noise (the simulated node, 3 % CV) for each sampler and
each variant of the study's design, ask/tell as a real study does. A study "reaches" 98 % at the
first trial after which the configuration it would recommend (its best observed trial) is truly
within 2 % of the optimum; a study that never does counts as budget + 1. Trials of the first
design count like any other.

Variants (``--variants``; the ablation of what each means contributes):

- ``study``: what ``tune`` does: the space of ``SearchSpace.for_target`` (threads up to the
  performance cores, conditional dimensions), a first design of full offload, llama.cpp's
  defaults, at a depth the same with flash attention on and the most compact KV cache, and the
  calibrated model's prediction, then the sampler.
- ``no-prediction``: the same without the prediction in the first design.
- ``no-compact-cache``: without the prediction nor, at a depth, llama.cpp's defaults with flash
  attention on and the most compact KV cache (q4_0 K and V).
- ``no-first-design``: the same space, no first design (the sampler from its first trial).
- ``all-threads``: ``study`` with threads searched up to every logical core.
- ``linear-threads``: ``study`` with threads proposed on a linear scale, not a log one.
- ``no-prediction-linear-threads``: ``no-prediction`` with threads on a linear scale.
- ``no-prediction-placements``: ``no-prediction`` plus, where full offload does not fit the GPU's
  working set, llama.cpp's ``--fit`` placement and the most whole layers that fit (with --fit's
  1 GiB margin): guesses from the memory estimate alone (``workers/placement.py``), no performance
  model. Not what ``tune`` does today: a candidate for a cold study of a model that does not fit.
- ``flat``: ``study`` with every dimension searched everywhere (batch, ubatch and n_threads_batch
  for tg too, no condition on the V type's flash attention: a quantized V without it fails).

Perturbed truths (``--truths N``, issue 23.6a): with the calibrated model as the truth, the
prediction in the first design is the simulator's own optimum, so ``study`` says nothing about a
real Mac. With ``--truths N`` each of N seeded truths moves every constant of the model
(``ModelConstants.perturbed``: each x U[1 - spread, 1 + spread], ``--spread`` 0.15, about the
calibration's error); the optimum is enumerated on that truth and the studies measure it (3 %
noise), while the first design, the prediction included, still comes from the calibrated model, as
a real study's does. Study seeds differ per truth. For each variant it also prints how close its
first design's best guess truly is to the optimum (every truth, chip and model).

    python bench/search_efficiency.py [--samplers tpe,random] [--variants study,flat] [--seeds 5]
        [--budget 40] [--objective tg] [--depth 0] [--chips all|"M2 Ultra/76,M1/8"] [--scenario calibrated]
        [--models "LLaMA-2 7B Q4_0,qwen3-30b-a3b/q4_k_m"] [--truths 20] [--spread 0.15]

A chip given with its memory ("M2 Pro/19/16") keeps it; one without gets at least 32 GB.

Measured landscapes (``--landscape GRID.json:TEST:BUDGET``, issue 23.6b): a grid measured on a
device by bench/placement_grid.py is the truth instead of the simulator. The space is the grid's
(its placements, threads, flash attention, micro-batches); a trial measures its point's median
times Gaussian noise of the grid's own spread (the CV of a point's mean of two repetitions: the
standard deviation of log(second / first) over the grid, halved; the first repetition's like
slowdown at every point moves no point against another); a point whose measured peak, in any test of its
placement and micro-batch, was over the budget is refused before loading, as a study refuses it
(told the penalty, no trial spent); the optimum is the grid's best point within the budget.
Variants: ``study`` (the first design of a study with a budget on a GPU that is not a
Mac's: llama.cpp's defaults, which are full offload, and --fit's placement in the knobs' terms;
there is no calibrated prediction for such a GPU), ``no-first-design``, and ``study-edge``: ``study``
plus the placement with the most on the GPU that fits the budget, at llama.cpp's defaults and at the
largest smaller micro-batch where it puts more there (a guess from memory alone: what a study
measures once the driver's overhead is known, ``StudyRunner._enqueue_edge``; here the measured peak
stands for the estimate with that overhead).

    python bench/search_efficiency.py --landscape grid-moe-16.json:tg128:16GiB \
        --landscape grid-moe-16.json:pp512:16GiB --samplers tpe,gp,random,seed-scan --seeds 20 --budget 40
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import placement_grid  # noqa: E402
from orchestrator.samplers import make_sampler  # noqa: E402
from orchestrator.space import (  # noqa: E402
    CACHE_TYPES,
    SearchSpace,
    compact_cache,
    full_offload,
    llama_cpp_defaults,
    moe_layout,
    predicted_optimum,
)
from orchestrator.studies import MAX_FAILED_PROPOSALS  # noqa: E402
from workers import placement, simulated  # noqa: E402
from workers.knobs import optuna_name  # noqa: E402
from workers.objective import objective as objective_named  # noqa: E402
from workers.simulated import ModelConstants  # noqa: E402
from workers.trial import BenchParams, TrialSpec, Workload  # noqa: E402

MODELS = {"LLaMA-2 7B Q4_0": ("llama2-7b", "q4_0"), "Llama-3-8B Q4_K_M": ("llama3-8b", "q4_k_m")}
WORKLOAD = Workload(n_prompt=512, n_gen=128, reps=3)
VARIANTS = ("study", "no-prediction", "no-compact-cache", "no-first-design", "all-threads", "linear-threads",
            "no-prediction-linear-threads", "flat", "no-prediction-placements")
MEMORY_FLOOR_GB = 32  # a bin given without its memory gets at least this (room for 8B models)
DEFAULT_CHIPS = ("M1/8", "M1 Pro/16", "M1 Max/32", "M1 Ultra/64", "M2/10", "M2 Pro/19", "M2 Max/38",
                 "M2 Ultra/76", "M3/10", "M3 Pro/18", "M3 Max/40", "M4/10", "M4 Pro/20", "M4 Max/40")


class FlatSpace(SearchSpace):
    """Every dimension in every trial: the V type without its flash-attention condition."""

    def suggest(self, trial) -> BenchParams:
        params = super().suggest(trial)
        type_v = trial.suggest_categorical("type_v_any", list(self.cache_types))
        if type_v != "f16" and params.flash_attn != "on":
            return replace(params, type_v="f16", n_ubatch=-1)  # marks the config llama.cpp refuses
        return replace(params, type_v=type_v)

    def optuna_params(self, params: BenchParams) -> dict:
        return {**super().optuna_params(params), "type_v_any": params.type_v}


def true_value(chip, shape, params: BenchParams, objective: str, scenario: str, workload: Workload = WORKLOAD,
               truth: ModelConstants | None = None) -> float:
    """The noiseless objective of ``params`` on the truth (None: the calibrated model)."""
    if params.n_ubatch < 1 or (params.type_v != "f16" and params.flash_attn != "on"):
        return 0.0  # a configuration llama.cpp refuses
    pred = simulated.predict(chip, shape, params, workload.n_prompt, workload.n_gen, scenario,
                             depth=workload.depth, constants=truth)
    if not pred.fits:
        return 0.0
    if objective == "tg":
        return pred.tg_tps
    if objective == "pp":
        return pred.pp_tps
    return (workload.n_prompt + workload.n_gen) / (workload.n_prompt / pred.pp_tps + workload.n_gen / pred.tg_tps)


def space_for(chip, shape, objective: str = "tg", workload: Workload = WORKLOAD) -> SearchSpace:
    info = shape  # a named shape is its own model record
    return SearchSpace.for_target(chip, info, workload.n_prompt, objective, moe_layout(info),
                                  depth=workload.depth)


def cpu_moe_choices(shape, space: SearchSpace, ngl: int) -> list[int]:
    """The n_cpu_moe values of distinct placements at ``ngl``: the first n_cpu_moe layers keep their
    experts on the CPU, so a value no larger than the layers the CPU holds whole runs as 0 does."""
    if not space.cpu_moe_max or not ngl:
        return [0]
    whole_on_cpu = shape.n_layer - min(ngl, shape.n_layer)
    return [0, *range(whole_on_cpu + 1, space.cpu_moe_max + 1)]


def every_config(chip, shape, space: SearchSpace):
    """Every configuration llama.cpp accepts in the space's ranges, threads up to every core, up to
    equivalence: of the n_cpu_moe values that place the experts alike, the smallest; of the batches
    above a micro-batch (which the simulator runs alike: the micro-batch is what it times), the largest."""
    logical = chip.logical_cores or 1
    batches = [(max(space.batch_choices), u) for u in space.batch_choices] \
        if space.tune_batch else [space.default_batch()]
    caches = [(k, v) for k in CACHE_TYPES for v in CACHE_TYPES]
    threads_batch = range(1, logical + 1) if space.threads_batch else [None]
    for ngl in range(space.ngl_max + 1):
        for t, (b, u), fa, (tk, tv), tb, cm in itertools.product(
                range(1, logical + 1), batches, ("off", "on", "auto"), caches, threads_batch,
                cpu_moe_choices(shape, space, ngl)):
            if tv != "f16" and fa != "on":
                continue
            yield BenchParams(ngl, t, b, u, flash_attn=fa, n_threads_batch=tb, type_k=tk, type_v=tv, n_cpu_moe=cm)


def grid_optimum(chip, shape, space: SearchSpace, objective: str, scenario: str,
                 workload: Workload = WORKLOAD, truth: ModelConstants | None = None) -> float:
    return max(true_value(chip, shape, p, objective, scenario, workload, truth)
               for p in every_config(chip, shape, space))


def first_design(chip, shape, space: SearchSpace, variant: str, objective: str, workload: Workload) -> list:
    """The configurations a new study measures before its sampler proposes."""
    if variant == "no-first-design":
        return []
    info = shape  # a named shape is its own model record
    defaults = llama_cpp_defaults(chip, info, workload.n_prompt)
    design = [full_offload(chip, info, space), defaults]
    if workload.depth and variant != "no-compact-cache":
        design.append(compact_cache(defaults, space))
    if variant not in ("no-prediction", "no-compact-cache", "no-prediction-linear-threads",
                       "no-prediction-placements"):  # the calibrated model's optimum, as a new study enqueues it
        design.append(predicted_optimum(chip, info, workload.n_prompt, workload.n_gen, workload.depth, objective))
    if variant == "no-prediction-placements":
        design += memory_placements(chip, shape, defaults, workload)
    return [p for p in design if p is not None]


def memory_placements(chip, shape, defaults: BenchParams, workload: Workload) -> list:
    """Where llama.cpp's defaults (every layer offloaded) do not fit the GPU's working set: --fit's
    placement, and the most whole layers that fit with --fit's margin (experts with their layers)."""
    working_set = placement.gpu_working_set(chip)
    n_ctx = workload.depth + workload.n_prompt + workload.n_gen
    if working_set is None or placement.gpu_need(shape, defaults, n_ctx).total <= working_set:
        return []
    whole = next((replace(defaults, n_gpu_layers=n) for n in range(shape.n_layer, 0, -1)
                  if placement.gpu_need(shape, replace(defaults, n_gpu_layers=n), n_ctx).total
                  <= working_set - placement.FIT_MARGIN_BYTES), None)
    return [placement.fit(shape, defaults, n_ctx, working_set), whole]


def variant_space(chip, shape, variant: str, objective: str, workload: Workload) -> SearchSpace:
    space = space_for(chip, shape, objective, workload)
    if variant == "all-threads":
        return replace(space, threads_max=chip.logical_cores)
    if variant in ("linear-threads", "no-prediction-linear-threads"):
        return replace(space, threads_log=False)
    if variant == "flat":
        flat = FlatSpace(**{**space.__dict__, "tune_batch": True, "threads_batch": True})
        return flat
    return space


REFUSED = "refused"  # measure(): refused before loading, no trial spent
TARGET = 0.98  # issue 23.6: a study reaches the optimum when its pick is truly within 2 % of it (--target)


def run_search(space, sampler_name: str, seed: int, budget: int, direction: str, measure, true_of,
               optimum: float, warm=(), target: float = TARGET) -> int:
    """The study's loop, ask/tell as a real study does (orchestrator/studies.py): trials until the
    incumbent (the best observed) is truly within ``target`` of the optimum (budget + 1 if never).
    ``measure(params, n)``: the trial's measured value, None where it fails, REFUSED where the study
    refuses it before loading (over the budget by its estimate: told the penalty, no trial spent);
    a failure is told the penalty too (issue 20.6: half the worst rate measured, so every sampler
    learns to avoid it). ``true_of(params)``: its true value; ``warm``: configurations measured
    first, as a new study's first design and warm start are."""
    study = optuna.create_study(direction=direction,
                                sampler=make_sampler(sampler_name, space, budget, direction, seed))
    for params in warm:
        study.enqueue_trial(space.optuna_params(space.clip(params)), skip_if_exists=True)
    best_observed, incumbent, worst = None, None, None
    maximize = direction == "maximize"

    def penalty() -> float:  # StudyRunner.penalty
        if worst is None:
            return 0.0 if maximize else 1e9
        return worst * 0.5 if maximize else worst * 2

    n, refusals = 0, 0
    while n < budget and refusals < MAX_FAILED_PROPOSALS:  # then a study's search ends
        trial = study.ask()
        params = space.suggest(trial)
        value = measure(params, n + 1)
        if value is REFUSED:
            refusals += 1
            study.tell(trial, penalty())
            continue
        n, refusals = n + 1, 0
        if value is None:
            study.tell(trial, penalty())
            continue
        worst = value if worst is None or (value < worst if maximize else value > worst) else worst
        study.tell(trial, value)
        better = best_observed is None or (value > best_observed if direction == "maximize" else value < best_observed)
        if better:
            best_observed, incumbent = value, params
        if incumbent is not None and true_of(incumbent) >= target * optimum:
            return n
    return budget + 1


def run_study(chip, shape, space, sampler_name: str, seed: int, budget: int, objective: str,
              scenario: str, optimum: float, warm=(), workload: Workload = WORKLOAD,
              truth: ModelConstants | None = None, target: float = TARGET) -> int:
    """A study on a simulated node of the truth (None: the calibrated model): trials until the
    incumbent is truly within ``target`` of the optimum (budget + 1 if never)."""
    goal = objective_named(objective)
    node = simulated.SimulatedNode(chip, shape_for=lambda _: shape, scenario=scenario, seed=seed, constants=truth)

    def measure(params: BenchParams, n: int) -> float | None:
        if params.n_ubatch < 1:  # refused by llama.cpp: a failed trial
            return None
        result = node.measure(TrialSpec(shape.path, "x", params, workload, trial_key=f"{seed}-{n}"))
        if not result.ok:
            return None
        return goal.value(result.pp.median if result.pp else None, result.tg.median if result.tg else None,
                          workload.n_prompt, workload.n_gen)

    return run_search(space, sampler_name, seed, budget, goal.direction.value, measure,
                      lambda p: true_value(chip, shape, p, objective, scenario, workload, truth), optimum, warm,
                      target)


# ---------------------------------------------------------------- measured landscapes (issue 23.6b)

LANDSCAPE_VARIANTS = ("study", "no-first-design", "study-edge")
LANDSCAPE_SAMPLERS = ("tpe", "gp", "random", "seed-scan")
NGL, THREADS, FLASH_ATTN, UBATCH = (optuna_name(f) for f in ("n_gpu_layers", "n_threads", "flash_attn", "n_ubatch"))
MIN_NOISE_CV = 0.01


@dataclass(frozen=True)
class LandscapeSpace:
    """A grid measured by bench/placement_grid.py as a study's space: its placements (ordered from
    least to most on the GPU), threads, flash attention and micro-batches, the values a study can
    propose. Placements and threads are proposed as integers in the grid's order (an index, so a
    sampler sees the order; the grid's threads are spaced as a log scale would space them); a
    configuration is (placement, threads, flash attention, micro-batch). ``ngl_min``, ``ngl_max``,
    ``threads_max`` and ``batch_choices`` are what SeedScanSampler reads of a space: its thread scan
    runs at the placement with the least on the GPU, as the hand method runs it at -ngl 0."""

    placements: tuple[str, ...]
    threads: tuple[int, ...]
    fa_modes: tuple[str, ...]
    ubatches: tuple[int, ...]
    ngl_min: int = 0

    @property
    def ngl_max(self) -> int:
        return len(self.placements) - 1

    @property
    def threads_max(self) -> int:
        return len(self.threads)

    @property
    def batch_choices(self) -> tuple[int, ...]:
        return self.ubatches

    def suggest(self, trial) -> tuple:
        where = self.placements[trial.suggest_int(NGL, 0, self.ngl_max)]
        threads = self.threads[trial.suggest_int(THREADS, 1, self.threads_max) - 1]
        fa = trial.suggest_categorical(FLASH_ATTN, list(self.fa_modes))
        ub = trial.suggest_categorical(UBATCH, list(self.ubatches)) if len(self.ubatches) > 1 else self.ubatches[0]
        return where, threads, fa, ub

    def optuna_params(self, config: tuple) -> dict:
        where, threads, fa, ub = config
        values = {NGL: self.placements.index(where), THREADS: self.threads.index(threads) + 1, FLASH_ATTN: fa}
        return values | ({UBATCH: ub} if len(self.ubatches) > 1 else {})

    def clip(self, config: tuple) -> tuple:
        return config


@dataclass(frozen=True)
class Landscape:
    """One test of a measured grid under one budget: each configuration's median (0 over the
    budget by its measured peak, or failed), the noise of a single measurement, llama.cpp's
    defaults and --fit's placement as configurations of the grid (a study's first design)."""

    space: LandscapeSpace
    truth: dict[tuple, float]
    over_budget: frozenset[tuple]  # refused before loading by a study (its estimate with the driver's overhead)
    noise_cv: float
    first_design: tuple[tuple, ...]
    edges: tuple[tuple, ...]  # the most on the GPU within the budget at llama.cpp's defaults (and a smaller -ub)
    fit_alone: float | None  # --fit's placement with llama-bench's defaults for the rest, measured
    description: str

    @property
    def optimum(self) -> float:
        return max(self.truth.values())


def placement_order(label: str) -> tuple:
    """Least on the GPU first: fewer GPU layers, or more layers' experts on the CPU."""
    kind, _, value = label.partition(" ")
    return (0, int(value)) if kind == "ngl" else (0, -int(value))


def load_landscape(path: str, test: str, budget: str) -> Landscape:
    """``test`` of the grid in ``path`` under ``budget`` (one of the grid's budgets)."""
    import json

    grid = json.loads(Path(path).read_text())
    if budget not in grid["budgets"]:
        raise SystemExit(f"error: {path} has no budget {budget!r} (it has {', '.join(grid['budgets'])})")
    limit_mib = grid["budgets"][budget]["bytes"] / 1024**2
    peaks = placement_grid.run_peaks(grid["points"])
    points = [p for p in grid["points"] if p["test"] == test]
    if not points:
        raise SystemExit(f"error: {path} has no test {test!r} (it has {', '.join(grid['tests'])})")
    fit_label = f"--fit {budget}"
    searched = [p for p in points if not p["placement"].startswith("--fit ")]
    truth: dict[tuple, float] = {}
    over: set[tuple] = set()
    for p in searched:
        params = p["params"]
        within = placement_grid.within_budget(p, peaks, limit_mib)
        config = (p["placement"], params["n_threads"], params["flash_attn"], params["n_ubatch"])
        truth[config] = p["median"] if p["median"] and within else 0.0
        if not within:
            over.add(config)
    space = LandscapeSpace(tuple(sorted({c[0] for c in truth}, key=placement_order)),
                           tuple(sorted({c[1] for c in truth})), tuple(dict.fromkeys(c[2] for c in truth)),
                           tuple(sorted({c[3] for c in truth})))
    # a trial's value is the mean of its repetitions; llama-bench's first is often slower by a like
    # share at every point (on the H200 pp512's by ~15 %), which moves no point against another: the
    # noise is the spread of log(second / first) across the grid, / 2 for the mean of two
    ratios = [math.log(b / a) for p in searched if len(p["samples"]) >= 2 for a, b in [p["samples"][:2]] if a > 0 < b]
    noise = max(statistics.stdev(ratios) / 2 if len(ratios) > 2 else MIN_NOISE_CV, MIN_NOISE_CV)
    alone = next((p for p in points if p["placement"] == fit_label and p["alone"]), None)
    defaults = alone["params"] if alone and alone["params"] else {"n_threads": max(space.threads)}

    def nearest(values, value):
        return min(values, key=lambda v: (abs(v - value), v))

    threads = nearest(space.threads, defaults["n_threads"])
    fa = "on" if "on" in space.fa_modes else space.fa_modes[-1]  # llama.cpp's auto is on for CUDA and Metal
    ub = nearest(space.ubatches, 512)
    design = [(space.placements[-1], threads, fa, ub)]  # full offload and llama.cpp's defaults: the most GPU
    fit_knobs = grid["budgets"][budget]["fit_knobs"]
    fit_place = (f"ngl {fit_knobs['n_gpu_layers']}" if not grid.get("n_expert") or grid["n_expert"] <= 1
                 else f"ncmoe {fit_knobs['n_cpu_moe']}")
    if fit_place in space.placements:  # --fit's placement as the study's knobs say it
        design.append((fit_place, threads, fa, ub))
    # the memory estimate's guess (StudyRunner._enqueue_edge): the most on the GPU that the estimate
    # with the driver's measured overhead lets in (within 2 % of llama.cpp's buffers in lease 1: taken
    # as the measured peak), and at the largest smaller micro-batch where that puts more there

    def edge_at(ubatch: int) -> tuple | None:
        return next((config for where in reversed(space.placements)
                     if (config := (where, threads, fa, ubatch)) in truth and config not in over), None)

    def on_gpu(config: tuple | None) -> int:
        return space.placements.index(config[0]) if config is not None else -1

    edge = edge_at(ub)
    smaller = next((e for u in sorted(space.ubatches, reverse=True) if u < ub and on_gpu(e := edge_at(u)) > on_gpu(edge)),
                   None)
    edges = tuple(e for e in (edge, smaller) if e is not None)
    text = (f"{Path(path).name} {test} under {budget}: {len(space.placements)} placements x "
            f"{len(space.threads)} threads x {len(space.fa_modes)} attention x {len(space.ubatches)} micro-batches "
            f"= {len(truth)} configurations, {sum(v > 0 for v in truth.values())} within the budget; "
            f"noise {noise:.1%} (a point's median, the median over the grid); first design {design}")
    return Landscape(space, truth, frozenset(over), noise, tuple(design), edges,
                     alone["median"] if alone else None, text)


def run_landscape(landscape: Landscape, sampler: str, variant: str, seed: int, budget: int,
                  target: float = TARGET) -> int:
    """A study on the measured grid: a trial measures its configuration's median times the grid's
    noise (seeded); over the budget or failed, it fails."""
    import random

    rng = random.Random(seed)

    def measure(config: tuple, n: int) -> float | str | None:
        true = landscape.truth[config]
        if true > 0:
            return true * rng.gauss(1.0, landscape.noise_cv)
        return REFUSED if config in landscape.over_budget else None

    warm = {"study": landscape.first_design, "study-edge": (*landscape.first_design, *landscape.edges)}.get(variant, ())
    return run_search(landscape.space, sampler, seed, budget, "maximize", measure, landscape.truth.__getitem__,
                      landscape.optimum, warm, target)


def main_landscape(args) -> int:
    samplers, notes = runnable(args.samplers.split(","))
    variants = [v for v in args.variants.split(",") if v in LANDSCAPE_VARIANTS] or list(LANDSCAPE_VARIANTS)
    rows = []
    started = time.time()
    for spec in args.landscape:
        path, _, rest = spec.partition(":")
        test, _, budget = rest.partition(":")
        landscape = load_landscape(path, test, budget)
        best = max(landscape.truth, key=landscape.truth.__getitem__)
        fit = f"{landscape.fit_alone:.1f}" if landscape.fit_alone else "none"
        print(f"{landscape.description}; optimum {landscape.optimum:.1f} tok/s at {best}; --fit alone {fit}")
        for sampler, variant in itertools.product(samplers, variants):
            ns = [run_landscape(landscape, sampler, variant, seed, args.budget, args.target)
                  for seed in range(args.seeds)]
            rows.append((Path(path).name, test, budget, sampler, variant, ns))
    print(f"{args.seeds} seeds a row, budget {args.budget} trials ({args.budget + 1} = never), "
          f"{time.time() - started:.0f}s")
    for note in notes:
        print(note)
    print(f"| grid | test | budget | sampler | variant | median trials to {args.target:.0%} | range | p90 | "
          "reached within budget |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name, test, budget, sampler, variant, ns in rows:
        reached = sum(n <= args.budget for n in ns) / len(ns)
        p90 = statistics.quantiles(ns, n=10)[-1] if len(ns) > 1 else ns[0]
        print(f"| {name} | {test} | {budget} | {sampler} | {variant} | {statistics.median(ns):g} | "
              f"{min(ns)}-{max(ns)} | {p90:g} | {reached:.0%} |")
    return 0


def parse_models(text: str | None) -> dict[str, tuple[str, str]]:
    """``--models``: names of MODELS or SHAPE/QUANT of any named shape ("qwen3-30b-a3b/q4_k_m")."""
    if not text:
        return dict(MODELS)
    models = {}
    for item in text.split(","):
        name, _, quant = item.partition("/")
        models[item] = MODELS.get(item) or (name, quant or "q4_0")
    return models


def parse_chips(text: str | None) -> list:
    """``--chips``: bins, or all. A bin given without its memory gets at least MEMORY_FLOOR_GB
    (room for 8B models); one given with it keeps it (a 16 GB Mac for a model that does not fit)."""
    if text == "all":
        return [simulated.with_memory(c, max(c.memory_gb, MEMORY_FLOOR_GB)) for c in simulated.all_chips()]
    chips = []
    for spec in text.split(",") if text else DEFAULT_CHIPS:
        chip = simulated.parse_chip(spec)
        with_memory = spec.replace(".", "/").count("/") == 2
        chips.append(chip if with_memory else simulated.with_memory(chip, max(chip.memory_gb, MEMORY_FLOOR_GB)))
    return chips


def runnable(samplers: list[str]) -> tuple[list[str], list[str]]:
    """The samplers this machine can run, and why any of the others is left out."""
    try:
        import torch  # noqa: F401
    except ImportError:
        if "gp" in samplers:
            return ([s for s in samplers if s != "gp"],
                    ["gp not run: it needs torch, which is not installed here (pip install 'fleettune[gp]')"])
    return samplers, []


def share_of_optimum(text: str) -> float:
    """``--target``: a share of the optimum in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a share of the optimum in (0, 1], e.g. 0.95")
    return value


def share(value: float, optimum: float) -> float:
    return value / optimum if optimum else 0.0


def main() -> int:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samplers", default="tpe")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", type=int, default=5, help="studies per sampler, variant and truth")
    ap.add_argument("--budget", type=int, default=40)
    ap.add_argument("--target", type=share_of_optimum, default=TARGET,
                    help="the share of the optimum a study's pick must truly reach (default 0.98: within 2 %%); "
                         "lower it on a landscape whose optimum stands out of a plateau by its noise alone")
    ap.add_argument("--objective", default="tg", choices=["tg", "pp", "e2e"])
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--scenario", default="calibrated", choices=list(simulated.SCENARIOS))
    ap.add_argument("--chips", help=f"comma-separated bins, or all (default: {', '.join(DEFAULT_CHIPS)})")
    ap.add_argument("--models", help=f"comma-separated: {', '.join(MODELS)}, or SHAPE/QUANT of a named shape "
                                     "(default: the first two)")
    ap.add_argument("--truths", type=int, default=0,
                    help="perturbed truths (0: the calibrated model is the truth, as its prediction)")
    ap.add_argument("--spread", type=float, default=0.15, help="each constant of a truth x U[1-spread, 1+spread]")
    ap.add_argument("--landscape", action="append", default=[], metavar="GRID.json:TEST:BUDGET",
                    help="a grid measured by bench/placement_grid.py as the truth instead of the simulator "
                         "(repeatable), e.g. grid.json:tg128:8GiB; variants study and no-first-design")
    args = ap.parse_args()
    if args.landscape:
        return main_landscape(args)
    chips, models = parse_chips(args.chips), parse_models(args.models)
    workload = replace(WORKLOAD, depth=args.depth)
    samplers, notes = runnable(args.samplers.split(","))
    variants = args.variants.split(",")
    calibrated = simulated.calibrated_constants()
    truths = [calibrated.perturbed(i, args.spread) for i in range(args.truths)] or [None]
    results: dict[tuple[str, str], list[int]] = {(s, v): [] for s in samplers for v in variants}
    first_shares: dict[str, list[float]] = {v: [] for v in variants}  # its best guess's true share of the optimum
    started = time.time()
    for chip, (shape_name, quant) in itertools.product(chips, models.values()):
        shape = simulated.model_shape(shape_name, quant)
        space = space_for(chip, shape, args.objective, workload)
        # what a real study measures first comes from the calibrated model, whatever the truth
        spaces = {v: variant_space(chip, shape, v, args.objective, workload) for v in variants}
        designs = {v: first_design(chip, shape, spaces[v], v, args.objective, workload) for v in variants}
        for index, truth in enumerate(truths):
            optimum = grid_optimum(chip, shape, space, args.objective, args.scenario, workload, truth)
            for variant in variants:  # how close the calibrated model's guesses truly are to this optimum
                first_shares[variant].append(max((share(true_value(
                    chip, shape, spaces[variant].clip(p), args.objective, args.scenario, workload, truth), optimum)
                    for p in designs[variant]), default=0.0))
            for variant in variants:
                for sampler, seed in itertools.product(samplers, range(args.seeds)):
                    results[sampler, variant].append(run_study(
                        chip, shape, spaces[variant], sampler, index * args.seeds + seed, args.budget,
                        args.objective, args.scenario, optimum, designs[variant], workload, truth, args.target))
    truth_text = (f"{args.truths} perturbed truths (every constant x U[{1 - args.spread:g}, {1 + args.spread:g}])"
                  if args.truths else "the calibrated model as the truth")
    print(f"{len(chips)} chip bins ({', '.join(c.label for c in chips)}) x {len(models)} models "
          f"({', '.join(models)}) x {truth_text} x {args.seeds} seeds, objective {args.objective}, "
          f"depth {args.depth}, scenario {args.scenario}, budget {args.budget}, {time.time() - started:.0f}s")
    for note in notes:
        print(note)
    for variant, shares in first_shares.items():
        reaching = sum(x >= args.target for x in shares) / len(shares)
        print(f"first design of {variant}, its best guess on the truth: median {statistics.median(shares):.1%} "
              f"of the optimum, worst {min(shares):.1%}, within {1 - args.target:.0%} for {reaching:.0%}")
    print(f"| sampler | variant | median trials to {args.target:.0%} | range | p90 | reached within budget |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (sampler, variant), ns in results.items():
        reached = sum(n <= args.budget for n in ns) / len(ns)
        p90 = statistics.quantiles(ns, n=10)[-1] if len(ns) > 1 else ns[0]
        print(f"| {sampler} | {variant} | {statistics.median(ns):g} | {min(ns)}-{max(ns)} | {p90:g} | {reached:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
