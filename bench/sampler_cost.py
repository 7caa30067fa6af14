"""Sampler cost: the head's time per proposal, as a study grows, with a fleet's trials running.

Each sampler fleettune offers proposes over a real study space (M2 Ultra, LLaMA-2 7B Q4_0, pp512),
ask/tell as the study loop does, with ``--running`` trials always in flight (a fleet of that many
nodes); a proposal's cost is the time of ``ask`` plus the suggestions, averaged per block of
``--every`` trials. Values come from the calibrated simulator (no measurement is timed).

    python bench/sampler_cost.py --samplers tpe,random [--trials 1000] [--running 32]
    python bench/sampler_cost.py --samplers gp --trials 400   # needs torch (pip install -e '.[gp]')
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from orchestrator.samplers import make_sampler  # noqa: E402
from orchestrator.space import SearchSpace  # noqa: E402
from workers import simulated  # noqa: E402

CHIP = simulated.parse_chip("M2 Ultra/76")
SHAPE = simulated.model_shape("llama2-7b", "q4_0")


def cost(name: str, trials: int, running: int, every: int) -> list[tuple[int, float]]:
    """(trials so far, ms per proposal over the last block) for one sampler."""
    space = SearchSpace.for_target(CHIP, simulated.sim_model_info("sim://llama2-7b/q4_0"), 512)
    study = optuna.create_study(direction="maximize",
                                sampler=make_sampler(name, space, trials, "maximize", seed=1))
    inflight, out, spent = [], [], 0.0
    for i in range(1, trials + 1):
        start = time.perf_counter()
        trial = study.ask()
        params = space.suggest(trial)
        spent += time.perf_counter() - start
        inflight.append((trial, params))
        if len(inflight) >= running:
            done, params = inflight.pop(0)
            pred = simulated.predict(CHIP, SHAPE, params)
            study.tell(done, pred.tg_tps if pred.fits else 0.0)
        if i % every == 0:
            out.append((i, 1000 * spent / every))
            spent = 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samplers", default="tpe,random")
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--running", type=int, default=32)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for name in args.samplers.split(","):
        blocks = cost(name, args.trials, args.running, args.every)
        print(f"{name:8s}", "  ".join(f"{n}: {ms:.2f} ms" for n, ms in blocks))


if __name__ == "__main__":
    main()
