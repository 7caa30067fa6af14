"""bench/search_efficiency.py's pieces: the truth it measures, and its enumeration of the optimum."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict, replace

import optuna

from bench import search_efficiency as se
from orchestrator.space import SearchSpace
from workers import simulated
from workers.trial import BenchParams

TRUTH = simulated.calibrated_constants().perturbed(2)


def test_the_enumeration_skips_only_configurations_that_run_alike():
    """Of n_cpu_moe values that place the experts alike and batches above the same micro-batch, one:
    the optimum is that of every configuration, on the calibrated model and on a perturbed truth."""
    chip = simulated.parse_chip("M2 Pro/19/16")
    shape = simulated.named_model("tiny-moe", "q4_0")  # a test shape: two layers of four experts
    space = replace(SearchSpace.for_target(chip, shape, 512, "pp"), cpu_moe_max=shape.n_layer, threads_max=2)
    every = [BenchParams(ngl, t, b, u, flash_attn="on", n_threads_batch=tb, n_cpu_moe=cm if ngl else 0)
             for ngl, t, b, u, tb, cm in itertools.product(range(space.ngl_max + 1), (1, 2), space.batch_choices,
                                                           space.batch_choices, (1, 2), range(space.cpu_moe_max + 1))
             if u <= b]
    kept = [p for p in se.every_config(chip, shape, replace(space, threads_max=2)) if p.flash_attn == "on"
            and p.type_k == p.type_v == "f16" and p.n_threads <= 2 and p.n_threads_batch <= 2]
    assert len(kept) < len(every)
    for truth in (None, TRUTH):
        def value(p, truth=truth):
            return se.true_value(chip, shape, p, "pp", "calibrated", truth=truth)

        assert max(map(value, every)) == max(map(value, kept))
        assert {value(p) for p in every} == {value(p) for p in kept}


def test_a_study_measures_the_truth_it_is_given_and_is_judged_on_it():
    chip = simulated.parse_chip("M1 Max/32/64")
    shape = simulated.model_shape("llama2-7b", "q4_0")
    space = se.space_for(chip, shape)
    full = BenchParams(shape.n_layer + 1, 4, 512, 512, flash_attn="on")
    truth_value = se.true_value(chip, shape, full, "tg", "calibrated", truth=TRUTH)
    assert truth_value != se.true_value(chip, shape, full, "tg", "calibrated")
    # an optimum just above what full offload truly does: reached at the first trial on the truth
    n = se.run_study(chip, shape, space, "random", 0, 3, "tg", "calibrated", truth_value, [full], truth=TRUTH)
    assert n == 1
    assert se.run_study(chip, shape, space, "random", 0, 3, "tg", "calibrated", truth_value * 1.5, [full],
                        truth=TRUTH) == 4  # never: budget + 1


def test_a_chip_given_with_its_memory_keeps_it():
    small, floored = se.parse_chips("M2 Pro/19/16,M2 Pro/19")
    assert small.memory_gb == 16 and floored.memory_gb == se.MEMORY_FLOOR_GB
    assert se.parse_models("qwen3-30b-a3b/q4_k_m") == {"qwen3-30b-a3b/q4_k_m": ("qwen3-30b-a3b", "q4_k_m")}
    assert se.parse_models(None) == se.MODELS


def landscape_file(tmp_path, peak_of=lambda ncmoe: 1000):
    """A measured grid as bench/placement_grid.py writes it: a mixture whose fewer experts on the CPU
    are faster, whose fewest (ncmoe 1) ran over the 8 GiB budget; threads matter, attention a little."""
    import json

    points = []
    for ncmoe, threads, fa in itertools.product((1, 2, 4, 8), (4, 8, 16), ("off", "on")):
        rate = 100.0 / ncmoe * {4: 0.5, 8: 0.8, 16: 1.0}[threads] * (1.02 if fa == "on" else 1.0)
        second = 1.1 if threads == 8 else 1.2  # the first repetition slower, by 1/1.1 or 1/1.2
        params = BenchParams(49, threads, 512, 512, flash_attn=fa, n_cpu_moe=ncmoe)
        points.append({"placement": f"ncmoe {ncmoe}", "test": "tg128", "params": asdict(params), "alone": False,
                       "samples": [rate, rate * second], "median": rate,
                       "peak_mib": 9000 if ncmoe == 1 else peak_of(ncmoe), "error": None})
    fit = BenchParams(49, 16, 2048, 512, flash_attn="auto")
    points.append({"placement": "--fit 8GiB", "test": "tg128", "params": asdict(fit), "alone": True,
                   "samples": [20.0, 20.0], "median": 20.0, "peak_mib": 7000, "error": None})
    grid = {"model": "m.gguf", "n_layer": 48, "n_expert": 128, "tests": ["tg128"], "reps": 2,
            "budgets": {"8GiB": {"bytes": 8 * 1024**3, "fit_flags": ["-ngl", "49", "-ot", "x=CPU"],
                                 "fit_knobs": {"n_gpu_layers": 49, "n_cpu_moe": 4}}},
            "points": points}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    return path


def test_a_measured_landscape_is_the_truth_over_the_budget_by_its_measured_peak(tmp_path):
    land = se.load_landscape(str(landscape_file(tmp_path)), "tg128", "8GiB")
    assert land.space.placements == ("ncmoe 8", "ncmoe 4", "ncmoe 2", "ncmoe 1")  # least on the GPU first
    assert land.truth[("ncmoe 1", 16, "on", 512)] == 0.0  # its peak was over the budget: fails
    assert land.optimum == 50.0 * 1.02  # ncmoe 2, 16 threads, attention on
    # the noise of a mean of two: the spread of log(second / first) over the grid, halved (not its mean)
    ratios = [math.log(1.1)] * 8 + [math.log(1.2)] * 16
    assert abs(land.noise_cv - statistics.stdev(ratios) / 2) < 1e-9 and land.noise_cv < 0.03
    # first design: llama.cpp's defaults (the most on the GPU: over the budget here), --fit's placement
    assert land.first_design == (("ncmoe 1", 16, "on", 512), ("ncmoe 4", 16, "on", 512))
    assert land.fit_alone == 20.0


def test_a_study_on_a_measured_landscape_is_judged_on_its_medians(tmp_path):
    land = se.load_landscape(str(landscape_file(tmp_path)), "tg128", "8GiB")
    space = land.space
    # the space proposes only the grid's points, and says each one back as it proposed it
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=3))
    for _ in range(20):
        trial = study.ask()
        config = space.suggest(trial)
        assert config in land.truth and space.optuna_params(config) == trial.params
        study.tell(trial, 1.0)
    counts = [se.run_landscape(land, sampler, variant, seed, 24)
              for sampler in ("random", "seed-scan", "tpe") for variant in ("study", "no-first-design")
              for seed in range(3)]
    assert all(1 <= n <= 25 for n in counts)
    # the first design: the defaults, over the budget, are refused before loading (no trial spent), so
    # a study of one trial measures --fit's placement, at half the optimum: never reached
    assert se.run_landscape(land, "random", "study", 0, 1) == 2
    # --target: the same study with half the optimum as its goal reaches it with --fit's placement
    assert se.run_landscape(land, "random", "study", 0, 1, target=0.5) == 1
    assert land.edges == (("ncmoe 2", 16, "on", 512),)  # the most on the GPU within the budget
    # the hand method: threads at the least on the GPU (ncmoe 8), then the placements at its best threads
    assert se.run_landscape(land, "seed-scan", "no-first-design", 0, 24) <= 3 + 4


def test_a_configuration_is_within_the_budget_only_if_every_test_of_it_was(tmp_path):
    """The prompt's buffers count: a placement whose tg128 fit but whose pp512 at the same micro-batch
    ran over the budget is over it for tg as well; at another micro-batch it is judged apart."""
    import json

    from bench import placement_grid

    path = landscape_file(tmp_path)
    grid = json.loads(path.read_text())
    for ub, peak in ((512, 9000), (256, 1000)):
        params = BenchParams(49, 16, 512, ub, flash_attn="on", n_cpu_moe=2)
        grid["points"].append({"placement": "ncmoe 2", "test": "pp512", "params": asdict(params), "alone": False,
                               "samples": [900.0, 900.0], "median": 900.0, "peak_mib": peak, "error": None})
    grid["tests"].append("pp512")
    path.write_text(json.dumps(grid))
    land = se.load_landscape(str(path), "tg128", "8GiB")
    assert land.truth[("ncmoe 2", 16, "on", 512)] == 0.0 and land.optimum == 25.0 * 1.02  # ncmoe 4 now
    pp = se.load_landscape(str(path), "pp512", "8GiB")
    assert pp.truth == {("ncmoe 2", 16, "on", 256): 900.0, ("ncmoe 2", 16, "on", 512): 0.0}
    assert pp.edges == (("ncmoe 2", 16, "on", 256),)  # none within the budget at -ub 512: the smaller one's
    best, count = placement_grid.best_within(grid, "tg128", "8GiB")
    assert best["placement"] == "ncmoe 4" and count == 12



def test_a_generation_test_is_measured_at_each_micro_batch_given_for_it(model_path):
    """Its micro-batch sizes the compute buffers, so a smaller one can buy a placement (lease 5's
    MoE: -ncmoe 2 fits 16 GiB only at -ub 64); by default a generation test keeps llama.cpp's 512.
    Real llama-bench and llama-fit-params on SmolLM2."""
    import argparse

    from bench import placement_grid
    from tests.conftest import require_llama_tool

    def grid_args(**given) -> argparse.Namespace:
        return argparse.Namespace(**{
            "model": str(model_path), "ngl": "0", "ncmoe": None, "threads": "2", "fa": "off", "ubatch": "512",
            "gen_ubatch": "512", "tests": "tg8", "budget": ["8GiB"], "reps": 1, "timeout": 120, "json": None,
            "llama_bench": require_llama_tool("llama-bench"), "fit_params": require_llama_tool("llama-fit-params"),
            **given})

    def searched(groups) -> list[int]:
        return [p.n_ubatch for g in groups if g.label == "ngl 0" for p in g.points]

    assert searched(placement_grid.plan(grid_args(), str(model_path))[0]) == [512]
    report = placement_grid.run(grid_args(gen_ubatch="512,32"))
    measured = [p for p in report["points"] if p["placement"] == "ngl 0"]
    assert [p["params"]["n_ubatch"] for p in measured] == [32, 512]
    assert all(p["test"] == "tg8" and p["median"] > 0 for p in measured)
    assert report["axes"]["n_ubatch_gen"] == [512, 32]
