"""The studies in fleettune's database open in Optuna's tools as they are, from the same URL."""

from __future__ import annotations

import io
import json

import optuna

from orchestrator.db import open_database, repo
from orchestrator.studies import StudyConfig
from orchestrator.tune import tune_all_chips
from workers.simulated import sim_model_info
from workers.trial import Workload


def test_every_study_loads_through_optunas_public_api_and_the_dashboard(db_url, fleet_cluster):
    db = open_database(db_url)
    cfg = StudyConfig(model=sim_model_info("sim://llama2-7b/q4_0"), n_trials=3, seed=2,
                      workload=Workload(n_prompt=64, n_gen=8, reps=1))
    outcomes = tune_all_chips(db, cfg)
    ours = {o.name for o in outcomes}

    summaries = optuna.get_all_study_summaries(storage=db.url_string)
    assert {s.study_name for s in summaries} == ours
    for name in ours:
        study = optuna.load_study(study_name=name, storage=db.url_string)
        complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        with db.session() as s:
            row = repo.get_study(s, name)
            stored = {t.optuna_number: t.objective_value for t in repo.study_trials(s, row.id, "search")
                      if t.state == "complete"}
        assert {t.number: t.value for t in complete} == stored  # the same trials, the same values
        assert study.best_value == max(stored.values())  # tg: maximise

    from wsgiref.util import setup_testing_defaults

    import optuna_dashboard

    app = optuna_dashboard.wsgi(db.url_string)
    environ = {"PATH_INFO": "/api/studies", "wsgi.errors": io.StringIO()}
    setup_testing_defaults(environ)
    status = []
    body = app(environ, lambda code, headers, exc_info=None: status.append(code))
    assert status[0].startswith("200"), environ["wsgi.errors"].getvalue()
    listed = json.loads(b"".join(body))["study_summaries"]
    assert {s["study_name"] for s in listed} == ours
