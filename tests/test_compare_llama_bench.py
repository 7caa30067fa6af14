"""bench/compare_llama_bench.py reads each configuration as llama-bench flags and gives both tools the same."""

from __future__ import annotations

import dataclasses

import pytest

from bench.compare_llama_bench import Case, llama_bench_argv, parse_case
from workers.errors import BadInput
from workers.hardware import Fingerprint

GPU = Fingerprint(None, "x", None, 16, 0, 16, None, None, None, None, None, None, "cuda", True)
CPU = dataclasses.replace(GPU, backend="cpu", gpu_offload=False)


def test_a_cpu_only_case_on_a_gpu_build_turns_op_offload_off_unless_it_says_so():
    assert parse_case("-ngl 0 -t 4", 30, GPU).params.op_offload is False
    assert parse_case("-ngl 0 -t 4 -nopo 0", 30, GPU).params.op_offload is True
    assert parse_case("-ngl 0 -t 4", 30, CPU).params.op_offload is True
    assert parse_case("-ngl 99 -t 4", 30, GPU).params.op_offload is True


def test_depth_and_flags_reach_llama_bench():
    case = parse_case("-ngl 99 -t 16 -fa on -d 4096", 30, GPU)
    assert case == Case("-ngl 99 -t 16 -fa on -d 4096", case.params, 4096)
    assert case.params.n_gpu_layers == 31 and case.params.flash_attn == "on"
    argv = llama_bench_argv("llama-bench", "m.gguf", case, 512, 128, 3, repack=True)
    joined = " ".join(argv)
    assert "-d 4096" in joined and "-ngl 31" in joined and "-fa on" in joined and "--repack 1" in joined
    cpu = llama_bench_argv("llama-bench", "m.gguf", parse_case("-ngl 0 -t 8", 30, GPU), 512, 128, 3, False)
    assert " -nopo 1 " in " ".join(cpu) + " " and "-fa off" in " ".join(cpu)


@pytest.mark.parametrize("text", ["-d", "-d x -t 1", "-t 1 --mlock"])
def test_bad_configurations_are_bad_input(text):
    with pytest.raises(BadInput):
        parse_case(text, 30, GPU)


def test_configurations_that_start_with_a_dash_are_values():
    from bench.compare_llama_bench import join_configs

    assert join_configs(["--model", "m", "--config", "-ngl 0 -t 4", "--rounds", "5"]) == \
        ["--model", "m", "--config=-ngl 0 -t 4", "--rounds", "5"]


def test_the_table_pairs_each_rounds_runs():
    from bench.compare_llama_bench import render

    argv = ["lb", "-m", "m", "-p", "512", "-n", "0", "-r", "2", "-d", "0", "-ngl", "0", "-t", "1", "--repack", "1"]
    log = [{"round": r, "config": "-t 1", "tool": tool, "figures": {"pp512": v},
            "argv": argv if tool == "llama-bench" else None}
           for r, (a, b) in enumerate([(100.0, 100.0), (90.0, 100.0), (110.0, 100.0)])
           for tool, v in (("fleettune", a), ("llama-bench", b))]
    row = render(log).splitlines()[-1]
    assert "`-ngl 0 -t 1`" in row and "| 3 |" in row and "1.000 (0.900–1.100)" in row
