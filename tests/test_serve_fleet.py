"""Serving end to end: three real serving nodes (raylets of the session's Ray cluster, each serving
SmolLM2 through its own `fleettune serve` on loopback) under a steady, bounded request loop from the
`openai` client. Recommendations for tg and pp roll out (each judged on served traffic in its own
objective, no spurious rollback), the second is rolled back by hand, an operator's regression (one thread, batch 1) is detected by
the canary analysis and rolled back within 90 s of its apply; no request fails, and every node ends
serving exactly what the rollout history says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.serve_load import RoundRobinLoop
from orchestrator import rollout as ro
from orchestrator.db import open_database, repo
from orchestrator.dispatch import BENCH_RESOURCE, CHIP_LABEL
from orchestrator.studies import StudyConfig
from orchestrator.tune import tune
from tests.conftest import wait_until
from workers import nodeconfig, serve
from workers.trial import Workload

pytestmark = pytest.mark.cluster

FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))
# The served probes send the recommendation's prompt: at 64 tokens a request's fixed cost (HTTP,
# tokenising, the server's loop) hid most of what batch 1 costs the prompt, and on a faster core
# (AMD EPYC) the one-thread batch-1 pin came out at 0.71 of control, inside the tolerance; at 256
# tokens the prompt's own time dominates.
WORKLOAD = Workload(n_prompt=256, n_gen=8, reps=1)
# Between noise and the regression, from the four runs' records (docs/serving.md): recommendations
# came out at 0.82-2.42 of their control group (medians), the one-thread batch-1 pin at 0.45-0.56
TOLERANCE = 0.3
# The canary's verdict is Mann-Whitney's at 98 %: 3 rounds (3 canary against 6 control samples,
# p >= 1/84) are the fewest that can show a regression, after the warm-up round; the one-thread
# batch-1 canary takes 5-6 s a request at 256 prompt tokens. Measured here: 70 s from intent to
# rollback with other work on both cores (the 3-round threshold judge it replaced took 23-30 s).
DETECTED_WITHIN_S = 90
TEST_TIMEOUT_S = 1800  # two studies and four rollouts on real servers (CI: about 20 minutes)
LOOP_MAX_S = TEST_TIMEOUT_S - 60


@pytest.fixture(scope="module")
def serving_fleet(ray_cluster, local_fingerprint, model_path, tmp_path_factory):
    """The session's real node and two more of its chip, each running `fleettune serve`."""
    cluster = ray_cluster["cluster"]
    chip_key = local_fingerprint.chip_key
    added = [cluster.add_node(num_cpus=1, resources={BENCH_RESOURCE: 1}, labels={CHIP_LABEL: chip_key})
             for _ in range(2)]
    cluster.wait_for_nodes()
    nodes = sorted([ray_cluster["real_node"].node_id, *(n.node_id for n in added)])
    logs = tmp_path_factory.mktemp("serve-logs")
    procs = []
    for node_id in nodes:
        with open(logs / f"{node_id[:8]}.log", "w") as log:
            procs.append(subprocess.Popen(
                [FLEETTUNE, "serve", "--model", str(model_path), "--node-id", node_id, "--port", "0",
                 "--server", "llama-cpp-python"], stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)))
    try:
        statuses = [wait_until(lambda n=n: (s := serve.read_status(n)) and s["healthy"] and s, timeout=180)
                    for n in nodes]
        yield chip_key, nodes, statuses
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=120)
        for node in added:
            cluster.remove_node(node)
        for node_id in nodes:
            nodeconfig.write(node_id, None)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_rollouts_rollback_and_a_regression_under_load_drop_nothing(serving_fleet, model_info, sqlite_url):
    chip_key, nodes, statuses = serving_fleet
    t0 = time.monotonic()
    db = open_database(sqlite_url)
    for objective in ("tg", "pp"):
        tune(db, StudyConfig(model=model_info, objective=objective, n_trials=1, seed=1, confirm_top=1,
                             workload=WORKLOAD), chip_key=chip_key, warm=False)

    def served_versions():
        return [serve.read_status(n)["config_version"] for n in nodes]

    def start(objective, pin=None):
        rollout_id = ro.start(db, model_info, objective=objective, canary_share=0.3, tolerance=TOLERANCE,
                              pin=pin, on_step=lambda text: print(f"{time.monotonic() - t0:6.1f}s {text}"))
        rows = ro.status_rows(db, rollout_id)  # every figure shown by pytest when the test fails
        print(f"{time.monotonic() - t0:6.1f}s rollout {rollout_id} ({objective}, pin {pin}): "
              f"{rows[0]['rollout_state']}", *(json.dumps(r["analysis"]) for r in rows), sep="\n  ")
        return rollout_id, rows[0]["rollout_state"], rows

    # bounded by the test's own time limit: the loop must outlast every rollout below
    with RoundRobinLoop(statuses, max_s=LOOP_MAX_S) as loop:
        wait_until(lambda: loop.ok >= 3, timeout=120)
        promoted = {}
        for objective in ("tg", "pp"):  # each judged in its own objective: no spurious rollback
            rollout_id, state, rows = start(objective)
            canary = next(r for r in rows if r["stage"] == 0)
            assert state == "promoted", [(r["state"], r["reason"], r["analysis"]) for r in rows]
            assert canary["analysis"]["method"] == "served" and canary["analysis"]["objective"] == objective
            assert canary["analysis"]["canary"]["errors"] == 0 and len(canary["analysis"]["controls"]) == 2
            wait_until(lambda r=rollout_id: served_versions() == [r] * 3, timeout=180)
            promoted[objective] = rollout_id

        done = ro.rollback(db, promoted["pp"])  # by hand: every node back to the tg config
        assert (done.restored, done.pending) == (3, 0)
        wait_until(lambda: served_versions() == [promoted["tg"]] * 3, timeout=180)

        regression, state, rows = start("pp", pin="-t 1 -tb 1 -b 1 -ub 1")  # one thread, batch 1
        assert state == "rolled_back", [(r["state"], r["reason"], r["analysis"]) for r in rows]
        canary = next(r for r in rows if r["stage"] == 0)
        assert "slower by more than" in canary["reason"] or "expected at least" in canary["reason"]
        assert canary["analysis"]["rate"] < canary["analysis"]["control_rate"] * (1 - TOLERANCE)
        wait_until(lambda: served_versions() == [promoted["tg"]] * 3, timeout=180)
        before = loop.ok
        wait_until(lambda: loop.ok >= before + 3, timeout=120)
    assert loop.failures == [] and loop.ok > 20

    with db.session() as s:  # detected and rolled back soon after the canary's apply
        rollout = repo.get_rollout(s, regression)
        intent_at = min(n.intent_at for n in repo.rollout_nodes(s, regression) if n.intent_at)
        assert (rollout.updated_at - intent_at).total_seconds() < DETECTED_WITHIN_S
        current = repo.current_chip_configs(s, model_info.sha256)[chip_key]
    assert current["version"] == promoted["tg"]  # what the history says the chip runs ...
    assert [nodeconfig.read(n) for n in nodes] == [current] * 3  # ... is each node's config
    assert served_versions() == [current["version"]] * 3  # ... and what each node serves
    assert all(serve.read_status(n)["params"] == current["params"] for n in nodes)


def test_a_node_that_joins_later_serves_its_chips_config(serving_fleet, ray_cluster, model_path, tmp_path):
    """A fourth node of the chip starts `fleettune serve` with no config: it asks the head's config
    hub through Ray (published by the rollouts above) and serves the chip's current config."""
    chip_key, nodes, _ = serving_fleet
    current = nodeconfig.read(nodes[0])
    assert current is not None  # the previous test left the chip on a promoted config
    cluster = ray_cluster["cluster"]
    joined = cluster.add_node(num_cpus=1, resources={BENCH_RESOURCE: 1}, labels={CHIP_LABEL: chip_key})
    cluster.wait_for_nodes()
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([FLEETTUNE, "serve", "--model", str(model_path), "--node-id", joined.node_id,
                                 "--port", "0", "--server", "llama-cpp-python", "--address", ray_cluster["address"]],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        status = wait_until(lambda: (s := serve.read_status(joined.node_id)) and s["healthy"]
                            and s["config_version"] == current["version"] and s, timeout=180)
        assert status["params"] == current["params"] and nodeconfig.read(joined.node_id) == current
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        cluster.remove_node(joined)
        nodeconfig.write(joined.node_id, None)
