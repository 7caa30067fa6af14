"""A GPU memory budget (issue 23.1): one estimate of what a configuration places on the GPU, the
user's budget checked against the device, and a study that never loads a configuration over it."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from functools import partial

import pytest
from click.testing import CliRunner

from orchestrator import learn
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.studies import ChipTarget, StudyConfig, StudyPaused, StudyRunner
from orchestrator.virtual import VirtualFleet
from workers import llamatools, placement, simulated
from workers.errors import BadInput
from workers.hardware import GIB, parse_compute_apps
from workers.models import ARCH_SHAPES
from workers.trial import BenchParams, Workload

CHIP = simulated.parse_chip("M2 Max/38/64")  # a 48 GiB working set
DENSE = simulated.sim_model_info("sim://llama2-13b/q4_0")  # about 6.9 GiB of weights


def test_sizes_parse_in_both_unit_systems_and_anything_else_is_refused():
    assert placement.parse_size("8GiB") == 8 * GIB
    assert placement.parse_size("16 GB") == 16 * 1000**3
    assert placement.parse_size("8192MiB") == 8 * GIB
    assert placement.parse_size("1.5g") == 1_500_000_000
    for bad in ("", "abc", "-1GiB", "8XB", "8 GiB GiB"):
        with pytest.raises(BadInput):
            placement.parse_size(bad)


def test_a_budget_is_positive_and_no_more_than_the_gpu_has():
    assert placement.parse_budget("8GiB", CHIP) == 8 * GIB
    for bad in ("0", "0GiB", "49GiB", "1TiB"):
        with pytest.raises(BadInput):
            placement.parse_budget(bad, CHIP)
    with pytest.raises(BadInput, match="no GPU"):
        placement.parse_budget("8GiB", replace(CHIP, gpu_offload=False))


def test_the_estimate_counts_offloaded_layers_their_cache_and_experts_kept_on_the_cpu():
    shape = ARCH_SHAPES["qwen3-30b-a3b"]
    full = placement.gpu_need(shape, BenchParams(n_gpu_layers=99), 4096)
    half = placement.gpu_need(shape, BenchParams(n_gpu_layers=24), 4096)
    assert half.weights < full.weights / 2 and half.kv_cache == pytest.approx(full.kv_cache / 2)
    moe = placement.gpu_need(shape, BenchParams(n_gpu_layers=99, n_cpu_moe=48), 4096)
    assert moe.weights < full.weights / 10  # the experts are nearly all of a MoE's weights
    no_kv = placement.gpu_need(shape, BenchParams(n_gpu_layers=99, no_kv_offload=True), 4096)
    assert no_kv.kv_cache == 0 and no_kv.weights == full.weights
    assert placement.gpu_need(shape, BenchParams(n_gpu_layers=0), 4096).total == 0


def runner(url: str, **cfg) -> StudyRunner:
    fleet = VirtualFleet(CHIP, 2, trial_s=0.0, prefix="node", seed=3)
    config = StudyConfig(model=DENSE, workload=Workload(512, 128, 2), n_trials=12, sampler="tpe", seed=1, **cfg)
    return StudyRunner(open_database(url), fleet, config, ChipTarget(CHIP, {}, simulated=True),
                       alive_nodes=partial(fleet.alive_nodes, CHIP.chip_key))


def test_a_study_never_loads_a_configuration_over_its_budget(sqlite_url):
    budget = 4 * GIB  # about 60 % of the model's weights
    run = runner(sqlite_url, gpu_budget="4GiB", name="budget")
    run.run()
    with run.db.session() as s:
        search = repo.study_trials(s, run.study_id, "search")
    assert len(search) == 12
    n_ctx = 512 + 128
    needs = [placement.gpu_need(DENSE, BenchParams.from_dict(r.params), n_ctx).total for r in search]
    assert max(needs) <= budget  # nothing over it was dispatched ...
    assert any(n > budget / 2 for n in needs)  # ... and the search still used the GPU
    refused = [t for t in run.optuna_study.trials if "over the GPU budget" in str(t.user_attrs.values())]
    assert refused  # the sampler proposed some and was told the penalty instead
    assert run.space.gpu_budget_bytes == budget  # stored with the study: a resumed one keeps it


def test_a_bad_budget_is_one_line_and_exit_2(tmp_path):
    for bad in ("0", "-1", "lots"):
        result = CliRunner().invoke(main, ["tune", "sim://llama2-7b/q4_0", "--chip", "M2 Max/38/64",
                                           "--gpu-budget", bad, "--trials", "1", "--db",
                                           f"sqlite:///{tmp_path}/b.db"])
        assert result.exit_code == 2, result.output
        assert "--gpu-budget" in result.output and len(result.output.strip().splitlines()) == 1


def test_llama_cpps_gpu_buffers_are_read_from_its_log():
    from workers.bench import gpu_buffer_bytes

    cuda = ("load_tensors:   CPU_Mapped model buffer size =   281.81 MiB\n"
            "load_tensors:        CUDA0 model buffer size =  4155.99 MiB\n"
            "llama_context:  CUDA_Host  output buffer size =     0.49 MiB\n"
            "llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB\n"
            "sched_reserve:      CUDA0 compute buffer size =   258.50 MiB\n"
            "sched_reserve:  CUDA_Host compute buffer size =    24.01 MiB\n")
    assert gpu_buffer_bytes(cuda) == int((4155.99 + 512 + 258.5) * 1024**2)
    metal = ("load_tensors: Metal_Mapped model buffer size =  4096.00 MiB\n"
             "llama_kv_cache:        Metal KV buffer size =   256.00 MiB\n")
    assert gpu_buffer_bytes(metal) == (4096 + 256) * 1024**2
    cpu = ("load_tensors:   CPU_Mapped model buffer size =    92.10 MiB\n"
           "llama_kv_cache:        CPU KV buffer size =    11.25 MiB\n")
    assert gpu_buffer_bytes(cpu) == 0


class GpuMemoryFleet(VirtualFleet):
    """The virtual fleet, where ``alter`` changes what a trial with GPU memory reports (llama.cpp
    allocating more than the estimate, a driver counting a CUDA context beside it)."""

    def __init__(self, alter, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.alter = alter

    def result(self, ref: int, trial_key: str):
        result = super().result(ref, trial_key)
        if result.ok:  # -ngl 0 too: a CUDA build holds its context and buffers there all the same
            self.alter(result)
        return result


def budget_study(url: str, alter, name: str, n_trials: int, budget: str = "6GiB") -> StudyRunner:
    """A simulated study of the dense model under a budget (6 GiB) on a GpuMemoryFleet."""
    fleet = GpuMemoryFleet(alter, CHIP, 2, trial_s=0.0, prefix="node", seed=3)
    config = StudyConfig(model=DENSE, workload=Workload(512, 128, 2), n_trials=n_trials, sampler="tpe", seed=1,
                         gpu_budget=budget, name=name)
    return StudyRunner(open_database(url), fleet, config, ChipTarget(CHIP, {}, simulated=True),
                       alive_nodes=partial(fleet.alive_nodes, CHIP.chip_key))


def test_a_trial_that_ran_over_the_budget_fails_whatever_its_speed(sqlite_url):
    def twice(result):  # llama.cpp allocates twice what the estimate says (wrong for this build, say)
        result.gpu_bytes *= 2

    run = budget_study(sqlite_url, twice, "over", 8)
    with contextlib.suppress(StudyPaused):  # its failure budget spent: what it measured is kept all the same
        run.run()
    with run.db.session() as s:
        rows = [r for r in repo.study_trials(s, run.study_id) if r.gpu_bytes]
    over = [r for r in rows if r.gpu_bytes > 6 * GIB]
    assert over and all(r.state == "failed" and r.failure_kind == "over budget" for r in over)
    assert all("over the GPU budget" in r.error for r in over)
    assert all(r.state == "complete" for r in rows if r.gpu_bytes <= 6 * GIB and r.phase == "search")


CUDA_CONTEXT = 3 * GIB // 4  # about 0.5 GiB on the H200 (issue 23's leases)


def test_the_drivers_count_is_stored_and_its_overhead_refused_before_loading(sqlite_url):
    def with_context(result):  # the GPU's driver holds a CUDA context beside llama.cpp's buffers
        result.gpu_device_bytes = result.gpu_bytes + CUDA_CONTEXT

    run = budget_study(sqlite_url, with_context, "context", 6)
    run.run()
    assert run.device_overhead_bytes == CUDA_CONTEXT  # learnt from the trials it measured
    with run.db.session() as s:
        measured = [r for r in repo.study_trials(s, run.study_id) if r.gpu_device_bytes]
    assert measured and all(r.gpu_device_bytes == r.gpu_bytes + CUDA_CONTEXT for r in measured)
    # a placement that fits the budget by llama.cpp's buffers alone, not with the context beside them
    n_ctx = 512 + 128
    between = [BenchParams(n_gpu_layers=n, n_threads=4) for n in range(DENSE.n_layer + 2)
               if 6 * GIB - CUDA_CONTEXT < placement.gpu_need(DENSE, BenchParams(n_gpu_layers=n), n_ctx).total
               <= 6 * GIB]
    assert between
    assert run.space.over_budget(between[0], DENSE, n_ctx) is None
    assert "the driver holds beside them" in run._refusal(between[0])


def test_the_budgets_edge_is_measured_once_the_drivers_overhead_is_known(sqlite_url):
    """Beside --fit's placement (1 GiB kept free) the study measures the most GPU layers that its
    estimate lets in beside the driver's measured overhead: within the budget, and where the
    optimum of a model that does not fit usually is (docs/benchmarks.md, "Against measured landscapes")."""
    def with_context(result):
        result.gpu_device_bytes = result.gpu_bytes + CUDA_CONTEXT

    run = budget_study(sqlite_url, with_context, "edge", 5)
    run.run()
    n_ctx = 512 + 128
    edge = placement.fit(DENSE, BenchParams(n_gpu_layers=DENSE.n_layer + 1), n_ctx, 6 * GIB, margin=CUDA_CONTEXT)
    fit = placement.fit(DENSE, BenchParams(n_gpu_layers=DENSE.n_layer + 1), n_ctx, 6 * GIB)
    assert edge.n_gpu_layers > fit.n_gpu_layers  # the overhead is less than --fit's margin
    with run.db.session() as s:
        search = [r for r in repo.study_trials(s, run.study_id) if r.phase == "search"]
    layers = [r.params["n_gpu_layers"] for r in search]
    assert edge.n_gpu_layers in layers[:4]  # after full offload (refused), the defaults (the same) and --fit's
    at_edge = next(r for r in search if r.params["n_gpu_layers"] == edge.n_gpu_layers)
    assert at_edge.state == "complete" and at_edge.gpu_device_bytes <= 6 * GIB


def test_the_overhead_is_counted_beyond_the_estimate_so_its_error_is_in_it(sqlite_url):
    """llama.cpp allocating 2 % more than the estimate says (as the H200's MoE did, 1.1 % at the
    budget's edge) is part of the overhead the next configurations are refused with."""
    def more_and_context(result):
        result.gpu_bytes = int(result.gpu_bytes * 1.02)
        result.gpu_device_bytes = result.gpu_bytes + CUDA_CONTEXT

    run = budget_study(sqlite_url, more_and_context, "estimate-error", 4)
    run.run()
    with run.db.session() as s:
        largest = max(r.gpu_bytes for r in repo.study_trials(s, run.study_id) if r.gpu_bytes)
    assert run.device_overhead_bytes >= CUDA_CONTEXT + 0.9 * (largest - largest / 1.02)


def test_a_smaller_micro_batch_that_buys_a_layer_is_measured_at_the_edge(sqlite_url):
    """Under a budget the micro-batch is a memory knob in a tg study too: where halving it frees
    the compute buffer a layer needs, that placement is measured beside the default micro-batch's
    (the 14B under 8 GiB on the H200: every layer at -ub 256, 4.9x --fit in tg; -ub 512, 3.0x)."""
    def with_context(result):
        result.gpu_device_bytes = result.gpu_bytes + CUDA_CONTEXT

    n_ctx = 512 + 128

    def edge(budget: int, ubatch: int) -> BenchParams:
        full = BenchParams(n_gpu_layers=DENSE.n_layer + 1, n_ubatch=ubatch)
        return placement.fit(DENSE, full, n_ctx, budget, margin=CUDA_CONTEXT)

    budget = next(b for b in range(5 * GIB, 7 * GIB, 16 << 20)
                  if edge(b, 256).n_gpu_layers > edge(b, 512).n_gpu_layers)
    run = budget_study(sqlite_url, with_context, "micro-batch", 5, budget=str(budget))
    outcome = run.run()
    assert run.space.tune_batch and str(run.objective) == "tg"
    with run.db.session() as s:
        search = [r for r in repo.study_trials(s, run.study_id) if r.phase == "search"]
    placed = [(r.params["n_gpu_layers"], r.params["n_ubatch"]) for r in search]
    assert (edge(budget, 256).n_gpu_layers, 256) in placed[:5]
    at_edge = next(r for r in search if (r.params["n_gpu_layers"], r.params["n_ubatch"]) == (edge(budget, 256).n_gpu_layers, 256))
    assert at_edge.state == "complete" and at_edge.gpu_device_bytes <= budget
    rec = outcome.recommendation.params  # the most layers win here; the micro-batch that bought one stays
    assert (rec.n_gpu_layers, rec.n_ubatch) == (edge(budget, 256).n_gpu_layers, 256)


OP_OFFLOAD_BUFFER = 2 * GIB // 5  # llama.cpp's compute buffer at -ngl 0 (180-395 MiB on the H200)


def test_a_trial_with_no_gpu_layers_adds_only_what_the_driver_holds_beyond_llama_cpps_buffers(sqlite_url):
    """At -ngl 0 the estimate counts nothing on the GPU, yet llama.cpp allocates op offload's compute
    buffer there: the overhead is the driver's count beyond that buffer, the same as beside a GPU
    layer's, so the first trial (llama-cpp-python's -ngl 0) does not push the budget's edge back."""
    def buffer_and_context(result):
        if not result.gpu_bytes:  # -ngl 0
            result.gpu_bytes = OP_OFFLOAD_BUFFER
        result.gpu_device_bytes = result.gpu_bytes + CUDA_CONTEXT

    run = budget_study(sqlite_url, buffer_and_context, "cpu-buffer", 5)
    run.run()
    with run.db.session() as s:
        trials = repo.study_trials(s, run.study_id)
    assert any(r.params["n_gpu_layers"] == 0 and r.gpu_device_bytes for r in trials)
    assert run.device_overhead_bytes == CUDA_CONTEXT
    edge = placement.fit(DENSE, BenchParams(n_gpu_layers=DENSE.n_layer + 1), 512 + 128, 6 * GIB, margin=CUDA_CONTEXT)
    assert edge.n_gpu_layers in [r.params["n_gpu_layers"] for r in trials if r.phase == "search"][:4]


def test_a_trial_over_the_budget_by_the_drivers_count_fails_over_budget():
    from orchestrator.studies import over_gpu_budget
    from workers.trial import TrialResult

    result = TrialResult(trial_key="t", ok=True, gpu_bytes=5 * GIB, gpu_device_bytes=6 * GIB + CUDA_CONTEXT)
    assert "the GPU's driver counted 6.75 GiB" in over_gpu_budget(result, 6 * GIB)
    assert over_gpu_budget(result, 7 * GIB) is None and over_gpu_budget(result, None) is None
    no_counter = TrialResult(trial_key="t", ok=True, gpu_bytes=7 * GIB)  # a Mac: llama.cpp's buffers decide
    assert "llama.cpp allocated 7.00 GiB" in over_gpu_budget(no_counter, 6 * GIB)


def test_nvidia_smis_count_for_one_process():
    apps = "4242, 7955\n4243, 512\n4242, 100\n977, [N/A]\n"  # a row per process and GPU, MiB
    assert parse_compute_apps(apps, 4242) == (7955 + 100) * 1024**2
    assert parse_compute_apps(apps, 977) is None and parse_compute_apps(apps, 1) is None
    assert parse_compute_apps("", 4242) is None


def test_fit_is_llama_cpps_placement_on_the_estimate():
    shape = ARCH_SHAPES["qwen3-30b-a3b"]
    base = BenchParams(n_gpu_layers=99, n_threads=4)
    assert placement.fit(shape, base, 640, 64 * GIB).n_gpu_layers == shape.n_layer + 1  # it fits: all of it
    moe = placement.fit(shape, base, 640, 12 * GIB)  # the experts of the first layers go to the CPU
    assert moe.n_gpu_layers == shape.n_layer + 1 and 0 < moe.n_cpu_moe < shape.n_layer
    assert placement.gpu_need(shape, moe, 640).total <= 11 * GIB  # 1 GiB left free, as --fit-target's default
    fewer = replace(moe, n_cpu_moe=moe.n_cpu_moe - 1)
    assert placement.gpu_need(shape, fewer, 640).total > 11 * GIB  # and no expert more would fit
    dense = placement.fit(ARCH_SHAPES["qwen3-14b"], base, 640, 4 * GIB)
    assert 0 < dense.n_gpu_layers < ARCH_SHAPES["qwen3-14b"].n_layer and dense.n_cpu_moe == 0
    assert placement.fit(ARCH_SHAPES["qwen3-14b"], base, 640, 1 * GIB) is None  # nothing fits in no room


def test_a_simulated_16gb_mac_places_a_moe_that_does_not_fit_and_beats_fit(sqlite_url):
    """Issue 23's simulated check: Qwen3-30B-A3B (Q4_K_M, about 17 GiB) on a 16 GB M2 Pro (a
    12 GiB working set): the study keeps experts on the CPU, never exceeds the working set, and
    its recommendation is at least as fast as llama.cpp's --fit placement of the same model."""
    from orchestrator.space import llama_cpp_defaults

    chip = simulated.parse_chip("M2 Pro/19/16")
    model = simulated.sim_model_info("sim://qwen3-30b-a3b/q4_k_m")
    shape = simulated.model_shape("qwen3-30b-a3b", "q4_k_m")
    fleet = VirtualFleet(chip, 2, trial_s=0.0, prefix="node", seed=3)
    config = StudyConfig(model=model, workload=Workload(512, 128, 2), n_trials=30, sampler="tpe", seed=1, name="moe")
    run = StudyRunner(open_database(sqlite_url), fleet, config, ChipTarget(chip, {}, simulated=True),
                      alive_nodes=partial(fleet.alive_nodes, chip.chip_key))
    outcome = run.run()
    working_set = placement.gpu_working_set(chip)
    with run.db.session() as s:
        measured = [r for r in repo.study_trials(s, run.study_id) if r.state == "complete"]
    assert all(r.gpu_bytes <= working_set for r in measured)
    rec = outcome.recommendation
    best = rec.params
    split = 0 < best.n_gpu_layers <= shape.n_layer or best.n_cpu_moe > 0
    assert best.n_gpu_layers > 0 and split  # the model placed: some of it on each side
    defaults = llama_cpp_defaults(chip, model, 512)  # a memory knob here, left at llama.cpp's where they fit
    assert (best.n_batch, best.n_ubatch) == (defaults.n_batch, defaults.n_ubatch)
    fitted = placement.fit(shape, llama_cpp_defaults(chip, model, 512), 640, working_set)
    assert outcome.baselines[learn.FIT] == fitted  # issue 23.3: --fit's placement, measured beside the others
    ours, theirs = (simulated.predict(chip, shape, p, 512, 128).tg_tps for p in (best, fitted))
    print(f"recommendation {best.llama_cpp_flags()}: {ours:.2f} tok/s; --fit {fitted.llama_cpp_flags()}: {theirs:.2f}")
    assert ours >= theirs, (best, fitted, ours, theirs)
    # llama.cpp's plain defaults do not fit: recorded as failed, not replaced; the claims are over --fit
    with run.db.session() as s:
        baselines = {r.confirm_arm: r for r in repo.study_trials(s, run.study_id, "baseline")}
    assert baselines[learn.LLAMA_CPP].state == "failed" and "out of memory" in baselines[learn.LLAMA_CPP].error
    assert baselines[learn.FIT].state == "complete"
    assert rec.claims["reference"] == learn.FIT and learn.LLAMA_CPP not in rec.claims["vs"]
    assert rec.claims["vs"][learn.FIT]["verdict"] == "faster" and "over llama.cpp's --fit" in rec.claims["outcome"]
    assert rec.claims["noise"]["rounds"] >= 3  # the A/A arm is --fit's placement measured twice a round


def test_llama_cpps_defaults_over_a_budget_are_refused_before_loading_and_fit_is_the_reference(sqlite_url):
    """With --gpu-budget, llama.cpp's defaults (every layer) that do not fit are never loaded: one
    failed baseline trial with the reason; llama.cpp's --fit for that budget is a baseline, and
    every claim of the study is made against it (issue 23.3)."""
    run = runner(sqlite_url, gpu_budget="4GiB", name="fitref")
    outcome = run.run()
    with run.db.session() as s:
        baselines = {r.confirm_arm: r for r in repo.study_trials(s, run.study_id, "baseline")}
        confirm_arms = {r.confirm_arm for r in repo.study_trials(s, run.study_id, "confirm")}
    refused = baselines[learn.LLAMA_CPP]
    assert refused.state == "failed" and refused.failure_kind == "over budget"
    assert "over the GPU budget" in refused.error and refused.node_id is None  # never dispatched
    fitted = outcome.baselines[learn.FIT]
    assert 0 < fitted.n_gpu_layers < DENSE.n_layer  # as many whole layers as the budget holds
    assert placement.gpu_need(DENSE, fitted, 640).total <= 4 * GIB - placement.FIT_MARGIN_BYTES
    assert learn.LLAMA_CPP not in confirm_arms and {learn.FIT, learn.noise_arm(learn.FIT)} <= confirm_arms
    claims = outcome.recommendation.claims
    assert claims["reference"] == learn.FIT and learn.FIT in claims["vs"] or claims["winner"] == learn.FIT
    assert claims["fit_source"] == "fleettune's estimate of llama.cpp's --fit (no real node to ask)"
    result = CliRunner().invoke(main, ["best", "--model", DENSE.path, "--db", sqlite_url, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["fit_source"] == claims["fit_source"]  # printed with the claims


# llama-fit-params' placement of the synthetic Qwen3-30B-A3B Q4_0 for an 8 GiB budget on the H200
# (docs/cuda-h200/issue23: pp512's, -fitc 512): layer 17 split (its ffn_down), 18-47 whole, and a
# blk.48 that names no tensor of a 48-layer model
H200_FIT_OVERRIDES = (r"blk\.17\.ffn_down.*=CPU",
                      *(rf"blk\.{n}\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU" for n in range(18, 49)))


def test_llama_fit_params_placement_in_the_knob_tables_terms():
    """llama.cpp's --fit keeps the last layers' experts on the CPU by -ot patterns; in knob terms
    that is -ncmoe of as many layers (a split layer counted whole, so it never needs more GPU
    memory than llama.cpp's own), every layer offloaded (issue 23.3)."""
    moe = simulated.sim_model_info("sim://qwen3-30b-a3b/q4_0")
    base = BenchParams(n_gpu_layers=moe.n_layer + 1, n_threads=16, n_batch=512, n_ubatch=512, flash_attn="auto")
    fitted = llamatools.FitPlacement(512, 49, H200_FIT_OVERRIDES)
    placed = placement.from_llama_fit(fitted, base, moe)
    assert (placed.n_gpu_layers, placed.n_cpu_moe) == (49, 31)
    assert replace(placed, n_gpu_layers=base.n_gpu_layers, n_cpu_moe=base.n_cpu_moe) == base  # nothing else moved
    # not even the layers without their experts fit: some layers offloaded, with every expert on the CPU
    partial = llamatools.FitPlacement(512, 10, tuple(rf"blk\.{n}\.ffn_(up|down|gate)_(ch|)exps=CPU" for n in range(38, 48)))
    few = placement.from_llama_fit(partial, base, moe)
    assert (few.n_gpu_layers, few.n_cpu_moe) == (10, moe.n_layer)
    assert placement.gpu_need(moe, few, 512).weights < placement.gpu_need(moe, replace(few, n_cpu_moe=9), 512).weights
    gpu = llamatools.FitPlacement(512, 49, ("blk.40.ffn_up_exps=CUDA0",))  # not a CPU buffer: not counted
    assert placement.from_llama_fit(gpu, base, moe).n_cpu_moe == 0
    dense = ARCH_SHAPES["qwen3-14b"]
    split = llamatools.FitPlacement(512, 30, (r"blk\.29\.ffn_down=CPU",))  # a dense layer split: kept off
    assert placement.from_llama_fit(split, base, dense).n_gpu_layers == 29
    assert placement.from_llama_fit(llamatools.FitPlacement(512, 30), base, dense).n_gpu_layers == 30
    whole = llamatools.FitPlacement(512, dense.n_layer + 1)  # it all fits: the defaults as they are
    assert placement.from_llama_fit(whole, base, dense) == placement.fit(dense, base, 512, 64 * GIB)


def test_a_node_plans_fit_with_its_own_llama_fit_params_or_says_why_not(monkeypatch):
    from workers import agent

    monkeypatch.setattr(llamatools, "find_tool", lambda name: None)
    assert agent.plan_fit("/m.gguf", 640, 8 * GIB) == {"error": "no llama-fit-params on the node"}
    monkeypatch.setattr(llamatools, "find_tool", lambda name: "/bin/true")
    monkeypatch.setattr(placement, "gpu_free_bytes", lambda: None)
    assert "free memory is unknown" in agent.plan_fit("/m.gguf", 640, 8 * GIB)["error"]  # -fitt cannot be set
    seen = []
    monkeypatch.setattr(placement, "run_fit_params",
                        lambda argv, timeout_s: seen.append(argv) or llamatools.FitPlacement(640, 20))
    monkeypatch.setattr(placement, "gpu_free_bytes", lambda: 100 * GIB)
    answer = agent.plan_fit("/m.gguf", 640, 8 * GIB)
    assert answer == {"tool": "/bin/true", "n_ctx": 640, "n_gpu_layers": 20, "overrides": ()}
    # it leaves free all the device has but the budget less --fit's 1 GiB margin: 100 - 8 + 1 GiB
    assert seen[0][seen[0].index("-fitt") + 1] == str(93 * 1024) and seen[0][seen[0].index("-fitc") + 1] == "640"


def test_a_real_chips_fit_baseline_is_llama_fit_params_on_its_node(sqlite_url, monkeypatch):
    """Where a node of the chip answers with llama-fit-params' placement, the --fit baseline is
    that placement and the claims say so; where none does, the estimate, with the reason."""
    from orchestrator import studies

    moe = simulated.sim_model_info("sim://qwen3-30b-a3b/q4_0")
    config = StudyConfig(model=moe, workload=Workload(512, 0, 2), n_trials=4, sampler="tpe", seed=1)
    fleet = VirtualFleet(CHIP, 1, trial_s=0.0)
    run = StudyRunner(open_database(sqlite_url), fleet, config, ChipTarget(CHIP, {}, ray_nodes=("node-a",)),
                      alive_nodes=partial(fleet.alive_nodes, CHIP.chip_key))
    defaults = run.baselines[learn.LLAMA_CPP]
    asked = []

    def ask(function, node_ids, timeout_s, args):
        asked.append((function.__name__, node_ids, args(node_ids[0])))
        return {node_ids[0]: {"tool": "/x/llama-fit-params", "n_ctx": 512, "n_gpu_layers": 49,
                              "overrides": list(H200_FIT_OVERRIDES)}}

    monkeypatch.setattr(studies.dispatch, "ask_nodes", ask)
    placed = run._fit_baseline(8 * GIB)
    assert asked == [("plan_fit", ["node-a"], (moe.path, 512, 8 * GIB))]
    assert (placed.n_gpu_layers, placed.n_cpu_moe) == (49, 31) and run.fit_source.startswith("llama-fit-params on node")
    # llama.cpp's own plan is not refused by fleettune's estimate (its measured buffers still decide)
    run.baselines[learn.FIT] = placed
    assert run._refusal(placed) is None
    monkeypatch.setattr(studies.dispatch, "ask_nodes", lambda *a, **k: {"node-a": {"error": "no llama-fit-params on the node"}})
    estimated = run._fit_baseline(8 * GIB)
    assert estimated == placement.fit(moe, defaults, 512, 8 * GIB)
    assert run.fit_source == "fleettune's estimate of llama.cpp's --fit (no llama-fit-params on the node)"
    asked.clear()
    monkeypatch.setattr(studies.dispatch, "ask_nodes", ask)
    assert run._fit_baseline(200 * GIB) is None and not asked  # the defaults fit: no node is asked


def test_where_llama_cpps_defaults_fit_the_budget_fit_is_not_a_second_baseline(sqlite_url):
    """--fit changes nothing where everything fits: one configuration, measured once."""
    run = runner(sqlite_url, gpu_budget="16GiB", name="fits")
    outcome = run.run()
    assert learn.FIT not in outcome.baselines and outcome.recommendation.claims["reference"] == learn.LLAMA_CPP


def test_a_resumed_study_keeps_its_budget_and_refuses_another(sqlite_url):
    runner(sqlite_url, gpu_budget="4GiB", name="kept").run()
    resumed = runner(sqlite_url, gpu_budget="8GiB", name="kept", resume=True)
    with pytest.raises(BadInput, match="created with a GPU budget of 4.00 GiB"):
        resumed.prepare()
    same = runner(sqlite_url, name="kept", resume=True)  # no --gpu-budget: the stored one holds
    same.prepare()
    assert same.space.gpu_budget_bytes == 4 * GIB
    first = learn.stored_baselines(same._phase_trials("baseline"))[learn.FIT]
    assert same.baselines[learn.FIT] == first  # and the --fit it measured first: one per study


def test_a_resumed_study_keeps_the_fit_placement_it_measured_first(sqlite_url, monkeypatch):
    """Whatever --fit would place now (another planner answered, the node's free memory moved), a
    resumed study's --fit baseline is the one it measured, which its claims and verify name."""
    runner(sqlite_url, gpu_budget="4GiB", name="firstfit").run()
    planned = []
    moved = partial(lambda fit, *a, **k: planned.append(a) or replace(fit(*a, **k), n_gpu_layers=1), placement.fit)
    monkeypatch.setattr(placement, "fit", moved)
    resumed = runner(sqlite_url, gpu_budget="4GiB", name="firstfit", resume=True)
    resumed.prepare()
    first = learn.stored_baselines(resumed._phase_trials("baseline"))[learn.FIT]
    assert first.n_gpu_layers > 1 and resumed.baselines[learn.FIT] == first
    assert planned == []  # nothing planned anew, no node asked: the stored placement is the baseline
    assert resumed.fit_source.startswith("the placement this study measured first, kept on resume")


def test_a_server_whose_kv_cache_cannot_fit_is_refused_before_it_runs():
    """Issue 22.3: every slot's context is allocated at start; unified memory holds weights and KV
    together, a discrete GPU holds its own share and leaves the host the rest."""
    from dataclasses import replace

    from workers import simulated
    from workers.placement import GIB, served_context, served_memory_problem
    from workers.trial import BenchParams

    shape = simulated.model_shape("llama3-8b", "q4_0")
    cpu = BenchParams(n_threads=8)
    assert served_context(shape, cpu) == shape.context_length  # llama-server's default: the model's
    assert served_memory_problem(shape, replace(cpu, n_parallel=4, n_ctx=4 * 4096), 32 * GIB, None) is None
    big = replace(cpu, n_parallel=64, n_ctx=64 * 8192)  # 64 GiB of f16 KV cache
    assert "does not fit memory" in served_memory_problem(shape, big, 32 * GIB, None)
    on_gpu = replace(big, n_gpu_layers=shape.n_layer + 1)
    assert "does not fit the GPU" in served_memory_problem(shape, on_gpu, 128 * GIB, 40 * GIB)
    assert served_memory_problem(shape, on_gpu, 32 * GIB, 140 * GIB, discrete_gpu=True) is None  # in VRAM
    assert "does not fit memory" in served_memory_problem(shape, on_gpu, 32 * GIB, 140 * GIB)  # unified: RAM
