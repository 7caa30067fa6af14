"""The paired-rounds ratio and its interval (orchestrator/pairedstats.py)."""

import math
import random

import pytest

from orchestrator.pairedstats import Verdict, ratio_interval


def test_identical_rounds_give_a_ratio_of_one_with_no_width():
    interval = ratio_interval([100.0, 110.0, 90.0], [100.0, 110.0, 90.0])
    assert interval.ratio == pytest.approx(1.0)
    assert interval.low == pytest.approx(1.0) and interval.high == pytest.approx(1.0)


def test_a_drift_shared_by_both_sides_cancels_in_paired_rounds():
    # the machine slows down by half over the rounds; A stays 10 % ahead of B in each round
    b = [200.0, 160.0, 130.0, 110.0, 100.0]
    a = [x * 1.10 for x in b]
    interval = ratio_interval(a, b)
    assert interval.ratio == pytest.approx(1.10)
    assert interval.verdict is Verdict.FASTER


def test_noise_around_one_is_no_measurable_difference():
    rng = random.Random(7)
    b = [100 * rng.uniform(0.9, 1.1) for _ in range(6)]
    a = [100 * rng.uniform(0.9, 1.1) for _ in range(6)]
    interval = ratio_interval(a, b)
    assert interval.low < 1.0 < interval.high
    assert interval.verdict is Verdict.NO_DIFFERENCE
    assert interval.describe().startswith("no measurable difference")


def test_a_slower_configuration_is_slower():
    b = [100.0, 102.0, 98.0, 101.0]
    a = [80.0, 83.0, 79.0, 80.5]
    assert ratio_interval(a, b).verdict is Verdict.SLOWER


def test_the_interval_covers_the_true_ratio_about_as_often_as_it_says():
    rng = random.Random(11)
    covered = 0
    for _ in range(400):
        b = [rng.lognormvariate(math.log(100), 0.05) for _ in range(5)]
        a = [x * 1.05 * rng.lognormvariate(0, 0.03) for x in b]
        covered += ratio_interval(a, b).contains(1.05)
    assert 0.91 <= covered / 400 <= 0.99


def test_unusable_rounds_are_left_out_and_one_round_has_no_interval():
    interval = ratio_interval([110.0, float("nan"), 0.0], [100.0, 100.0, 100.0])
    assert interval.rounds == 1 and interval.verdict is Verdict.UNKNOWN
    assert ratio_interval([], []).rounds == 0
    with pytest.raises(ValueError):
        ratio_interval([1.0], [1.0, 2.0])


def test_a_baseline_that_scored_zero_in_every_round_is_beaten_for_certain():
    """Rule 2: a served figure can be 0 (no request met the SLO); a log ratio cannot hold it."""
    from orchestrator.pairedstats import Verdict, ratio_interval

    beaten = ratio_interval([3.1, 3.4, 3.2], [0.0, 0.0, 0.0])
    assert beaten.verdict is Verdict.FASTER and beaten.ratio == float("inf") and beaten.half_width == 0.0
    assert "scored 0" in beaten.describe()
    assert ratio_interval([0.0, 0.0], [1.0, 2.0]).verdict is Verdict.SLOWER
    assert ratio_interval([0.0, 0.0], [0.0, 0.0]).verdict is Verdict.NO_DIFFERENCE
    mixed = ratio_interval([1.0, 2.0, 3.0], [0.0, 1.9, 3.1])  # zeros in one round only: left out
    assert mixed.rounds == 2 and not mixed.zeros
    assert ratio_interval([1.0, 2.0], [0.0, 2.0]).verdict is Verdict.UNKNOWN  # one usable round
