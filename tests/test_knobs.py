"""The knob table (workers/knobs.py): every knob, read and written in every tool's form, comes back
the same; and what each tool cannot say is declared in the table, not dropped on the way."""

from __future__ import annotations

import dataclasses

import pytest

from workers import knobs
from workers.errors import BadInput
from workers.trial import BenchParams

N_LAYER = 30


def other_value(knob: knobs.Knob):
    """A value of ``knob`` away from its default (and from -t for -tb) that every tool can print."""
    if knob.type is bool:
        return not knob.default
    if knob.type is str:
        return [c for c in knob.choices if c != knob.default][-1]
    return (knob.low or 0) + 3 if knob.default is None else knob.default + 3


def params_with(knob: knobs.Knob) -> BenchParams:
    values = {knob.field: other_value(knob)}
    if knob.field == "type_v":
        values["flash_attn"] = "on"  # a quantized V cache needs flash attention on
    if knob.field == "n_batch":
        values["n_ubatch"] = 128
    return BenchParams(**{"n_gpu_layers": 7, "n_threads": 2, "n_ubatch": 256, **values})


@pytest.mark.parametrize("knob", knobs.KNOBS, ids=lambda k: k.field)
@pytest.mark.parametrize("tool", knobs.TOOLS)
def test_every_knob_round_trips_through_every_tools_flags(knob, tool):
    params = params_with(knob)
    printed = params.llama_cpp_flags(tool)
    back = BenchParams.from_llama_flags(printed, N_LAYER)
    if (knob.bench_flags if tool == "llama-bench" else knob.server_flags):
        assert back == params, printed
        assert BenchParams.from_llama_flags(back.llama_cpp_flags(tool), N_LAYER) == params
    else:  # declared unsayable in this tool: left out, the rest intact
        assert back == dataclasses.replace(params, **{knob.field: knob.default}), printed


@pytest.mark.parametrize("knob", knobs.KNOBS, ids=lambda k: k.field)
def test_every_knob_round_trips_through_llama_cpp_python_and_llama_bench_fields(knob):
    params = params_with(knob)
    if knob.field == "flash_attn":  # llama-cpp-python's flash_attn is a bool: auto is given as on
        assert params.flash_attn == "auto" and knob.from_python(knob.to_python("auto")) == "on"
        params = dataclasses.replace(params, flash_attn="on")
    python = knobs.from_python_kwargs(params.llama_cpp_python_kwargs())
    bench = knobs.from_bench_fields(knobs.bench_fields(params))
    for side, back, declared in (("Llama(...)", python, knob.python_kwarg), ("llama-bench", bench, knob.bench_field)):
        expected = getattr(params, knob.field) if declared else None
        assert back.get(knob.field) == expected, side
    if knob.server_field:
        assert knobs.from_python_kwargs(knobs.server_settings(params), "server_field")[knob.field] == \
            getattr(params, knob.field)
        assert knobs.unservable(params, "llama-cpp-python") is None
    else:  # refused in one line, never dropped
        problem = knobs.unservable(params, "llama-cpp-python")
        assert problem and "\n" not in problem and any(f in problem for f in (*knob.bench_flags, *knob.server_flags))
        with pytest.raises(BadInput):
            knobs.server_settings(params)


def test_the_llama_cpp_python_server_is_given_the_nodes_config_field_for_field():
    """Real ModelSettings: every knob it has a field for (the K/V types included) as the config says."""
    settings_module = pytest.importorskip("llama_cpp.server.settings")
    params = BenchParams(n_gpu_layers=5, n_threads=3, n_threads_batch=6, n_batch=256, n_ubatch=64,
                         flash_attn="on", type_k="q8_0", type_v="q4_0")
    settings = settings_module.ModelSettings(model="m.gguf", **knobs.server_settings(params))
    served = knobs.from_python_kwargs(settings.model_dump(), "server_field")
    assert BenchParams(**served) == params
    assert settings.type_k == 8 and settings.type_v == 2


def test_a_pin_is_parsed_like_any_flags_over_the_recommendation():
    from orchestrator.rollout import parse_pin

    pin = parse_pin("-ctk q8_0 -fa auto -ncmoe 2 -nopo 1", N_LAYER)
    assert pin == {"type_k": "q8_0", "flash_attn": "auto", "n_cpu_moe": 2, "op_offload": False}
    recommendation = BenchParams(n_gpu_layers=31, n_threads=4, n_batch=512, n_ubatch=512).to_dict()
    pinned = BenchParams.from_dict(knobs.over(recommendation, pin))
    assert pinned.type_k == "q8_0" and pinned.flash_attn == "auto" and pinned.n_threads == 4
    assert parse_pin("-ngl all -b 256", N_LAYER) == {"n_gpu_layers": 31, "n_batch": 256}
    assert BenchParams.from_dict(knobs.over(recommendation, {"n_batch": 256})).n_ubatch == 256


@pytest.mark.parametrize("params, match", [
    ({"n_threads": 0}, "n_threads 0"),
    ({"n_batch": 1 << 17}, "n_batch"),
    ({"type_k": "q5_1"}, "type_k"),
    ({"flash_attn": "maybe"}, "flash_attn"),
    ({"op_offload": "no"}, "op_offload"),
    ({"later": 1}, "unknown keys: later"),
    ({"type_v": "q8_0", "flash_attn": "off"}, "needs flash attention on"),
    ({"n_batch": 64, "n_ubatch": 128}, "ubatch 128"),
])
def test_validate_params_names_the_first_thing_wrong_in_one_line(params, match):
    with pytest.raises(BadInput, match=match) as info:
        knobs.validate_params(params)
    assert "\n" not in str(info.value)


def test_every_knob_is_described_once_and_completely():
    fields = {f.name for f in dataclasses.fields(BenchParams)}
    assert set(knobs.BY_FIELD) == fields  # a BenchParams field without a knob, or the reverse, fails
    names = [k.optuna_name for k in knobs.KNOBS]
    assert None not in names and len(set(names)) == len(names)
    for k in knobs.KNOBS:
        assert k.help and k.effective and (k.server_flags or k.bench_flags)
        assert getattr(BenchParams(), k.field) == k.default
        assert k.type is not bool or set(k.senses) >= {*k.bench_flags, *k.server_flags}
    assert [k.field for k in knobs.KNOBS if k.lossy] == ["type_k", "type_v"]


def test_no_kv_offload_is_searched_printed_served_pinned_and_carried_in_llama_bench_files(tmp_path):
    """The proof of the table: -nkvo was added in one entry (and one BenchParams field)."""
    import optuna

    from orchestrator import llamabench
    from orchestrator.rollout import parse_pin
    from orchestrator.space import SearchSpace
    from workers import simulated
    from workers.hardware import fingerprint_from_dir

    model = simulated.sim_model_info("sim://llama2-7b/q4_0")  # 32 layers
    gpu = SearchSpace.for_target(simulated.parse_chip("M2 Max/38"), model, 512, objective="tg")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    assert {gpu.suggest(study.ask()).no_kv_offload for _ in range(30)} == {False, True}
    cpuinfo = "".join(f"processor\t: {i}\nmodel name\t: AMD EPYC 9654\ncore id\t: {i}\n\n" for i in range(4))
    (tmp_path / "cpuinfo.txt").write_text(cpuinfo)
    assert SearchSpace.for_target(fingerprint_from_dir(tmp_path), model, 512).switches == ()  # no GPU

    params = BenchParams(n_gpu_layers=33, n_threads=4, no_kv_offload=True)
    assert params.llama_cpp_flags("llama-bench").endswith("-nkvo 1")
    assert params.llama_cpp_flags("llama-server").endswith("-nkvo")
    assert params.llama_cpp_python_kwargs()["offload_kqv"] is False
    assert knobs.server_settings(params)["offload_kqv"] is False
    assert knobs.library_params(params, "context")["offload_kqv"] is False
    assert parse_pin("--no-kv-offload -t 2", 32) == {"no_kv_offload": True, "n_threads": 2}
    record = llamabench.llama_bench_record(
        params=params, kind="tg", samples=[(16, 0.5), (16, 0.4)], build_commit="x", cpu_info="c", gpu_info="g",
        backend="metal", model_filename="x.gguf", model_type="llama 8B Q4_0", model_size=1, model_n_params=1,
        test_time="2026-01-01T00:00:00Z")
    assert record["no_kv_offload"] is True
    assert llamabench.parse_record(1, record).params == params
