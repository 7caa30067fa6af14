"""The head's write-behind Optuna storage writes what Optuna's RDBStorage writes, and resumes from it."""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from orchestrator.db import open_database
from orchestrator.db.storage import HeadStorage


def play(study: optuna.Study, between=lambda: None) -> None:
    """The same calls on any storage: every kind of parameter, value, attribute and state;
    ``between`` runs after each call (a flush, for the head: each write then changes a written trial)."""
    study.enqueue_trial({"ngl": 7, "threads": 3, "batch": 256, "lr": 0.5})
    values = [12.5, math.inf, None, -3.25, 40.0]
    for i, value in enumerate(values):
        trial = study.ask()
        between()
        trial.suggest_int("ngl", 0, 33)
        between()
        trial.suggest_int("threads", 1, 16, log=True)
        trial.suggest_categorical("batch", [128, 256, 512])
        between()
        trial.suggest_float("lr", 0.01, 1.0)
        trial.set_user_attr("node", f"node-{i}")
        between()
        trial.report(float(i), step=i)
        between()
        study._storage.set_trial_system_attr(trial._trial_id, "probe", i)
        between()
        if value is None:
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, value)
        between()
    running = study.ask()  # left running, as a killed driver leaves it
    running.suggest_int("ngl", 0, 33)
    study.enqueue_trial({"ngl": 1, "threads": 1, "batch": 128, "lr": 0.1})  # left waiting
    between()


def same(a: optuna.trial.FrozenTrial, b: optuna.trial.FrozenTrial) -> None:
    assert (a.number, a.state, a.params, a.distributions) == (b.number, b.state, b.params, b.distributions)
    assert (a.values, a.intermediate_values) == (b.values, b.intermediate_values)
    assert (a.user_attrs, a.system_attrs) == (b.user_attrs, b.system_attrs)
    for start_a, start_b in ((a.datetime_start, b.datetime_start), (a.datetime_complete, b.datetime_complete)):
        assert (start_a is None) == (start_b is None)
        if start_a is not None:
            # the two studies run one after the other (seconds apart on a busy machine); a time
            # zone mistake would show as a whole hour
            assert abs((start_a - start_b).total_seconds()) < 600


@pytest.fixture
def url(db_url) -> str:
    open_database(db_url)  # the migrations: the database the head writes to
    return db_url


def test_what_the_head_writes_reads_back_like_rdb_storage(url):
    sampler = optuna.samplers.RandomSampler
    plain = optuna.create_study(study_name="plain", storage=RDBStorage(url), sampler=sampler(seed=3))
    head_storage = HeadStorage(RDBStorage(url))
    head = optuna.create_study(study_name="head", storage=head_storage, sampler=sampler(seed=3))
    play(plain)
    play(head)
    assert head_storage.pending() > 0
    assert optuna.load_study(study_name="head", storage=url).trials == []  # nothing before a flush
    head_storage.flush()
    assert head_storage.pending() == 0
    expected = optuna.load_study(study_name="plain", storage=url).trials
    written = optuna.load_study(study_name="head", storage=url).trials
    assert [t.state for t in written] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL,
                                          TrialState.COMPLETE, TrialState.COMPLETE, TrialState.RUNNING,
                                          TrialState.WAITING]
    assert len(written) == len(expected)
    for a, b in zip(written, expected, strict=True):
        same(a, b)
    # a second flush after more changes updates the same rows, it does not add new ones
    head.tell(5, 1.0)
    head_storage.flush()
    again = optuna.load_study(study_name="head", storage=url).trials
    assert len(again) == len(expected) and again[5].state == TrialState.COMPLETE and again[5].value == 1.0


def test_flushed_after_every_call_the_head_writes_what_rdb_storage_writes(url):
    """Each flush writes only what changed since the last (a finished trial: its row and values);
    what lands is the same as when everything is written at once."""
    sampler = optuna.samplers.RandomSampler
    plain = optuna.create_study(study_name="plain", storage=RDBStorage(url), sampler=sampler(seed=3))
    head_storage = HeadStorage(RDBStorage(url))
    head = optuna.create_study(study_name="head", storage=head_storage, sampler=sampler(seed=3))
    play(plain)
    flushes = []
    play(head, between=lambda: flushes.append(head_storage.flush()))
    assert head_storage.pending() == 0 and sum(flushes) > 7 * 2
    expected = optuna.load_study(study_name="plain", storage=url).trials
    written = optuna.load_study(study_name="head", storage=url).trials
    assert len(written) == len(expected)
    for a, b in zip(written, expected, strict=True):
        same(a, b)


def test_a_new_head_continues_the_numbers_it_reads(url):
    storage = HeadStorage(RDBStorage(url))
    study = optuna.create_study(study_name="resumed", storage=storage, sampler=optuna.samplers.RandomSampler(seed=1))
    play(study)
    storage.flush()
    later = HeadStorage(RDBStorage(url))
    resumed = optuna.load_study(study_name="resumed", storage=later, sampler=optuna.samplers.RandomSampler(seed=2))
    waiting = resumed.ask()  # the waiting trial is asked first, as with RDBStorage
    assert waiting.number == 6 and waiting.suggest_int("ngl", 0, 33) == 1  # the enqueued value
    fresh = resumed.ask()
    assert fresh.number == 7
    resumed.tell(waiting, 2.0)
    resumed.tell(fresh, 3.0)
    later.flush()
    numbers = [t.number for t in optuna.load_study(study_name="resumed", storage=url).trials]
    assert numbers == list(range(8))


def test_a_rolled_back_flush_is_written_again(url):
    db = open_database(url)
    storage = HeadStorage(RDBStorage(url))
    study = optuna.create_study(study_name="rollback", storage=storage)
    trial = study.ask()
    trial.suggest_int("ngl", 0, 33)
    study.tell(trial, 5.0)

    class Abort(Exception):
        pass

    with pytest.raises(Abort), db.session() as s:
        storage.flush(s)
        raise Abort
    assert optuna.load_study(study_name="rollback", storage=url).trials == []
    assert storage.pending() == 1
    with db.session() as s:
        storage.flush(s)
    assert [t.value for t in optuna.load_study(study_name="rollback", storage=url).trials] == [5.0]
