"""bench/search_efficiency.py's pieces: the truth it measures, and its enumeration of the optimum."""

from __future__ import annotations

import itertools
from dataclasses import replace

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
