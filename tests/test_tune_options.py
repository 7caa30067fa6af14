"""`tune` checks every option before anything is written (no Ray, no server: the fast tier)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.db import open_database, repo


def tune(tmp_path, *option):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    result = CliRunner().invoke(main, ["tune", "sim://llama2-7b/q4_0", "--db", url, "--quiet", *option])
    with open_database(url).session() as s:
        assert repo.list_studies(s) == []  # nothing written
    return result


@pytest.mark.parametrize("option", [
    ["--timeout", "nan"], ["--timeout", "inf"], ["--timeout", "0"], ["--timeout", "-5"],
    ["--cooldown", "-1"], ["--cooldown", "nan"], ["-r", "0"], ["--trials", "0"], ["--confirm-top", "-2"],
])
def test_out_of_range_or_non_finite_options_are_one_line_and_exit_2(tmp_path, option):
    result = tune(tmp_path, *option)
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("error: ")


@pytest.mark.parametrize("option", [["--objective", "speed"], ["--sampler", "annealing"]])
def test_unknown_names_are_one_line_and_exit_2(tmp_path, option):
    result = tune(tmp_path, *option)
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("error: unknown ")


@pytest.mark.parametrize("rounds", ["2", "five", "-4"])
def test_a_bad_confirmation_budget_in_the_environment_is_one_line_and_exit_2(tmp_path, monkeypatch, rounds):
    monkeypatch.setenv("FLEETTUNE_CONFIRM_ROUNDS", rounds)
    result = tune(tmp_path)
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "FLEETTUNE_CONFIRM_ROUNDS" in result.output
