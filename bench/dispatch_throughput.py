"""Dispatch throughput: can the head keep a large fleet busy with short trials?

Two measurements, both with the study loop fleettune really runs (`StudyRunner`: Optuna ask/tell,
a DB row written when each trial starts and when it ends, results stored with their samples):

- ``virtual``: N virtual nodes in the head process, no Ray. Each trial "runs" for exactly
  ``--trial-s`` seconds of wall time on its node (its values from the calibrated simulator), so the
  only cost is the head's own: the figure is the head's per-trial overhead and the utilisation it
  allows at N nodes (256 fit here; 256 Ray raylets do not fit in this machine's memory).
- ``ray``: a real Ray cluster (``ray.cluster_utils.Cluster``) with R raylets, each a simulated Mac
  with one bench slot, trials sleeping ``--trial-s`` seconds: the head's overhead plus Ray's.

With ``--chips K`` (virtual) the nodes are split over K chips and one study per chip runs at
once, in threads of one process, as ``tune --all-chips`` runs them.

Utilisation = the nodes' busy seconds / (nodes x seconds of a window), per study, node-weighted:
``steady`` from the moment every node first had a search trial to the last search trial's start
(fill and drain left out: what is idle then waits for the head or Ray), ``search`` from the first
search trial's start to the last one's end, ``study`` the same for all phases (baseline, search,
confirmation). The head's time per trial = the process's CPU seconds / trials. Run:

    python bench/dispatch_throughput.py virtual --nodes 256 --trials 2048 --trial-s 1 --db sqlite
    python bench/dispatch_throughput.py virtual --nodes 256 --chips 8 --trials 512 --trial-s 1
    python bench/dispatch_throughput.py ray --nodes 32 --trials 256 --trial-s 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator import studies  # noqa: E402
from orchestrator.db import open_database  # noqa: E402
from orchestrator.studies import ChipTarget, StudyConfig, StudyRunner  # noqa: E402
from orchestrator.virtual import VirtualFleet  # noqa: E402
from workers import simulated  # noqa: E402
from workers.hardware import Fingerprint  # noqa: E402
from workers.trial import Workload  # noqa: E402

CHIP = "M2 Ultra/76"
MODEL = "sim://llama2-7b/q4_0"
WORKLOAD = Workload(n_prompt=512, n_gen=128, reps=1)


def utilisation(spans: list[tuple[str, float, float]], n_nodes: int, phase: str | None = None,
                steady: bool = False) -> float:
    """Busy node-seconds over available node-seconds in a window of the study.

    The window runs from the first trial's start to the last one's end; ``steady`` leaves out the
    fill and the drain: it starts when the fleet first had a trial on every node (the start of the
    n-th trial; a cold Ray worker on each node makes the first wave slow) and ends at the last
    trial's start (after it the study has nothing left to hand out, so what is idle then is the
    budget's end, not the head).
    """
    spans = [sp for sp in spans if phase is None or sp[0] == phase]
    starts = sorted(start for _, start, _ in spans)
    if steady:
        first, last = starts[min(n_nodes, len(starts)) - 1], starts[-1]
    else:
        first, last = starts[0], max(end for _, _, end in spans)
    busy = sum(max(0.0, min(end, last) - max(start, first)) for _, start, end in spans)
    return busy / (n_nodes * (last - first))


def utilisations(fleets: list[tuple[list, int]]) -> dict[str, float]:
    """Node-weighted means over the studies' fleets, each fleet given as (spans, nodes)."""
    total = sum(n for _, n in fleets)

    def mean(**kw) -> float:
        return sum(n * utilisation(spans, n, **kw) for spans, n in fleets) / total

    return {"steady_utilisation": mean(phase="search", steady=True),
            "search_utilisation": mean(phase="search"), "study_utilisation": mean()}


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


def fleet_chips(n_chips: int) -> list[Fingerprint]:
    """``n_chips`` different chips from the calibrated table, spread over its families."""
    chips = simulated.all_chips()
    if n_chips == 1:
        return [simulated.parse_chip(CHIP)]
    step = len(chips) / n_chips
    return [chips[int(i * step)] for i in range(n_chips)]


def pick_quality(runner: StudyRunner, chip: Fingerprint, scenario: str) -> float:
    """The true (noiseless) speed of the study's best observed configuration over the optimum's."""
    from orchestrator.db import repo
    from workers.trial import BenchParams

    shape = simulated.parse_sim_model(MODEL)
    w = WORKLOAD
    _, _, best = simulated.optimum(chip, shape, "tg", w.n_prompt, w.n_gen, scenario)
    with runner.db.session() as s:
        rows = [t for t in repo.study_trials(s, runner.study_id, "search") if t.objective_value]
    pick = max(rows, key=lambda t: t.objective_value)
    params = BenchParams.from_dict(pick.params)
    return simulated.predict(chip, shape, params, w.n_prompt, w.n_gen, scenario).tg_tps / best


def run_virtual(args) -> dict:
    """One study per chip, all at once (as `tune --all-chips` runs them), nodes split evenly."""
    if args.no_ahead:
        studies.AHEAD_MIN_RUNNING = sys.maxsize
    if args.round_results:
        studies.ROUND_RESULTS = args.round_results
    tmp = tempfile.mkdtemp()
    db = open_database(db_url(args.db, tmp))
    chips = fleet_chips(args.chips)
    runners = []
    for i, chip in enumerate(chips):
        fleet = VirtualFleet(chip, args.nodes // len(chips), args.trial_s, prefix=f"chip{i}",
                             scenario=args.scenario, seed=args.seed)
        target = ChipTarget(chip, {}, simulated=True)
        cfg = StudyConfig(model=simulated.sim_model_info(MODEL), workload=WORKLOAD, n_trials=args.trials,
                          sampler=args.sampler, seed=args.seed, confirm_top=1)
        runner = StudyRunner(db, fleet, cfg, target, alive_nodes=partial(fleet.alive_nodes, chip.chip_key))
        runner.prepare()
        runners.append((runner, fleet))
    cpu, start = time.process_time(), time.monotonic()
    with ThreadPoolExecutor(max_workers=len(runners)) as pool:
        list(pool.map(lambda rf: rf[0].run(), runners))
    wall, cpu = time.monotonic() - start, time.process_time() - cpu
    fleets = [(fleet.spans, len(fleet.nodes)) for _, fleet in runners]
    n_trials = sum(len(spans) for spans, _ in fleets)
    return {"mode": "virtual", "nodes": sum(n for _, n in fleets), "chips": len(chips), "trials": n_trials,
            "trial_s": args.trial_s, "db": args.db, "sampler": args.sampler, "wall_s": wall,
            **utilisations(fleets),
            "head_ms_per_trial": 1000 * cpu / n_trials, "trials_per_s": n_trials / wall,
            "worst_pick": min(pick_quality(r, c, args.scenario) for (r, _), c in zip(runners, chips, strict=True))}


def run_ray(args) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator import dispatch
    from workers.join import plan_join

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    plan = plan_join(CHIP, "calibrated", time_scale=0.0)
    from workers.labels import TRIAL_S_LABEL

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
    dispatch.describe_nodes(dispatch.bench_nodes(key))  # as `tune` does first: every node's worker started
    dispatcher = dispatch.RayDispatcher()
    runner = StudyRunner(db, dispatcher, cfg, target)
    runner.prepare()
    cpu, start = time.process_time(), time.monotonic()
    runner.run()
    wall, cpu = time.monotonic() - start, time.process_time() - cpu
    with db.session() as s:
        from orchestrator.db import repo

        rows = [t for t in repo.study_trials(s, runner.study_id) if t.state == "complete"]
        spans = [(t.phase, t.started_at.timestamp(), t.finished_at.timestamp()) for t in rows]
    ray.shutdown()
    cluster.shutdown()
    return {"mode": "ray", "nodes": args.nodes, "trials": len(rows), "trial_s": args.trial_s,
            "db": args.db, "sampler": args.sampler, "wall_s": wall,
            **utilisations([(spans, args.nodes)]),
            "head_ms_per_trial": 1000 * cpu / len(rows),
            "trials_per_s": len(rows) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["virtual", "ray"])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--trials", type=int, default=1024, help="search budget of each study")
    parser.add_argument("--chips", type=int, default=1, help="virtual: chips (one study each) the nodes are split over")
    parser.add_argument("--trial-s", type=float, default=1.0)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--sampler", default="tpe")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scenario", default="calibrated", choices=sorted(simulated.SCENARIOS),
                        help="virtual: the simulator's scenario (worst_pick: true speed of each study's pick / optimum)")
    parser.add_argument("--no-ahead", action="store_true", help="virtual: never propose ahead of need")
    parser.add_argument("--round-results", type=int, help="virtual: results collected per round (default: "
                        "the study loop's ROUND_RESULTS)")
    args = parser.parse_args()
    threading.current_thread().name = "bench"
    out = run_virtual(args) if args.mode == "virtual" else run_ray(args)
    print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
