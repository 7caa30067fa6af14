"""Dispatch throughput: can the head keep a large fleet busy with short trials?

Two measurements, both with the study loop fleettune really runs (`StudyRunner`: Optuna ask/tell,
a DB row written when each trial starts and when it ends, results stored with their samples):

- ``virtual``: N virtual nodes in the head process, no Ray. Each trial "runs" for exactly
  ``--trial-s`` seconds of wall time on its node (its values from the calibrated simulator), so the
  only cost is the head's own: the figure is the head's per-trial overhead and the utilisation it
  allows at N nodes (256 fit here; 256 Ray raylets do not fit in this machine's memory).
- ``ray``: a real Ray cluster (``ray.cluster_utils.Cluster``) with R raylets, each a simulated Mac
  with one bench slot, trials sleeping ``--trial-s`` seconds: the head's overhead plus Ray's.

Utilisation = the nodes' busy seconds / (nodes x wall seconds from the first submit to the last
result), fill and drain included; the head's time per trial = (wall - time blocked waiting for
results) / trials. Run:

    python bench/dispatch_throughput.py virtual --nodes 256 --trials 2048 --trial-s 1 --db sqlite
    python bench/dispatch_throughput.py ray --nodes 32 --trials 256 --trial-s 1
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.db import open_database  # noqa: E402
from orchestrator.studies import ChipTarget, StudyConfig, StudyRunner  # noqa: E402
from workers import simulated  # noqa: E402
from workers.hardware import Fingerprint  # noqa: E402
from workers.trial import TrialResult, TrialSpec, Workload  # noqa: E402

CHIP = "M2 Ultra/76"
MODEL = "sim://llama2-7b/q4_0"
WORKLOAD = Workload(n_prompt=512, n_gen=128, reps=1)


class VirtualFleet:
    """A Dispatcher over N in-process nodes: each trial holds its node for ``trial_s`` seconds."""

    def __init__(self, n_nodes: int, trial_s: float) -> None:
        self.trial_s = trial_s
        self.free = [f"virtual-{i:03d}" for i in range(n_nodes)]
        self.node = simulated.SimulatedNode(simulated.parse_chip(CHIP), seed=1, time_scale=0.0)
        self.finish: list[tuple[float, int]] = []  # (finish time, ref)
        self.specs: dict[int, tuple[TrialSpec, str, float]] = {}
        self.busy_s = 0.0
        self.waited_s = 0.0  # time the head spent waiting for results: the rest is its own work
        self.first_submit: float | None = None
        self.last_result = 0.0
        self._next = 0

    def submit(self, spec: TrialSpec, chip_key, node_id=None):
        if node_id in self.free:  # pinned to a free node: that one, else any free node
            self.free.remove(node_id)
            node = node_id
        else:
            node = self.free.pop()
        now = time.monotonic()
        self.first_submit = self.first_submit or now
        ref, self._next = self._next, self._next + 1
        heapq.heappush(self.finish, (now + self.trial_s, ref))
        self.specs[ref] = (spec, node, now)
        return ref

    def wait(self, refs: list, timeout_s: float) -> list:
        if not self.finish:
            return []
        delay = self.finish[0][0] - time.monotonic()
        if delay > 0:
            time.sleep(min(delay, timeout_s))
            self.waited_s += min(delay, timeout_s)
        done, now = [], time.monotonic()
        while self.finish and self.finish[0][0] <= now:
            done.append(heapq.heappop(self.finish)[1])
        return done

    def result(self, ref, trial_key: str) -> TrialResult:
        spec, node, started = self.specs.pop(ref)
        self.free.append(node)
        now = time.monotonic()
        self.busy_s += self.trial_s
        self.last_result = now
        result = self.node.measure(spec)
        result.node_id = node
        return result

    def cancel(self, ref) -> None:
        self.specs.pop(ref, None)

    def alive(self) -> list[str]:
        return [f"virtual-{i:03d}" for i in range(len(self.free) + len(self.specs))]


def db_url(kind: str, tmp: str) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp}/throughput.db"
    import uuid

    from sqlalchemy import create_engine, text

    admin = os.environ.get("FLEETTUNE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    name = f"fleettune_bench_{uuid.uuid4().hex[:8]}"
    with create_engine(admin, isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return admin.rsplit("/", 1)[0] + f"/{name}"


def run_virtual(args) -> dict:
    tmp = tempfile.mkdtemp()
    db = open_database(db_url(args.db, tmp))
    fleet = VirtualFleet(args.nodes, args.trial_s)
    chip = simulated.parse_chip(CHIP)
    target = ChipTarget(Fingerprint.from_dict(chip.fingerprint()), {}, simulated=True)
    cfg = StudyConfig(model=simulated.sim_model_info(MODEL), workload=WORKLOAD, n_trials=args.trials,
                      sampler=args.sampler, seed=1, confirm_top=1)
    runner = StudyRunner(db, fleet, cfg, target, alive_nodes=fleet.alive)
    runner.prepare()
    start = time.monotonic()
    runner.run()
    wall = time.monotonic() - start
    span = fleet.last_result - (fleet.first_submit or start)
    n = args.trials + 2 + 2  # search + baseline + confirmation (top 1 and the baseline)
    return {"mode": "virtual", "nodes": args.nodes, "trials": n, "trial_s": args.trial_s, "db": args.db,
            "sampler": args.sampler, "wall_s": wall, "utilisation": fleet.busy_s / (args.nodes * span),
            "head_ms_per_trial": 1000 * (wall - fleet.waited_s) / n, "trials_per_s": n / wall}


class TimedDispatcher:
    """The real Dispatcher, with the time the head spends blocked in ``wait`` counted."""

    def __init__(self, inner) -> None:
        self.inner, self.waited_s = inner, 0.0

    def wait(self, refs, timeout_s):
        start = time.monotonic()
        try:
            return self.inner.wait(refs, timeout_s)
        finally:
            self.waited_s += time.monotonic() - start

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_ray(args) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator import dispatch
    from workers.join import plan_join

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    plan = plan_join(CHIP, "calibrated", time_scale=0.0)
    from workers.agent import TRIAL_S_LABEL

    labels = {**plan.labels, TRIAL_S_LABEL: f"{args.trial_s:g}"}
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=0, resources=plan.resources, labels=labels)
    cluster.wait_for_nodes()
    tmp = tempfile.mkdtemp()
    db = open_database(db_url(args.db, tmp))
    key = plan.fingerprint.chip_key
    target = ChipTarget(plan.fingerprint, {}, simulated=True)
    cfg = StudyConfig(model=simulated.sim_model_info(MODEL), workload=WORKLOAD, n_trials=args.trials,
                      sampler=args.sampler, seed=1, confirm_top=1)
    alive = [n.ray_node_id for n in dispatch.bench_nodes(key)]
    dispatcher = TimedDispatcher(dispatch.Dispatcher())
    runner = StudyRunner(db, dispatcher, cfg, target, alive_nodes=lambda: alive)
    runner.prepare()
    start = time.monotonic()
    runner.run()
    wall = time.monotonic() - start
    with db.session() as s:
        from orchestrator.db import repo

        rows = [t for t in repo.study_trials(s, runner.study_id) if t.state == "complete"]
        busy = sum((t.finished_at - t.started_at).total_seconds() for t in rows)
        first = min(t.started_at for t in rows)
        last = max(t.finished_at for t in rows)
    ray.shutdown()
    cluster.shutdown()
    span = (last - first).total_seconds()
    return {"mode": "ray", "nodes": args.nodes, "trials": len(rows), "trial_s": args.trial_s,
            "db": args.db, "sampler": args.sampler, "wall_s": wall, "utilisation": busy / (args.nodes * span),
            "head_ms_per_trial": 1000 * (wall - dispatcher.waited_s) / len(rows),
            "trials_per_s": len(rows) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["virtual", "ray"])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--trials", type=int, default=1024)
    parser.add_argument("--trial-s", type=float, default=1.0)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--sampler", default="tpe")
    args = parser.parse_args()
    threading.current_thread().name = "bench"
    out = run_virtual(args) if args.mode == "virtual" else run_ray(args)
    print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
