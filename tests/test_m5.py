"""The M5 generation (issue 23.5), modelled from Apple's public specifications: its chip-table rows,
its core tiers as a Mac reports them (an M5 Pro/Max's second tier is performance cores, not
efficiency cores), llama.cpp's default threads on it, the thread model, and the M1-M4 figures
left exactly as they were."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from orchestrator import schedules
from orchestrator.cli import main
from orchestrator.db import open_database
from orchestrator.space import SearchSpace, llama_cpp_defaults
from orchestrator.transfer import ConfigPredictor, Example
from workers import simulated
from workers.hardware import (
    apple_bandwidth,
    chip_table,
    fingerprint_from_dir,
    parse_system_profiler_json,
    parse_system_profiler_text,
)
from workers.simulated import M_CORE_SPEED, model_shape, optimum, parse_chip, predict
from workers.trial import BenchParams

MODEL = simulated.sim_model_info("sim://llama2-7b/q4_0")
SHAPE = model_shape("llama2-7b", "q4_0")


def test_the_m5_rows_parse_and_the_older_rows_have_no_second_tier():
    m5 = {(c.family, c.gpu_cores): c for c in chip_table() if c.generation == "M5"}
    tiers = {key: (c.p_cores, c.m_cores, c.e_cores, c.logical_cores, c.bandwidth_gbs) for key, c in m5.items()}
    assert tiers == {
        ("M5", 10): (4, 0, 6, 10, 153.0),  # 4 super + 6 efficiency
        ("M5 Pro", 16): (5, 10, 0, 15, 307.0),  # 5 super + 10 performance
        ("M5 Pro", 20): (6, 12, 0, 18, 307.0),
        ("M5 Max", 40): (6, 12, 0, 18, 614.0),
    }
    older = [c for c in chip_table() if c.generation != "M5"]
    assert len(older) == 31 and all(c.m_cores == 0 and c.logical_cores == c.p_cores + c.e_cores for c in older)
    assert {c.generation for c in older} == {"M1", "M2", "M3", "M4"}


def test_every_m5_bin_is_simulated_and_labelled_modelled():
    labels = [c.label for c in simulated.all_chips() if c.generation == "M5"]
    assert labels == ["M5/10/16", "M5 Pro/16/24", "M5 Pro/20/24", "M5 Max/40/36"]
    assert simulated.basis(parse_chip("M5 Max/40")) == "modelled"
    assert simulated.basis(parse_chip("M2 Max/38")) == "calibrated"
    assert parse_chip("M5 Pro").gpu_cores == 20  # the family's largest bin


# Constructed captures, not real ones: the key names and values follow what M5 Macs print in public
# reports (sysctl hw.perflevelN.name "Super" / "Performance" / "Efficiency" as of macOS 26.3.1;
# system_profiler's "proc 18:6:0:12"; "Total Number of Cores: 18 (6 Super and 12 Performance)").
M5_MAX_SYSCTL = (
    "machdep.cpu.brand_string: Apple M5 Max\nhw.memsize: 137438953472\nhw.logicalcpu: 18\n"
    "hw.nperflevels: 2\nhw.perflevel0.physicalcpu: 6\nhw.perflevel0.logicalcpu: 6\nhw.perflevel0.name: Super\n"
    "hw.perflevel1.physicalcpu: 12\nhw.perflevel1.logicalcpu: 12\nhw.perflevel1.name: Performance\n"
    "kern.osproductversion: 26.5\n"
)
M5_MAX_IOREG = '+-o AGXAcceleratorG17X  <class AGXAcceleratorG17X>\n    "gpu-core-count" = 40\n'


def test_an_m5_max_reports_super_cores_as_p_cores_and_its_performance_cores_apart(tmp_path):
    (tmp_path / "sysctl.txt").write_text(M5_MAX_SYSCTL)
    (tmp_path / "ioreg.txt").write_text(M5_MAX_IOREG)
    fp = fingerprint_from_dir(tmp_path)
    assert (fp.p_cores, fp.m_cores, fp.e_cores, fp.logical_cores) == (6, 12, 0, 18)
    assert fp.chip_key == "apple-m5-max-40g" and fp.bandwidth_gbs == 614.0 and fp.backend == "metal"
    # the base M5: super cores above efficiency cores, no second tier
    base = M5_MAX_SYSCTL.replace("M5 Max", "M5").replace("physicalcpu: 12", "physicalcpu: 6") \
        .replace("hw.perflevel0.physicalcpu: 6", "hw.perflevel0.physicalcpu: 4").replace("1.name: Performance",
                                                                                        "1.name: Efficiency")
    (tmp_path / "sysctl.txt").write_text(base)
    (tmp_path / "ioreg.txt").write_text(M5_MAX_IOREG.replace("40", "10"))
    fp = fingerprint_from_dir(tmp_path)
    assert (fp.p_cores, fp.m_cores, fp.e_cores, fp.bandwidth_gbs) == (4, 0, 6, 153.0)


def test_system_profiler_names_the_m5_tiers():
    hardware = {"SPHardwareDataType": [{"chip_type": "Apple M5 Max", "number_processors": "proc 18:6:0:12"}]}
    out = parse_system_profiler_json(json.dumps(hardware))
    assert (out["logical_cores"], out["p_cores"], out["e_cores"], out["m_cores"]) == (18, 6, 0, 12)
    old = {"SPHardwareDataType": [{"chip_type": "Apple M3 Max", "number_processors": "proc 16:12:4"}]}
    assert parse_system_profiler_json(json.dumps(old))["m_cores"] == 0
    text = "Hardware:\n\n    Hardware Overview:\n\n      Total Number of Cores: {}\n"
    for cores, tiers in (("18 (6 Super and 12 Performance)", (18, 6, 12, 0)),
                         ("10 (4 Super and 6 Efficiency)", (10, 4, 0, 6)),
                         ("24 (16 performance and 8 efficiency)", (24, 16, 0, 8))):
        out = parse_system_profiler_text(text.format(cores))
        assert (out["logical_cores"], out["p_cores"], out["m_cores"], out["e_cores"]) == tiers


def test_a_sysctl_capture_without_level_names_takes_the_tiers_from_system_profiler(tmp_path):
    sysctl = "\n".join(line for line in M5_MAX_SYSCTL.splitlines() if ".name:" not in line)
    (tmp_path / "sysctl.txt").write_text(sysctl)
    (tmp_path / "system_profiler.json").write_text(json.dumps(
        {"SPHardwareDataType": [{"chip_type": "Apple M5 Max", "number_processors": "proc 18:6:0:12"}]}))
    fp = fingerprint_from_dir(tmp_path)
    assert (fp.p_cores, fp.m_cores, fp.e_cores) == (6, 12, 0)


def test_an_unlisted_gpu_bin_gets_no_bandwidth_from_its_family():
    assert apple_bandwidth("M5 Max", 40, None, None) == 614.0
    assert apple_bandwidth("M5 Max", 32, None, None) is None  # not Apple-confirmed, not in the table
    assert apple_bandwidth("M5 Max", None, None, None) == 614.0  # the one listed bin
    assert apple_bandwidth("M4 Max", 32, None, None) == 410.0  # listed bins as before


@pytest.mark.parametrize("label", ["M5 Pro/20/48", "M5 Max/40/128", "M5 Pro/16/24"])
def test_llama_cpp_defaults_run_the_super_cores_only_and_the_space_searches_both_tiers(label):
    """llama.cpp's default -t on macOS is hw.perflevel0.physicalcpu (common/common.cpp,
    common_cpu_get_num_physical_cores): the super cores, not the performance cores beside them."""
    chip = parse_chip(label)
    assert llama_cpp_defaults(chip, MODEL).n_threads == chip.p_cores == (5 if "/16/" in label else 6)
    assert SearchSpace.for_target(chip, MODEL, n_prompt=512).threads_max == chip.p_cores + chip.m_cores
    base = parse_chip("M5/10/32")  # 4 super + 6 efficiency: the efficiency cores stay out
    assert (llama_cpp_defaults(base, MODEL).n_threads, SearchSpace.for_target(base, MODEL, 512).threads_max) == (4, 4)


def _cpu_tg(chip, threads):
    return predict(chip, SHAPE, BenchParams(n_gpu_layers=0, n_threads=threads, n_batch=512, n_ubatch=512)).tg_tps


def test_threads_on_the_performance_cores_pace_the_step_far_less_than_efficiency_cores():
    chip = parse_chip("M5 Max/40/128")  # 6 super + 12 performance
    as_e_cores = replace(chip, e_cores=12, m_cores=0)  # the same chip were its second tier efficiency cores
    six = _cpu_tg(chip, 6)
    for threads in range(7, 19):
        assert _cpu_tg(chip, threads) >= 1.9 * _cpu_tg(as_e_cores, threads), threads  # 0.4 vs 0.2 a core
    for threads in range(7, 15):  # still paced by the slower cores: slower than the 6 super cores alone
        assert _cpu_tg(chip, threads) < six, threads
    # from 6 / M_CORE_SPEED = 15 threads on, the 12 performance cores add more than they hold back:
    # 18 threads are ~20 % faster than llama.cpp's default of 6 on CPU-bound generation (modelled)
    assert _cpu_tg(chip, round(6 / M_CORE_SPEED)) == pytest.approx(six)
    assert _cpu_tg(chip, 18) == pytest.approx(1.2 * six, rel=0.02)
    assert _cpu_tg(chip, 20) < _cpu_tg(chip, 18)  # more threads than cores is worse still
    base = parse_chip("M5/10/32")  # the base M5's efficiency cores pace as every E core does
    assert _cpu_tg(base, 10) == pytest.approx(_cpu_tg(base, 4) * 10 * 0.2 / 4, rel=0.01)


@pytest.mark.parametrize("label", ["M5/10/16", "M5 Pro/16/24", "M5 Pro/20/24", "M5 Max/40/36"])
def test_predictions_and_optima_work_for_every_m5_bin(label):
    chip = parse_chip(label)
    full = predict(chip, SHAPE, BenchParams(99, chip.p_cores, 2048, 512))
    assert full.fits and full.pp_tps > 0 and full.tg_tps > 0
    params, _, value = optimum(chip, SHAPE, "tg")
    assert value >= full.tg_tps and params.n_threads <= chip.logical_cores


def test_generation_follows_the_bandwidth_from_m4_to_m5():
    m4, m5 = predict(parse_chip("M4/10/16"), SHAPE, BenchParams(99, 4, 2048, 512)), \
        predict(parse_chip("M5/10/16"), SHAPE, BenchParams(99, 4, 2048, 512))
    assert m5.tg_tps / m4.tg_tps == pytest.approx(153 / 120, rel=0.1)  # memory-bound
    # one public row (llama.cpp #16634, an M5: Mistral 7B Q4_0 tg128 26.6 tok/s; the model says 27.7)
    # is in docs/benchmarks.md; its pp (608 tok/s with the GPU's Neural Accelerators) is not modelled


def test_a_transfer_prediction_for_an_m5_max_may_use_its_performance_cores():
    chips = [simulated.with_memory(c, 64) for c in simulated.all_chips() if c.family in ("M2 Max", "M4 Max")]
    examples = [Example(c.chip_key, c, MODEL, params, value)
                for c in chips for params, _, value in [optimum(c, SHAPE, "tg")]]
    predictor = ConfigPredictor(examples)
    pred = predictor.predict(simulated.with_memory(parse_chip("M5 Max/40"), 64), MODEL)
    assert 1 <= pred.params.n_threads <= 18 and pred.expected_tps > 0


def test_recommend_names_an_m5_bin_from_the_chip_table(sqlite_url):
    db = open_database(sqlite_url)
    assert schedules.hardware(db, "apple-m5-pro-20g").m_cores == 12
    result = CliRunner().invoke(main, ["recommend", "--model", "sim://llama2-7b/q4_0", "--chip", "apple-m5-max-40g",
                                       "--workload", "capacity", "--db", sqlite_url, "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)[0]
    assert row["source"] == "predicted (simulated)" and row["simulated"] is True and row["expected_tps"] > 0


def test_sim_chips_lists_every_bin_with_its_basis():
    rows = json.loads(CliRunner().invoke(main, ["sim", "chips", "--json"]).output)
    assert len(rows) == len(chip_table()) and all(r["simulated"] for r in rows)
    m5_max = next(r for r in rows if r["chip_key"] == "apple-m5-max-40g")
    assert (m5_max["p_cores"], m5_max["m_cores"], m5_max["e_cores"], m5_max["basis"]) == (6, 12, 0, "modelled")
    table = CliRunner().invoke(main, ["sim", "chips"]).output
    assert "M5 Pro/16/24" in table and "no measurement" in table
    predicted = json.loads(CliRunner().invoke(main, ["sim", "predict", "--chip", "M5 Max/40", "--model-shape",
                                                     "llama2-7b", "--json"]).output)
    assert predicted["basis"] == "modelled" and predicted["simulated"] is True


# Figures the simulator gave before M5 was added (bench/sim_outputs.py at the parent commit), for
# threads on efficiency cores and beyond the cores, where the thread model changed: equal (to 1e-12: the last bits of a sum differ between CPUs).
BEFORE_M5 = [
    ("M1/8/192", "q6_k", dict(n_gpu_layers=0, n_threads=8, n_batch=2048, n_ubatch=1024, flash_attn="off",
                              type_k="q8_0", n_cpu_moe=1), "138.6444753633843", "2.314447442204941"),
    ("M1 Pro/16/16", "f16", dict(n_gpu_layers=16, n_threads=14, n_batch=2048, n_ubatch=256, flash_attn="auto",
                                 n_cpu_moe=37), "276.3710765606926", "1.0579823994964204"),
    ("M2 Pro/16/16", "q2_k", dict(n_gpu_layers=0, n_threads=8, n_batch=2048, n_ubatch=1, flash_attn="on",
                                  type_k="q8_0", type_v="q8_0", n_cpu_moe=16), "8.238891544149196", "4.958951929864247"),
    ("M2/10/8", "q6_k", dict(n_gpu_layers=1, n_threads=10, n_batch=32, n_ubatch=32, flash_attn="auto",
                             type_k="q8_0"), "110.83007937305774", "1.3876001950996617"),
    ("M3 Ultra/60/96", "q4_0", dict(n_gpu_layers=0, n_threads=28, n_batch=2048, n_ubatch=16, flash_attn="on",
                                    type_k="q4_0", type_v="q8_0", n_cpu_moe=1), "40.405451267714405",
     "14.95124006854071"),
    ("M3/8/192", "q6_k", dict(n_gpu_layers=16, n_threads=12, n_batch=16, n_ubatch=16, flash_attn="on",
                              type_k="q4_0", type_v="q8_0", n_cpu_moe=1), "9.064042704999558", "2.334406130167433"),
    ("M4/8/192", "q4_0", dict(n_gpu_layers=1, n_threads=8, n_batch=1024, n_ubatch=1024, flash_attn="on",
                              type_k="q4_0", type_v="q8_0", n_cpu_moe=37, op_offload=False),
     "13.140351188579642", "4.745813910068158"),
    ("M4/10/192", "q4_0", dict(n_gpu_layers=0, n_threads=13, n_batch=2048, n_ubatch=1, flash_attn="auto",
                               n_cpu_moe=1), "5.759589586809472", "2.974967498827799"),
]


@pytest.mark.parametrize("label, quant, knobs, pp, tg", BEFORE_M5, ids=[row[0] for row in BEFORE_M5])
def test_m1_to_m4_predictions_are_unchanged(label, quant, knobs, pp, tg):
    pred = predict(parse_chip(label), model_shape("llama2-7b", quant), BenchParams(**knobs), 512, 128)
    # equal to the last bits but for the order of floating-point sums (numpy's, per CPU): 1e-12
    assert (pred.pp_tps, pred.tg_tps) == (pytest.approx(float(pp), rel=1e-12), pytest.approx(float(tg), rel=1e-12))
