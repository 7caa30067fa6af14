"""A canary's rates against its control group's, judged as Kayenta judges a metric (issue 22.7).

The two groups are independent samples (the canary's requests and its controls', interleaved over
one stretch of time), so the test is Mann-Whitney's U on the logarithms of the rates, one-sided,
and the effect size is the Hodges-Lehmann estimate of the ratio (the median of every pairwise
ratio canary/control). Rules:

- fail: at ``CONFIDENCE`` the canary's rates lie below ``floor`` times its control group's (the
  floor is 1 - tolerance, raised where the canary is expected to be faster than the control's
  config); a slow canary fails as soon as that is shown, whatever the number of points;
- pass: each group has at least ``min_points`` rates, the canary is not shown slower than the
  floor, and its Hodges-Lehmann ratio is at or above the floor (Kayenta's effect size);
- inconclusive: fewer points than that, or a ratio below the floor that the test does not (yet)
  show; the analysis goes on, within its budget.

A rollout's canary judge looks at the rates after every round, so the test is taken several times
on growing samples; the floor below the control group (not the control itself) keeps a canary that
is as fast as its controls far from failing on any look. The A/A false-fail rate and the detection
rate are measured by bench/canary_stats.py (docs/serving.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from scipy import stats

CONFIDENCE = 0.98  # Kayenta's default for its Mann-Whitney classifier
MIN_POINTS = 8  # rates per group before a canary may pass (Kayenta asks ~50: see docs/serving.md)

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass(frozen=True)
class Comparison:
    """One metric's comparison: what was tested, on how many points, and the outcome."""

    outcome: str  # PASS, FAIL or INCONCLUSIVE
    n_canary: int
    n_control: int
    ratio: float  # Hodges-Lehmann estimate of canary / control (nan without points)
    floor: float  # the ratio below which the canary fails
    p_below_floor: float  # one-sided p-value that the canary's rates lie below floor x control's
    confidence: float
    min_points: int

    def describe(self) -> str:
        if math.isnan(self.ratio):
            return "no rates to compare"
        return (f"{self.ratio:.2f}x its control group (Hodges-Lehmann; {self.n_canary} vs {self.n_control} rates, "
                f"p={self.p_below_floor:.3f} that it is below {self.floor:.2f}x)")

    def as_dict(self) -> dict:
        return asdict(self)


def _logs(rates: Sequence[float | None]) -> list[float]:
    return [math.log(r) for r in rates if r is not None and math.isfinite(r) and r > 0]


def hodges_lehmann_ratio(canary: Sequence[float], control: Sequence[float]) -> float:
    """The median of every pairwise ratio canary_i / control_j (nan where a group is empty)."""
    a, b = _logs(canary), _logs(control)
    if not a or not b:
        return math.nan
    return math.exp(statistics.median(x - y for x in a for y in b))


def compare(canary: Sequence[float | None], control: Sequence[float | None], floor: float,
            confidence: float = CONFIDENCE, min_points: int = MIN_POINTS) -> Comparison:
    """Higher-is-better rates of the canary against its control group's; ``floor`` (0 < floor)
    is the ratio canary/control it must not be shown to fall below."""
    if not (floor > 0 and math.isfinite(floor)):
        raise ValueError(f"floor must be a positive ratio, not {floor!r}")
    a, b = _logs(canary), _logs(control)
    ratio = hodges_lehmann_ratio(canary, control)
    p = 1.0
    if a and b:
        shifted = [x - math.log(floor) for x in a]  # the canary's rates over the floor
        p = float(stats.mannwhitneyu(shifted, b, alternative="less").pvalue)
    if p < 1 - confidence:
        outcome = FAIL
    elif len(a) >= min_points and len(b) >= min_points and ratio >= floor:
        outcome = PASS
    else:
        outcome = INCONCLUSIVE
    return Comparison(outcome, len(a), len(b), ratio, floor, p, confidence, min_points)


def compare_to_figure(canary: Sequence[float | None], figure: float, floor: float,
                      confidence: float = CONFIDENCE, min_points: int = MIN_POINTS) -> Comparison:
    """The canary's rates against one expected figure (a chip with no control node): Wilcoxon's
    signed-rank test of their logarithms against log(floor x figure), one-sided."""
    a = _logs(canary)
    ratio = math.exp(statistics.median(a) - math.log(figure)) if a and figure > 0 else math.nan
    p = 1.0
    if a and figure > 0:
        shifted = [x - math.log(floor * figure) for x in a]
        if any(shifted):
            p = float(stats.wilcoxon(shifted, alternative="less").pvalue)
    outcome = (FAIL if p < 1 - confidence else PASS if len(a) >= min_points and ratio >= floor
               else INCONCLUSIVE)
    return Comparison(outcome, len(a), 0, ratio, floor, p, confidence, min_points)
