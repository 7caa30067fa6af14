"""BenchParams and Workload as stored, printed and read back: llama.cpp's flags and old records."""

from __future__ import annotations

import dataclasses
import json

import pytest

from workers.errors import BadInput
from workers.trial import BenchParams, Workload

OLD = {"n_gpu_layers": 31, "n_threads": 4, "n_batch": 512, "n_ubatch": 256, "flash_attn": True,
       "n_threads_batch": None}  # a record as studies stored it before flash attention had three values


def test_old_records_read_and_store_exactly_as_before():
    params = BenchParams.from_dict(OLD)
    assert params.flash_attn == "on" and params.type_k == "f16" and params.op_offload is True
    assert params.to_dict() == OLD  # the same dict, so stored configurations still compare equal
    off = BenchParams.from_dict({**OLD, "flash_attn": False})
    assert off.flash_attn == "off" and off.to_dict()["flash_attn"] is False
    assert json.dumps(BenchParams().to_dict(), sort_keys=True) == json.dumps(
        {"n_gpu_layers": 0, "n_threads": 1, "n_batch": 2048, "n_ubatch": 512, "flash_attn": False,
         "n_threads_batch": None}, sort_keys=True)


def test_new_fields_round_trip_and_appear_only_when_set():
    params = BenchParams(n_gpu_layers=33, n_threads=8, flash_attn="auto", type_k="q8_0", type_v="q4_0",
                         n_cpu_moe=4, op_offload=False, n_threads_batch=16)
    stored = params.to_dict()
    assert stored["flash_attn"] == "auto" and stored["type_v"] == "q4_0" and stored["op_offload"] is False
    assert BenchParams.from_dict(json.loads(json.dumps(stored))) == params
    assert BenchParams.from_dict({**stored, "a_later_field": 1}) == params  # unknown keys ignored
    assert "type_k" not in dataclasses.replace(params, type_k="f16").to_dict()


@pytest.mark.parametrize("value", ["maybe", "ON", 2])
def test_bad_flash_attn_values_are_bad_input(value):
    with pytest.raises(BadInput, match="flash attention"):
        BenchParams(flash_attn=value)


def test_a_quantized_v_needs_flash_attention_on():
    assert BenchParams(type_v="q8_0", flash_attn="on").kv_problem is None
    assert BenchParams(type_k="q8_0", flash_attn="off").kv_problem is None  # K alone is fine
    for fa in ("off", "auto"):
        assert "needs flash attention on" in BenchParams(type_v="q4_0", flash_attn=fa).kv_problem
    with pytest.raises(BadInput, match="type_k"):
        BenchParams(type_k="q5_1")


def test_flags_for_each_tool():
    params = BenchParams(n_gpu_layers=33, n_threads=8, n_threads_batch=16, n_batch=2048, n_ubatch=512,
                         flash_attn="on", type_k="q8_0", type_v="q8_0", n_cpu_moe=2, op_offload=False)
    server = params.llama_cpp_flags("llama-server")
    assert server == ("-ngl 33 -t 8 -tb 16 -b 2048 -ub 512 -fa on -ctk q8_0 -ctv q8_0 -ncmoe 2 "
                      "--no-op-offload")
    assert params.llama_cpp_flags() == server
    bench = params.llama_cpp_flags("llama-bench")
    assert "-tb" not in bench and bench.endswith("-ncmoe 2 -nopo 1")  # llama-bench has no -tb
    assert BenchParams().llama_cpp_flags() == "-ngl 0 -t 1 -b 2048 -ub 512 -fa off"
    assert params.llama_cpp_flags("llama-cli") == server  # llama-cli reads common/arg.cpp's flags too
    with pytest.raises(BadInput):
        params.llama_cpp_flags("llama-run")


@pytest.mark.parametrize("tool", ["llama-server", "llama-bench"])
def test_printed_flags_read_back_to_the_same_params(tool):
    params = BenchParams(n_gpu_layers=12, n_threads=3, n_batch=1024, n_ubatch=128, flash_attn="auto",
                         type_k="q4_0", n_cpu_moe=1, op_offload=False)
    assert BenchParams.from_llama_flags(params.llama_cpp_flags(tool), n_layer=30) == params


def test_python_kwargs():
    kwargs = BenchParams(n_threads=4, flash_attn="on", type_k="q8_0", type_v="q4_0",
                         op_offload=False).llama_cpp_python_kwargs()
    assert kwargs["flash_attn"] is True and kwargs["type_k"] == 8 and kwargs["type_v"] == 2
    assert kwargs["op_offload"] is False and kwargs["n_threads_batch"] == 4
    assert BenchParams().llama_cpp_python_kwargs()["flash_attn"] is False
    assert "type_k" not in BenchParams().llama_cpp_python_kwargs()


@pytest.mark.parametrize("ngl, effective", [("99", 31), ("-1", 31), ("all", 31), ("auto", 31), ("31", 31),
                                            ("32", 31), ("0", 0), ("7", 7)])
def test_ngl_is_read_as_llama_cpp_reads_it(ngl, effective):
    params = BenchParams.from_llama_flags(f"-ngl {ngl} -t 4", n_layer=30)
    assert params.n_gpu_layers == effective and params.n_threads == 4
    assert params.llama_cpp_flags().startswith(f"-ngl {effective} ")  # the effective value is printed


def test_flag_spellings_and_values():
    read = BenchParams.from_llama_flags
    assert read("--flash-attn 1 --n-gpu-layers 5", 30) == BenchParams(n_gpu_layers=5, flash_attn="on")
    assert read("-fa enabled", 30).flash_attn == "on" and read("-fa -1", 30).flash_attn == "auto"
    assert read("--no-op-offload -t 2", 30) == BenchParams(n_threads=2, op_offload=False)
    assert read("-nopo 0", 30).op_offload is True and read("--no-op-offload 1", 30).op_offload is False
    assert read("--cache-type-k q8_0 -ctv q8_0 -fa on", 30).type_v == "q8_0"
    base = BenchParams(n_threads=6, n_batch=512)
    assert read("-ub 64", 30, base) == dataclasses.replace(base, n_ubatch=64)


@pytest.mark.parametrize("text, match", [
    ("-ngl", "needs a value"),
    ("-ngl many", "whole number"),
    ("-ngl -2", "-2"),
    ("-t 0", "-t 0"),
    ("-fa yes", "on, off or auto"),
    ("-ctk q5_1", "q5_1"),
    ("-nopo 2", "0 or 1"),
    ("--mlock", "unknown flag '--mlock'"),
    ("-ncmoe -1", "-ncmoe -1"),
])
def test_bad_flags_are_one_line_of_bad_input(text, match):
    with pytest.raises(BadInput, match=match) as info:
        BenchParams.from_llama_flags(text, n_layer=30)
    assert "\n" not in str(info.value)


def test_workload_depth_is_stored_only_when_set():
    assert "depth" not in Workload().to_dict()  # existing studies keep their identity
    assert Workload(**Workload().to_dict()) == Workload()
    deep = Workload(n_prompt=512, n_gen=128, depth=8192)
    assert deep.to_dict()["depth"] == 8192 and Workload(**deep.to_dict()) == deep
