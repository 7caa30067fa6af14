"""Schema and database corners (issue 24, case 11): a newer schema, tables without a version row,
a password in the URL's query, values SQLite stores but PostgreSQL refuses, an in-memory SQLite
URL. Each one line on stderr, exit 2, nothing written; real SQLite files and a real PostgreSQL."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, func, select, text

from migrations import VERSION_TABLE
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.db.models import Model, Study
from workers.errors import BadInput
from workers.models import ModelInfo


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in result.output, result.output
    return err


def _set_version(url: str, revision: str | None) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {VERSION_TABLE}"))
        if revision:
            conn.execute(text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES (:v)"), {"v": revision})
    engine.dispose()


def _tables(url: str) -> set[str]:
    from sqlalchemy import inspect

    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_a_newer_schema_is_refused_without_sending_the_user_to_db_upgrade(sqlite_url):
    open_database(sqlite_url).dispose()
    _set_version(sqlite_url, "f00dfeedbeef")  # a revision a newer fleettune wrote
    for args in (["results", "--db", sqlite_url], ["db", "upgrade", "--db", sqlite_url]):
        err = one_line_error(cli(*args))
        assert "newer fleettune" in err and "db upgrade" not in err, err
    out = cli("db", "current", "--db", sqlite_url)
    assert out.exit_code == 0 and "made by a newer fleettune" in out.output and "needs" not in out.output


def test_tables_without_a_version_row_are_one_line_for_db_upgrade(sqlite_url):
    open_database(sqlite_url).dispose()
    _set_version(sqlite_url, None)
    before = _tables(sqlite_url)
    err = one_line_error(cli("db", "upgrade", "--db", sqlite_url))
    assert "no schema version" in err
    assert _tables(sqlite_url) == before


def test_a_password_in_the_query_is_never_printed():
    url = "postgresql://someone@127.0.0.1:1/fleet?password=hunter2-secret&sslmode=disable"  # port 1: nothing listens
    for args in (["results", "--db", url], ["db", "current", "--db", url], ["db", "upgrade", "--db", url]):
        result = cli(*args)
        assert result.exit_code == 2, result.output
        assert "hunter2" not in result.output and "hunter2" not in (result.stderr or ""), result.output
        assert "password=***" in result.stderr, result.stderr


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file::memory:?mode=memory&uri=true"])
def test_an_in_memory_sqlite_database_is_refused(url):
    err = one_line_error(cli("results", "--db", url))
    assert "in-memory" in err


def _info(name: str) -> ModelInfo:
    return ModelInfo(sha256="ab" * 32, path="/models/x.gguf", name=name, architecture="llama", n_layer=2,
                     n_params=1000, file_type="Q4_0", size_bytes=1000, context_length=2048)


@pytest.mark.parametrize("name", ["m" * 201, "nul\x00name"])
def test_text_postgresql_refuses_is_refused_on_every_backend(db_url, name):
    db = open_database(db_url)
    with pytest.raises(BadInput, match="model name"), db.session() as s:
        repo.upsert_model(s, _info(name))
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Model)) == 0  # nothing written
    db.dispose()


def test_a_study_name_too_long_for_its_column_is_refused_before_anything_runs(sqlite_url):
    err = one_line_error(cli("tune", "sim://llama2-7b/q4_0", "--study", "s" * 256, "--db", sqlite_url))
    assert "--study" in err


def test_a_nul_in_imported_text_is_refused_on_every_backend(db_url, tmp_path):
    row = json.loads((llamabench_fixture()).read_text().splitlines()[0])
    row["model_filename"] = "/models/a\x00b.gguf"
    source = tmp_path / "nul.jsonl"
    source.write_text(json.dumps(row) + "\n")
    err = one_line_error(cli("import", "llama-bench", source, "--db", db_url))
    assert "NUL" in err
    db = open_database(db_url)
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Study)) == 0
    db.dispose()


def llamabench_fixture():
    from pathlib import Path

    return Path(__file__).parent / "fixtures" / "llama-bench" / "smollm2.jsonl"
