"""Search efficiency on the simulated fleet: trials until a study's pick is within 2 % of the true
optimum, in the search space of today's llama.cpp (flash attention off/on/auto, K and V cache
types, n_threads_batch where the objective has a prompt, n_cpu_moe where experts do not fit).

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
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
from workers import placement, simulated  # noqa: E402
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


def run_study(chip, shape, space, sampler_name: str, seed: int, budget: int, objective: str,
              scenario: str, optimum: float, warm=(), workload: Workload = WORKLOAD,
              truth: ModelConstants | None = None) -> int:
    """Trials until the incumbent is truly within 2 % of the optimum (budget + 1 if never).

    ``warm``: configurations measured first (moved into the space), as a new study's first design
    and warm start are. ``truth``: what the simulated node measures and the optimum is of (None:
    the calibrated model).
    """
    direction = objective_named(objective).direction.value
    study = optuna.create_study(direction=direction,
                                sampler=make_sampler(sampler_name, space, budget, direction, seed))
    for params in warm:
        study.enqueue_trial(space.optuna_params(space.clip(params)), skip_if_exists=True)
    node = simulated.SimulatedNode(chip, shape_for=lambda _: shape, scenario=scenario, seed=seed, constants=truth)
    best_observed, incumbent = None, None
    for n in range(1, budget + 1):
        trial = study.ask()
        params = space.suggest(trial)
        if params.n_ubatch < 1:  # refused by llama.cpp: a failed trial
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        spec = TrialSpec(shape.path, "x", params, workload, trial_key=f"{seed}-{n}")
        result = node.measure(spec)
        if not result.ok:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        target = objective_named(objective)
        value = target.value(result.pp.median if result.pp else None, result.tg.median if result.tg else None,
                             workload.n_prompt, workload.n_gen)
        study.tell(trial, value)
        better = best_observed is None or (value > best_observed if direction == "maximize" else value < best_observed)
        if better:
            best_observed, incumbent = value, params
        if incumbent is not None and true_value(chip, shape, incumbent, objective, scenario, workload,
                                                truth) >= 0.98 * optimum:
            return n
    return budget + 1


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


def share(value: float, optimum: float) -> float:
    return value / optimum if optimum else 0.0


def main() -> int:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samplers", default="tpe")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", type=int, default=5, help="studies per sampler, variant and truth")
    ap.add_argument("--budget", type=int, default=40)
    ap.add_argument("--objective", default="tg", choices=["tg", "pp", "e2e"])
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--scenario", default="calibrated", choices=list(simulated.SCENARIOS))
    ap.add_argument("--chips", help=f"comma-separated bins, or all (default: {', '.join(DEFAULT_CHIPS)})")
    ap.add_argument("--models", help=f"comma-separated: {', '.join(MODELS)}, or SHAPE/QUANT of a named shape "
                                     "(default: the first two)")
    ap.add_argument("--truths", type=int, default=0,
                    help="perturbed truths (0: the calibrated model is the truth, as its prediction)")
    ap.add_argument("--spread", type=float, default=0.15, help="each constant of a truth x U[1-spread, 1+spread]")
    args = ap.parse_args()
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
                        args.objective, args.scenario, optimum, designs[variant], workload, truth))
    truth_text = (f"{args.truths} perturbed truths (every constant x U[{1 - args.spread:g}, {1 + args.spread:g}])"
                  if args.truths else "the calibrated model as the truth")
    print(f"{len(chips)} chip bins ({', '.join(c.label for c in chips)}) x {len(models)} models "
          f"({', '.join(models)}) x {truth_text} x {args.seeds} seeds, objective {args.objective}, "
          f"depth {args.depth}, scenario {args.scenario}, budget {args.budget}, {time.time() - started:.0f}s")
    for note in notes:
        print(note)
    for variant, shares in first_shares.items():
        print(f"first design of {variant}, its best guess on the truth: median {statistics.median(shares):.1%} "
              f"of the optimum, worst {min(shares):.1%}, within 2 % for {sum(x >= 0.98 for x in shares) / len(shares):.0%}")
    print("| sampler | variant | median trials to 98 % | range | p90 | reached within budget |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (sampler, variant), ns in results.items():
        reached = sum(n <= args.budget for n in ns) / len(ns)
        p90 = statistics.quantiles(ns, n=10)[-1] if len(ns) > 1 else ns[0]
        print(f"| {sampler} | {variant} | {statistics.median(ns):g} | {min(ns)}-{max(ns)} | {p90:g} | {reached:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
