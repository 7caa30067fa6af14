"""Faults injected for real into real studies, then every invariant checked (orchestrator/audit.py).

The fast subset of bench/faults.py: the study's driver is a separate process (the study loop
`tune` runs, over in-process simulated Macs whose trials take real wall time), killed with
SIGKILL, sent SIGINT/SIGTERM/SIGHUP, raced by a second driver, or left running while its database
is restarted, stopped or locked. PostgreSQL faults use a private server started here (initdb +
pg_ctl on another port); the shared server is never touched.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from bench.faults import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_PAUSED,
    Harness,
    PrivatePostgres,
    pg_restart,
    sqlite_lock,
)
from orchestrator.audit import audit_study
from orchestrator.db import open_database

pytestmark = pytest.mark.faults
RETRY_ENV = {"FLEETTUNE_DB_RETRY_S": "4", "FLEETTUNE_SQLITE_BUSY_TIMEOUT_S": "1"}


@pytest.fixture(scope="module")
def private_pg():
    server = PrivatePostgres()
    server.start()
    yield server
    server.close()


@pytest.fixture(params=["sqlite", "postgres"])
def harness(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'faults.db'}"
    else:
        url = request.getfixturevalue("private_pg").new_database()
    open_database(url).dispose()
    return Harness(url, seed=7, env=RETRY_ENV, trials=16)


def assert_clean(h: Harness) -> None:
    assert not h.tally.problems, h.tally.problems
    assert h.tally.lost == 0 and h.tally.duplicated == 0
    assert sum(h.tally.studies.values()) == sum(h.tally.held.values())


def test_sigkill_of_the_driver_at_random_moments_then_resume(harness):
    harness.kills(6, per_study=3)
    assert harness.tally.faults["SIGKILL driver"] == 6
    assert_clean(harness)


@pytest.mark.parametrize("chips", [1, 3])
def test_signals_pause_every_study_within_seconds(harness, chips):
    harness.signals(3, chips=chips)  # SIGINT, SIGTERM, SIGHUP
    assert harness.tally.paused >= 2  # a study may end before its signal, not most of them
    assert max(harness.tally.pause_s) < 10
    assert_clean(harness)


def test_a_signalled_driver_exits_paused_and_resume_completes(tmp_path):
    h = Harness(f"sqlite:///{tmp_path / 'f.db'}", env=RETRY_ENV, trials=200, trial_s=0.2)
    open_database(h.url).dispose()
    proc = h.start("paused")
    while proc.poll() is None and h.phase_now("paused") != "search":
        time.sleep(0.02)  # polling for the search to start
    proc.send_signal(signal.SIGTERM)
    code, line = h.finish(proc, timeout=30)
    assert code == EXIT_PAUSED and "--resume" in line
    db = open_database(h.url)
    report = audit_study(db, "paused")
    assert report.state == "paused" and report.ok and report.complete < 200
    h.resume_to_end("paused")
    assert audit_study(db, "paused").ok


def test_a_second_driver_on_a_running_study_is_refused(harness):
    harness.trial_s = 0.2
    harness.two_drivers(1)
    assert_clean(harness)


def test_two_new_studies_started_at_once_get_distinct_names(harness):
    harness.same_name(1)
    assert_clean(harness)


def test_sqlite_locked_by_another_writer(tmp_path):
    h = Harness(f"sqlite:///{tmp_path / 'locked.db'}", env=RETRY_ENV, trials=16, trial_s=0.1)
    open_database(h.url).dispose()
    sqlite_lock(h, 2.0, "within the retry window")  # past the 1 s busy timeout: retried
    sqlite_lock(h, 6.0, "past the retry window")  # the study pauses, then resumes
    assert_clean(h)


def test_postgres_restart_and_outage(private_pg):
    h = Harness(private_pg.new_database(), env=RETRY_ENV, trials=16, trial_s=0.1)
    open_database(h.url).dispose()
    assert pg_restart(h, private_pg, down_s=0, kind="restart") == EXIT_OK  # retried, no pause
    assert pg_restart(h, private_pg, down_s=7, kind="outage") == EXIT_PAUSED  # past the window
    assert_clean(h)


def test_the_driver_command_reports_bad_input_in_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    proc = subprocess.run([sys.executable, "bench/faults.py", "drive", "--db", url, "--study", "none",
                           "--resume"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_BAD_INPUT
    assert proc.stderr.strip().count("\n") == 0 and "no study to resume" in proc.stderr
