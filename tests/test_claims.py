"""Issue 20: claims a referee confirms. Effective configurations (1), the interleaved confirmation
(2), gains with intervals and the A/A noise (3), lossy knobs opt-in with their KL divergence (4),
only the knobs a study decided (5), no repeated failures (6).

Fast tests run the study loop on the in-process virtual fleet and the simulator; the two real
ones measure SmolLM2 with llama.cpp."""

from __future__ import annotations

import json
import math
from functools import partial

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState

from orchestrator import learn
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.report import llama_bench_form
from orchestrator.space import CACHE_TYPES, SearchSpace, llama_cpp_defaults
from orchestrator.studies import (
    PENALISED,
    ChipTarget,
    SamplerJobs,
    StudyConfig,
    StudyRunner,
)
from orchestrator.virtual import VirtualFleet
from workers import simulated
from workers.bench import lossy as is_lossy
from workers.bench import measure
from workers.trial import BenchParams, FailureKind, Sample, TrialResult, TrialSpec, Workload

CHIP = simulated.parse_chip("M2 Ultra/76/192")
MODEL = simulated.sim_model_info("sim://llama2-7b/q4_0")


class FailingFleet(VirtualFleet):
    """The virtual fleet, where every configuration ``fails(params)`` picks times out."""

    def __init__(self, *args, fails, **kw) -> None:
        super().__init__(*args, **kw)
        self.fails = fails

    def result(self, ref: int, trial_key: str) -> TrialResult:
        spec = self.running[ref][0]
        result = super().result(ref, trial_key)
        if self.fails(spec.params):
            return TrialResult.failure(trial_key, "timed out after 45s", FailureKind.TIMEOUT,
                                       node_id=result.node_id, simulated=True)
        return result


def runner(url: str, fleet: VirtualFleet | None = None, **cfg) -> StudyRunner:
    fleet = fleet or VirtualFleet(CHIP, 3, trial_s=0.0, prefix="node", seed=3)
    workload = cfg.pop("workload", Workload(512, 128, 2))
    config = StudyConfig(model=MODEL, workload=workload, **{"n_trials": 12, "sampler": "tpe", "seed": 1, **cfg})
    return StudyRunner(open_database(url), fleet, config, ChipTarget(CHIP, {}, simulated=True),
                       alive_nodes=partial(fleet.alive_nodes, CHIP.chip_key))


def rows_of(run: StudyRunner, phase: str | None = None):
    with run.db.session() as s:
        return repo.study_trials(s, run.study_id, phase)


# ---------------------------------------------------------------- 1. effective configurations


def test_every_trial_stores_what_llama_cpp_ran_and_equal_ones_are_one_configuration(sqlite_url):
    run = runner(sqlite_url, name="effective")
    run.run()
    rows = [r for r in rows_of(run) if r.state == "complete"]
    assert rows and all(r.effective for r in rows)
    assert all(BenchParams.from_dict(r.effective).flash_attn in ("on", "off") for r in rows)  # auto resolved
    # llama.cpp's defaults (-fa auto) are never confirmed as a rival of what they resolve to
    defaults = next(r for r in rows_of(run, "baseline") if r.params["flash_attn"] == "auto")
    default_id = learn.identity(BenchParams.from_dict(defaults.params), defaults.effective)
    search_ids = {learn.config_key(BenchParams.from_dict(r.params)): learn.identity(
        BenchParams.from_dict(r.params), r.effective) for r in rows if r.phase == "search"}
    for r in rows_of(run, "confirm"):
        if r.confirm_arm.startswith(learn.CANDIDATE):
            asked = learn.config_key(BenchParams.from_dict(r.params))
            assert search_ids.get(asked) != default_id


def test_samples_of_configurations_that_ran_alike_pool():
    ran = BenchParams(33, 8, 512, 512, flash_attn="on").to_dict()
    auto, on = BenchParams(33, 8, 512, 512, flash_attn="auto"), BenchParams(33, 8, 512, 512, flash_attn="on")

    def rec(i: int, params: BenchParams, tg: float) -> learn.TrialRecord:
        samples = tuple(Sample("tg", r, 128, 128 / tg) for r in range(2))
        effective = ran if params.n_gpu_layers else params.to_dict()
        return learn.TrialRecord(i, "search", params, samples, True, effective=effective)

    records = [rec(1, auto, 100.0), rec(2, on, 110.0), rec(3, BenchParams(0, 8, 512, 512), 50.0)]
    assert learn.top_configs(records, {1: 100.0, 2: 110.0, 3: 50.0}, "tg", 3) == [on, BenchParams(0, 8, 512, 512)]
    draft = learn.recommend(records, "tg", 512, 128, {})
    assert sorted(draft.evidence) == [1, 2]  # one configuration: both trials' samples
    assert draft.expected_tps == pytest.approx(105.0)


def test_the_sampler_is_told_a_trial_is_a_repeat(sqlite_url):
    from dataclasses import replace

    defaults = llama_cpp_defaults(CHIP, MODEL, 512)  # -fa auto, which this chip resolves to on
    run = runner(sqlite_url, name="repeats", n_trials=8, sampler="random", seed=5,
                 warm_start=(replace(defaults, flash_attn="on"),))
    run.run()
    trials = {t.number: t for t in run.optuna_study.get_trials(states=(TrialState.COMPLETE,))}
    groups: dict[str, list[int]] = {}
    for r in rows_of(run, "search"):
        if r.state == "complete":
            groups.setdefault(learn.identity(BenchParams.from_dict(r.params), r.effective), []).append(r.optuna_number)
    repeated = [numbers for numbers in groups.values() if len(numbers) > 1]
    assert repeated  # -fa auto and -fa on ran alike
    for numbers in repeated:
        firsts = [n for n in numbers if "repeat_of" not in trials[n].user_attrs]
        assert len(firsts) == 1
        assert all(trials[n].user_attrs["repeat_of"] == firsts[0] for n in numbers if n != firsts[0])


# ---------------------------------------------------------------- 2. interleaved confirmation


def test_confirmation_rotates_every_arm_over_rounds_each_round_on_one_warmed_node(sqlite_url):
    fleet = VirtualFleet(CHIP, 3, trial_s=0.0, prefix="node", seed=3)
    pinned: list[str | None] = []  # the node each job was sent to, in order (confirmation jobs come last)
    submit = fleet.submit
    fleet.submit = lambda spec, chip_key, node_id=None: pinned.append(node_id) or submit(spec, chip_key, node_id)
    run = runner(sqlite_url, fleet=fleet, name="rounds")
    run.run()
    confirm = rows_of(run, "confirm")
    assert confirm[0].confirm_arm == learn.WARMUP_ARM
    rounds: dict[int, list[str]] = {}
    nodes: dict[int, set[str | None]] = {}
    warmed: set[str | None] = set()
    for r, node in zip(confirm, pinned[-len(confirm):], strict=True):
        assert node is not None
        if r.confirm_arm == learn.WARMUP_ARM:
            assert node not in warmed  # one warm-up per node, before its first round
            warmed.add(node)
            continue
        assert node in warmed
        rounds.setdefault(r.confirm_round, []).append(r.confirm_arm)
        nodes.setdefault(r.confirm_round, set()).add(node)
    assert 3 <= len(rounds) <= 8
    first = rounds[1]
    assert {learn.LLAMA_CPP, learn.LLAMA_CPP_PYTHON, learn.NOISE_ARM} <= set(first)
    for number, order in rounds.items():
        shift = (number - 1) % len(first)
        assert order == first[shift:] + first[:shift]  # A B C, B C A, ...
    assert all(len(n) == 1 for n in nodes.values())  # a round's ratios are paired on one node
    in_turn = [next(iter(nodes[number])) for number in sorted(nodes)]
    assert len(set(in_turn[:3])) == 3 and in_turn[3:] == in_turn[:len(in_turn) - 3]  # the nodes in turn


def test_rounds_stop_at_their_budget(sqlite_url):
    run = runner(sqlite_url, name="budget", confirm_rounds=3,
                 fleet=VirtualFleet(CHIP, 2, trial_s=0.0, prefix="node", seed=3, scenario="calibrated"))
    run.run()
    assert max(r.confirm_round for r in rows_of(run, "confirm")) == 3


# ---------------------------------------------------------------- 3. gains with intervals


def _rounds(arms: dict[str, list[float]]) -> list[learn.TrialRecord]:
    params = {learn.LLAMA_CPP: BenchParams(33, 16, 512, 512, flash_attn="auto"),
              learn.NOISE_ARM: BenchParams(33, 16, 512, 512, flash_attn="auto"),
              learn.LLAMA_CPP_PYTHON: BenchParams(0, 8, 512, 512),
              "candidate 1": BenchParams(33, 12, 512, 512, flash_attn="on")}
    out, i = [], 0
    for arm, values in arms.items():
        for n, tg in enumerate(values, start=1):
            i += 1
            samples = (Sample("tg", 0, 128, 128 / tg),)
            out.append(learn.TrialRecord(i, "confirm", params[arm], samples, True, confirm_round=n, confirm_arm=arm))
    return out


def test_a_gain_inside_the_noise_recommends_llama_cpps_defaults():
    records = _rounds({learn.LLAMA_CPP: [100, 102, 98, 101, 99], "candidate 1": [101, 100, 99, 103, 98],
                       learn.LLAMA_CPP_PYTHON: [50, 51, 49, 50, 50], learn.NOISE_ARM: [99, 101, 100, 100, 101]})
    draft = learn.recommend(records, "tg", 512, 128, None)
    assert draft.claims["winner"] == learn.LLAMA_CPP
    assert draft.claims["outcome"] == "no measurable difference from llama.cpp's defaults"
    assert draft.params == BenchParams(33, 16, 512, 512, flash_attn="auto")
    assert draft.claims["noise"]["low"] < 1 < draft.claims["noise"]["high"]
    gain = draft.claims["vs"][learn.LLAMA_CPP_PYTHON]
    assert gain["low"] > 1.9 and gain["rounds"] == 5


def test_a_real_gain_is_claimed_with_its_interval():
    records = _rounds({learn.LLAMA_CPP: [100, 102, 98, 101, 99], "candidate 1": [121, 119, 118, 122, 120],
                       learn.LLAMA_CPP_PYTHON: [50, 51, 49, 50, 50], learn.NOISE_ARM: [99, 101, 100, 100, 101]})
    draft = learn.recommend(records, "tg", 512, 128, None)
    vs = draft.claims["vs"][learn.LLAMA_CPP]
    assert draft.claims["winner"] == "candidate 1" and vs["low"] > 1.1 and vs["high"] < 1.3
    assert draft.improvement_over(learn.LLAMA_CPP) == pytest.approx(vs["ratio"] - 1)
    assert draft.claims["outcome"].endswith("over llama.cpp's defaults")


def test_tune_and_best_print_the_claims_and_the_noise(sqlite_url):
    run = runner(sqlite_url, name="printed")
    run.run()
    rows = CliRunner().invoke(main, ["best", "--model", MODEL.sha256[:12], "--db", sqlite_url, "--json"])
    assert rows.exit_code == 0, rows.output
    row = json.loads(rows.stdout)[0]
    assert row["noise_aa"] and row["vs_llama_cpp"] and row["outcome"]
    assert row["claims"]["rounds"] >= 3
    table = CliRunner().invoke(main, ["best", "--model", MODEL.sha256[:12], "--db", sqlite_url])
    assert "noise (A/A)" in table.stdout and row["outcome"] in table.stdout


# ---------------------------------------------------------------- 4. lossy knobs


def test_cache_types_are_searched_only_when_lossy_knobs_are_allowed():
    assert SearchSpace.for_target(CHIP, MODEL, 512, "tg").cache_types == ()
    assert SearchSpace.for_target(CHIP, MODEL, 512, "tg", lossy=True).cache_types == CACHE_TYPES


def test_a_default_study_never_measures_a_quantized_cache(sqlite_url):
    run = runner(sqlite_url, name="lossless")
    run.run()
    assert all(BenchParams.from_dict(r.params).type_k == "f16" == BenchParams.from_dict(r.params).type_v
               for r in rows_of(run))


def test_allow_lossy_measures_the_kl_divergence_of_quantized_caches(sqlite_url):
    run = runner(sqlite_url, name="lossy", allow_lossy=True, n_trials=16)
    run.run()
    rows = [r for r in rows_of(run) if r.state == "complete"]
    lossy = [r for r in rows if is_lossy(BenchParams.from_dict(r.params))]
    assert lossy and all(r.kl_divergence and r.kl_divergence > 0 for r in lossy)
    assert all(r.kl_divergence is None for r in rows if r not in lossy)
    out = CliRunner().invoke(main, ["results", "--study", "lossy", "--db", sqlite_url, "--json"])
    assert any(row["kl_divergence"] for row in json.loads(out.stdout))


# ---------------------------------------------------------------- 5. only what the study decided


def test_a_tg_study_pins_no_batch_sizes(sqlite_url):
    run = runner(sqlite_url, name="tg-p0", workload=Workload(0, 128, 2))
    outcome = run.run()
    rec = outcome.recommendation.params
    assert (rec.n_batch, rec.n_ubatch) == (2048, 512)  # llama.cpp's own, not the space's 32
    for r in rows_of(run, "confirm"):
        p = BenchParams.from_dict(r.params)
        if r.confirm_arm != learn.LLAMA_CPP_PYTHON:  # llama-cpp-python's own defaults: -b 512
            assert (p.n_batch, p.n_ubatch) == (2048, 512)


def test_llama_bench_form_of_a_pp_configuration_uses_the_prompt_threads():
    params = BenchParams(0, 8, 512, 512, n_threads_batch=16)
    assert llama_bench_form(params, "pp").startswith("-ngl 0 -t 16 ")
    assert llama_bench_form(params, "tg").startswith("-ngl 0 -t 8 ")
    assert "-tb" not in llama_bench_form(params, "pp") + llama_bench_form(params, "e2e")


def test_tune_prints_every_baseline_in_every_tools_form(sqlite_url):
    from orchestrator.cli import _outcome_record

    run = runner(sqlite_url, name="forms", objective="pp")
    outcome = run.run()
    record = _outcome_record(outcome, run.cfg)
    for prefix in ("", "baseline_", "llama_cpp_baseline_"):
        assert f"{prefix}llama_bench_flags" in record and f"{prefix}llama_cpp_python" in record
    python_defaults = outcome.baseline_params  # -t half the cores, -tb all of them
    assert record["baseline_llama_bench_flags"].startswith(f"-ngl 0 -t {python_defaults.threads_batch} ")


# ---------------------------------------------------------------- 6. no repeated failures


def test_a_failed_configuration_is_told_a_penalty_and_never_dispatched_again():
    space = SearchSpace.for_target(CHIP, MODEL, 512, "tg")
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    failed = BenchParams(7, 2, *space.default_batch(), flash_attn="auto")
    study.enqueue_trial(space.optuna_params(failed))
    first = study.ask()
    study.tell(first, 40.0)
    for _ in range(3):  # the sampler proposes the failed configuration again and again
        study.enqueue_trial(space.optuna_params(failed))
    jobs = SamplerJobs(study, space, 10, failed={learn.config_key(failed)})
    [job] = jobs.take(1)
    assert job.params != failed
    penalised = [t for t in study.get_trials() if PENALISED in t.user_attrs]
    assert len(penalised) == 3 and all(t.state == TrialState.COMPLETE and t.value == 20.0 for t in penalised)
    assert jobs.done_count() == 1  # penalties are not measurements


def test_a_study_whose_configurations_time_out_proposes_none_twice(sqlite_url):
    fleet = FailingFleet(CHIP, 1, trial_s=0.0, prefix="node", seed=3, fails=lambda p: p.n_threads <= 2)
    run = runner(sqlite_url, fleet, name="timeouts", n_trials=10, sampler="tpe", seed=2)
    outcome = run.run()
    failed = [learn.config_key(BenchParams.from_dict(r.params)) for r in rows_of(run, "search")
              if r.state == "failed"]
    assert failed and len(failed) == len(set(failed))
    assert outcome.recommendation is not None


# ---------------------------------------------------------------- real llama.cpp


def _spec(model_info, params: BenchParams, **kw) -> TrialSpec:
    return TrialSpec(model_info.path, model_info.sha256, params, Workload(n_prompt=16, n_gen=4, reps=1),
                     timeout_s=180, trial_key="claims", **kw)


def test_llama_cpp_reports_what_it_ran(model_info, local_fingerprint):
    asked = BenchParams(n_gpu_layers=0, n_threads=2, n_batch=2048, n_ubatch=512, flash_attn="auto")
    result = measure(_spec(model_info, asked))
    assert result.ok, result.error
    ran = BenchParams.from_dict(result.effective)
    assert ran.flash_attn in ("on", "off")  # auto, as this build resolved it
    assert (ran.n_batch, ran.n_ubatch) == (16, 16)  # clipped to the prompt test's context
    assert ran.n_threads == 2 and ran.n_gpu_layers == 0
    defaults = llama_cpp_defaults(local_fingerprint, model_info, 16)
    assert defaults.flash_attn == "auto"


def test_kl_divergence_of_a_quantized_cache_against_f16(model_info):
    q8 = BenchParams(n_threads=2, n_batch=64, n_ubatch=64, flash_attn="on", type_k="q8_0", type_v="q8_0")
    q4 = BenchParams(n_threads=2, n_batch=64, n_ubatch=64, flash_attn="on", type_k="q4_0", type_v="q4_0")
    kl8 = measure(_spec(model_info, q8, measure_kl=True))
    kl4 = measure(_spec(model_info, q4, measure_kl=True))
    assert kl8.ok and kl4.ok, (kl8.error, kl4.error)
    assert kl8.kl_divergence is not None and kl4.kl_divergence is not None
    assert 0 < kl8.kl_divergence < kl4.kl_divergence < 1 and math.isfinite(kl4.kl_divergence)
    assert BenchParams.from_dict(kl4.effective).type_k == "q4_0"


def test_baseline_trials_name_their_baseline_and_older_ones_are_named_by_order():
    """Issue 23.3 added a third baseline: each baseline trial now names its baseline; trials of
    studies stored before they did are named by the order the study measured them in."""
    a, b, c = BenchParams(0, 6, 512, 512), BenchParams(33, 8, 512, 512), BenchParams(20, 8, 512, 512)

    def record(params, arm):
        return learn.TrialRecord(1, "baseline", params, (), True, confirm_arm=arm)

    named = [record(a, learn.LLAMA_CPP_PYTHON), record(b, learn.LLAMA_CPP), record(c, learn.FIT)]
    assert learn.stored_baselines(named) == {learn.LLAMA_CPP_PYTHON: a, learn.LLAMA_CPP: b, learn.FIT: c}
    legacy = [record(a, None), record(b, None), record(a, None)]
    assert learn.stored_baselines(legacy) == {learn.LLAMA_CPP_PYTHON: a, learn.LLAMA_CPP: b}
    assert learn.stored_baselines(legacy[:2], served=True) == {learn.LLAMA_CPP: a, learn.SINGLE_STREAM: b}


def test_the_reference_is_fit_only_where_llama_cpps_defaults_never_ran():
    rounds = {1: {learn.LLAMA_CPP: None, learn.FIT: 10.0}, 2: {learn.LLAMA_CPP: None, learn.FIT: 11.0}}
    assert learn.reference_arm(rounds) == learn.FIT
    rounds[2][learn.LLAMA_CPP] = 12.0
    assert learn.reference_arm(rounds) == learn.LLAMA_CPP
    assert learn.reference_arm({1: {"candidate 1": 3.0}}) is None


def test_a_candidate_the_rounds_could_not_confirm_is_named_beside_the_reference_it_did_not_beat():
    """The study recommends the reference, and says which configuration came closest, in the flags a
    user gives llama-bench or llama-server to referee it with more rounds (lease 5's MoE)."""
    from orchestrator.report import claim_fields

    records = _rounds({learn.LLAMA_CPP: [100, 102, 98], "candidate 1": [132, 109, 140],
                       learn.NOISE_ARM: [90, 101, 98]})
    draft = learn.recommend(records, "tg", 512, 128, None)
    assert draft.claims["winner"] == learn.LLAMA_CPP
    shown = claim_fields(draft.claims)["vs_llama_cpp"]
    assert shown.startswith("best candidate -ngl 33 -t 12 -b 512 -ub 512 -fa on: no measurable difference")
