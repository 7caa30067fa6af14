"""The search space follows from the hardware record and the model: GPU layers only where the node
offloads, threads up to its cores, batches up to the prompt; Optuna's proposals stay inside it."""

from __future__ import annotations

from dataclasses import replace

import optuna

from orchestrator.space import SearchSpace, full_offload, llama_cpp_python_defaults
from workers import simulated
from workers.hardware import fingerprint_from_dir
from workers.trial import BenchParams

MODEL = simulated.sim_model_info("sim://llama2-7b/q4_0")  # 32 layers, context 4096


def test_an_apple_bin_offloads_every_layer_and_threads_up_to_its_cores():
    chip = simulated.parse_chip("M2 Ultra/76/192")  # 16 P + 8 E cores
    space = SearchSpace.for_target(chip, MODEL, n_prompt=512)
    assert space.ngl_max == MODEL.n_layer + 1  # the output layer too
    assert space.threads_max == 24
    assert space.batch_choices == (32, 64, 128, 256, 512)  # up to the prompt, never beyond
    assert SearchSpace.for_target(chip, MODEL, n_prompt=100_000).batch_choices[-1] == 4096


def test_a_cpu_only_node_searches_no_gpu_layers(tmp_path):
    cpuinfo = "".join(f"processor\t: {i}\nmodel name\t: AMD EPYC 9654\ncore id\t: {i}\n\n" for i in range(6))
    (tmp_path / "cpuinfo.txt").write_text(cpuinfo)
    fp = fingerprint_from_dir(tmp_path)
    space = SearchSpace.for_target(fp, MODEL, n_prompt=512)
    assert (space.ngl_max, space.threads_max) == (0, 6)
    assert full_offload(fp, MODEL, space) is None
    assert llama_cpp_python_defaults(fp) == BenchParams(0, 3, 512, 512, n_threads_batch=6)


def test_optuna_proposals_stay_inside_and_round_trip_through_optuna_params():
    space = SearchSpace.for_target(simulated.parse_chip("M1 Pro/16"), MODEL, n_prompt=256)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    for _ in range(40):
        trial = study.ask()
        params = space.suggest(trial)
        assert 0 <= params.n_gpu_layers <= space.ngl_max and 1 <= params.n_threads <= space.threads_max
        assert params.n_ubatch <= params.n_batch and params.n_batch in space.batch_choices
        study.tell(trial, 1.0)
        enqueued = optuna.create_study()
        enqueued.enqueue_trial(space.optuna_params(params))
        assert space.suggest(enqueued.ask()) == params
    assert space.size() == (space.ngl_max + 1) * space.threads_max * len(space.batch_choices) ** 2


def test_clip_brings_a_configuration_learnt_elsewhere_inside():
    space = SearchSpace.for_target(simulated.parse_chip("M1/8/16"), MODEL, n_prompt=512)  # 4 P + 4 E
    clipped = space.clip(BenchParams(n_gpu_layers=99, n_threads=24, n_batch=3000, n_ubatch=1000,
                                     n_threads_batch=24))
    assert clipped == BenchParams(n_gpu_layers=33, n_threads=8, n_batch=512, n_ubatch=512)
    assert space.clip(clipped) == clipped
    assert SearchSpace.from_dict(space.to_dict()) == space


def test_full_offload_is_every_layer_with_the_defaults_otherwise():
    chip = simulated.parse_chip("M3 Max/40")
    space = SearchSpace.for_target(chip, MODEL, n_prompt=128)
    full = full_offload(chip, MODEL, space)
    assert full == replace(llama_cpp_python_defaults(chip), n_gpu_layers=33, n_batch=128, n_ubatch=128,
                           n_threads_batch=None)


def test_the_grid_spans_each_axis_within_its_bounds():
    space = SearchSpace.for_target(simulated.parse_chip("M2 Ultra/76"), MODEL, n_prompt=512)
    grid = space.grid(max_axis=8)
    assert grid["ngl"][0] == 0 and grid["ngl"][-1] == space.ngl_max and len(grid["ngl"]) == 8
    assert grid["threads"][0] == 1 and grid["threads"][-1] == space.threads_max
    assert set(grid["batch"]) <= set(space.batch_choices)
