"""Served tokens/s per node before and after a rollout, drawn from the rollout's own records.

Every serving node's rollout row keeps what it served just before its apply and after the
promotion (``analysis.before`` / ``analysis.after`` of ``rollout status --json``: five samples each,
a one-token and a full request of the workload per sample). This script draws those records only:
per node the median of the five samples' rates with their range, and the rate (from the
fastest samples in records made before the analysis took the median) the rollout recorded.

Two ways to get records:

- ``--db URL --rollout ID``: a rollout already in a results database (tests/test_serve_fleet.py's,
  a fleet's);
- no ``--db``: a local Ray cluster of three nodes of this machine's chip, each running `fleettune
  serve` with SmolLM2-135M (llama-cpp-python's server on loopback, no other traffic); an operator's
  pin goes to every node first (``--params '-t 1 -b 8 -ub 8'``, tolerance 90 %, so it is promoted:
  the "before"), then the tuned recommendation (tg, 2 trials), whose rollout is drawn.

    python bench/serve_rollout.py -o docs/plots/rollout-served.png
    python bench/serve_rollout.py --db sqlite:///PATH/results.db --rollout 1 -o docs/plots/rollout-served.png
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))


def wait_for(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)  # polling a condition with a deadline
    raise TimeoutError("condition not met")


def scenario() -> tuple[str, int]:
    """Run the pin-then-recommendation scenario; the database URL and the rollout to draw."""
    home = Path(tempfile.mkdtemp(prefix="fleettune-serve-bench-"))
    os.environ["FLEETTUNE_HOME"] = str(home)
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator import rollout as ro
    from orchestrator.db import open_database
    from orchestrator.dispatch import BENCH_RESOURCE, CHIP_LABEL
    from orchestrator.studies import StudyConfig
    from orchestrator.tune import tune
    from workers import serve
    from workers.hardware import fingerprint_live
    from workers.models import fetch_known_model, read_model_info
    from workers.trial import Workload

    model_path = fetch_known_model("smollm2-135m", home / "models")
    model = read_model_info(model_path)
    chip = fingerprint_live().chip_key
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    nodes = [cluster.add_node(num_cpus=1, resources={BENCH_RESOURCE: 1}, labels={CHIP_LABEL: chip})
             for _ in range(3)]
    cluster.wait_for_nodes()
    procs = [subprocess.Popen([FLEETTUNE, "serve", "--model", str(model_path), "--node-id", n.node_id,
                               "--port", "0", "--server", "llama-cpp-python"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for n in nodes]
    url = f"sqlite:///{home / 'results.db'}"
    try:
        for n in nodes:
            wait_for(lambda n=n: (s := serve.read_status(n.node_id)) and s["healthy"], 180)
        db = open_database(url)
        tune(db, StudyConfig(model=model, objective="tg", n_trials=2, seed=1, confirm_top=1,
                             workload=Workload(n_prompt=64, n_gen=32, reps=2)), chip_key=chip, warm=False)
        ro.start(db, model, canary_share=0.3, tolerance=0.9, pin="-t 1 -b 8 -ub 8")
        rollout_id = ro.start(db, model, canary_share=0.3, tolerance=0.4)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=120)
        ray.shutdown()
        cluster.shutdown()
    return url, rollout_id


def draw(url: str, rollout_id: int, output: str) -> None:
    """The figure and a table, from the rollout's records in the database at ``url``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from orchestrator import rollout as ro
    from orchestrator.db import open_database
    from workers.trial import BenchParams

    db = open_database(url)
    rows = ro.status_rows(db, rollout_id)
    objective = (rows[0]["analysis"] or {}).get("objective") or "tg"
    previous = next((r.get("previous") for r in _previous_configs(db, rollout_id) if r.get("previous")), None)
    from workers.serve import DEFAULT_PARAMS

    before_flags = BenchParams.from_dict(previous["params"] if previous else DEFAULT_PARAMS).llama_cpp_flags()
    before_flags += "" if previous else " (server defaults)"
    print(f"rollout {rollout_id}: {rows[0]['rollout_state']}, objective {objective}, "
          f"{before_flags} -> {rows[0]['flags']}")
    print(f"{'node':14} {'stage':>5} {'before: median (range), recorded':>34} {'after: median (range), recorded':>34}")
    labels, figures = [], {"before": [], "after": []}
    for row in rows:
        analysis = row["analysis"] or {}
        cells = []
        for when in ("before", "after"):
            record = analysis.get(when) or {}
            samples = sorted(record.get("sample_rates") or [float("nan")])
            median = statistics.median(samples)
            figures[when].append((median, samples[0], samples[-1]))
            cells.append(f"{median:.1f} ({samples[0]:.1f}-{samples[-1]:.1f}), {record.get('rate') or float('nan'):.1f}")
        print(f"{row['node']:14} {row['stage']:>5} {cells[0]:>34} {cells[1]:>34}")
        stage = "canary" if row["stage"] == 0 else f"wave {row['stage']}"
        labels.append(f"{row['node'][:8]}\n{stage}")
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = range(len(labels))
    for when, shift, label in (("before", -0.2, f"before ({before_flags})"), ("after", 0.2, f"after ({rows[0]['flags']})")):
        medians = [m for m, _, _ in figures[when]]
        errors = [[m - lo for m, lo, _ in figures[when]], [hi - m for m, _, hi in figures[when]]]
        ax.bar([x + shift for x in xs], medians, width=0.4, yerr=errors, capsize=3, label=label)
    ax.set_yscale("log")  # a single sample's generation rate can be 10x off under load: the range stays readable
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel(f"served {objective} tok/s (median, range of 5; log)")
    ax.set_title(f"rollout {rollout_id}: served rate per node, from the rollout's records", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")


def _previous_configs(db, rollout_id: int) -> list[dict]:
    from orchestrator.db import repo

    with db.session() as s:
        return [{"previous": n.previous} for n in repo.rollout_nodes(s, rollout_id)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="docs/plots/rollout-served.png")
    parser.add_argument("--db", help="Draw a rollout already in this results database (URL).")
    parser.add_argument("--rollout", type=int, help="With --db: the rollout to draw.")
    args = parser.parse_args()
    if bool(args.db) != bool(args.rollout):
        parser.error("--db and --rollout go together")
    url, rollout_id = (args.db, args.rollout) if args.db else scenario()
    draw(url, rollout_id, args.output)


if __name__ == "__main__":
    main()
