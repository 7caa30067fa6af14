"""Two baselines measured in every study (llama-cpp-python's defaults and llama.cpp's own), the
recommendation never slower than either by the study's evidence, and a workload with a depth."""

from __future__ import annotations

import json
from functools import partial

import pytest
from click.testing import CliRunner

from orchestrator import learn
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.space import llama_cpp_defaults, llama_cpp_python_defaults
from orchestrator.studies import ChipTarget, StudyConfig, StudyRunner, check_depth
from orchestrator.virtual import VirtualFleet
from workers import simulated
from workers.errors import BadInput
from workers.trial import BenchParams, Sample, Workload

CHIP = simulated.parse_chip("M2 Ultra/76/192")
MODEL = simulated.sim_model_info("sim://llama2-7b/q4_0")
SLOW = BenchParams(0, 4, 512, 512)
DEFAULTS = BenchParams(33, 16, 512, 512, flash_attn="auto")


def record(trial_id: int, phase: str, params: BenchParams, tg: float) -> learn.TrialRecord:
    samples = tuple(Sample("tg", rep, 128, 128 / (tg * (1 + 0.01 * rep))) for rep in range(3))
    return learn.TrialRecord(trial_id, phase, params, samples, simulated=True)


BASELINES = {learn.LLAMA_CPP_PYTHON: SLOW, learn.LLAMA_CPP: DEFAULTS}


def test_a_baseline_no_search_beats_is_the_recommendation():
    searched = BenchParams(20, 8, 512, 512)
    records = [record(1, "baseline", SLOW, 10.0), record(2, "baseline", DEFAULTS, 80.0),
               record(3, "search", searched, 70.0), record(4, "confirm", searched, 71.0),
               record(5, "confirm", SLOW, 10.0), record(6, "confirm", DEFAULTS, 79.0)]
    draft = learn.recommend(records, "tg", 512, 128, BASELINES)
    assert draft.params == DEFAULTS
    assert draft.improvement_over(learn.LLAMA_CPP) == pytest.approx(0.0)
    assert draft.improvement_over(learn.LLAMA_CPP_PYTHON) > 6
    assert draft.baseline_tps == draft.baselines[learn.LLAMA_CPP_PYTHON]


def test_a_baseline_measured_but_left_out_of_the_confirmation_still_competes():
    searched = BenchParams(20, 8, 512, 512)
    records = [record(1, "baseline", SLOW, 10.0), record(2, "baseline", DEFAULTS, 80.0),
               record(3, "confirm", searched, 70.0)]
    assert learn.recommend(records, "tg", 512, 128, BASELINES).params == DEFAULTS


def test_the_gain_over_each_baseline_when_the_search_wins():
    searched = BenchParams(33, 1, 512, 512, flash_attn="on")
    records = [record(1, "baseline", SLOW, 10.0), record(2, "baseline", DEFAULTS, 80.0),
               record(3, "confirm", searched, 88.0)]
    draft = learn.recommend(records, "tg", 512, 128)  # names follow the study's order
    assert draft.params == searched
    assert set(draft.baselines) == {learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP}
    assert draft.improvement_over(learn.LLAMA_CPP) == pytest.approx(88 / 80 - 1, rel=0.02)
    assert draft.improvement_over(learn.LLAMA_CPP_PYTHON) == pytest.approx(88 / 10 - 1, rel=0.02)



def never_measurably_slower(rec) -> bool:
    """Rule 20.3: by the paired rounds, the recommendation is slower than neither baseline (each
    baseline is either the recommendation itself or compared with it in ``claims["vs"]``)."""
    vs = rec.claims["vs"]
    return set(vs) | {rec.claims["winner"]} >= {learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP} and all(
        claim["verdict"] != "slower" for claim in vs.values())

def runner(url: str, **cfg) -> StudyRunner:
    fleet = VirtualFleet(CHIP, 4, trial_s=0.0, per_wait=7, prefix="node", seed=3)
    workload = cfg.pop("workload", Workload(512, 128, 1))
    config = StudyConfig(model=MODEL, workload=workload, **{"n_trials": 12, "sampler": "tpe", "seed": 1, **cfg})
    return StudyRunner(open_database(url), fleet, config, ChipTarget(CHIP, {}, simulated=True),
                       alive_nodes=partial(fleet.alive_nodes, CHIP.chip_key))


def test_a_study_measures_both_baselines_and_stores_its_gain_over_each(sqlite_url):
    run = runner(sqlite_url, name="two-baselines")
    outcome = run.run()
    rec = outcome.recommendation
    assert set(outcome.baselines) == {learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP}
    assert outcome.baselines[learn.LLAMA_CPP] == llama_cpp_defaults(CHIP, MODEL, 512)
    assert outcome.baselines[learn.LLAMA_CPP_PYTHON] == llama_cpp_python_defaults(CHIP)
    assert never_measurably_slower(rec)
    with run.db.session() as s:
        phases = [(t.phase, t.params) for t in repo.study_trials(s, run.study_id)]
        stored = repo.latest_recommendations(s, [repo.find_models(s, MODEL.sha256)[0].id])[0]
        assert stored.baselines == pytest.approx(rec.baselines)
    baseline_configs = {str(sorted(p.items())) for phase, p in phases if phase == "baseline"}
    assert len(baseline_configs) == 2
    confirmed = [BenchParams.from_dict(p) for phase, p in phases if phase == "confirm"]
    assert all(b in confirmed for b in outcome.baselines.values())  # both measured again at the end
    rows = CliRunner().invoke(main, ["best", "--model", MODEL.sha256[:12], "--db", sqlite_url, "--json"])
    assert rows.exit_code == 0, rows.output
    assert '"improvement_llama_cpp"' in rows.stdout and "llama_bench_flags" in rows.stdout
    shown = CliRunner().invoke(main, ["recommend", "--model", "sim://llama2-7b/q4_0", "--chip", CHIP.chip_key,
                                      "--db", sqlite_url, "--json"])
    assert shown.exit_code == 0, shown.output
    gains = json.loads(shown.stdout)[0]["gains"]
    assert set(gains) == {learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP} and min(gains.values()) >= 0


def test_a_workload_with_a_depth_is_its_own_study(sqlite_url):
    deep = runner(sqlite_url, workload=Workload(512, 128, 1, depth=2048), n_trials=4, allow_lossy=True)
    deep.run()
    assert deep.name.endswith("-d2048")
    first = _search_params(deep.db, deep.name)[:4]
    # the compact guess, where lossy knobs are allowed (issue 20.4)
    assert any((p.flash_attn, p.type_k, p.type_v) == ("on", "q4_0", "q4_0") for p in first)
    with deep.db.session() as s:
        assert repo.get_study(s, deep.name).depth == 2048
    flat = runner(sqlite_url, n_trials=4)
    flat.run()
    assert flat.name != deep.name
    again = runner(sqlite_url, workload=Workload(512, 128, 1, depth=2048), resume=True, n_trials=6)
    again.run()
    assert again.name == deep.name  # --resume finds the study of the same depth
    with pytest.raises(BadInput, match="another chip, model or workload"):
        runner(sqlite_url, workload=Workload(512, 128, 1, depth=1024), name=deep.name, resume=True).prepare()


@pytest.mark.parametrize("depth, message", [(-1, ">= 0"), (4000, "exceed"), (1.5, "whole number")])
def test_a_bad_depth_is_refused_before_anything_is_written(depth, message):
    with pytest.raises(BadInput, match=message):
        check_depth(Workload(512, 128, 1, depth=depth), MODEL)


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "5000"])
def test_tune_with_a_bad_depth_is_one_line_exit_2(sqlite_url, value):
    result = CliRunner().invoke(main, ["tune", "sim://llama2-7b/q4_0", "--depth", value, "--db", sqlite_url,
                                       "--quiet"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output and "depth" in result.output.lower()


def test_the_history_plot_draws_both_baselines_as_levels_to_beat(sqlite_url):
    from orchestrator import plots

    run = runner(sqlite_url, name="plotted", n_trials=6)
    outcome = run.run()
    figure = plots.history(run.db, run.name)
    levels = {name: ys[0] for name, (_, ys) in figure.series.items() if name != "best so far"}
    assert set(levels) == {learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP}
    assert levels[learn.LLAMA_CPP] > levels[learn.LLAMA_CPP_PYTHON]  # every layer on the GPU
    assert levels == pytest.approx(outcome.recommendation.baselines, rel=0.1)


def _search_params(db, name: str) -> list[BenchParams]:
    with db.session() as s:
        study = repo.get_study(s, name)
        return [BenchParams.from_dict(t.params) for t in repo.study_trials(s, study.id, "search")]


def test_tune_searches_the_new_dimensions_on_a_simulated_mac_at_a_depth(sqlite_url, ray_cluster):
    from orchestrator.tune import tune
    from tests.conftest import SIM_CHIPS

    db = open_database(sqlite_url)
    model = simulated.sim_model_info("sim://llama3-8b/q4_k_m")
    cfg = StudyConfig(model=model, n_trials=16, seed=2, objective="e2e", allow_lossy=True,
                      workload=Workload(n_prompt=512, n_gen=64, reps=1, depth=4096))
    outcome = tune(db, cfg, chip_key=SIM_CHIPS["M2 Ultra/76"], warm=False)
    tried = _search_params(db, outcome.name)
    assert {p.flash_attn for p in tried} == {"off", "on", "auto"}
    assert {p.type_k for p in tried} > {"f16"} and {p.type_v for p in tried} > {"f16"}
    assert len({p.n_threads_batch for p in tried}) > 2  # e2e: the prompt's threads apart
    assert all(p.kv_problem is None for p in tried)
    rec = outcome.recommendation
    assert set(rec.baselines) == {learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP}
    assert never_measurably_slower(rec)
    with db.session() as s:
        assert repo.get_study(s, outcome.name).depth == 4096


@pytest.mark.timeout(1200)  # a real study: 10 trials, KL divergences of quantized caches, 3 interleaved rounds
def test_tune_searches_the_new_dimensions_on_this_cpu_with_the_real_model(sqlite_url, model_info,
                                                                          local_fingerprint, ray_cluster):
    from orchestrator.tune import tune

    db = open_database(sqlite_url)
    cfg = StudyConfig(model=model_info, n_trials=8, seed=1, confirm_top=1, objective="e2e", allow_lossy=True,
                      confirm_rounds=3,
                      workload=Workload(n_prompt=64, n_gen=16, reps=1, depth=128))
    outcome = tune(db, cfg, chip_key=local_fingerprint.chip_key, warm=False)
    tried = _search_params(db, outcome.name)
    assert len({(p.flash_attn, p.type_k, p.type_v) for p in tried}) > 2
    assert all(p.n_gpu_layers == 0 for p in tried)  # a CPU-only build
    rec = outcome.recommendation
    assert rec is not None and set(rec.baselines) == {learn.LLAMA_CPP_PYTHON, learn.LLAMA_CPP}
    assert never_measurably_slower(rec)
    flags = rec.params.llama_cpp_flags()
    assert BenchParams.from_llama_flags(flags, model_info.n_layer) == rec.params  # flags llama.cpp reads back
