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
- ``flat``: ``study`` with every dimension searched everywhere (batch, ubatch and n_threads_batch
  for tg too, no condition on the V type's flash attention: a quantized V without it fails).

    python bench/search_efficiency.py [--samplers tpe,random] [--variants study,flat] [--seeds 5]
        [--budget 40] [--objective tg] [--depth 0] [--chips all|"M2 Ultra/76,M1/8"] [--scenario calibrated]
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
from workers import simulated  # noqa: E402
from workers.objective import objective as objective_named  # noqa: E402
from workers.trial import BenchParams, TrialSpec, Workload  # noqa: E402

MODELS = {"LLaMA-2 7B Q4_0": ("llama2-7b", "q4_0"), "Llama-3-8B Q4_K_M": ("llama3-8b", "q4_k_m")}
WORKLOAD = Workload(n_prompt=512, n_gen=128, reps=3)
VARIANTS = ("study", "no-prediction", "no-compact-cache", "no-first-design", "all-threads", "linear-threads",
            "no-prediction-linear-threads", "flat")
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


def true_value(chip, shape, params: BenchParams, objective: str, scenario: str, workload: Workload = WORKLOAD) -> float:
    if params.n_ubatch < 1 or (params.type_v != "f16" and params.flash_attn != "on"):
        return 0.0  # a configuration llama.cpp refuses
    pred = simulated.predict(chip, shape, params, workload.n_prompt, workload.n_gen, scenario,
                             depth=workload.depth)
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


def every_config(chip, shape, space: SearchSpace):
    """Every configuration llama.cpp accepts in the space's ranges, threads up to every core."""
    logical = chip.logical_cores or 1
    batches = [(b, u) for b in space.batch_choices for u in space.batch_choices if u <= b] \
        if space.tune_batch else [space.default_batch()]
    caches = [(k, v) for k in CACHE_TYPES for v in CACHE_TYPES]
    moe = range(space.cpu_moe_max + 1) if space.cpu_moe_max else [0]
    threads_batch = range(1, logical + 1) if space.threads_batch else [None]
    for ngl, t, (b, u), fa, (tk, tv), tb, cm in itertools.product(
            range(space.ngl_max + 1), range(1, logical + 1), batches, ("off", "on", "auto"), caches,
            threads_batch, moe):
        if tv != "f16" and fa != "on":
            continue
        yield BenchParams(ngl, t, b, u, flash_attn=fa, n_threads_batch=tb, type_k=tk, type_v=tv,
                          n_cpu_moe=cm if ngl else 0)


def grid_optimum(chip, shape, space: SearchSpace, objective: str, scenario: str,
                 workload: Workload = WORKLOAD) -> float:
    return max(true_value(chip, shape, p, objective, scenario, workload) for p in every_config(chip, shape, space))


def first_design(chip, shape, space: SearchSpace, variant: str, objective: str, workload: Workload) -> list:
    """The configurations a new study measures before its sampler proposes."""
    if variant == "no-first-design":
        return []
    info = shape  # a named shape is its own model record
    defaults = llama_cpp_defaults(chip, info, workload.n_prompt)
    design = [full_offload(chip, info, space), defaults]
    if workload.depth and variant != "no-compact-cache":
        design.append(compact_cache(defaults, space))
    if variant not in ("no-prediction", "no-compact-cache", "no-prediction-linear-threads"):  # the calibrated model's optimum, as a new study enqueues it
        design.append(predicted_optimum(chip, info, workload.n_prompt, workload.n_gen, workload.depth, objective))
    return [p for p in design if p is not None]


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
              scenario: str, optimum: float, warm=(), workload: Workload = WORKLOAD) -> int:
    """Trials until the incumbent is truly within 2 % of the optimum (budget + 1 if never).

    ``warm``: configurations measured first (moved into the space), as a new study's first design
    and warm start are.
    """
    direction = objective_named(objective).direction.value
    study = optuna.create_study(direction=direction,
                                sampler=make_sampler(sampler_name, space, budget, direction, seed))
    for params in warm:
        study.enqueue_trial(space.optuna_params(space.clip(params)), skip_if_exists=True)
    node = simulated.SimulatedNode(chip, shape_for=lambda _: shape, scenario=scenario, seed=seed)
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
        if incumbent is not None and true_value(chip, shape, incumbent, objective, scenario, workload) >= 0.98 * optimum:
            return n
    return budget + 1


def main() -> int:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samplers", default="tpe")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budget", type=int, default=40)
    ap.add_argument("--objective", default="tg", choices=["tg", "pp", "e2e"])
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--scenario", default="calibrated", choices=list(simulated.SCENARIOS))
    ap.add_argument("--chips", help=f"comma-separated bins, or all (default: {', '.join(DEFAULT_CHIPS)})")
    args = ap.parse_args()
    if args.chips == "all":
        chips = simulated.all_chips()
    else:
        chips = [simulated.parse_chip(c) for c in (args.chips.split(",") if args.chips else DEFAULT_CHIPS)]
    chips = [simulated.with_memory(c, max(c.memory_gb, 32)) for c in chips]  # room for 8B models
    workload = replace(WORKLOAD, depth=args.depth)
    samplers, variants = args.samplers.split(","), args.variants.split(",")
    results: dict[tuple[str, str], list[int]] = {(s, v): [] for s in samplers for v in variants}
    started = time.time()
    for chip, (shape_name, quant) in itertools.product(chips, MODELS.values()):
        shape = simulated.model_shape(shape_name, quant)
        optimum = grid_optimum(chip, shape, space_for(chip, shape, args.objective, workload), args.objective,
                               args.scenario, workload)
        for variant in variants:
            space = variant_space(chip, shape, variant, args.objective, workload)
            design = first_design(chip, shape, space, variant, args.objective, workload)
            for sampler, seed in itertools.product(samplers, range(args.seeds)):
                results[sampler, variant].append(run_study(chip, shape, space, sampler, seed, args.budget,
                                                           args.objective, args.scenario, optimum, design,
                                                           workload))
    print(f"{len(chips)} chip bins x {len(MODELS)} models x {args.seeds} seeds, objective {args.objective}, "
          f"depth {args.depth}, scenario {args.scenario}, budget {args.budget}, {time.time() - started:.0f}s")
    print("| sampler | variant | median trials to 98 % | range | p90 | reached within budget |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (sampler, variant), ns in results.items():
        reached = sum(n <= args.budget for n in ns) / len(ns)
        p90 = statistics.quantiles(ns, n=10)[-1] if len(ns) > 1 else ns[0]
        print(f"| {sampler} | {variant} | {statistics.median(ns):g} | {min(ns)}-{max(ns)} | {p90:g} | {reached:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
