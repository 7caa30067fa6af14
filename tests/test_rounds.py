"""A large fleet's study loop without Ray: rounds of results, proposals made ahead, one fit a round.

The study loop is the one `tune` runs; the fleet is in-process (the calibrated simulator answers at
once), so a 48-node study runs in a second and every path of a large fleet is exercised: results
collected ROUND_RESULTS at a time, proposals made ahead while results are awaited, interrupts with
proposals not yet dispatched.
"""

from __future__ import annotations

from functools import partial

import optuna
import pytest
from optuna.trial import TrialState

from orchestrator import studies
from orchestrator.db import open_database, repo
from orchestrator.samplers import RoundTPESampler
from orchestrator.studies import ChipTarget, StudyConfig, StudyPaused, StudyRunner
from orchestrator.virtual import VirtualFleet
from workers import simulated
from workers.trial import Workload

CHIP = simulated.parse_chip("M2 Ultra/76")
MODEL = "sim://llama2-7b/q4_0"


def instant_fleet(n: int, per_wait: int = 7) -> VirtualFleet:
    """``n`` in-process nodes whose trials finish when the head blocks for results (a wait with a
    timeout), a few at a time, so the loop meets both empty polls and backlogs."""
    return VirtualFleet(CHIP, n, trial_s=0.0, per_wait=per_wait, prefix="node", seed=3)


def runner(url: str, fleet: VirtualFleet, on_progress=None, **cfg) -> StudyRunner:
    target = ChipTarget(CHIP, {}, simulated=True)
    config = StudyConfig(model=simulated.sim_model_info(MODEL), workload=Workload(512, 128, 1),
                         **{"n_trials": 120, "sampler": "tpe", "seed": 5, "confirm_top": 1, **cfg})
    return StudyRunner(open_database(url), fleet, config, target, alive_nodes=partial(fleet.alive_nodes, CHIP.chip_key),
                       on_progress=on_progress)


def stored(run: StudyRunner):
    with run.db.session() as s:
        return repo.study_trials(s, run.study_id, "search")


def test_a_large_fleet_study_ends_with_its_budget_every_trial_once(db_url, monkeypatch):
    asked_ahead = []
    real_wait = VirtualFleet.wait

    def counting_wait(self, refs, timeout_s):  # a poll (timeout 0) is the loop proposing ahead
        if timeout_s == 0:
            asked_ahead.append(len(refs))
        return real_wait(self, refs, timeout_s)

    monkeypatch.setattr(VirtualFleet, "wait", counting_wait)
    fleet = instant_fleet(48)
    run = runner(db_url, fleet, name="large")
    outcome = run.run()
    rows = stored(run)
    assert outcome.n_complete == 120 == sum(r.state == "complete" for r in rows)
    assert fleet.most_running == 48  # every node busy at once
    assert asked_ahead and all(n >= studies.AHEAD_MIN_RUNNING for n in asked_ahead)
    optuna_trials = {t.number: t for t in optuna.load_study(study_name="large", storage=db_url).trials}
    assert not [t for t in optuna_trials.values() if t.state == TrialState.RUNNING]
    numbers = [r.optuna_number for r in rows]
    assert len(numbers) == len(set(numbers))
    for row in rows:  # what Optuna holds is what fleettune stored, trial by trial
        trial = optuna_trials[row.optuna_number]
        assert trial.state == (TrialState.COMPLETE if row.state == "complete" else TrialState.FAIL)
        if row.state == "complete":
            assert trial.value == pytest.approx(row.objective_value)
            assert trial.params["ngl"] == row.params["n_gpu_layers"]


def test_a_small_fleet_never_proposes_ahead(sqlite_url, monkeypatch):
    polls = []
    real_wait = VirtualFleet.wait
    monkeypatch.setattr(VirtualFleet, "wait",
                        lambda self, refs, t: polls.append(t) or real_wait(self, refs, t))
    runner(sqlite_url, instant_fleet(studies.AHEAD_MIN_RUNNING - 1), n_trials=40).run()
    assert 0 not in polls  # every proposal was made with every result in


def test_an_interrupted_large_fleet_leaves_nothing_running(db_url):
    seen = []

    def stop_after_60(progress):
        if progress.phase == "search" and progress.last is not None:
            seen.append(progress.last)
            if len(seen) == 60:
                raise KeyboardInterrupt

    run = runner(db_url, instant_fleet(48), on_progress=stop_after_60, name="stopped")
    with pytest.raises(StudyPaused):
        run.run()
    rows = stored(run)
    assert not [r for r in rows if r.state == "running"]
    complete = sum(r.state == "complete" for r in rows)
    assert complete >= 60  # the interrupted round's results, collected already, are kept
    trials = optuna.load_study(study_name="stopped", storage=db_url).trials
    assert not [t for t in trials if t.state == TrialState.RUNNING]  # proposals made ahead: failed
    assert sum(t.state == TrialState.COMPLETE for t in trials) == complete
    resumed = runner(db_url, instant_fleet(48), name="stopped", resume=True)
    assert resumed.run().n_complete == 120


def sequential(sampler, n: int = 30) -> list[dict]:
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for _ in range(n):
        trial = study.ask()
        x, y = trial.suggest_int("ngl", 0, 33), trial.suggest_categorical("batch", [128, 256, 512])
        study.tell(trial, -((x - 20) ** 2) + y / 100)
    return [t.params for t in study.trials]


def test_round_tpe_one_trial_at_a_time_is_optunas_tpe():
    kwargs = {"n_startup_trials": 5, "multivariate": True, "constant_liar": True, "seed": 11}
    assert sequential(RoundTPESampler(**kwargs)) == sequential(optuna.samplers.TPESampler(**kwargs))


def test_round_tpe_fits_once_a_round_and_draws_the_round_at_once():
    fits = []

    class Counting(RoundTPESampler):
        def _build_parzen_estimator(self, *args, **kwargs):
            fits.append(1)
            return super()._build_parzen_estimator(*args, **kwargs)

    sampler = Counting(n_startup_trials=3, multivariate=True, constant_liar=True, seed=2)
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def round_of(k: int) -> list:
        trials = [study.ask() for _ in range(k)]
        return [(t, t.suggest_int("ngl", 0, 33), t.suggest_int("threads", 1, 24)) for t in trials]

    for trial, ngl, threads in round_of(4):  # startup: random, no fit
        study.tell(trial, ngl - abs(threads - 8))
    assert fits == []
    first = round_of(9)
    assert len(fits) == 2  # one fit (below and above) for the nine proposals
    for trial, ngl, threads in first:
        study.tell(trial, ngl - abs(threads - 8))
    assert sampler._batch == 8  # the next round draws what this one needed, in one go
    second = round_of(9)
    assert len(fits) == 4
    proposals = {(ngl, threads) for _, ngl, threads in first + second}
    assert len(proposals) > 9  # draws of one fit differ: each has its own candidates
    assert all(0 <= ngl <= 33 and 1 <= threads <= 24 for ngl, threads in proposals)


def test_auto_is_gp_for_a_few_nodes_with_torch_and_tpe_for_a_fleet(monkeypatch):
    import sys
    import types

    from orchestrator.samplers import GP_MAX_NODES, resolve_sampler

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # as if installed
    assert resolve_sampler("auto", GP_MAX_NODES) == "gp"
    assert resolve_sampler("auto", GP_MAX_NODES + 1) == "tpe"  # GP's proposals would hold the fleet
    assert resolve_sampler("random", 1) == "random"
    monkeypatch.setitem(sys.modules, "torch", None)  # not installed: import fails
    assert resolve_sampler("auto", 1) == "tpe"


def test_a_resumed_study_keeps_the_sampler_it_was_created_with(sqlite_url):
    first = runner(sqlite_url, instant_fleet(4), name="kept", sampler="random", n_trials=6)
    first.run()
    again = runner(sqlite_url, instant_fleet(40), name="kept", sampler="auto", resume=True, n_trials=8)
    again.prepare()
    assert again.sampler == "random"
    assert again.run().n_complete == 8


# ---------------------------------------------------------------- what used to lose or duplicate


def audit(run: StudyRunner, max_versions: int | None = 1):
    from orchestrator.audit import audit_study

    report = audit_study(run.db, run.name, max_versions=max_versions)
    assert report.ok, report.problems
    return report


class FlakyResults(VirtualFleet):
    """A fleet whose ``result`` raises on its ``n``-th call: an exception while a round's results
    are being collected (the results before it in the round were already taken)."""

    def __init__(self, n_nodes: int, fail_at: int, exc: type[BaseException]) -> None:
        super().__init__(CHIP, n_nodes, trial_s=0.0, per_wait=7, prefix="node", seed=3)
        self.calls, self.fail_at, self.exc = 0, fail_at, exc

    def result(self, ref, trial_key):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.exc("while collecting")
        return super().result(ref, trial_key)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_an_exception_while_collecting_loses_nothing(db_url, exc):
    run = runner(db_url, FlakyResults(8, fail_at=12, exc=exc), name="flaky", n_trials=30)
    with pytest.raises(StudyPaused if exc is KeyboardInterrupt else RuntimeError):
        run.run()
    if exc is RuntimeError:
        run._pause("test")  # what the CLI's error path leaves: a study to resume
    audit(run)  # Optuna and fleettune agree on every trial, nothing running
    resumed = runner(db_url, instant_fleet(8), name="flaky", resume=True, n_trials=None)
    assert resumed.run().n_complete == 30
    assert audit(resumed).complete == 30


def test_a_stop_request_pauses_and_resume_completes(db_url):
    from orchestrator.stopping import StopRequest

    stop = StopRequest()
    run = runner(db_url, instant_fleet(8), name="asked", n_trials=30,
                 on_progress=lambda p: p.done >= 10 and stop.request("SIGTERM"))
    run.stop = stop
    with pytest.raises(StudyPaused, match="SIGTERM"):
        run.run()
    report = audit(run)
    assert report.state == "paused" and 10 <= report.complete < 30
    assert runner(db_url, instant_fleet(8), name="asked", resume=True, n_trials=None).run().n_complete == 30


def test_grid_with_a_budget_above_its_size_completes(sqlite_url):
    from orchestrator.samplers import grid_size
    from orchestrator.space import SearchSpace

    run = runner(sqlite_url, instant_fleet(8), name="grid", sampler="grid", n_trials=100_000)
    run.prepare()
    size = grid_size(SearchSpace.from_dict(run.space.to_dict()))
    assert run.budget == size
    outcome = run.run()
    assert outcome.state == "complete" and outcome.n_complete == size
    audit(run)


def test_resume_keeps_the_budget_sampler_and_reps_it_was_created_with(sqlite_url):
    first = runner(sqlite_url, instant_fleet(4), on_progress=None, name="budget", n_trials=12,
                   sampler="random", reps=2)
    first.prepare()
    first.stop.request("test")  # paused before any trial
    with pytest.raises(StudyPaused):
        first.run()
    again = runner(sqlite_url, instant_fleet(4), name="budget", resume=True, n_trials=None, sampler="auto")
    again.prepare()
    assert (again.budget, again.sampler, again.workload.reps) == (12, "random", 2)
    assert again.run().n_complete == 12


def test_resuming_a_finished_study_changes_nothing(db_url):
    first = runner(db_url, instant_fleet(8), name="done", n_trials=10)
    outcome = first.run()
    before = audit(first)
    again = runner(db_url, instant_fleet(8), name="done", resume=True, n_trials=None)
    repeat = again.run()
    after = audit(again)
    assert (after.complete, after.failed, after.recommendation_versions) == \
        (before.complete, before.failed, before.recommendation_versions) == (10, 0, 1)
    assert repeat.recommendation_version == outcome.recommendation_version == 1
    assert repeat.recommendation.params == outcome.recommendation.params
    more = runner(db_url, instant_fleet(8), name="done", resume=True, n_trials=14)
    assert more.run().n_complete == 14  # a larger budget continues it


def test_a_second_driver_is_refused_and_a_stale_lease_is_taken_over_and_fences_the_first(db_url):
    """Two drivers on one study once both ran (42 complete rows for a budget of 40, Optuna trials
    left RUNNING): the lease refuses the second while the first's heartbeat is fresh, lets a
    driver take over a silent holder on another host, and the old holder then writes nothing."""
    from datetime import timedelta

    from sqlalchemy import update

    from orchestrator import lease
    from orchestrator.db.models import Study
    from workers.errors import BadInput

    first = runner(db_url, instant_fleet(4), name="held", n_trials=10)
    first.prepare()
    second = runner(db_url, instant_fleet(4), name="held", resume=True, n_trials=None)
    with pytest.raises(BadInput, match="another driver"):
        second.prepare()
    with first.db.session() as s:  # the first's host went silent: its heartbeat is past the TTL
        s.execute(update(Study).where(Study.id == first.study_id).values(
            lease_owner="elsewhere:1:0000", lease_heartbeat=repo.utcnow() - timedelta(seconds=lease.LEASE_TTL_S + 5)))
    third = runner(db_url, instant_fleet(4), name="held", resume=True, n_trials=None)
    assert third.run().n_complete == 10
    first.owner = "elsewhere:1:0000"  # the silent holder comes back: fenced, it writes nothing
    with pytest.raises(StudyPaused, match="taken over"):
        first.run()
    report = audit(third)
    assert (report.state, report.complete) == ("complete", 10)


def test_two_studies_recommending_at_once_both_store_their_version(pg_url):
    """Two studies of one chip, model and workload (two new studies started at once under one
    default name) store a recommendation at the same instant: each reads the latest version, the
    other commits that version + 1 first. PostgreSQL refused the second insert (IntegrityError on
    the version's unique key) and the driver died with the study left running; the round is
    retried and stores the next version."""
    from dataclasses import replace

    from sqlalchemy import event

    first = runner(pg_url, instant_fleet(4), name="first", n_trials=6)
    other = open_database(pg_url)
    raced = []

    def race(conn, cursor, statement, parameters, context, executemany) -> None:
        if raced or "max(ft_recommendations.version)" not in statement:
            return
        raced.append(statement)  # the first has read the latest version: the other commits one now
        draft = first._draft()
        with other.session() as s:
            study = repo.get_study(s, "first")
            new = repo.NewRecommendation(study.chip_id, study.model_id, study.id, "tg", 512, 128,
                                         replace(draft, expected_tps=draft.expected_tps + 1), depth=0)
            assert repo.add_recommendation(s, new).version == 1

    event.listen(first.db.engine, "after_cursor_execute", race)
    outcome = first.run()
    assert raced and outcome.state == "complete" and outcome.recommendation_version == 2
    audit(first, max_versions=2)
    other.dispose()


class LosesNodes(VirtualFleet):
    """Every trial of the full-offload configuration (the first design's first) loses its node."""

    def __init__(self, n_nodes: int) -> None:
        super().__init__(CHIP, n_nodes, trial_s=0.0, per_wait=7, prefix="node", seed=3)
        from orchestrator.space import SearchSpace, full_offload

        info = simulated.sim_model_info(MODEL)
        self.full = full_offload(CHIP, info, SearchSpace.for_target(CHIP, info, 512))

    def result(self, ref, trial_key):
        from workers.trial import FailureKind, TrialResult

        full_offload = self.running[ref][0].params == self.full
        result = super().result(ref, trial_key)
        return TrialResult.failure(trial_key, "node lost", FailureKind.NODE_LOST) if full_offload else result


def test_a_configuration_lost_on_too_many_nodes_is_failed_not_retried_forever(sqlite_url):
    run = runner(sqlite_url, LosesNodes(4), name="lossy", n_trials=8, sampler="random")
    outcome = run.run()
    rows = stored(run)
    lost = [r for r in rows if r.failure_kind == "node lost"]
    assert len(lost) == studies.MAX_NODE_LOSSES  # measured again twice, then given up
    assert outcome.n_complete == 8
    audit(run)


class FailsFullOffload(LosesNodes):
    """The full-offload configuration's trials fail with a given kind and message."""

    def __init__(self, n_nodes: int, kind, message: str) -> None:
        super().__init__(n_nodes)
        self.kind, self.message = kind, message

    def result(self, ref, trial_key):
        from workers.trial import TrialResult

        full_offload = self.running[ref][0].params == self.full
        result = VirtualFleet.result(self, ref, trial_key)
        return TrialResult.failure(trial_key, self.message, self.kind) if full_offload else result


@pytest.mark.parametrize("kind,message,measured", [
    ("NODE_LOST", "the raylet on 10.0.0.7 died", studies.MAX_NODE_LOSSES),  # a lost node, whatever it says
    ("CRASH", "llama.cpp crashed: node lost its GPU", 1),  # says "node lost", is not one: not again
])
def test_a_lost_node_is_known_by_its_kind_not_its_message(sqlite_url, kind, message, measured):
    from workers.trial import FailureKind

    run = runner(sqlite_url, FailsFullOffload(4, FailureKind[kind], message), name="kinds", n_trials=8,
                 sampler="random")
    outcome = run.run()
    failed = [r for r in stored(run) if r.error == message]
    assert len(failed) == measured and {r.state for r in failed} == {"failed"}
    assert outcome.n_complete == 8
    audit(run)


@pytest.mark.parametrize("bad", [
    {"timeout_s": float("nan")}, {"timeout_s": float("inf")}, {"timeout_s": 0}, {"timeout_s": -1},
    {"cooldown_s": -0.5}, {"cooldown_s": float("nan")}, {"reps": 0}, {"n_trials": 0}, {"confirm_top": -1},
])
def test_bad_study_options_are_refused_before_anything_is_written(sqlite_url, bad):
    from workers.errors import BadInput

    run = runner(sqlite_url, instant_fleet(2), name="bad", **bad)
    with pytest.raises(BadInput):
        run.prepare()
    with run.db.session() as s:
        assert repo.get_study(s, "bad") is None
