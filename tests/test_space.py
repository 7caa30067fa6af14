"""The search space follows from the hardware record, the model and the objective: GPU layers only
where the node offloads, threads up to its performance cores, batches up to the prompt (and only
where the objective has one), flash attention and cache types with their condition, experts on the
CPU only for a mixture-of-experts model that does not fit; Optuna's proposals stay inside it."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from orchestrator.space import (
    MoeLayout,
    SearchSpace,
    compact_cache,
    full_offload,
    llama_cpp_defaults,
    llama_cpp_python_defaults,
    moe_layout,
)
from workers import simulated
from workers.hardware import GIB, fingerprint_from_dir
from workers.trial import BenchParams

MODEL = simulated.sim_model_info("sim://llama2-7b/q4_0")  # 32 layers, context 4096


def test_an_apple_bin_offloads_every_layer_and_threads_up_to_its_performance_cores():
    chip = simulated.parse_chip("M2 Ultra/76/192")  # 16 P + 8 E cores
    space = SearchSpace.for_target(chip, MODEL, n_prompt=512)
    assert space.ngl_max == MODEL.n_layer + 1  # the output layer too
    assert space.threads_max == 16  # an E-core thread paces every step
    assert space.batch_choices == (32, 64, 128, 256, 512)  # up to the prompt, never beyond
    assert SearchSpace.for_target(chip, MODEL, n_prompt=100_000).batch_choices[-1] == 4096
    assert space.fa_modes == ("off", "on", "auto") and space.cache_types == ()  # lossy: opt-in (issue 20.4)
    assert SearchSpace.for_target(chip, MODEL, 512, lossy=True).cache_types == ("f16", "q8_0", "q4_0")
    assert space.cpu_moe_max == 0 and not space.op_offload  # dense; tg: a token is a batch of one


def test_a_cpu_only_node_searches_no_gpu_layers(tmp_path):
    cpuinfo = "".join(f"processor\t: {i}\nmodel name\t: AMD EPYC 9654\ncore id\t: {i}\n\n" for i in range(6))
    (tmp_path / "cpuinfo.txt").write_text(cpuinfo)
    fp = fingerprint_from_dir(tmp_path)
    space = SearchSpace.for_target(fp, MODEL, n_prompt=512)
    assert (space.ngl_max, space.threads_max) == (0, 6)
    assert full_offload(fp, MODEL, space) is None
    assert llama_cpp_python_defaults(fp) == BenchParams(0, 3, 512, 512, n_threads_batch=6)
    assert space.fa_modes == ("off", "on") and not space.op_offload  # no GPU: auto is on, nothing to offload
    assert llama_cpp_defaults(fp, MODEL) == BenchParams(0, 6, 2048, 512, flash_attn="auto")


@pytest.mark.parametrize("objective", ["tg", "pp", "e2e"])
def test_optuna_proposals_stay_inside_and_round_trip_through_optuna_params(objective):
    space = SearchSpace.for_target(simulated.parse_chip("M1 Pro/16"), MODEL, n_prompt=256, objective=objective,
                                   lossy=True)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen_v, seen_tb = set(), set()
    for _ in range(80):
        trial = study.ask()
        params = space.suggest(trial)
        assert 0 <= params.n_gpu_layers <= space.ngl_max and 1 <= params.n_threads <= space.threads_max
        assert params.n_ubatch <= params.n_batch and params.n_batch in space.batch_choices
        assert params.kv_problem is None  # a quantized V only with flash attention on
        seen_v.add(params.type_v)
        seen_tb.add(params.n_threads_batch)
        study.tell(trial, 1.0)
        enqueued = optuna.create_study()
        enqueued.enqueue_trial(space.optuna_params(params))
        assert space.suggest(enqueued.ask()) == params
    assert seen_v == {"f16", "q8_0", "q4_0"}  # the conditional dimension is searched
    if objective == "tg":  # a generated token never runs the batch threads nor a batch above one
        assert seen_tb == {None} and not space.tune_batch
    else:
        assert len(seen_tb) > 2 and space.tune_batch


def test_the_size_counts_each_dimension_with_its_condition():
    space = SearchSpace.for_target(simulated.parse_chip("M1 Pro/16"), MODEL, n_prompt=256, objective="pp",
                                   lossy=True)
    kv = 2 * 3 + 3 * 3  # off/auto: K only; on: K x V
    assert space.op_offload  # a GPU backend, an objective with a prompt
    assert space.switches == ("no_kv_offload",)  # -nkvo: a GPU backend
    assert space.size() == ((space.ngl_max + 1) * space.threads_max * len(space.batch_choices) ** 2
                            * kv * space.threads_max * 2 * 2)


def test_a_stored_space_of_an_older_study_searches_what_it_searched():
    old = {"ngl_max": 33, "threads_max": 10, "batch_choices": [32, 64, 128, 256, 512], "flash_attn": False}
    space = SearchSpace.from_dict(old)
    assert space.fa_modes == () and space.cache_types == () and space.tune_batch and not space.threads_log
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        params = space.suggest(study.ask())
        assert set(params.to_dict()) == {"n_gpu_layers", "n_threads", "n_batch", "n_ubatch", "flash_attn",
                                         "n_threads_batch"}  # the old stored form, for deduplication
        assert params.flash_attn == "off" and params.type_k == params.type_v == "f16"
    legacy = SearchSpace.from_dict({**old, "flash_attn": True})
    enqueued = optuna.create_study()
    enqueued.enqueue_trial({"ngl": 3, "threads": 2, "batch": 64, "ubatch": 64, "flash_attn": True})
    assert legacy.suggest(enqueued.ask()).flash_attn == "on"


def test_experts_on_the_cpu_only_for_a_moe_model_that_does_not_fit():
    moe = simulated.sim_model_info("sim://qwen3-30b-a3b/q4_k_m")  # about 17 GiB
    layout = moe_layout(moe)
    assert layout is not None and layout.n_expert == 128
    assert layout.expert_bytes > 0.9 * moe.size_bytes
    small = simulated.parse_chip("M4 Pro/20/16")  # 12 GiB working set
    big = simulated.parse_chip("M4 Pro/20/64")
    assert SearchSpace.for_target(small, moe, 512, moe=layout).cpu_moe_max == moe.n_layer
    assert SearchSpace.for_target(big, moe, 512, moe=layout).cpu_moe_max == 0
    assert SearchSpace.for_target(small, MODEL, 512, moe=moe_layout(MODEL)).cpu_moe_max == 0  # dense
    # weights that fit a budget but not with --fit's 1 GiB margin: --fit keeps experts back, so does the search
    just = moe.size_bytes + GIB // 4
    assert SearchSpace.for_target(big, moe, 512, moe=layout, gpu_budget=just).cpu_moe_max == moe.n_layer
    assert SearchSpace.for_target(big, moe, 512, moe=layout, gpu_budget=just + GIB).cpu_moe_max == 0
    # and the micro-batch, a memory knob there whatever the objective (its compute buffer buys a layer)
    assert SearchSpace.for_target(big, moe, 512, "tg", moe=layout, gpu_budget=just).tune_batch
    assert not SearchSpace.for_target(big, moe, 512, "tg", moe=layout, gpu_budget=just + GIB).tune_batch
    space = SearchSpace.for_target(small, moe, 512, moe=MoeLayout(128, layout.expert_bytes))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=2))
    proposals = [space.suggest(study.ask()) for _ in range(40)]
    assert all(p.n_cpu_moe == 0 for p in proposals if p.n_gpu_layers == 0)  # nothing to keep back
    assert any(p.n_cpu_moe > 0 for p in proposals)


def test_op_offload_only_on_a_gpu_and_with_a_prompt_in_the_objective(tmp_path):
    cuda = replace(simulated.parse_chip("M2 Max/38"), backend="cuda", gpu_memory_bytes=80 << 30)
    assert SearchSpace.for_target(cuda, MODEL, 512, objective="pp").op_offload
    assert not SearchSpace.for_target(cuda, MODEL, 512, objective="tg").op_offload  # batches of one
    assert SearchSpace.for_target(simulated.parse_chip("M2 Max/38"), MODEL, 512, objective="e2e").op_offload
    cpuinfo = "".join(f"processor\t: {i}\nmodel name\t: AMD EPYC 9654\ncore id\t: {i}\n\n" for i in range(4))
    (tmp_path / "cpuinfo.txt").write_text(cpuinfo)
    assert not SearchSpace.for_target(fingerprint_from_dir(tmp_path), MODEL, 512, objective="pp").op_offload


def test_llama_cpp_defaults_offload_everything_on_the_performance_cores():
    chip = simulated.parse_chip("M2 Max/38/96")  # 8 P + 4 E
    params = llama_cpp_defaults(chip, MODEL, n_prompt=512)
    assert params == BenchParams(n_gpu_layers=33, n_threads=8, n_batch=512, n_ubatch=512, flash_attn="auto")
    assert llama_cpp_defaults(chip, MODEL).n_batch == 2048  # no prompt given: llama.cpp's -b


def test_clip_brings_a_configuration_learnt_elsewhere_inside():
    space = SearchSpace.for_target(simulated.parse_chip("M1/8/16"), MODEL, n_prompt=512, lossy=True)  # 4 P + 4 E
    clipped = space.clip(BenchParams(n_gpu_layers=99, n_threads=24, n_batch=3000, n_ubatch=1000,
                                     n_threads_batch=24, type_v="q8_0", flash_attn="on"))
    # tg: llama.cpp's batch defaults clipped to the prompt; the threads to the 4 P-cores
    assert clipped == BenchParams(n_gpu_layers=33, n_threads=4, n_batch=512, n_ubatch=512, flash_attn="on",
                                  type_v="q8_0")
    assert space.clip(replace(clipped, flash_attn="off")).type_v == "f16"  # needs flash attention on
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
    assert "batch" not in grid  # tg: not searched
    prompt = SearchSpace.for_target(simulated.parse_chip("M2 Ultra/76"), MODEL, n_prompt=512, objective="pp")
    assert set(prompt.grid()["batch"]) <= set(prompt.batch_choices)
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(grid, seed=0))
    for _ in range(5):
        assert space.suggest(study.ask()).kv_problem is None


def test_the_compact_cache_guess_is_flash_attention_on_with_the_smallest_types():
    space = SearchSpace.for_target(simulated.parse_chip("M2 Max/38"), MODEL, 512, lossy=True)
    guess = compact_cache(BenchParams(33, 8, 512, 512, flash_attn="auto"), space)
    assert (guess.flash_attn, guess.type_k, guess.type_v) == ("on", "q4_0", "q4_0")
    assert guess.kv_problem is None and space.clip(guess) == guess
    old = SearchSpace.from_dict({"ngl_max": 33, "threads_max": 8, "batch_choices": [512]})
    assert compact_cache(guess, old) is None


def test_a_tg_study_at_a_depth_fills_the_cache_with_llama_cpps_default_batch():
    """The depth is filled with the trial's batch before tg is timed: clipped to the empty prompt,
    a tg study at depth 8160 filled it 32 tokens at a time (trials timed out on the H200, and with
    -fa off llama.cpp's CUDA backend aborted: docs/cuda-h200/issue15)."""
    chip = simulated.parse_chip("M2 Ultra/76")
    deep = SearchSpace.for_target(chip, MODEL, n_prompt=0, objective="tg", depth=4000)
    assert not deep.tune_batch and deep.default_batch() == (2048, 512)
    assert full_offload(chip, MODEL, deep).n_batch == 512  # llama-cpp-python's, no longer clipped to 32
    assert SearchSpace.for_target(chip, MODEL, n_prompt=0, objective="tg").default_batch() == (32, 32)
    # a prompt objective searches the batch for the prompt's tokens, whatever the depth
    pp = SearchSpace.for_target(chip, MODEL, n_prompt=128, objective="pp", depth=4000)
    assert pp.tune_batch and max(pp.batch_choices) == 128


def test_a_served_spaces_first_design_gives_each_user_a_slot_with_and_without_the_host_prompt_cache():
    from orchestrator.space import obvious_slots, without_prompt_cache
    from workers.trial import ServedWorkload

    chip = simulated.parse_chip("M2 Ultra/76/192")
    space = SearchSpace.for_served(chip, MODEL, n_prompt=280, n_gen=128, served=ServedWorkload(users=48))
    obvious = obvious_slots(llama_cpp_defaults(chip, MODEL), space)
    assert (obvious.n_parallel, obvious.n_ctx, obvious.cache_ram) == (48, 48 * 2048, None)  # 4 x 512 per slot
    uncached = without_prompt_cache(obvious, space)
    assert uncached == replace(obvious, cache_ram=0)
    clipped = space.clip(uncached)  # as the study enqueues it: batches up to what a request's prompt fills
    assert space.suggest(_enqueued(space, clipped)) == clipped and clipped.cache_ram == 0
    plain = SearchSpace.for_target(chip, MODEL, n_prompt=280)
    assert without_prompt_cache(obvious, plain) is None and obvious_slots(obvious, plain) is None


def _enqueued(space: SearchSpace, params: BenchParams):
    study = optuna.create_study()
    study.enqueue_trial(space.optuna_params(params))
    return study.ask()
