"""Schedules: prediction for chips the fleet has not measured, recommend, schedule learn, warm start."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator import schedules
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.space import SearchSpace, full_offload, llama_cpp_defaults, predicted_optimum
from orchestrator.studies import StudyConfig
from orchestrator.transfer import ConfigPredictor, Example
from orchestrator.tune import tune
from tests.conftest import SIM_CHIPS, module_db_url, tuned_sim_fleet
from workers import simulated
from workers.errors import BadInput
from workers.simulated import sim_model_info
from workers.trial import BenchParams, Workload

SIM_MODEL = "sim://llama2-7b/q4_0"


@pytest.mark.parametrize("held_out", ["M3", "M4 Max"])
def test_a_chip_family_never_measured_gets_a_configuration_within_10_percent(held_out):
    shape = simulated.model_shape("llama2-7b", "q4_0")
    model = sim_model_info(SIM_MODEL)
    chips = [simulated.with_memory(c, 32) for c in simulated.all_chips()
             if c.family in ("M1", "M1 Pro", "M1 Max", "M2 Ultra", "M3 Pro", "M3 Max", "M4", "M4 Max")]
    known = [c for c in chips if c.family != held_out]
    examples = []
    for chip in known:
        params, _, value = simulated.optimum(chip, shape, "tg")
        examples.append(Example(chip.chip_key, chip, model, params, value))
    predictor = ConfigPredictor(examples)
    for chip in (c for c in chips if c.family == held_out):
        pred = predictor.predict(chip, model)
        _, _, best = simulated.optimum(chip, shape, "tg")
        achieved = simulated.predict(chip, shape, pred.params, 512, 128).tg_tps
        assert achieved >= 0.9 * best, (chip.label, pred.params)
        assert pred.expected_tps == pytest.approx(best, rel=0.15)
        assert pred.interval[0] < pred.expected_tps < pred.interval[1]


def test_too_little_evidence_is_one_clear_error():
    with pytest.raises(BadInput, match="too little evidence"):
        ConfigPredictor([])


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def fleet_db(request, tmp_path_factory, ray_cluster):
    """Two chips of the simulated fleet tuned (tg), in one database (SQLite, then PostgreSQL)."""
    return tuned_sim_fleet(module_db_url(request, tmp_path_factory), SIM_MODEL, n_trials=6, seed=4,
                           workload=Workload(n_prompt=128, n_gen=16, reps=1))


def cli_json(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_recommend_is_measured_for_a_tuned_chip_and_predicted_for_an_unseen_one(fleet_db):
    measured = cli_json("recommend", "--model", SIM_MODEL, "--chip", SIM_CHIPS["M2 Ultra/76"],
                        "--db", fleet_db, "--json")[0]
    best = cli_json("best", "--model", "llama2-7b-q4_0", "--chip", SIM_CHIPS["M2 Ultra/76"],
                    "--db", fleet_db, "--json")[0]
    assert measured["source"] == "measured" and measured["flags"] == best["flags"]
    predicted = cli_json("recommend", "--model", SIM_MODEL, "--chip", "apple-m4-max-40g",
                         "--db", fleet_db, "--json")[0]
    assert predicted["source"] == "predicted" and predicted["simulated"] is True
    assert predicted["interval"][0] < predicted["expected_tps"] < predicted["interval"][1]
    assert set(predicted["evidence"]) <= set(SIM_CHIPS.values())
    result = CliRunner().invoke(main, ["recommend", "--model", SIM_MODEL, "--chip", "apple-m9-zzz",
                                       "--db", fleet_db])
    assert result.exit_code == 2 and "unknown chip" in result.output


def test_schedule_learn_adds_a_version_only_when_the_answer_changes(fleet_db):
    first = cli_json("schedule", "learn", "--db", fleet_db, "--json")
    assert {r["chip"] for r in first} == set(SIM_CHIPS.values())
    assert not any(r["changed"] for r in first)  # the studies stored these already
    db = open_database(fleet_db)
    with db.session() as s:  # a newer, different recommendation appears (say, by hand)
        rec = repo.all_latest_recommendations(s, "tg", True)[0]
        chip, version = rec.chip.key, rec.version
        rec.params = {**rec.params, "n_threads": rec.params["n_threads"] + 1}
    second = {r["chip"]: r for r in cli_json("schedule", "learn", "--db", fleet_db, "--json")}
    assert second[chip]["changed"] and second[chip]["version"] == version + 1


def test_a_new_study_measures_the_warm_start_first(fleet_db):
    db = open_database(fleet_db)
    model = sim_model_info(SIM_MODEL)
    chip = SIM_CHIPS["M1 Pro/16"]
    warm = schedules.warm_start(db, chip, model, "tg", simulated=True)
    assert warm  # a prediction, then the nearest known chips' configurations
    cfg = StudyConfig(model=model, n_trials=len(warm) + 2, seed=9,
                      workload=Workload(n_prompt=128, n_gen=32, reps=1))  # a new workload: a new study
    outcome = tune(db, cfg, chip_key=chip)
    with db.session() as s:
        study = repo.get_study(s, outcome.name)
        rows = sorted(repo.study_trials(s, study.id, "search"), key=lambda r: r.optuna_number)
        measured = [BenchParams.from_dict(r.params) for r in rows]
        space = SearchSpace.from_dict(study.space)
    assert measured[0].n_gpu_layers == space.ngl_max  # full offload first, as in every GPU study
    fp = simulated.parse_chip("M1 Pro/16")  # the simulated node's own fingerprint
    # the first design (full offload, llama.cpp's defaults, the calibrated model's prediction),
    # then the warm start, each config once
    first = [full_offload(fp, model, space), llama_cpp_defaults(fp, model, 128), predicted_optimum(fp, model, 128, 32)]
    expected = []
    for p in (space.clip(p) for p in [*first, *warm] if p is not None):
        if p not in expected:
            expected.append(p)
    assert measured[:len(expected)] == expected


def finished_sim_study(url: str):
    """A database holding one complete study (tg, 64+16 tokens) of a simulated M1 Pro on the
    in-process fleet, with its recommendation."""
    from functools import partial

    from orchestrator.studies import ChipTarget, StudyRunner
    from orchestrator.virtual import VirtualFleet

    chip = simulated.parse_chip("M1 Pro/16")
    fleet = VirtualFleet(chip, 4, seed=2)
    cfg = StudyConfig(model=sim_model_info(SIM_MODEL), n_trials=8, seed=3, confirm_top=1,
                      workload=Workload(n_prompt=64, n_gen=16, reps=1))
    db = open_database(url)
    StudyRunner(db, fleet, cfg, ChipTarget(chip, {}, simulated=True),
                alive_nodes=partial(fleet.alive_nodes, chip.chip_key)).run()
    return db


def test_schedule_learn_stores_exactly_what_the_study_stored_and_versions_only_changes(sqlite_url):
    """A study on the in-process fleet stores its recommendation; the NewRecommendation that
    `schedule learn` writes from the same evidence carries every column the same (one typed copy)."""
    from orchestrator import learn

    db = finished_sim_study(sqlite_url)
    assert [r["changed"] for r in schedules.learn_all(db)] == [False]  # the study stored it already
    with db.session() as s:
        study = repo.completed_studies(s)[0]
        draft = learn.recommend(schedules.study_records(s, study.id), study.objective, 64, 16)
        new = repo.NewRecommendation(chip_id=study.chip_id, model_id=study.model_id, study_id=study.id,
                                     objective="tg", n_prompt=64, n_gen=16, draft=draft, source="learn")
        [first] = repo.latest_recommendations(s, [study.model_id], study.chip.key, "tg")
        typed = repo.add_recommendation(s, new)
        assert (first.version, typed.version) == (1, 2)
        columns = [c.key for c in typed.__table__.columns if c.key not in ("id", "version", "source", "created_at")]
        assert {c: getattr(typed, c) for c in columns} == {c: getattr(first, c) for c in columns}


@pytest.mark.postgres
def test_schedule_learn_retries_when_a_study_stores_the_same_version_first(pg_url):
    """`schedule learn` and a study finishing at that moment (same chip, model and workload) both
    read the latest version and insert the next: PostgreSQL refuses the second insert on the
    version's unique key. learn's transaction is retried, reads the other version, stores its own."""
    from dataclasses import replace

    from sqlalchemy import event, update

    from orchestrator import learn
    from orchestrator.db.models import Recommendation

    db = finished_sim_study(pg_url)
    with db.session() as s:  # the stored answer differs from the evidence's: learn stores a version
        s.execute(update(Recommendation).values(expected_tps=Recommendation.expected_tps * 2))
    other = open_database(pg_url)
    raced = []

    def race(conn, cursor, statement, parameters, context, executemany) -> None:
        if raced or "max(ft_recommendations.version)" not in statement:
            return
        raced.append(statement)  # learn has read the latest version: a study commits the next now
        with other.session() as s:
            study = repo.completed_studies(s)[0]
            draft = learn.recommend(schedules.study_records(s, study.id), study.objective, 64, 16)
            new = repo.NewRecommendation(study.chip_id, study.model_id, study.id, study.objective, 64, 16,
                                         replace(draft, expected_tps=draft.expected_tps + 1), depth=0)
            assert repo.add_recommendation(s, new).version == 2

    event.listen(db.engine, "after_cursor_execute", race)
    rows = schedules.learn_all(db)
    assert raced and [(r["changed"], r["version"]) for r in rows] == [(True, 3)]
    other.dispose()
