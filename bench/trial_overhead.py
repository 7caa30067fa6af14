"""Orchestration overhead of a trial in embedded mode (local Ray, SQLite, real llama.cpp).

Overhead is everything but llama.cpp's own load + decode: Optuna ask/tell, the Ray task, the fresh
measuring subprocess (Python start, llama-cpp-python import), result transfer and the database
writes. One bench node runs trials one after another, so

    overhead per trial = (study wall time - sum of load+decode seconds) / trials

    python bench/trial_overhead.py --model MODEL.gguf --trials 8 [--prompt-tokens 512 --gen-tokens 128 -r 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from orchestrator import registry
from orchestrator.db import open_database, repo
from orchestrator.studies import StudyConfig
from orchestrator.tune import tune
from workers.trial import Workload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = open_database(f"sqlite:///{tmp}/overhead.db")
        info = registry.register(db, args.model)
        cfg = StudyConfig(
            model=info,
            workload=Workload(args.prompt_tokens, args.gen_tokens, args.reps),
            n_trials=args.trials,
            seed=1,
            confirm_top=0,
        )
        runner_wall: dict = {}

        def on_ready(runner) -> None:
            runner_wall["start"] = time.perf_counter()

        outcome = tune(db, cfg, on_ready=on_ready)
        wall = time.perf_counter() - runner_wall["start"]
        with db.session() as s:
            study = repo.get_study(s, outcome.name)
            rows = repo.study_trials(s, study.id)
        measured = sum(r.measure_s or 0 for r in rows)
        n = len(rows)
        per_trial = (wall - measured) / n
        print(f"workload pp{args.prompt_tokens}/tg{args.gen_tokens} r{args.reps}: {n} trials "
              f"(baseline + search), wall {wall:.1f}s, llama.cpp load+decode {measured:.1f}s")
        print(f"overhead per trial {per_trial:.2f}s = {(wall - measured) / wall:.1%} of trial wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
