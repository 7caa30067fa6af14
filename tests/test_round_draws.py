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


def test_progress_reports_the_best_search_trial_as_optuna_ranks_it(tmp_path):
    from functools import partial

    from orchestrator.db import open_database
    from orchestrator.studies import ChipTarget, StudyConfig, StudyRunner
    from orchestrator.virtual import VirtualFleet
    from workers import simulated
    from workers.trial import Workload

    chip = simulated.parse_chip("M2 Ultra/76")
    fleet = VirtualFleet(chip, 8, seed=4, scenario="seed")  # where full offload (measured first) is not best
    seen = []
    cfg = StudyConfig(model=simulated.sim_model_info("sim://llama2-7b/q4_0"), n_trials=40, seed=5, confirm_top=1,
                      workload=Workload(n_prompt=64, n_gen=16, reps=1))
    runner = StudyRunner(open_database(f"sqlite:///{tmp_path / 'p.db'}"), fleet, cfg,
                         ChipTarget(chip, {}, simulated=True), alive_nodes=partial(fleet.alive_nodes, chip.chip_key),
                         on_progress=lambda p: seen.append(p) if p.phase == "search" else None)
    runner.run()
    best = runner.optuna_study.best_trial
    last = seen[-1]
    assert last.best_value == best.value and last.best_params == runner.space.suggest(optuna.trial.FixedTrial(best.params))
    values = [p.best_value for p in seen if p.best_value is not None]
    assert values == sorted(values) and len(set(values)) > 1  # tg: it only improves, and it did
