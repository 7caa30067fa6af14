"""Warm start, leave one chip out, on the simulated fleet: trials until a study's pick is within 2 %
of the true optimum, with and without the warm start a new study gets.

For each held-out chip bin: the fleet's knowledge is every other bin's best configuration and speed
(the simulator's optimum on the coarse grid, standing in for their studies' recommendations); the
transfer model (orchestrator/transfer.py) predicts the held-out chip's configuration, and the warm
start is that prediction followed by the best configurations of its two nearest known chips,
exactly as `fleettune tune --warm-start` enqueues them. Both arms then run the same sampler with
the same noise (the simulated node, 3 % CV) in the study's own search space, after the same first
design a new study measures (full offload, llama.cpp's defaults, the calibrated model's prediction).

    python bench/warm_start.py [--scenario calibrated|seed] [--seeds 3] [--budget 30] [--sampler tpe]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_efficiency import WORKLOAD, first_design, grid_optimum, run_study, space_for, true_value  # noqa: E402

from orchestrator.transfer import ConfigPredictor, Example  # noqa: E402
from workers import simulated  # noqa: E402

MODEL = ("llama2-7b", "q4_0")


def main() -> int:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="calibrated", choices=list(simulated.SCENARIOS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=30)
    ap.add_argument("--sampler", default="tpe")
    args = ap.parse_args()
    started = time.time()
    shape = simulated.model_shape(*MODEL)
    model = simulated.sim_model_info(f"sim://{MODEL[0]}/{MODEL[1]}")
    chips = [simulated.with_memory(c, max(c.memory_gb, 32)) for c in simulated.all_chips()]
    known = {}
    for chip in chips:
        params, _, value = simulated.optimum(chip, shape, "tg", scenario=args.scenario)
        known[chip.chip_key] = Example(chip.chip_key, chip, model, params, value)
    cold, warm, quality = [], [], []
    for chip in chips:
        predictor = ConfigPredictor([e for k, e in known.items() if k != chip.chip_key])
        pred = predictor.predict(chip, model)
        configs = [pred.params, *(p for _, p in pred.nearest)]
        space = space_for(chip, shape)
        optimum = grid_optimum(chip, shape, space, "tg", args.scenario)
        quality.append(true_value(chip, shape, space.clip(pred.params), "tg", args.scenario) / optimum)
        design = first_design(chip, shape, space, "study", "tg", WORKLOAD)
        for seed in range(args.seeds):
            cold.append(run_study(chip, shape, space, args.sampler, seed, args.budget, "tg",
                                  args.scenario, optimum, warm=design))
            warm.append(run_study(chip, shape, space, args.sampler, seed, args.budget, "tg",
                                  args.scenario, optimum, warm=[*design, *configs]))
    print(f"{len(chips)} chip bins held out one at a time x {args.seeds} seeds, {MODEL[0]} {MODEL[1]}, "
          f"tg, scenario {args.scenario}, sampler {args.sampler}, budget {args.budget}, "
          f"{time.time() - started:.0f}s")
    print("| start | median trials to 98 % | p90 | reached within budget |")
    print("| --- | ---: | ---: | ---: |")
    for name, ns in (("cold", cold), ("warm", warm)):
        p90 = statistics.quantiles(ns, n=10)[-1]
        reached = sum(n <= args.budget for n in ns) / len(ns)
        print(f"| {name} | {statistics.median(ns):g} | {p90:g} | {reached:.0%} |")
    print(f"\npredicted configuration alone (no trial): median {statistics.median(quality):.1%} of the "
          f"optimum, worst {min(quality):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
