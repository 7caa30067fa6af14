"""What one TPE proposal costs the head, the way a large fleet's study loop asks for them.

In a round of the study loop the sampler fits once (the first proposal after a result) and then
draws the round's other proposals from that fit in one batch (``RoundTPESampler``). This measures
both, over the real study space (M2 Ultra, LLaMA-2 7B Q4_0), at N completed trials with 128 more
running (the constant liar's kernels), as process CPU time; each figure is the median of 5 rounds:

    python bench/proposal_cost.py --trials 500,1000,2000

At 256 one-second nodes the head has 1000 / 256 = 3.9 ms of CPU per trial for everything
(docs/benchmarks.md, "Dispatch throughput").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from orchestrator.samplers import make_sampler  # noqa: E402
from orchestrator.space import SearchSpace  # noqa: E402
from workers import simulated  # noqa: E402

ROUND = 16  # proposals per round: a round collects at most 16 results (studies.ROUND_RESULTS)
RUNNING = 128


def cost(n_trials: int, rounds: int = 5) -> tuple[float, float]:
    """(fit with its first proposal, each further proposal of the round), ms, medians of ``rounds``."""
    chip = simulated.parse_chip("M2 Ultra/76")
    space = SearchSpace.for_target(chip, simulated.sim_model_info("sim://llama2-7b/q4_0"), 512)
    rng = random.Random(1)
    history = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(n_trials):  # completed trials over the space (random: only their count matters here)
        trial = history.ask()
        space.suggest(trial)
        history.tell(trial, rng.random())
    study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", space, n_trials + 1000,
                                                                              "maximize", 1))
    study.add_trials(history.get_trials(deepcopy=False))
    running = [study.ask() for _ in range(RUNNING)]
    for trial in running:
        space.suggest(trial)
    fits, draws = [], []
    for _ in range(rounds):
        study.tell(running.pop(), rng.random())  # a result: the next proposal refits
        start = time.process_time()
        space.suggest(study.ask())
        fits.append(time.process_time() - start)
        start = time.process_time()
        for _ in range(ROUND - 1):
            space.suggest(study.ask())
        draws.append((time.process_time() - start) / (ROUND - 1))
    return 1000 * statistics.median(fits), 1000 * statistics.median(draws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", default="500,1000,2000", help="completed trials, comma-separated")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for n in (int(x) for x in args.trials.split(",")):
        fit, draw = cost(n)
        per_trial = fit / ROUND + draw * (ROUND - 1) / ROUND
        print(f"trials={n}  fit_ms={fit:.1f}  draw_ms={draw:.2f}  per_proposal_in_a_round_of_{ROUND}_ms={per_trial:.2f}")


if __name__ == "__main__":
    main()
