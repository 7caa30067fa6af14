"""The results database on a real SQLite file and the real PostgreSQL server."""

from __future__ import annotations

import optuna
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from migrations import VERSION_TABLE
from orchestrator.db import open_database
from orchestrator.db.models import Base
from orchestrator.db.session import head_revision, redact
from workers.errors import BadInput


def test_first_use_creates_the_schema_with_our_own_version_table(db_url):
    db = open_database(db_url)
    tables = set(inspect(db.engine).get_table_names())
    assert set(Base.metadata.tables) <= tables
    assert VERSION_TABLE in tables and "alembic_version" not in tables
    assert db.current_revision() == head_revision()


def test_optuna_tables_coexist_in_the_same_database(db_url):
    db = open_database(db_url)
    storage = optuna.storages.RDBStorage(db.url_string)
    study = optuna.create_study(study_name="coexist", storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    db.dispose()
    again = open_database(db_url)  # Optuna's alembic_version does not confuse ours
    assert again.current_revision() == head_revision()
    assert len(optuna.load_study(study_name="coexist", storage=db.url_string).trials) == 2


def test_models_and_migrations_describe_the_same_schema(db_url):
    db = open_database(db_url)
    with db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        diff = [d for d in compare_metadata(ctx, Base.metadata)
                if not (d[0] == "remove_table" and d[1].name == VERSION_TABLE)]
    assert diff == []


def test_sqlite_uses_wal(sqlite_url):
    db = open_database(sqlite_url)
    with db.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"


def test_an_old_schema_is_refused_not_altered(db_url):
    db = open_database(db_url)
    with db.engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '0001'"))  # our first revision
    db.dispose()
    with pytest.raises(BadInput, match="fleettune db upgrade"):
        open_database(db_url)
    check = open_database(db_url, check=False)
    assert check.current_revision() == "0001"  # untouched


def test_bad_urls_are_one_line_errors(tmp_path):
    for url, match in [
        ("not a url", "bad database URL"),
        (f"sqlite:///{tmp_path}/missing/dir/x.db", "does not exist"),
        ("nosuchdb://x/y", "bad database URL"),
        ("postgresql+psycopg://postgres@127.0.0.1:1/nope", "cannot open database"),
    ]:
        with pytest.raises(BadInput, match=match) as info:
            open_database(url)
        assert "\n" not in str(info.value)


def test_password_never_shown():
    url = "postgresql+psycopg://fleet:s3cret@127.0.0.1:1/fleet"
    assert "s3cret" not in redact(url)
    with pytest.raises(BadInput) as info:
        open_database(url)
    assert "s3cret" not in str(info.value)


def test_the_head_reconnects_after_postgresql_drops_its_connections(pg_url, pg_server, model_info):
    """What a server restart does to the head's pooled connections: every one is terminated."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from orchestrator.db import open_database, repo

    db = open_database(pg_url)
    with db.session() as s:
        repo.upsert_model(s, model_info)
    name = make_url(pg_url).database
    with pg_server.connect() as conn:
        killed = conn.execute(text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = :name AND pid <> pg_backend_pid()"), {"name": name}).scalar()
    assert killed >= 1  # the head's pooled connection is gone
    with db.session() as s:  # the next unit of work gets a fresh connection, nothing lost
        assert [m.sha256 for m in repo.list_models(s)] == [model_info.sha256]
