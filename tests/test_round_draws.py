"""The study loop says how many proposals it asks at once; RoundTPESampler draws that many, none wasted."""

from __future__ import annotations

import optuna

from orchestrator.samplers import RoundTPESampler


def test_a_round_draws_what_the_loop_expects_and_throws_nothing_away():
    draws = []

    class Counting(RoundTPESampler):
        def _draw(self, below, above, search_space, count):
            draws.append(count)
            return super()._draw(below, above, search_space, count)

    sampler = Counting(n_startup_trials=3, multivariate=True, constant_liar=True, seed=2)
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def ask(k: int) -> list:
        trials = [study.ask() for _ in range(k)]
        return [(t, t.suggest_int("ngl", 0, 33), t.suggest_int("threads", 1, 24)) for t in trials]

    for trial, ngl, threads in ask(4):  # startup: random
        study.tell(trial, ngl - abs(threads - 8))
    sampler.expect(6)
    first = ask(6)  # one from the fit, five drawn together
    assert draws == [5] and sampler._drawn[("ngl", "threads")] == []
    study.tell(first[0][0], 1.0)
    sampler.expect(1)
    ask(1)  # a new fit gives it: nothing drawn
    sampler.expect(1)
    ask(1)
    assert draws == [5, 1]  # one at a time when the loop asks one at a time
    sampler.expect(40)
    ask(40)
    assert draws[2:] == [RoundTPESampler.MAX_BATCH, RoundTPESampler.MAX_BATCH, 40 - 2 * RoundTPESampler.MAX_BATCH]
