"""The calibrated Apple Silicon model: calibration table, generalisation, physics, the seed scenario."""

from __future__ import annotations

from dataclasses import replace

import pytest

from workers import simulated
from workers.errors import BadInput
from workers.simulated import (
    SimulatedNode,
    calibration_rows,
    model_shape,
    optimum,
    parse_chip,
    predict,
)
from workers.trial import BenchParams, TrialSpec, Workload

FULL = BenchParams(n_gpu_layers=99, n_threads=4, n_batch=2048, n_ubatch=512)  # llama-bench -ngl 99


def test_calibration_table_every_full_offload_row_within_15_percent(capsys):
    rows, worst = [], 0.0
    for r in calibration_rows():
        pred = predict(r["chip"], model_shape("llama2-7b", r["quant"]), FULL)
        for test, got, want in (("pp512", pred.pp_tps, r["pp512"]), ("tg128", pred.tg_tps, r["tg128"])):
            err = got / want - 1
            worst = max(worst, abs(err))
            rows.append(f"{r['chip'].family:9} {r['chip'].gpu_cores:3}g {r['quant']:5} {test}  "
                        f"predicted {got:8.2f}  measured {want:8.2f}  error {err:+6.1%}")
    with capsys.disabled():
        print("\n" + "\n".join(rows) + f"\nworst error {worst:.1%} over {len(rows)} values")
    assert len(rows) == 2 * 45  # every reported cell of the public table
    assert worst <= 0.15


@pytest.mark.parametrize(
    "chip, pp, tg",
    [  # public llama-bench figures (LLaMA-2 7B Q4_0, full offload) for chips the fit never saw
        ("M3 Max/40", 759.7, 66.3),
        ("M4 Max/40", 885.7, 83.1),
        ("M4 Pro/20", 449.6, 50.7),
        ("M3 Pro/18", 341.7, 30.7),
    ],
)
def test_the_same_physics_holds_for_m3_and_m4(chip, pp, tg):
    pred = predict(parse_chip(chip + "/128"), model_shape("llama2-7b", "q4_0"), FULL)
    assert pred.pp_tps == pytest.approx(pp, rel=0.25)
    assert pred.tg_tps == pytest.approx(tg, rel=0.25)


def test_threads_on_e_cores_slow_the_whole_step():
    chip = parse_chip("M2 Max/38/96")  # 8 P + 4 E cores
    shape = model_shape("llama2-7b", "q4_0")

    def cpu_tg(threads):
        return predict(chip, shape, BenchParams(n_gpu_layers=0, n_threads=threads, n_batch=512,
                                                n_ubatch=512)).tg_tps

    assert cpu_tg(8) > 1.8 * cpu_tg(4)  # P-cores scale
    assert cpu_tg(12) < cpu_tg(8) / 3  # the field: 18 -> 5 tok/s going from 8 to 12 threads
    assert cpu_tg(8) == pytest.approx(18, rel=0.2)
    assert cpu_tg(16) < cpu_tg(12)  # more threads than cores is worse still


def test_cpu_threads_stop_scaling_at_the_bandwidth_limit():
    from dataclasses import replace

    # an M1 Max whose memory were as slow as 60 GB/s: its 8 P-cores could stream more than that
    chip = replace(parse_chip("M1 Max/32/64"), bandwidth_gbs=60)
    shape = model_shape("llama2-7b", "q4_0")
    rates = [predict(chip, shape, BenchParams(0, t, 512, 512)).tg_tps for t in (2, 4, 6, 8)]
    assert rates[1] > 1.9 * rates[0]  # scales with P-cores while bandwidth lasts
    assert rates[3] == pytest.approx(rates[2])  # then stops at the CPU's bandwidth share


def test_a_gpu_share_beyond_the_working_set_fails_like_oom():
    chip = parse_chip("M2/8/8")
    f16 = model_shape("llama2-7b", "f16")  # 12.5 GiB of weights on an 8 GB machine
    pred = predict(chip, f16, FULL)
    assert not pred.fits and "out of memory" in pred.reason
    assert predict(chip, f16, BenchParams(0, 4, 512, 512)).fits  # on the CPU it only swaps


def test_seed_scenario_reproduces_the_interior_optimum_on_m2_ultra():
    chip = parse_chip("M2 Ultra/76/192")
    shape = model_shape("llama3-8b", "q4_k_m")
    by_ngl = {ngl: predict(chip, shape, BenchParams(ngl, 8, 512, 512), scenario="seed").tg_tps
              for ngl in range(0, 34)}
    best = max(by_ngl, key=by_ngl.get)
    assert 22 <= best <= 26 and 50 <= by_ngl[best] <= 60
    assert by_ngl[33] < by_ngl[best] * 0.95  # full offload is worse
    calibrated = {ngl: predict(chip, shape, BenchParams(ngl, 8, 512, 512)).tg_tps for ngl in (24, 33)}
    assert calibrated[33] > calibrated[24]  # the default scenario prefers full offload


def test_optimum_is_the_best_of_the_grid():
    chip = parse_chip("M1 Pro/16/32")
    shape = model_shape("llama2-7b", "q4_0")
    params, pred, value = optimum(chip, shape, "tg")
    assert value == pred.tg_tps
    for other in simulated.search_grid(chip, shape):
        assert predict(chip, shape, other).tg_tps <= value + 1e-9


def test_the_public_rows_of_the_newer_dimensions(capsys):
    """Each fitted row reproduces its measured ratio to its base row (or its figure); rows never
    fitted (checks) are predictions, within the tolerance the M3/M4 generalisation has."""
    rows = simulated.dims_rows()
    base = {(r["chip"].label, r["model"], r["test"], r["n_tokens"]): r for r in rows if r["role"] == "base"}
    lines = []
    for r in rows:
        got = simulated.predict_row(r)
        lines.append(f"{r['dimension'][:28]:28} {r['chip'].label:16} {r['model']:14} {r['quant']:6} "
                     f"{r['test']}{r['n_tokens']}@d{r['depth']:<5} fa {r['fa']:4} predicted {got:8.2f} "
                     f"measured {r['tps']:8.2f} error {got / r['tps'] - 1:+6.1%}  {r['role']}")
        b = base.get((r["chip"].label, r["model"], r["test"], r["n_tokens"]))
        if r["role"].startswith("fit:") and b is not None:
            assert got / simulated.predict_row(b) == pytest.approx(r["tps"] / b["tps"], rel=0.01)
        elif r["role"].startswith("fit:"):
            assert got == pytest.approx(r["tps"], rel=0.01)
        else:
            assert got == pytest.approx(r["tps"], rel=0.30)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert {r["dimension"] for r in rows} >= {"flash attention", "depth", "experts"}


def test_depth_slows_generation_less_with_a_quantized_cache_and_flash_attention():
    chip = parse_chip("M2 Ultra/76/192")
    shape = model_shape("llama3-8b", "q4_k_m")
    on = BenchParams(99, 8, 2048, 512, flash_attn="on")

    def tg(params, depth):
        return predict(chip, shape, params, 512, 128, depth=depth).tg_tps

    assert tg(on, 32768) < 0.8 * tg(on, 0)  # the cache read grows with depth
    q8 = replace(on, type_k="q8_0", type_v="q8_0")
    assert tg(q8, 32768) > 1.1 * tg(on, 32768)  # half the bytes of the cache
    assert tg(q8, 0) == pytest.approx(tg(on, 0), rel=0.02)  # nothing to read at an empty context
    off = replace(on, flash_attn="off")
    assert tg(on, 0) > tg(off, 0)  # the kernels flash attention saves (PR 5021's row)
    pp_on = predict(chip, shape, on, 512, 0, depth=16384).pp_tps
    pp_off = predict(chip, shape, off, 512, 0, depth=16384).pp_tps
    assert pp_on > 1.2 * pp_off  # the score matrix grows with the depth without flash attention
    assert predict(chip, shape, on, 512, 128, depth=0).gpu_bytes < predict(chip, shape, on, 512, 128,
                                                                             depth=32768).gpu_bytes


def test_flash_attention_on_hurts_a_model_the_gpu_has_no_kernel_for_and_auto_avoids_it():
    chip = parse_chip("M3 Max/40/64")
    gemma = model_shape("gemma2-2b", "q8_0")
    p = {fa: predict(chip, gemma, BenchParams(99, 4, 2048, 512, flash_attn=fa), 512, 64) for fa in ("off", "on", "auto")}
    assert p["on"].pp_tps < 0.85 * p["off"].pp_tps and p["on"].tg_tps < 0.7 * p["off"].tg_tps
    assert p["auto"] == p["off"]
    llama = model_shape("llama3-8b", "q4_k_m")
    assert predict(chip, llama, BenchParams(99, 4, 2048, 512, flash_attn="auto")) == \
        predict(chip, llama, BenchParams(99, 4, 2048, 512, flash_attn="on"))


def test_experts_kept_on_the_cpu_make_a_moe_model_fit_at_cpu_speed():
    chip = parse_chip("M4 Pro/20/16")  # 12 GiB working set; Qwen3-30B-A3B Q4_K_M is about 17 GiB
    moe = model_shape("qwen3-30b-a3b", "q4_k_m")
    full = BenchParams(99, 10, 2048, 512, flash_attn="on")
    assert not predict(chip, moe, full).fits
    fits = {n: predict(chip, moe, replace(full, n_cpu_moe=n)) for n in (0, 12, 24, 36, 48)}
    assert not fits[0].fits and fits[48].fits
    ok = [n for n, p in fits.items() if p.fits]
    rates = [fits[n].tg_tps for n in ok]
    assert rates == sorted(rates, reverse=True)  # each layer's experts on the CPU costs speed
    big = parse_chip("M4 Pro/20/64")
    assert predict(big, moe, full).tg_tps > 1.5 * fits[48].tg_tps


def test_prompt_threads_pace_the_prompt_only_and_op_offload_takes_it_to_the_gpu():
    chip = parse_chip("M2 Max/38/96")
    shape = model_shape("llama2-7b", "q4_0")
    cpu = BenchParams(0, 8, 512, 512, op_offload=False)
    one = predict(chip, shape, replace(cpu, n_threads_batch=1))
    eight = predict(chip, shape, cpu)
    assert eight.pp_tps > 4 * one.pp_tps and eight.tg_tps == one.tg_tps
    offloaded = predict(chip, shape, replace(cpu, op_offload=True))
    assert offloaded.pp_tps > 2 * eight.pp_tps and offloaded.tg_tps == eight.tg_tps  # tg: batches of one
    small = replace(cpu, op_offload=True, n_batch=16, n_ubatch=16)  # below the offload batch size
    assert predict(chip, shape, small).pp_tps == predict(chip, shape, replace(small, op_offload=False)).pp_tps


def test_a_simulated_node_measures_at_the_workloads_depth():
    chip = parse_chip("M1 Max/32/64")
    node = SimulatedNode(chip, shape_for=simulated.shape_for_path, noise_cv=0.0)
    params = BenchParams(99, 4, 512, 512, flash_attn="on")
    shallow = node.measure(TrialSpec("sim://llama2-7b/q4_0", "x", params, Workload(512, 128, 1), trial_key="a"))
    deep = node.measure(TrialSpec("sim://llama2-7b/q4_0", "x", params, Workload(512, 128, 1, depth=3000),
                                  trial_key="b"))
    assert deep.tg.median < 0.95 * shallow.tg.median


def test_unknown_chip_and_bin():
    with pytest.raises(BadInput, match="unknown chip"):
        parse_chip("M9 Hyper/99")
    with pytest.raises(BadInput, match="comes with"):
        parse_chip("M2 Ultra/77")
    assert parse_chip("M2_Ultra.76.192") == parse_chip("M2 Ultra/76/192")


def _spec(key="k", reps=3):
    return TrialSpec("sim://llama2-7b/q4_0", "x", BenchParams(99, 4, 512, 512), Workload(512, 128, reps),
                     trial_key=key)


def test_simulated_node_is_labelled_noisy_and_seeded():
    chip = parse_chip("M1 Max/32/64")
    a = SimulatedNode(chip, shape_for=simulated.shape_for_path, seed=1).measure(_spec())
    b = SimulatedNode(chip, shape_for=simulated.shape_for_path, seed=1).measure(_spec())
    c = SimulatedNode(chip, shape_for=simulated.shape_for_path, seed=2).measure(_spec())
    assert a.ok and a.simulated and "simulated" in a.backend_info
    assert [s.seconds for s in a.samples] == [s.seconds for s in b.samples]  # a seed makes it deterministic
    assert [s.seconds for s in a.samples] != [s.seconds for s in c.samples]
    truth = predict(chip, model_shape("llama2-7b", "q4_0"), BenchParams(99, 4, 512, 512)).tg_tps
    assert a.tg.median == pytest.approx(truth, rel=0.1) and a.tg.stddev > 0


def test_fanless_machines_throttle_under_sustained_load():
    node = SimulatedNode(parse_chip("M2/10/24"), shape_for=simulated.shape_for_path, noise_cv=0.0)
    cool = node.measure(_spec("a")).tg.median
    for i in range(40):
        node.measure(_spec(f"warm{i}"))
    hot = node.measure(_spec("b")).tg.median
    assert hot < cool * 0.9
    fan = SimulatedNode(parse_chip("M2 Max/38/64"), shape_for=simulated.shape_for_path, noise_cv=0.0)
    first = fan.measure(_spec("a")).tg.median
    for i in range(40):
        fan.measure(_spec(f"warm{i}"))
    assert fan.measure(_spec("b")).tg.median == pytest.approx(first)


def test_shape_from_the_real_gguf(model_path):
    shape = simulated.shape_from_gguf(str(model_path))
    assert (shape.n_layer, shape.n_embd, shape.n_vocab) == (30, 576, 49152)
    assert shape.n_params == pytest.approx(134.5e6, rel=0.05)


# predict's output before the constants became an argument (HEAD 8d727de): the default truth must
# reproduce them to the last bit
TODAY = [
    ("M2 Ultra/76/192", "llama2-7b", "q4_0", BenchParams(24, 8, 512, 512), 0, "seed",
     873.4252320375767, 61.25704218912856),
    ("M1/8/16", "llama3-8b", "q4_k_m", BenchParams(20, 6, 256, 128, flash_attn="on", n_threads_batch=8, type_k="q8_0",
                                                   type_v="q4_0", op_offload=False), 4096, "calibrated",
     15.442623605854992, 3.7795562204784847),
    ("M2 Pro/19/16", "qwen3-30b-a3b", "q4_k_m", BenchParams(49, 12, 512, 512, flash_attn="auto", n_cpu_moe=20), 0,
     "calibrated", 582.1791292471662, 20.210269644892307),
    ("M4/10/16", "gemma2-2b", "q8_0", BenchParams(99, 14, 2048, 512, flash_attn="on", n_threads_batch=3), 512, "seed",
     130.78325688691868, 6.437890169837887),
    ("M3 Max/40/64", "qwen3-14b", "q8_0", BenchParams(0, 11, 512, 64, flash_attn="off"), 0, "calibrated",
     239.89084500624926, 7.342907769706584),
]


def test_the_default_truth_reproduces_todays_predictions_exactly():
    default = simulated.calibrated_constants()
    assert default == simulated.ModelConstants(simulated.fitted_constants(), simulated.fitted_dims())
    assert (default.cpu_bytes_per_s_per_ghz, default.cpu_flops_per_ghz, default.e_core_speed,
            default.cpu_bandwidth_share, default.oversubscribed_penalty) == (
        simulated.CPU_BYTES_PER_S_PER_GHZ, simulated.CPU_FLOPS_PER_GHZ, simulated.E_CORE_SPEED,
        simulated.CPU_BANDWIDTH_SHARE, simulated.OVERSUBSCRIBED_PENALTY)
    for chip, name, quant, params, depth, scenario, pp, tg in TODAY:
        preds = [predict(parse_chip(chip), model_shape(name, quant), params, 512, 128, scenario, depth=depth,
                         constants=constants) for constants in (None, default)]
        assert preds[0] == preds[1], (chip, name)  # the default truth is today's model, bit for bit
        # and today's figures, but for the last bits of a sum, whose order differs between CPUs
        assert (preds[0].pp_tps, preds[0].tg_tps) == (pytest.approx(pp, rel=1e-12), pytest.approx(tg, rel=1e-12)), chip
    chip = parse_chip("M1 Max/32/64")
    plain = SimulatedNode(chip, shape_for=simulated.shape_for_path, seed=1).measure(_spec())
    given = SimulatedNode(chip, shape_for=simulated.shape_for_path, seed=1, constants=default).measure(_spec())
    assert [s.seconds for s in plain.samples] == [s.seconds for s in given.samples]


def test_a_perturbed_truth_is_seeded_and_moves_every_constant_within_the_spread():
    default = simulated.calibrated_constants()
    a, b, other = default.perturbed(3), default.perturbed(3), default.perturbed(4)
    assert a == b and a != other  # the same seed, the same truth
    assert default.perturbed(3, spread=0.0).leaves() == default.leaves()
    assert len(default.leaves()) == 23  # 10 GPU, 5 newer-dimension, 5 CPU constants, contention, hand-over, M5's tier
    ratios = []
    for seed in range(20):
        moved = default.perturbed(seed).leaves()
        assert moved.keys() == default.leaves().keys()
        ratios += [moved[k] / v for k, v in default.leaves().items()]
    assert all(0.85 <= r <= 1.15 and r != 1.0 for r in ratios)
    assert min(ratios) < 0.87 and max(ratios) > 1.13  # the whole spread is drawn
    assert default.perturbed(3, spread=0.05).leaves().keys() == a.leaves().keys()
    assert all(0.95 <= x / v <= 1.05 for x, v in zip(default.perturbed(3, spread=0.05).leaves().values(),
                                                      default.leaves().values(), strict=True))
    node = SimulatedNode(parse_chip("M1 Max/32/64"), shape_for=simulated.shape_for_path, seed=1, constants=a)
    result = node.measure(_spec())
    assert "perturbed truth 3" in result.backend_info
    truth = predict(parse_chip("M1 Max/32/64"), model_shape("llama2-7b", "q4_0"), BenchParams(99, 4, 512, 512),
                    constants=a).tg_tps
    assert truth != predict(parse_chip("M1 Max/32/64"), model_shape("llama2-7b", "q4_0"), BenchParams(99, 4, 512, 512)).tg_tps
    assert result.tg.median == pytest.approx(truth, rel=0.1)


def test_every_constant_of_the_truth_reaches_the_prediction():
    """Each constant alone moved by 10 % changes some prediction: none is held but unused."""
    cases = [  # full offload of each quant class, partial offload on P- and E-cores and beyond,
        # CPU only, flash attention off and on at a depth, a model without a GPU kernel, experts
        (parse_chip(c), model_shape(m, q), p, depth)
        for c, m, q, p, depth in [
            ("M2 Max/38/64", "llama2-7b", quant, BenchParams(99, 4, 512, 512), 0) for quant in ("f16", "q8_0", "q4_0")
        ] + [
            ("M2 Pro/19/32", "llama2-7b", "q4_0", BenchParams(16, t, 512, 512, op_offload=False), 0)
            for t in (2, 8, 11, 16)
        ] + [
            ("M2 Pro/19/32", "llama2-7b", "q4_0", BenchParams(0, 8, 512, 512), 0),
            ("M2 Max/38/64", "llama3-8b", "q4_0", BenchParams(99, 4, 512, 512, flash_attn="off"), 4096),
            ("M2 Max/38/64", "llama3-8b", "q4_0", BenchParams(99, 4, 512, 512, flash_attn="on"), 4096),
            ("M3 Max/40/64", "gemma2-2b", "q8_0", BenchParams(99, 4, 512, 512, flash_attn="on"), 0),
            ("M2 Pro/19/16", "qwen3-30b-a3b", "q4_k_m", BenchParams(49, 8, 512, 512, n_cpu_moe=20), 0),
            ("M5 Max/40/64", "llama2-7b", "q4_0", BenchParams(0, 12, 512, 512), 0),  # the performance cores
        ]
    ]

    def outputs(constants):
        return [(pred.pp_tps, pred.tg_tps) for chip, shape, params, depth in cases for scenario in simulated.SCENARIOS
                for pred in [predict(chip, shape, params, 512, 128, scenario, depth=depth, constants=constants)]]

    default = simulated.calibrated_constants()
    today = outputs(default)
    for i, name in enumerate(default.leaves()):
        factors = iter([1.1 if j == i else 1.0 for j in range(len(default.leaves()))])
        one = simulated._scaled(default, factors.__next__)
        assert [k for k, v in one.leaves().items() if v != default.leaves()[k]] == [name]
        assert outputs(one) != today, f"{name} changes no prediction"
