"""One driver per model's rollouts, exit codes, rollback semantics and `--dry-run` (issue 24.4), on the
session's real Ray cluster: the two simulated M1 Pro nodes, with real node-config files.

- a second driver (a thread, and the CLI) is refused in one line, exit 2, while the first is alive;
  a driver process killed with SIGKILL leaves a lease the next driver takes over;
- `rollout start` exits 0 when promoted, 3 when rolled back;
- a rollback of a promoted rollout leaves every node with what it had before (here: no config at
  all), and the config hub never hands out the rolled-back config, not even while the rollback
  runs; a rollback of a rollout rolled back already changes nothing;
- `--dry-run` shows the pin and the canary floor the tolerance gives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import rollout as ro
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.studies import StudyConfig
from orchestrator.tune import tune
from tests.conftest import SIM_CHIPS, wait_until
from workers import confighub, nodeconfig
from workers.simulated import sim_model_info
from workers.trial import Workload

MODEL = "sim://llama2-13b/q8_0"  # a model no other test rolls out
CHIP = SIM_CHIPS["M1 Pro/16"]
FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))


@pytest.fixture(scope="module")
def fleet(ray_cluster, tmp_path_factory):
    """A database with a recommendation for MODEL on CHIP; the chip's two nodes with no config."""
    from orchestrator import dispatch

    url = f"sqlite:///{tmp_path_factory.mktemp('drivers') / 'results.db'}"
    tune(open_database(url), StudyConfig(model=sim_model_info(MODEL), n_trials=3, seed=4,
                                         workload=Workload(n_prompt=64, n_gen=16, reps=2)), chip_key=CHIP, warm=False)
    nodes = sorted(n.ray_node_id for n in dispatch.bench_nodes(CHIP))
    assert len(nodes) == 2
    for node in nodes:
        nodeconfig.write(node, None)
    return url, nodes


def cli(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result


def lease_holder(url: str) -> str | None:
    db = open_database(url)
    with db.session() as s:
        model_id = repo.find_models(s, sim_model_info(MODEL).sha256)[0].id
        return repo.rollout_lease_holder(s, model_id)[0]


def test_a_second_driver_is_refused_while_the_first_is_alive(fleet):
    url, nodes = fleet
    db = open_database(url)
    inside, go_on = threading.Event(), threading.Event()

    class HeldAtItsCanary(ro.Applier):
        def verify(self, *args, **kwargs):
            inside.set()
            assert go_on.wait(120)
            return super().verify(*args, **kwargs)

    done: dict = {}
    first = threading.Thread(target=lambda: done.setdefault("id", ro.start(
        db, sim_model_info(MODEL), chips=[CHIP], canary_share=0.5, tolerance=0.9, applier=HeldAtItsCanary())))
    first.start()
    try:
        assert inside.wait(120)
        for args in (["rollout", "start", "--model", MODEL, "--chips", CHIP], ["rollout", "rollback"]):
            refused = cli(*args, "--db", url, code=2)
            lines = refused.output.strip().splitlines()
            assert len(lines) == 1 and "being driven by another process" in lines[0], refused.output
        with pytest.raises(ro.BadInput, match="being driven by another process"):
            ro.start(db, sim_model_info(MODEL), chips=[CHIP], canary_share=0.5, tolerance=0.9)
        rows = ro.status_rows(db)
        assert [r["state"] for r in rows] == ["applied", "pending"]  # the refused drivers touched nothing
    finally:
        go_on.set()
        first.join(timeout=300)
    assert ro.status_rows(db, done["id"])[0]["rollout_state"] == "promoted"
    assert lease_holder(url) is None  # let go at the end
    assert [nodeconfig.read(n)["version"] for n in nodes] == [done["id"]] * 2


def test_a_killed_drivers_lease_is_taken_over_and_start_exits_0_when_promoted(fleet, tmp_path):
    url, nodes = fleet
    db = open_database(url)
    with db.session() as s:  # a config the nodes do not hold yet
        rec = [r for r in repo.all_latest_recommendations(s, "tg", True) if r.chip.key == CHIP][0]
        rec.params = {**rec.params, "n_threads": rec.params["n_threads"] % 8 + 1}
    with nodeconfig.locked(nodes[0]), open(tmp_path / "driver.log", "w") as log:  # its canary's apply waits
        proc = subprocess.Popen([FLEETTUNE, "rollout", "start", "--model", MODEL, "--chips", CHIP,
                                 "--canary", "50%", "--tolerance", "90%", "--db", url],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            wait_until(lambda: f":{proc.pid}:" in (lease_holder(url) or "")
                       and ro.status_rows(db)[0]["state"] == "intent", timeout=120)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    assert f":{proc.pid}:" in lease_holder(url)  # its lease is left behind, its heartbeat fresh
    result = cli("rollout", "start", "--model", MODEL, "--chips", CHIP, "--canary", "50%", "--tolerance", "90%",
                 "--db", url, "--json")
    rows = json.loads(result.stdout)
    assert {r["rollout_state"] for r in rows} == {"promoted"} and rows[0]["state"] == "verified"
    assert lease_holder(url) is None
    assert [nodeconfig.read(n)["version"] for n in nodes] == [rows[0]["rollout"]] * 2


def test_a_rollback_of_a_promoted_rollout_leaves_every_node_as_it_was_before_it(fleet):
    """The issue's case: v1 promoted over nodes with no config, an operator's pin rolled back by its
    canary, then `rollout rollback` of v1: both nodes go back to no config, and the config hub,
    asked after each node's restore (as a node without a config asks), never hands v1 out."""
    url, nodes = fleet
    db = open_database(url)
    model = sim_model_info(MODEL)
    for earlier in reversed([h["rollout"] for h in ro.history_rows(db) if h["state"] == "promoted"]):
        ro.rollback(db, earlier)  # the earlier tests' rollouts, newest first: every node back to no config
    assert [nodeconfig.read(n) for n in nodes] == [None, None]
    cli("rollout", "start", "--model", MODEL, "--chips", CHIP, "--canary", "50%", "--tolerance", "90%", "--db", url)
    v1 = ro.latest_rollout_id(db)
    assert [nodeconfig.read(n)["version"] for n in nodes] == [v1, v1]
    with db.session() as s:  # the operator's pin is held to a figure no node reaches
        rec = [r for r in repo.all_latest_recommendations(s, "tg", True) if r.chip.key == CHIP][0]
        rec.expected_tps *= 10
    pinned = cli("rollout", "start", "--model", MODEL, "--chips", CHIP, "--canary", "50%", "--params", "-t 1",
                 "--db", url, code=3)  # rolled back: exit 3
    assert "expected at least" in pinned.output
    pin_id = ro.latest_rollout_id(db)
    assert pin_id != v1 and ro.status_rows(db, pin_id)[0]["rollout_state"] == "rolled_back"
    assert [nodeconfig.read(n)["version"] for n in nodes] == [v1, v1]
    reason = ro.history_rows(db)[-1]["message"]

    handed_out = []

    class AskingTheHub(ro.Applier):
        def apply(self, node_id, payload, only_if=None):
            out = super().apply(node_id, payload, only_if)
            handed_out.append(confighub.ask(CHIP, model.sha256))  # what a node without a config gets now
            return out

    done = ro.rollback(db, v1, applier=AskingTheHub())
    assert (done.restored, done.pending, done.already) == (2, 0, False)
    assert [nodeconfig.read(n) for n in nodes] == [None, None]  # what they had before v1
    assert handed_out == [None, None] and confighub.ask(CHIP, model.sha256) is None

    again = cli("rollout", "rollback", pin_id, "--db", url).output
    assert "rolled back already" in again and "nothing changed" in again
    assert ro.history_rows(db)[-1]["message"] == reason  # its recorded reason is kept
    assert "rolled back already" in cli("rollout", "rollback", v1, "--db", url).output
    assert [nodeconfig.read(n) for n in nodes] == [None, None]


def test_dry_run_shows_what_the_pin_and_the_tolerance_would_do(fleet):
    url, nodes = fleet
    db = open_database(url)
    before = ro.history_rows(db)
    out = cli("rollout", "start", "--model", MODEL, "--chips", CHIP, "--params", "-t 1 -b 64", "--tolerance", "20%",
              "--canary", "50%", "--dry-run", "--db", url, "--json").stdout
    (row,) = json.loads(out)
    assert "-t 1 " in row["flags"] + " " and "-b 64" in row["flags"] and row["source"] == "pin"
    assert row["floor_tps"] == pytest.approx(row["expected_tps"] * 0.8)
    assert (row["nodes"], row["canaries"], row["waves"]) == (2, 1, 1)
    cli("rollout", "start", "--model", MODEL, "--tolerance", "100%", "--dry-run", "--db", url, code=2)
    cli("rollout", "start", "--model", MODEL, "--params", "-t zero", "--dry-run", "--db", url, code=2)
    assert ro.history_rows(db) == before and [nodeconfig.read(n) for n in nodes] == [None, None]


def test_an_inconclusive_canary_pauses_the_rollout_and_start_judges_it_again(fleet):
    """Servers that answer every request but generate one token: no tg rate, so the canary analysis
    cannot decide. The rollout pauses (exit 3 through the CLI's rule, here its state), `rollout
    status` says why, and nothing is promoted; the next `rollout start` judges the canary again."""
    from dataclasses import asdict

    from workers.probe import RequestResult

    url, nodes = fleet
    db = open_database(url)
    with db.session() as s:  # a config the nodes do not hold yet
        rec = [r for r in repo.all_latest_recommendations(s, "tg", True) if r.chip.key == CHIP][0]
        rec.params = {**rec.params, "n_threads": rec.params["n_threads"] % 8 + 1}
        rec.expected_tps /= 10

    class OneTokenServers(ro.Applier):
        """Each node's server, as its status and probe report it: it serves the node's config file."""

        def serve_status(self, node_id):
            held = nodeconfig.read(node_id)
            return {"fresh": True, "ready": True, "config_version": held["version"] if held else 0}

        def probe(self, node_id, n_prompt, n_gen, n_requests=1, first=0):
            version = self.serve_status(node_id)["config_version"]
            result = RequestResult(True, ttft_s=0.1, total_s=0.1, n_gen=1, n_prompt=n_prompt)
            return {"served": True, "results": [asdict(result)], "config_version": version,
                    "config_version_after": version}

    rollout_id = ro.start(db, sim_model_info(MODEL), chips=[CHIP], canary_share=0.5, tolerance=0.5,
                          applier=OneTokenServers())
    rows = ro.status_rows(db, rollout_id)
    assert rows[0]["rollout_state"] == "paused" and [r["state"] for r in rows] == ["applied", "pending"]
    shown = json.loads(cli("rollout", "status", rollout_id, "--db", url, "--json").stdout)
    assert shown[0]["rollout_message"].startswith("inconclusive: ") and "no tg rate" in shown[0]["rollout_message"]
    with db.session() as s:
        assert repo.current_chip_configs(s, sim_model_info(MODEL).sha256) == {}  # nothing promoted
    assert nodeconfig.read(nodes[1]) is None  # the wave never moved
    cli("rollout", "start", "--model", MODEL, "--chips", CHIP, "--db", url)  # judged again: exit 0
    assert {r["rollout_state"] for r in ro.status_rows(db, rollout_id)} == {"promoted"}


def test_a_llama_server_canary_is_judged_per_metric_and_status_json_carries_each_comparison(fleet, monkeypatch):
    """Nodes whose servers are llama-server (fake streaming servers of a known TTFT and ITL): the
    canary analysis loads canary and control at once with streamed requests and judges TTFT, ITL,
    the objective's rate and errors together; the promoted canary's row in `rollout status --json`
    carries the verdict and every metric's comparison. A config whose server decodes 1.6x slower
    (its ITL; its TTFT and its rate within their tolerances) is rolled back on ITL."""
    from bench.fake_openai_server import FakeConfig, FakeServer
    from orchestrator import canaryload
    from workers import probe, timedload

    url, nodes = fleet
    db = open_database(url)
    monkeypatch.setattr(canaryload, "ROUND_S", 1.0)  # fake servers answer in ~0.3 s: 4 users, 1 s rounds
    monkeypatch.setattr(canaryload, "CONCURRENCY", 4)
    fakes = {n: FakeServer(config=FakeConfig(ttft_s=0.02, itl_s=0.008)) for n in nodes}
    slow_server = FakeServer(config=FakeConfig(ttft_s=0.02, itl_s=0.008 * 1.6))
    threads = [threading.Thread(target=f.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
               for f in [*fakes.values(), slow_server]]
    for thread in threads:
        thread.start()
    slow_threads: list[int] = []  # the n_threads of the config whose server is slow

    class StreamingServers(ro.Applier):
        """Each node's llama-server, as its status, load and probe report it: it serves the node's config."""

        def serve_status(self, node_id):
            held = nodeconfig.read(node_id)
            return {"fresh": True, "ready": True, "config_version": held["version"] if held else 0,
                    "kind": "llama-server"}

        def server(self, node_id) -> FakeServer:
            held = nodeconfig.read(node_id)
            return slow_server if held and held["params"]["n_threads"] in slow_threads else fakes[node_id]

        def load(self, node_id, spec, duration_s):
            version = self.serve_status(node_id)["config_version"]
            records = timedload.run_for(self.server(node_id).url, spec, duration_s).records
            return {"served": True, "records": [r.to_dict() for r in records], "config_version": version,
                    "config_version_after": version}

        def probe(self, node_id, n_prompt, n_gen, n_requests=1, first=0):  # the before/after snapshots
            version = self.serve_status(node_id)["config_version"]
            return {"served": True, **probe.probe(self.server(node_id).url + "/v1", "m", n_prompt, n_gen,
                                                  n_requests, first=first),
                    "config_version": version, "config_version_after": version}

    def new_config() -> int:
        with db.session() as s:  # a config the nodes do not hold yet
            rec = [r for r in repo.all_latest_recommendations(s, "tg", True) if r.chip.key == CHIP][0]
            rec.params = {**rec.params, "n_threads": rec.params["n_threads"] % 8 + 1}
            rec.expected_tps = 1.0  # the canary is held to its control group alone
            return rec.params["n_threads"]

    try:
        new_config()
        rollout_id = ro.start(db, sim_model_info(MODEL), chips=[CHIP], canary_share=0.5, tolerance=0.3,
                              applier=StreamingServers())
        shown = json.loads(cli("rollout", "status", rollout_id, "--db", url, "--json").stdout)
        assert {r["rollout_state"] for r in shown} == {"promoted"}, shown[0]["reason"]
        analysis = next(r for r in shown if r["stage"] == 0)["analysis"]
        assert analysis["method"] == "served-load" and analysis["judgement"]["outcome"] == "pass"
        metrics = analysis["judgement"]["metrics"]
        assert set(metrics) == {"ttft", "itl", "rate", "errors"}
        assert all(m["outcome"] == "pass" and m["n_canary"] >= 50 for m in metrics.values())
        assert metrics["itl"]["floor"] == pytest.approx(1 + canaryload.ITL_TOLERANCE)
        assert len(analysis["canary"]["records"]) == metrics["errors"]["n_canary"]  # every request kept

        slow_threads.append(new_config())
        regressed = ro.start(db, sim_model_info(MODEL), chips=[CHIP], canary_share=0.5, tolerance=0.9,
                             applier=StreamingServers())
        rows = json.loads(cli("rollout", "status", regressed, "--db", url, "--json").stdout)
        canary = next(r for r in rows if r["stage"] == 0)
        assert canary["rollout_state"] == "rolled_back" and "in itl" in canary["reason"], canary["reason"]
        assert canary["analysis"]["judgement"]["metrics"]["itl"]["outcome"] == "fail"
        assert [nodeconfig.read(n)["version"] for n in nodes] == [rollout_id] * 2  # both back on the first
    finally:
        for fake in [*fakes.values(), slow_server]:
            fake.shutdown()
            fake.server_close()
