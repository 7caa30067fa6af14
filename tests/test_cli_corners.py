"""Smaller corners of issue 24: `tune --trials` past any budget, `dashboard` on a database without
Optuna's tables or on a port that does not exist, `results --state failed` with its reasons.
Real SQLite files, the real CLI; nothing here starts Ray (a test that did would fail: conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from orchestrator.cli import MAX_TRIALS, main
from orchestrator.db import open_database

FIXTURES = Path(__file__).parent / "fixtures" / "llama-bench"


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, match: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in result.output, result.output
    assert match in err, err
    return err


@pytest.mark.parametrize("trials", [10**20, MAX_TRIALS + 1, 0, -3])
def test_a_trial_budget_no_study_can_hold_is_refused_before_ray_starts(sqlite_url, trials):
    one_line_error(cli("tune", "sim://llama2-7b/q4_0", "--trials", trials, "--db", sqlite_url), "--trials")
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()  # not even the database was opened


def test_the_dashboard_refuses_a_database_without_optuna_tables(sqlite_url):
    pytest.importorskip("optuna_dashboard")
    open_database(sqlite_url).dispose()  # fleettune's tables, no study yet: Optuna's are missing
    one_line_error(cli("dashboard", "--db", sqlite_url, "--port", "8765"), "no Optuna studies")


@pytest.mark.parametrize("port", [70000, 0, -1])
def test_the_dashboard_refuses_a_port_that_does_not_exist(sqlite_url, port):
    one_line_error(cli("dashboard", "--db", sqlite_url, "--port", port), "--port")


def test_failed_trials_are_listed_with_their_reason(sqlite_url):
    assert cli("import", "llama-bench", FIXTURES / "smollm2.json", "--db", sqlite_url).exit_code == 0
    db = open_database(sqlite_url)
    with db.engine.begin() as conn:
        conn.execute(text("UPDATE ft_trials SET state = 'failed', failure_kind = 'crash', "
                          "error = 'llama.cpp crashed (SIGSEGV)' WHERE id = (SELECT MIN(id) FROM ft_trials)"))
    db.dispose()
    for state in ("failed", "all"):
        result = cli("results", "--state", state, "--db", sqlite_url)
        assert result.exit_code == 0, result.output
        header, words = result.output.splitlines()[0], result.output.split()  # the table wraps long cells
        assert "reason" in header.split() and {"crashed", "(SIGSEGV)"} <= set(words), result.output
        assert state == "failed" or "state" in header.split()
    complete = cli("results", "--db", sqlite_url)
    assert "reason" not in complete.output
