"""Tests are put in their tier by what they use (tests/conftest.py), not by hand."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import tier_markers


def item(*fixtures: str, **params: str) -> SimpleNamespace:
    test = SimpleNamespace(fixturenames=list(fixtures))
    if params:
        test.callspec = SimpleNamespace(params=params)
    return test


def test_fixtures_and_database_parameters_pick_the_tier():
    assert tier_markers(item("sqlite_url", "tmp_path")) == set()  # the fast tier
    assert tier_markers(item("db_url", "sqlite_url", db_url="sqlite")) == set()
    assert tier_markers(item("db_url", db_url="postgres")) == {"postgres"}
    assert tier_markers(item("tuned", "ray_cluster", tuned="postgres")) == {"cluster", "postgres"}
    assert tier_markers(item("fleet_cluster", "model_info", "model_path")) == {"cluster", "model"}
    assert tier_markers(item("pg_url", "pg_server")) == {"postgres"}
