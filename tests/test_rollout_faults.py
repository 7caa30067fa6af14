"""Rollout under real faults: a node that does not answer (its config lock held by another writer,
as a stuck node's would be), a head process killed with SIGKILL at a moment found by polling the
database, a database row locked so that the head stops exactly between an apply and its record.

Each test runs the rollout on three simulated nodes of its own chip (added to the session cluster
and removed afterwards), against a fresh PostgreSQL database.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, text

from orchestrator import rollout as ro
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.studies import StudyConfig
from orchestrator.tune import tune
from tests.conftest import wait_until
from workers import nodeconfig
from workers.join import plan_join
from workers.simulated import sim_model_info
from workers.trial import Workload

pytestmark = [pytest.mark.postgres, pytest.mark.cluster]

CHIP = "M3 Pro/18"  # no other test's nodes are of this chip
MODEL = "sim://llama2-7b/q8_0"  # nor roll out this model
FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))


@pytest.fixture(scope="module")
def fault_nodes(ray_cluster):
    """Three simulated nodes of CHIP, sorted by id (the first is the canary at a 30 % share)."""
    plan = plan_join(CHIP, "calibrated", 0.02)
    cluster = ray_cluster["cluster"]
    nodes = [cluster.add_node(num_cpus=0, resources=plan.resources, labels=plan.labels) for _ in range(3)]
    cluster.wait_for_nodes()
    yield plan.fingerprint.chip_key, sorted(n.node_id for n in nodes)
    for node in nodes:
        cluster.remove_node(node)


@pytest.fixture(scope="module")
def fault_db(request, fault_nodes, pg_server):
    """A PostgreSQL database holding a recommendation for MODEL on CHIP."""
    from sqlalchemy.engine import make_url

    from tests.conftest import PG_ADMIN_URL

    name = f"fleettune_test_faults_{os.getpid()}"
    with pg_server.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    db = open_database(url)
    tune(db, StudyConfig(model=sim_model_info(MODEL), n_trials=3, seed=3,
                         workload=Workload(n_prompt=64, n_gen=16, reps=2)),
         chip_key=fault_nodes[0], warm=False)
    yield url
    db.dispose()
    with pg_server.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def set_recommendation(url: str, chip_key: str, n_threads: int, expected_scale: float = 1.0) -> None:
    """What the next rollout plans: the chip's recommendation with ``n_threads`` threads."""
    db = open_database(url)
    with db.session() as s:
        rec = [r for r in repo.all_latest_recommendations(s, "tg", True) if r.chip.key == chip_key][0]
        rec.params = {**rec.params, "n_threads": n_threads}
        rec.expected_tps = rec.interval_low * expected_scale


def promoted_baseline(url: str, chip_key: str, nodes: list[str]) -> dict:
    """Every node on one promoted config (C0); returns it."""
    set_recommendation(url, chip_key, n_threads=2, expected_scale=0.5)
    db = open_database(url)
    rollout_id = ro.start(db, sim_model_info(MODEL), chips=[chip_key], canary_share=0.3, tolerance=0.9,
                          applier=ro.Applier(20))
    rows = ro.status_rows(db, rollout_id)
    assert {r["rollout_state"] for r in rows} == {"promoted"}, rows
    baseline = nodeconfig.read(nodes[0])
    assert all(nodeconfig.read(n) == baseline for n in nodes)
    return baseline


def head(url: str, *args: str, log: Path) -> subprocess.Popen:
    """`fleettune rollout ...` as its own head process, attached to the session cluster."""
    from tests.conftest import RAY_TOKEN  # noqa: F401 - the token is in os.environ already

    with open(log, "w") as out:
        return subprocess.Popen([FLEETTUNE, "rollout", *args, "--db", url], stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ))


def cli(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result


@contextlib.contextmanager
def stuck(node_id: str):
    """The node's config lock held here: its applies wait, as on a node that does not answer."""
    with nodeconfig.locked(node_id):
        yield


def rows_of(url: str, rollout_id: int | None = None) -> list[dict]:
    try:
        return ro.status_rows(open_database(url), rollout_id)
    except Exception:  # noqa: BLE001 - no rollout yet
        return []


def newest_rollout_id(url: str) -> int:
    with open_database(url).session() as s:
        return repo.latest_rollout(s).id


def test_rollback_reaches_every_node_it_can_and_restores_the_unreachable_one_later(fault_db, fault_nodes,
                                                                                    ray_cluster):
    chip_key, nodes = fault_nodes
    baseline = promoted_baseline(fault_db, chip_key, nodes)
    set_recommendation(fault_db, chip_key, n_threads=3, expected_scale=0.5)
    ro.start(open_database(fault_db), sim_model_info(MODEL), chips=[chip_key], canary_share=0.3,
             tolerance=0.9, applier=ro.Applier(20))
    new = nodeconfig.read(nodes[0])
    assert new != baseline and all(nodeconfig.read(n) == new for n in nodes)

    with stuck(nodes[1]):
        out = cli("rollout", "rollback", "--apply-timeout", "2", "--address", ray_cluster["address"],
                  "--db", fault_db).output
        assert "2 node(s) restored, 1 pending" in out
        rows = {r["ray_node_id"]: r for r in rows_of(fault_db)}
        assert {r["rollout_state"] for r in rows.values()} == {"rolling_back"}
        assert rows[nodes[1]]["state"] == "restore_pending"
        assert [nodeconfig.read(n) for n in nodes] == [baseline, new, baseline]
    # the node answers again: the next rollback call (or `rollout sync`) reaches it
    out = cli("rollout", "rollback", "--apply-timeout", "20", "--address", ray_cluster["address"],
              "--db", fault_db).output
    assert "1 node(s) restored" in out
    assert {r["rollout_state"] for r in rows_of(fault_db)} == {"rolled_back"}
    assert all(nodeconfig.read(n) == baseline for n in nodes)


def test_a_failed_apply_never_deletes_the_nodes_config(fault_db, fault_nodes, ray_cluster, tmp_path):
    chip_key, nodes = fault_nodes
    baseline = promoted_baseline(fault_db, chip_key, nodes)
    set_recommendation(fault_db, chip_key, n_threads=4, expected_scale=0.5)
    before = newest_rollout_id(fault_db)
    with stuck(nodes[0]):  # the canary does not answer: its apply fails
        proc = head(fault_db, "start", "--model", MODEL, "--chips", chip_key, "--canary", "30%",
                    "--apply-timeout", "3", "--address", ray_cluster["address"], log=tmp_path / "head.log")
        wait_until(lambda: [r for r in rows_of(fault_db) if r["rollout"] > before
                            and r["state"] not in ("pending", "intent")], timeout=120)
    # the canary answers again while the head rolls back
    assert proc.wait(timeout=120) == 3, (tmp_path / "head.log").read_text()  # rolled back: exit 3
    if {r["rollout_state"] for r in rows_of(fault_db)} != {"rolled_back"}:  # it answered too late
        cli("rollout", "rollback", "--address", ray_cluster["address"], "--db", fault_db)
    assert [nodeconfig.read(n) for n in nodes] == [baseline] * 3  # the canary's config is still there
    rows = rows_of(fault_db)
    assert rows[0]["rollout"] > before and {r["rollout_state"] for r in rows} == {"rolled_back"}
    assert "could not apply" in (rows[0]["reason"] or "")


def test_a_failed_row_stops_promotion_after_the_head_is_killed_during_its_rollback(
        fault_db, fault_nodes, ray_cluster, tmp_path):
    chip_key, nodes = fault_nodes
    baseline = promoted_baseline(fault_db, chip_key, nodes)
    set_recommendation(fault_db, chip_key, n_threads=5, expected_scale=0.5)
    before = newest_rollout_id(fault_db)
    with stuck(nodes[0]):  # the canary's apply fails, and the rollback waits on the same node
        proc = head(fault_db, "start", "--model", MODEL, "--chips", chip_key, "--canary", "30%",
                    "--apply-timeout", "8", "--address", ray_cluster["address"], log=tmp_path / "head.log")
        wait_until(lambda: [r for r in rows_of(fault_db) if r["rollout"] > before and r["state"] == "failed"],
                   timeout=120)
        proc.send_signal(signal.SIGKILL)  # the head dies while rolling back
        assert proc.wait(timeout=30) == -signal.SIGKILL
    rows = rows_of(fault_db)
    assert rows[0]["rollout"] > before and {r["rollout_state"] for r in rows} != {"rolled_back"}
    # a new head resumes the unfinished rollout: it must roll back, never promote the waves
    cli("rollout", "start", "--model", MODEL, "--chips", chip_key, "--canary", "30%", "--apply-timeout", "20",
        "--address", ray_cluster["address"], "--db", fault_db, code=3)  # the killed head's lease is taken over
    rows = rows_of(fault_db, rows[0]["rollout"])
    assert {r["rollout_state"] for r in rows} == {"rolled_back"}
    assert not [r for r in rows if r["stage"] > 0 and r["state"] in ("applied", "verified")]
    assert [nodeconfig.read(n) for n in nodes] == [baseline] * 3


def _waiting_on_a_lock(conn) -> bool:
    return bool(conn.execute(text(
        "select count(*) from pg_locks l join pg_stat_activity a on a.pid = l.pid "
        "where not l.granted and a.datname = current_database()")).scalar())


def test_a_head_killed_between_apply_and_record_resumes_knowing_the_true_previous(
        fault_db, fault_nodes, ray_cluster, tmp_path):
    """The canary's row is locked in PostgreSQL, so the head blocks on its next write to it; the
    head is killed once the node's file holds the new config and the head waits on that lock."""
    chip_key, nodes = fault_nodes
    canary = nodes[0]
    baseline = promoted_baseline(fault_db, chip_key, nodes)
    set_recommendation(fault_db, chip_key, n_threads=6, expected_scale=0.5)
    before = newest_rollout_id(fault_db)
    engine = create_engine(fault_db, isolation_level="READ COMMITTED")
    watcher = create_engine(fault_db, isolation_level="AUTOCOMMIT").connect()
    locker = engine.connect()
    stack = contextlib.ExitStack()
    stack.enter_context(stuck(canary))
    try:
        proc = head(fault_db, "start", "--model", MODEL, "--chips", chip_key, "--canary", "30%",
                    "--tolerance", "90%", "--address", ray_cluster["address"], log=tmp_path / "head.log")
        row = wait_until(lambda: [r for r in rows_of(fault_db)
                                  if r["rollout"] > before and r["ray_node_id"] == canary], timeout=120)[0]
        row_id = watcher.execute(text("select id from ft_rollout_nodes where rollout_id = :r and ray_node_id = :n"),
                                 {"r": row["rollout"], "n": canary}).scalar()
        lock_row = text("select id from ft_rollout_nodes where id = :i for update")
        locker.execute(lock_row, {"i": row_id})

        def state():
            return watcher.execute(text("select state from ft_rollout_nodes where id = :i"), {"i": row_id}).scalar()

        wait_until(lambda: _waiting_on_a_lock(watcher) or nodeconfig.read(canary) != baseline
                   or state() == "intent", timeout=120)
        if nodeconfig.read(canary) == baseline:  # the head records an intent before it applies
            if state() != "intent":  # it waits to record it: let it, then stop it right after its apply
                locker.commit()
                wait_until(lambda: state() == "intent", timeout=60)
                locker.execute(lock_row, {"i": row_id})
            stack.close()  # the apply goes through now
        wait_until(lambda: nodeconfig.read(canary) != baseline and _waiting_on_a_lock(watcher), timeout=120)
        proc.send_signal(signal.SIGKILL)  # applied on the node, not recorded as applied
        assert proc.wait(timeout=30) == -signal.SIGKILL
        new = nodeconfig.read(canary)
        assert new["version"] == row["version"]
    finally:
        locker.rollback()
        locker.close()
        watcher.close()
        engine.dispose()
        stack.close()
    # a new head resumes it (the canary's apply is not lost) and then rolls it back by hand
    cli("rollout", "start", "--model", MODEL, "--chips", chip_key, "--canary", "30%",
        "--address", ray_cluster["address"], "--db", fault_db)
    assert {r["rollout_state"] for r in rows_of(fault_db, row["rollout"])} == {"promoted"}
    assert all(nodeconfig.read(n) == new for n in nodes)
    with open_database(fault_db).session() as s:
        recorded = {n.ray_node_id: n.previous for n in repo.rollout_nodes(s, row["rollout"])}
    assert recorded[canary] == baseline
    out = cli("rollout", "rollback", str(row["rollout"]), "--address", ray_cluster["address"],
              "--db", fault_db).output
    assert "3 node(s) restored" in out
    assert [nodeconfig.read(n) for n in nodes] == [baseline] * 3
    assert json.loads(json.dumps(baseline)) == nodeconfig.read(canary)
