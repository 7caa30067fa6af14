"""Studies on the real Ray cluster: interrupt and resume, orphaned trials, samplers, objectives."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from optuna.trial import TrialState
from sqlalchemy import update

from orchestrator import dispatch
from orchestrator.db import open_database, repo
from orchestrator.db.models import Study
from orchestrator.studies import ChipTarget, StudyConfig, StudyPaused, StudyRunner
from orchestrator.tune import record_nodes
from workers.trial import Workload

WORKLOAD = Workload(n_prompt=16, n_gen=4, reps=1)


def make_runner(url, model_info, fingerprint, on_progress=None, **cfg) -> StudyRunner:
    db = open_database(url)
    nodes = dispatch.bench_nodes(fingerprint.chip_key)
    infos = dispatch.describe_nodes(nodes)
    config = StudyConfig(model=model_info, workload=WORKLOAD, **{"n_trials": 3, "seed": 7, **cfg})
    target = ChipTarget(fingerprint, {})
    runner = StudyRunner(db, dispatch.RayDispatcher(), config, target,
                         alive_nodes=dispatch.ChipNodes(fingerprint.chip_key, ttl_s=0),
                         on_progress=on_progress)
    runner.prepare()
    target.node_ids.update(record_nodes(db, infos))
    return runner


def search_rows(runner):
    with runner.db.session() as s:
        return repo.study_trials(s, runner.study_id, "search")


def test_interrupted_study_resumes_to_its_budget_without_duplicates(
    db_url, model_info, local_fingerprint, ray_cluster
):
    seen = []

    def interrupt_after_first_search_trial(progress):
        if progress.phase == "search" and progress.last is not None:
            seen.append(progress.last)
            raise KeyboardInterrupt

    runner = make_runner(db_url, model_info, local_fingerprint, interrupt_after_first_search_trial,
                         name="resumable", n_trials=3)
    with pytest.raises(StudyPaused):
        runner.run()
    with runner.db.session() as s:
        assert repo.get_study(s, "resumable").state == "paused"
    assert sum(r.state == "complete" for r in search_rows(runner)) == 1

    resumed = make_runner(db_url, model_info, local_fingerprint, name="resumable", n_trials=3, resume=True)
    outcome = resumed.run()
    rows = search_rows(resumed)
    assert outcome.n_complete == 3 == sum(r.state == "complete" for r in rows)
    numbers = [r.optuna_number for r in rows]
    assert len(numbers) == len(set(numbers))  # every Optuna trial stored once
    optuna_trials = resumed.optuna_study.get_trials()
    assert sum(t.state == TrialState.COMPLETE for t in optuna_trials) == 3
    assert not any(t.state == TrialState.RUNNING for t in optuna_trials)
    assert outcome.recommendation is not None


def test_running_trials_orphaned_by_a_killed_driver_are_failed_on_resume(
    db_url, model_info, local_fingerprint, ray_cluster
):
    runner = make_runner(db_url, model_info, local_fingerprint, name="orphans", n_trials=1)
    # what a driver killed mid-trial leaves behind: an asked Optuna trial and a running row,
    # written in one transaction as the study loop writes them
    trial = runner.optuna_study.ask()
    params = runner.space.suggest(trial)
    with runner.db.session() as s:
        repo.start_trial(s, study_id=runner.study_id, optuna_number=trial.number, phase="search",
                         params=params.to_dict(), simulated=False)
        runner.storage.flush(s)
    # ...and a lease whose holder is a process of this host that was killed
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait()
    with runner.db.session() as s:
        s.execute(update(Study).where(Study.id == runner.study_id)
                  .values(lease_owner=f"{socket.gethostname()[:30]}:{killed.pid}:killed0"))
    resumed = make_runner(db_url, model_info, local_fingerprint, name="orphans", n_trials=1, resume=True)
    outcome = resumed.run()
    rows = search_rows(resumed)
    orphan = next(r for r in rows if r.optuna_number == trial.number)
    assert orphan.state == "failed" and orphan.error.startswith("orphaned")
    states = {t.number: t.state for t in resumed.optuna_study.get_trials()}
    assert states[trial.number] == TrialState.FAIL
    assert outcome.n_complete == 1


def test_resume_of_another_workload_is_refused(db_url, model_info, local_fingerprint, ray_cluster):
    from workers.errors import BadInput

    make_runner(db_url, model_info, local_fingerprint, name="wl", n_trials=1)
    with pytest.raises(BadInput, match="another chip, model or workload"):
        make_runner(db_url, model_info, local_fingerprint, name="wl", resume=True, objective="pp")


def test_seed_scan_scans_threads_then_ngl(sqlite_url, model_info, local_fingerprint, ray_cluster):
    runner = make_runner(sqlite_url, model_info, local_fingerprint, sampler="seed-scan", n_trials=3)
    runner.run()
    params = [r.params for r in search_rows(runner)]
    threads_max = local_fingerprint.logical_cores
    scan = [p["n_threads"] for p in params[:threads_max]]
    assert scan == list(range(1, threads_max + 1))[: len(scan)]
    assert all(p["n_gpu_layers"] == 0 for p in params)


@pytest.mark.parametrize("objective", ["pp", "e2e"])
def test_other_objectives(sqlite_url, model_info, local_fingerprint, ray_cluster, objective):
    runner = make_runner(sqlite_url, model_info, local_fingerprint, objective=objective, n_trials=2,
                         sampler="random")
    outcome = runner.run()
    rows = [r for r in search_rows(runner) if r.state == "complete"]
    for row in rows:
        if objective == "pp":
            assert row.objective_value == row.pp_tps_median
        else:
            expected = 16 / row.pp_tps_median + 4 / row.tg_tps_median
            assert row.objective_value == pytest.approx(expected) == row.e2e_s
    assert outcome.recommendation.expected_tps > 0
