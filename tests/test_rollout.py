"""Rollout on the real Ray cluster: canary, verification, promotion in waves, a forced regression
that rolls back, a killed rollout that resumes; `config show` on each node matches the DB."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator import rollout as ro
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.studies import StudyConfig
from orchestrator.tune import tune
from tests.conftest import SIM_CHIPS, module_db_url, tuned_sim_fleet
from workers import nodeconfig
from workers.errors import BadInput
from workers.simulated import sim_model_info
from workers.trial import Workload

SIM_MODEL = "sim://llama2-13b/q4_0"  # a model no other test rolls out


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def tuned(request, tmp_path_factory, ray_cluster):
    return tuned_sim_fleet(module_db_url(request, tmp_path_factory), SIM_MODEL, n_trials=4, seed=2,
                           workload=Workload(n_prompt=64, n_gen=16, reps=2))


def cli(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result


def node_files(rows):
    return {r["ray_node_id"]: nodeconfig.read(r["ray_node_id"]) for r in rows}


def test_canary_then_waves_promote_and_every_node_shows_the_rolled_out_config(tuned):
    plan = json.loads(cli("rollout", "plan", "--model", SIM_MODEL, "--canary", "34%", "--db", tuned,
                          "--json").output)
    assert {p["chip"]: (p["nodes"], p["canaries"]) for p in plan} == {
        SIM_CHIPS["M1 Pro/16"]: (2, 1), SIM_CHIPS["M2 Ultra/76"]: (3, 2)}
    cli("rollout", "start", "--model", SIM_MODEL, "--canary", "34%", "--tolerance", "50%", "--db", tuned)
    rows = json.loads(cli("rollout", "status", "--db", tuned, "--json").output)
    assert {r["rollout_state"] for r in rows} == {"promoted"}
    canaries = [r for r in rows if r["stage"] == 0]
    assert all(r["state"] == "verified" and r["measured_tps"] > 0 for r in canaries)
    assert all(r["state"] == "applied" for r in rows if r["stage"] > 0)
    db = open_database(tuned)
    with db.session() as s:
        rollout = repo.latest_rollout(s)
        plan_by_chip = dict(rollout.plan)
    for row in rows:  # what each node shows is what the DB says it got
        shown = json.loads(cli("config", "show", "--node", row["ray_node_id"]).output)
        assert shown == plan_by_chip[row["chip"]]
    one = rows[0]["ray_node_id"]
    assert cli("config", "show", "--node", one, "--format", "flags").output.strip() == rows[0]["flags"]
    assert "PARAMETER num_gpu" in cli("config", "show", "--node", one, "--format", "ollama").output
    assert cli("config", "show", "--node", one, "--format", "python").output.startswith("llama_cpp.Llama(")


def test_a_regression_at_the_canary_rolls_every_touched_node_back(tuned):
    db = open_database(tuned)
    before = node_files(ro.status_rows(db))  # the configs the previous rollout left
    with db.session() as s:  # the recommendation now promises far more than the nodes can do
        rec = [r for r in repo.all_latest_recommendations(s, "tg", True)
               if r.chip.key == SIM_CHIPS["M2 Ultra/76"]][0]
        rec.expected_tps *= 10
        rec.params = {**rec.params, "n_threads": rec.params["n_threads"] % 8 + 1}  # and differs
    result = cli("rollout", "start", "--model", SIM_MODEL, "--canary", "34%", "--db", tuned, code=3)  # rolled back
    assert "expected at least" in result.output
    rows = ro.status_rows(db)
    assert {r["rollout_state"] for r in rows} == {"rolled_back"}
    failed = [r for r in rows if r["state"] == "failed" or "expected at least" in (r["reason"] or "")]
    assert failed and failed[0]["chip"] == SIM_CHIPS["M2 Ultra/76"]
    assert node_files(rows) == {k: before[k] for k in node_files(rows)}  # every node as it was
    history = json.loads(cli("rollout", "history", "--db", tuned, "--json").output)
    assert [h["state"] for h in history][-2:] == ["promoted", "rolled_back"]
    assert "expected at least" in history[-1]["message"]


def test_a_killed_rollout_resumes_without_applying_twice(tuned):
    db = open_database(tuned)
    model = sim_model_info(SIM_MODEL)
    with db.session() as s:  # a promise the nodes can keep again, and a config that differs
        rec = [r for r in repo.all_latest_recommendations(s, "tg", True)
               if r.chip.key == SIM_CHIPS["M2 Ultra/76"]][0]
        rec.expected_tps /= 20

    class KilledAfterFirstApply(ro.Applier):
        def verify(self, *args, **kwargs):
            raise KeyboardInterrupt  # the head dies while its first canary is being verified

    with pytest.raises(KeyboardInterrupt):
        ro.start(db, model, canary_share=0.34, tolerance=0.5, applier=KilledAfterFirstApply())
    rows = ro.status_rows(db)
    assert rows[0]["rollout_state"] == "running"
    assert [r["state"] for r in rows].count("applied") == 1

    applied = []

    class Counting(ro.Applier):
        def apply(self, node_id, payload, only_if=None):
            applied.append(node_id)
            return super().apply(node_id, payload, only_if)

    resumed = ro.start(db, model, canary_share=0.34, tolerance=0.5, applier=Counting())
    rows = ro.status_rows(db, resumed)
    assert rows[0]["rollout"] == resumed and rows[0]["rollout_state"] == "promoted"
    assert len(applied) == len(rows) - 1 == len(set(applied))  # the first canary was not re-applied


def test_the_real_node_gets_a_verified_config(sqlite_url, model_info, local_fingerprint, ray_cluster):
    db = open_database(sqlite_url)
    cfg = StudyConfig(model=model_info, n_trials=2, seed=1, confirm_top=1,
                      workload=Workload(n_prompt=16, n_gen=4, reps=1))
    tune(db, cfg, chip_key=local_fingerprint.chip_key, warm=False)
    rollout_id = ro.start(db, model_info, canary_share=1.0, tolerance=0.9)
    rows = ro.status_rows(db, rollout_id)
    assert len(rows) == 1 and rows[0]["state"] == "verified" and rows[0]["measured_tps"] > 0
    assert nodeconfig.read(rows[0]["ray_node_id"])["model_sha256"] == model_info.sha256


def test_bad_payloads_are_refused():
    good = {"version": 1, "rollout_id": 1, "model_sha256": "a" * 64, "model_name": "m", "objective": "tg",
            "params": {"n_gpu_layers": 1, "n_threads": 2, "n_batch": 64, "n_ubatch": 64, "flash_attn": False,
                       "n_threads_batch": None}, "expected_tps": 10.0}
    assert nodeconfig.validate(good) == good
    for bad in ({**good, "shell": "rm -rf /"}, {**good, "model_name": "x; rm -rf /"},
                {**good, "params": {**good["params"], "n_threads": 0}},
                {**good, "params": {**good["params"], "n_batch": "64"}}):
        with pytest.raises(BadInput):
            nodeconfig.validate(bad)


def test_sync_restores_a_lost_config_file(tuned):
    db = open_database(tuned)
    rows = ro.status_rows(db)
    assert rows[0]["rollout_state"] == "promoted"
    lost = rows[-1]["ray_node_id"]
    expected = nodeconfig.read(lost)
    nodeconfig.write(lost, None)  # as on a Mac that joins after the rollout: no config yet
    synced = json.loads(cli("rollout", "sync", "--model", SIM_MODEL, "--db", tuned, "--json").output)
    assert [r["changed"] for r in synced if lost.startswith(r["node"])] == [True]
    assert not any(r["changed"] for r in synced if not lost.startswith(r["node"]))
    assert nodeconfig.read(lost) == expected


def test_rollback_by_hand_restores_what_each_node_had(tuned):
    from orchestrator.db.models import Rollout

    db = open_database(tuned)
    with db.session() as s:
        latest = repo.latest_rollout(s)
        assert latest.state == "promoted"
        had = {n.ray_node_id: n.previous for n in s.get(Rollout, latest.id).nodes}
    out = cli("rollout", "rollback", "--db", tuned).output
    assert f"rollout {latest.id}: {len(had)} node(s) restored" in out
    assert {r["rollout_state"] for r in ro.status_rows(db)} == {"rolled_back"}
    assert {node: nodeconfig.read(node) for node in had} == had
