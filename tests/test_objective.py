"""The objective is data (issue 21 item 3): which rates it combines, its direction and units; every
answer below comes from those fields."""

from __future__ import annotations

import pytest

from workers.errors import BadInput
from workers.objective import E2E, PP, TG, Direction, objective


def test_each_objective_says_what_it_combines():
    assert (TG.kinds, PP.kinds, E2E.kinds) == (("tg",), ("pp",), ("pp", "tg"))
    assert [o.needs_prompt for o in (TG, PP, E2E)] == [False, True, True]
    assert [o.needs_generation for o in (TG, PP, E2E)] == [True, False, True]
    assert [o.main_kind for o in (TG, PP, E2E)] == ["tg", "pp", "pp"]
    assert (TG.maximize, E2E.direction, E2E.unit, E2E.rate_unit.startswith("tok/s")) == (True, Direction.MINIMIZE,
                                                                                         "s", True)
    assert objective("e2e") is E2E and objective(PP) is PP


def test_values_rates_and_spreads_follow_the_combined_rates():
    assert TG.value(100.0, 20.0, 64, 16) == 20.0 and PP.value(100.0, 20.0, 64, 16) == 100.0
    assert E2E.value(100.0, 20.0, 64, 16) == pytest.approx(64 / 100 + 16 / 20)
    assert E2E.rate(100.0, 20.0, 64, 16) == pytest.approx(80 / (64 / 100 + 16 / 20))
    assert TG.rate_spread([90.0, 110.0], [10.0, 30.0, 20.0], 64, 16) == {"value": 20.0, "low": 10.0, "high": 30.0}
    spread = E2E.rate_spread([90.0, 110.0], [10.0, 30.0], 64, 16)
    assert spread["low"] == pytest.approx(E2E.rate(90.0, 10.0, 64, 16))
    assert spread["high"] == pytest.approx(E2E.rate(110.0, 30.0, 64, 16))
    assert PP.rate_spread([], [1.0], 64, 16) is None and E2E.rate(None, 20.0, 64, 16) is None


def test_a_workload_must_hold_what_the_objective_measures():
    TG.check_workload(0, 1)
    PP.check_workload(1, 0)
    E2E.check_workload(0, 1)
    for obj, n_prompt, n_gen, words in ((TG, 512, 0, "--gen-tokens"), (PP, 0, 128, "--prompt-tokens"),
                                        (E2E, 0, 0, "prompt or generated")):
        with pytest.raises(BadInput, match=f"objective {obj.name} needs .*{words}"):
            obj.check_workload(n_prompt, n_gen)
