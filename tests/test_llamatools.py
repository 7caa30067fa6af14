"""llama.cpp's own tools as dependencies (issue 22 item 4; issue 20 items 7 and 8): where each is found,
which build it is, how the build is configured and reused, llama-bench's runs of a configuration,
``fleettune verify``'s plan and refusals, and the one line for a GPU that llama.cpp cannot use."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import learn, verify
from orchestrator.cli import main
from orchestrator.db import open_database
from orchestrator.studies import ChipTarget, StudyConfig, StudyRunner
from orchestrator.virtual import VirtualFleet
from tests.conftest import require_llama_tool
from workers import hardware, llamatools, simulated
from workers.errors import BadInput
from workers.trial import BenchParams, Workload

ROOT = Path(__file__).resolve().parents[1]


def executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """No tool variables, an empty cache and a PATH of one empty folder."""
    for var in llamatools.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "path").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    return tmp_path


def test_a_tool_is_found_by_its_variable_then_the_build_cache_then_path(clean_env, monkeypatch):
    assert llamatools.find_tool("llama-server") is None
    on_path = executable(clean_env / "path" / "llama-server")
    assert llamatools.find_tool("llama-server") == str(on_path)
    cached = executable(llamatools.build_dir("cpu") / "bin" / "llama-server")
    assert llamatools.find_tool("llama-server") == str(cached)  # fleettune's build before PATH
    assert str(cached).startswith(str(clean_env / "cache" / "fleettune" / "llama.cpp-0.3.36-cpu" / "bin"))
    named = executable(clean_env / "mine" / "llama-server")
    monkeypatch.setenv("FLEETTUNE_LLAMA_SERVER", str(named))
    assert llamatools.find_tool("llama-server") == str(named)  # the variable before everything
    monkeypatch.setenv("FLEETTUNE_LLAMA_SERVER", str(clean_env / "missing"))
    assert llamatools.find_tool("llama-server") is None  # a variable naming nothing is not skipped over
    assert llamatools.find_tool("llama-bench") is None  # each tool has its own variable and file
    monkeypatch.setenv("FLEETTUNE_LLAMA_BENCH", str(named))
    assert llamatools.find_tool("llama-bench") == str(named)
    with pytest.raises(BadInput):
        llamatools.find_tool("llama-cli")


def test_a_gpu_build_in_the_cache_is_found_before_the_cpu_one(clean_env):
    executable(llamatools.build_dir("cpu") / "bin" / "llama-bench")
    cuda = executable(llamatools.build_dir("cuda") / "bin" / "llama-bench")
    assert llamatools.find_tool("llama-bench") == str(cuda)


def test_serve_finds_llama_server_the_same_way(clean_env):
    from workers import serve

    with pytest.raises(BadInput, match="tools build"):
        serve.server_kind("llama-server")
    assert serve.server_kind("auto").name == "llama-cpp-python"
    cached = executable(llamatools.build_dir("cpu") / "bin" / "llama-server")
    kind = serve.server_kind("auto")
    assert kind.name == "llama-server" and kind.binary == str(cached)


def test_the_identity_of_a_build_and_of_another_binary(clean_env):
    built = executable(llamatools.build_dir("cpu") / "bin" / "llama-bench")
    (llamatools.build_dir("cpu") / "build.json").write_text(json.dumps(
        {"llama_cpp_python": "0.3.36", "commit": "0c1e57098", "backend": "cpu"}))
    assert llamatools.identity(str(built))["commit"] == "0c1e57098"
    assert llamatools.identity(str(built))["backend"] == "cpu"
    brewed = executable(clean_env / "brew" / "bin" / "llama-bench",
                        "#!/bin/sh\necho 'version: 6100 (4df29be4f)' >&2\necho 'built with clang' >&2\n")
    found = llamatools.identity(str(brewed))
    assert found["version"] == "6100" and found["commit"] == "4df29be4f"
    newer = executable(clean_env / "brew2" / "bin" / "llama-server",  # llama.cpp's --version since 2026
                       "#!/bin/sh\necho 'version: 0.5.0-dev (build 1, commit 0c1e57098)' >&2\n")
    found = llamatools.identity(str(newer))
    assert found["version"] == "0.5.0-dev" and found["commit"] == "0c1e57098"


def test_the_build_is_configured_offline_without_the_web_ui(monkeypatch):
    monkeypatch.setattr(llamatools, "drop_amx", lambda: False)
    args = llamatools.cmake_args("cpu", "0c1e57098")
    for wanted in ("-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_SERVER=ON",
                   "-DLLAMA_BUILD_COMMIT=0c1e57098", "-DBUILD_SHARED_LIBS=OFF"):
        assert wanted in args
    assert not any("amx" in a for a in args)
    assert "-DGGML_CUDA=ON" in llamatools.cmake_args("cuda", None)
    monkeypatch.setattr(llamatools, "drop_amx", lambda: True)  # as install.sh built the library here
    assert f"-DCMAKE_CXX_FLAGS={llamatools.NO_AMX_FLAGS}" in llamatools.cmake_args("cpu", None)


def test_the_tools_drop_amx_only_where_the_library_did(monkeypatch):
    """Issue 20.8: the AMX kernels are dropped where install.sh's probe saw them crash (the installed
    library has none), never from /proc/cpuinfo alone."""
    from workers import llamacompat

    monkeypatch.setattr(llamatools, "amx_reported", lambda: True)
    monkeypatch.setattr(llamacompat, "library_has_amx", lambda: True)
    assert not llamatools.drop_amx()  # they ran: kept
    monkeypatch.setattr(llamacompat, "library_has_amx", lambda: False)
    assert llamatools.drop_amx()  # dropped from the library: dropped from the tools
    monkeypatch.setattr(llamatools, "amx_reported", lambda: False)
    assert not llamatools.drop_amx()


def test_the_amx_probe_runs_llama_cpps_kernels_on_a_synthetic_model_in_a_child(monkeypatch):
    """The probe's child really loads and decodes (with this machine's library: it has run), a
    child's death by a signal is a crash, an ordinary exit status is not."""
    from workers import llamacompat

    monkeypatch.setattr(llamacompat, "library_has_amx", lambda: True)  # probe whatever is installed
    assert llamacompat.amx_kernels_run() is True
    assert llamacompat.crashed(-4) and llamacompat.crashed(-11) and not llamacompat.crashed(1)


def test_the_vendored_commit_comes_from_the_releases_changelog(tmp_path):
    (tmp_path / "CHANGELOG.md").write_text(
        "# Changelog\n\n## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n"
        "## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n")
    assert llamatools.vendored_commit(tmp_path, "0.3.36") == "0c1e57098"
    assert llamatools.vendored_commit(tmp_path, "0.3.35") == "4df29be4f"
    assert llamatools.vendored_commit(tmp_path, "0.3.1") is None


def test_a_build_in_the_cache_is_reused_and_a_bad_backend_refused(clean_env, monkeypatch):
    monkeypatch.setenv("PATH", os.environ["PATH"] + os.pathsep + "/usr/bin:/bin")  # cmake and c++ are there
    if not (llamatools.shutil.which("cmake") and llamatools.shutil.which("c++")):
        pytest.skip("no cmake or c++ on this machine")
    target = llamatools.build_dir("cpu")
    for name in llamatools.TOOLS:
        executable(target / "bin" / name)
    (target / "build.json").write_text(json.dumps({"llama_cpp_python": "0.3.36", "commit": "x", "backend": "cpu"}))
    info = llamatools.build("cpu")
    assert info["reused"] and info["commit"] == "x"  # nothing built: no cmake ran, no log was written
    assert not list((clean_env / "cache" / "fleettune").glob("*.build.log"))
    with pytest.raises(BadInput):
        llamatools.build("vulkan")


def test_llama_bench_runs_a_prompt_on_the_prompt_threads():
    """llama-bench has no -tb: a configuration whose prompt threads differ is two runs, the pp one
    with -t set to the prompt threads (issue 20 item 5's rule)."""
    params = BenchParams(0, 4, 512, 512, n_threads_batch=8)
    pp_run, tg_run = llamatools.bench_runs("lb", "m.gguf", params, Workload(64, 16, 2, depth=128), repack=False)
    assert " -p 64 -n 0 " in " ".join(pp_run) and pp_run[pp_run.index("-t") + 1] == "8"
    assert " -p 0 -n 16 " in " ".join(tg_run) and tg_run[tg_run.index("-t") + 1] == "4"
    assert pp_run[pp_run.index("-d") + 1] == "128" and "-tb" not in pp_run and pp_run[-2:] == ["-o", "json"]
    assert "--repack" in pp_run
    (one,) = llamatools.bench_runs("lb", "m.gguf", BenchParams(0, 4, 512, 512), Workload(64, 16, 2))
    assert " -p 64 -n 16 -r 2 " in " ".join(one)
    (pp_only,) = llamatools.bench_runs("lb", "m.gguf", params, Workload(64, 0, 2))
    assert pp_only[pp_only.index("-t") + 1] == "8"


def test_llama_bench_json_is_read_as_rates():
    text = json.dumps([{"n_prompt": 64, "n_gen": 0, "avg_ts": 812.5}, {"n_prompt": 0, "n_gen": 16, "avg_ts": 91.25}])
    assert llamatools.parse_llama_bench_json(text) == {"pp64": 812.5, "tg16": 91.25}


def test_a_failing_llama_bench_is_one_line(tmp_path):
    broken = executable(tmp_path / "llama-bench", "#!/bin/sh\necho loading >&2\necho 'error: no model' >&2\nexit 1\n")
    with pytest.raises(llamatools.ToolError, match="exited with 1: error: no model"):
        llamatools.run_llama_bench([str(broken)])


def test_rounds_rotate_the_order():
    assert verify.rotation(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


CHIP = simulated.parse_chip("M2 Ultra/76/192")
MODEL = simulated.sim_model_info("sim://llama2-7b/q4_0")


@pytest.fixture(scope="module")
def simulated_study(tmp_path_factory) -> tuple[str, StudyRunner, object]:
    """One finished simulated study (database URL, its runner, its outcome) for the tests below."""
    url = f"sqlite:///{tmp_path_factory.mktemp('verify') / 'results.db'}"
    fleet = VirtualFleet(CHIP, 2, trial_s=0.0, prefix="node", seed=3)
    config = StudyConfig(model=MODEL, workload=Workload(512, 128, 1), n_trials=6, sampler="tpe", seed=1,
                         name="sim-study")
    run = StudyRunner(open_database(url), fleet, config, ChipTarget(CHIP, {}, simulated=True),
                      alive_nodes=partial(fleet.alive_nodes, CHIP.chip_key))
    return url, run, run.run()


def test_the_plan_is_the_studys_recommendation_baselines_workload_and_claims(simulated_study):
    url, run, outcome = simulated_study
    plan = verify.plan(open_database(url), "sim-study", reps=2)
    rec = outcome.recommendation
    assert list(plan.configs) == [verify.RECOMMENDATION, learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP]
    assert plan.configs[learn.LLAMA_CPP_PYTHON] == run.baselines[learn.LLAMA_CPP_PYTHON]
    assert plan.configs[learn.LLAMA_CPP] == run.baselines[learn.LLAMA_CPP]
    assert plan.configs[verify.RECOMMENDATION] == rec.params
    assert plan.workload == Workload(512, 128, 2) and plan.simulated and plan.objective.name == "tg"
    claims = rec.claims
    for name in (learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP):
        # the study's paired claim; where llama.cpp's defaults won, the claim over them is 1 with the
        # A/A arm's interval centred on it
        stored = claims["vs"].get(name) or (claims["winner"] == name
                                            and verify.same_configuration_claim(claims["noise"]))
        assert stored, name
        assert [plan.claims[name][k] for k in ("ratio", "low", "high")] == pytest.approx(
            [stored[k] for k in ("ratio", "low", "high")])


def test_an_earlier_study_is_planned_with_its_own_recommendation_after_a_later_one(tmp_path):
    # the H200 CPU's five studies of one model: a later study's recommendation is the newer version,
    # the earlier study's own stays what verify referees
    url = f"sqlite:///{tmp_path / 'results.db'}"
    runs = {}
    for seed, name in ((1, "first"), (2, "second")):
        fleet = VirtualFleet(CHIP, 2, trial_s=0.0, prefix="node", seed=seed)
        config = StudyConfig(model=MODEL, workload=Workload(512, 128, 1), n_trials=4, sampler="tpe", seed=seed,
                             name=name)
        run = StudyRunner(open_database(url), fleet, config, ChipTarget(CHIP, {}, simulated=True),
                          alive_nodes=partial(fleet.alive_nodes, CHIP.chip_key))
        runs[name] = run.run().recommendation
    for name, rec in runs.items():
        plan = verify.plan(open_database(url), name)
        assert plan.configs[verify.RECOMMENDATION] == rec.params
        assert plan.claims[learn.LLAMA_CPP_PYTHON]["ratio"] == pytest.approx(
            rec.claims["vs"][learn.LLAMA_CPP_PYTHON]["ratio"])


def test_a_recommended_reference_is_claimed_as_itself_within_the_aa_width():
    # the H200 CPU's study 2: llama.cpp's defaults recommended, their A/A arm at -6.7 % (-10.4 … -3.0 %)
    noise = {"ratio": 0.933, "low": 0.896, "high": 0.970, "rounds": 5, "text": "-6.7 % (...)"}
    claim = verify.same_configuration_claim(noise)
    assert claim["ratio"] == 1.0 and claim["low"] == pytest.approx(0.896 / 0.933)
    assert claim["high"] == pytest.approx(0.970 / 0.933) and claim["low"] < 1 < claim["high"]
    assert "the same configuration" in claim["text"] and "5 rounds" in claim["text"]
    # an A/A arm with no interval (a baseline that scored 0) claims 1 with none
    assert verify.same_configuration_claim({"ratio": None, "low": None, "high": None})["low"] is None


def test_verify_refuses_with_one_line(simulated_study, clean_env, monkeypatch):
    url = simulated_study[0]

    def run(*args):
        return CliRunner().invoke(main, ["verify", *args, "--db", url])

    done = run("some-study")
    assert done.exit_code == 2 and "llama-bench not found" in done.stderr and len(done.stderr.splitlines()) == 1
    monkeypatch.setenv("FLEETTUNE_LLAMA_BENCH", str(executable(clean_env / "llama-bench")))
    done = run("some-study")
    assert done.exit_code == 2 and "unknown study 'some-study'" in done.stderr
    done = run("sim-study")
    assert done.exit_code == 2 and "simulated" in done.stderr and len(done.stderr.splitlines()) == 1
    done = run("sim-study", "--rounds", "1")
    assert done.exit_code == 2


def test_a_gpu_llama_cpp_cannot_use_gets_one_line():
    nvidia = {"gpu_name": "NVIDIA H200", "gpu_memory_bytes": 141 * 2**30}
    cpuinfo = {"cpu_model": "Intel Xeon", "physical_cores": 16, "logical_cores": 32}
    fields = hardware._linux_fingerprint(cpuinfo, {}, 2**40, nvidia, "Linux")
    without = hardware._finish(fields, False)
    line = hardware.gpu_unused(without)
    assert without.backend == "cpu" and "NVIDIA H200" in line and "FLEETTUNE_CUDA=1" in line
    assert hardware.gpu_unused(hardware._finish(fields, True)) is None
    assert hardware.gpu_unused(hardware._finish(hardware._linux_fingerprint(cpuinfo, {}, 2**40, {}, "Linux"),
                                                False)) is None  # no GPU: nothing to say
    mac = hardware.apple_chip("M2 Max", 8, 4, 38, 400.0)
    import dataclasses

    assert "Metal" in hardware.gpu_unused(dataclasses.replace(mac, backend="cpu", gpu_offload=False))
    assert hardware.gpu_unused(mac) is None


def test_hw_show_says_so(monkeypatch):
    from orchestrator import cli

    nvidia = {"gpu_name": "NVIDIA H200", "gpu_memory_bytes": 141 * 2**30}
    fields = hardware._linux_fingerprint({"cpu_model": "Intel Xeon", "physical_cores": 16, "logical_cores": 32},
                                         {}, 2**40, nvidia, "Linux")
    monkeypatch.setattr(cli, "fingerprint_live", lambda: hardware._finish(fields, False))
    done = CliRunner().invoke(main, ["hw", "show", "--json"])
    assert done.exit_code == 0 and json.loads(done.stdout)["backend"] == "cpu"
    assert done.stderr.startswith("warning: this machine has a GPU (NVIDIA H200)")


def test_a_missing_tool_skips_its_tests_but_fails_them_in_ci(clean_env, monkeypatch):
    """Outside CI a missing llama-server or llama-bench skips the tests that need it; in CI (CI=true,
    .ci/run, which builds the tools first) it fails them."""
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="no llama-server binary"):
        require_llama_tool("llama-server")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no llama-bench binary"):
        require_llama_tool("llama-bench")
    found = executable(llamatools.build_dir("cpu") / "bin" / "llama-bench")
    assert require_llama_tool("llama-bench") == str(found)


def test_ci_builds_the_tools_before_the_tests():
    run = (ROOT / ".ci" / "run").read_text()
    assert "export CI=true" in run
    line = next(x for x in run.splitlines() if "pytest" in x)
    assert line.index("fleettune tools build") < line.index("pytest")


# ---------------------------------------------------------------- with the real llama-bench and model

@pytest.fixture(scope="session")
def llama_bench() -> str:
    return require_llama_tool("llama-bench")


def test_llama_bench_measures_a_configuration_with_its_prompt_threads(llama_bench, model_path):
    from workers.llamacompat import extra_buffers_usable

    params = BenchParams(0, 1, 32, 32, n_threads_batch=2)
    figures = llamatools.measure_with_llama_bench(llama_bench, str(model_path), params, Workload(32, 8, 1),
                                                  repack=extra_buffers_usable(str(model_path)))
    assert figures.pp_tps > 0 and figures.tg_tps > 0
    build = llamatools.identity(llama_bench)
    assert build["commit"]  # fleettune's build records the vendored commit; Homebrew's says its own


def test_verify_referees_a_real_study_with_llama_bench(llama_bench, model_info, local_fingerprint, ray_cluster,
                                                       sqlite_url):
    from orchestrator.tune import tune

    db = open_database(sqlite_url)
    cfg = StudyConfig(model=model_info, n_trials=3, seed=1, confirm_top=1, objective="tg", name="referee-me",
                      workload=Workload(n_prompt=32, n_gen=8, reps=1))
    outcome = tune(db, cfg, chip_key=local_fingerprint.chip_key, warm=False)
    assert outcome.recommendation is not None
    report = verify.verify_study(db, "referee-me", rounds=3, reps=1)
    assert report.orders == verify.rotation(list(report.plan.configs), 3)  # A B C, B C A, C A B
    assert all(len(rates) == 3 and all(r and r > 0 for r in rates) for rates in report.rates.values())
    rows = {row["config"]: row for row in report.rows()}
    for name in (learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP):
        row = rows[name]
        assert row["low"] <= row["measured_ratio"] <= row["high"] and row["verdict"] in (
            "faster", "slower", "no measurable difference")
        claims = outcome.recommendation.claims  # the study's paired ratio and its interval (1 in the A/A
        # arm's width where the recommendation is llama.cpp's defaults itself)
        claim = claims["vs"].get(name) or verify.same_configuration_claim(claims["noise"])
        assert (row["claimed_ratio"], row["claimed_low"], row["claimed_high"]) == pytest.approx(
            (claim["ratio"], claim["low"], claim["high"]))
        assert row["inside_claim"] == (claim["low"] <= row["measured_ratio"] <= claim["high"])
    shown = CliRunner().invoke(main, ["verify", "referee-me", "--rounds", "2", "-r", "1", "--db", sqlite_url,
                                      "--json"])
    assert shown.exit_code == 0, shown.output
    printed = json.loads(shown.stdout)
    assert [r["config"] for r in printed] == list(report.plan.configs)
    assert "round 2/2" in shown.stderr and "commit" in shown.stderr


# llama-fit-params's stdout as llama.cpp's tools/fit-params/README.md shows it (Qwen3-30B-A3B F16 on a
# 24 GiB RTX 4090), two layers of its 34 overflowing ones kept here
FIT_PARAMS_README = ('-c 4096 -ngl 48 -ot "blk\\.14\\.ffn_(up|down|gate)_(ch|)exps=CPU,'
                     'blk\\.15\\.ffn_(up|down|gate)_(ch|)exps=CPU"\n')


def test_llama_fit_params_placement_is_read_and_given_to_each_tool_in_its_own_form():
    fit = llamatools.parse_fit_params(FIT_PARAMS_README)
    assert (fit.n_ctx, fit.n_gpu_layers) == (4096, 48)
    assert fit.overrides == (r"blk\.14\.ffn_(up|down|gate)_(ch|)exps=CPU", r"blk\.15\.ffn_(up|down|gate)_(ch|)exps=CPU")
    bench = fit.llama_bench_args()  # llama-bench: ';' between overrides (',' would be a second test)
    assert bench[:2] == ["-ngl", "48"] and bench[3].count(";") == 1 and "," not in bench[3]
    assert fit.llama_server_args()[-1].count(",") == 1
    assert llamatools.parse_fit_params("-c 8192 -ngl 0\n").overrides == ()
    with pytest.raises(llamatools.ToolError):
        llamatools.parse_fit_params("llama_params_fit: failed to fit\n")


def test_the_fit_target_makes_llama_cpp_plan_for_the_budget():
    gib = 1024**3
    # 140 GiB free, an 8 GiB budget: leave 133 GiB free, so 7 GiB (the budget less the 1 GiB margin) is used
    assert llamatools.fit_target_mib(140 * gib, 8 * gib) == 133 * 1024
    assert llamatools.fit_target_mib(4 * gib, 8 * gib) == 0  # less free than the budget: the default margin is moot
    argv = llamatools.fit_params_argv("llama-fit-params", "m.gguf", 640, 1024)
    assert argv[argv.index("-fitc") + 1] == "640" and argv[argv.index("-fitt") + 1] == "1024"


def test_llama_fit_params_places_the_real_model_and_the_referee_runs_it(llama_bench, model_path, tmp_path):
    """llama-fit-params of fleettune's build prints its placement (on a CPU build: every layer asked,
    nothing to move), and bench/fit_referee.py measures it against a configuration with llama-bench."""
    import subprocess
    import sys

    fitter = require_llama_tool("llama-fit-params")
    placed = llamatools.run_fit_params(llamatools.fit_params_argv(fitter, str(model_path), 96))
    assert placed.n_ctx == 96 and placed.overrides == ()
    report = tmp_path / "referee.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_referee.py"), "--model", str(model_path),
                           "--budget", "1GiB", "--config", "one=-t 1", "--tests", "pp32,tg8", "--rounds", "2",
                           "-r", "1", "--llama-bench", llama_bench, "--fit-params", fitter, "--json", str(report)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads(report.read_text())["tests"]
    assert rows["pp32"]["one"]["median"] > 0 and rows["tg8"]["llama.cpp --fit"]["median"] > 0
    assert rows["tg8"]["one"]["vs_fit"]["text"]  # a ratio with its interval, from the paired rounds


def test_a_placement_grid_of_the_real_model_is_measured_point_by_point(llama_bench, model_path, tmp_path):
    """bench/placement_grid.py measures every point of the product with the real llama-bench (one
    process per placement and test), --fit's placement alone and crossed, and its best point's
    flags are what the referee is given."""
    import subprocess
    import sys

    fitter = require_llama_tool("llama-fit-params")
    grid = tmp_path / "grid.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "placement_grid.py"), "--model", str(model_path),
                           "--budget", "1GiB", "--ngl", "0,31", "--threads", "1,2", "--fa", "off,on",
                           "--ubatch", "16,32", "--tests", "tg4,pp32", "-r", "2", "--llama-bench", llama_bench,
                           "--fit-params", fitter, "--json", str(grid)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(grid.read_text())
    points = report["points"]
    searched = [p for p in points if not p["placement"].startswith("--fit")]
    # 2 placements x 2 threads x 2 attention, tg at one micro-batch and pp at two
    assert len([p for p in searched if p["test"] == "tg4"]) == 8
    assert len([p for p in searched if p["test"] == "pp32"]) == 16
    assert all(len(p["samples"]) == 2 and p["median"] > 0 and p["error"] is None for p in points)
    keys = {(p["placement"], p["test"], p["params"]["n_threads"], p["params"]["flash_attn"], p["params"]["n_ubatch"])
            for p in searched}
    assert len(keys) == 24  # each point its own row of llama-bench's output, none read twice
    alone = [p for p in points if p["alone"]]
    assert {p["test"] for p in alone} == {"tg4", "pp32"} and alone[0]["placement"] == "--fit 1GiB"
    assert report["budgets"]["1GiB"]["fit_flags"][0] == "-ngl"
    flags = subprocess.run([sys.executable, str(ROOT / "bench" / "placement_grid.py"), "--best",
                            f"{grid}:pp32:1GiB"], capture_output=True, text=True, check=True).stdout.split()
    best = max((p for p in searched if p["test"] == "pp32"), key=lambda p: p["median"])
    assert flags[flags.index("-t") + 1] == str(best["params"]["n_threads"])
    assert flags[flags.index("-ub") + 1] == str(best["params"]["n_ubatch"])
    assert "best of 16 points within the budget" in done.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "placement_grid.py"), "--best", f"{grid}:tg9:1GiB"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
