"""The canary test's error rates on a noise model of served rates (orchestrator.canarystats).

Each analysis draws rounds as the rollout takes them (one canary sample and two control samples a
round, a look after 3 rounds and after each round from then on, at most ``--rounds``) from a model
of served rates on a shared 2-core machine: log-normal around the node's rate (spread ``--spread``
on the log scale), one sample in four queued behind another client's request (slowed to 0.5-1 of
it). Prints, per true canary/control ratio, how many analyses passed, failed and stayed
inconclusive, and the mean number of rounds taken.

    python bench/canary_stats.py --analyses 200 --tolerance 0.3
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.canarystats import FAIL, INCONCLUSIVE, PASS, compare  # noqa: E402 (after the path is set)


def noisy(rng: random.Random, rate: float, spread: float) -> float:
    queued = rng.uniform(0.5, 1) if rng.random() < 0.25 else 1.0
    return rate * math.exp(rng.gauss(0, spread)) * queued


def analysis(rng: random.Random, ratio: float, floor: float, spread: float, rounds: int) -> tuple[str, int]:
    canary: list[float] = []
    control: list[float] = []
    for round_no in range(1, rounds + 1):
        canary.append(noisy(rng, 30 * ratio, spread))
        control += [noisy(rng, 30, spread), noisy(rng, 30, spread)]
        if round_no >= 3 and (outcome := compare(canary, control, floor).outcome) != INCONCLUSIVE:
            return outcome, round_no
    return INCONCLUSIVE, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--analyses", type=int, default=200)
    parser.add_argument("--tolerance", type=float, default=0.3)
    parser.add_argument("--spread", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"tolerance {args.tolerance:.0%}, spread {args.spread}, at most {args.rounds} rounds, "
          f"{args.analyses} analyses per ratio\n")
    print("| canary / control | pass | fail | inconclusive | mean rounds |")
    print("|---:|---:|---:|---:|---:|")
    for ratio in (1.0, 0.9, 0.8, 0.7, 0.6, 0.55, 0.45):
        rng = random.Random(f"{args.seed}-{ratio}")
        runs = [analysis(rng, ratio, 1 - args.tolerance, args.spread, args.rounds) for _ in range(args.analyses)]
        outcomes = [o for o, _ in runs]
        print(f"| {ratio:.2f} | {outcomes.count(PASS)} | {outcomes.count(FAIL)} | {outcomes.count(INCONCLUSIVE)} "
              f"| {sum(r for _, r in runs) / len(runs):.1f} |")


if __name__ == "__main__":
    main()
