"""A canary against its control group, judged as Kayenta judges metrics (issue 22.7).

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

Several metrics at once (``judge_metrics``, Kayenta's canary judge over its metric classifiers):
each ``Metric`` has a direction and a tolerance.

- A continuous metric (TTFT, ITL, per-user tok/s, the objective's rate; one value per request) is
  compared as above on the logarithms of its values: a higher-is-better metric fails when shown
  below (1 - tolerance) x its control group's, a lower-is-better one when shown above
  (1 + tolerance) x it; it passes when each group has at least the metric's ``min_points`` values
  (``MIN_POINTS_PER_ARM``, Kayenta's 50) and its Hodges-Lehmann ratio is on the right side of that
  limit.
- A share metric (errors: the share of requests that failed, lower is better; goodput: the share of
  requests that met the SLO, higher is better; one 0/1 flag per request) fails when the canary's
  share is worse than its control group's by more than the metric's margin (its tolerance, an
  absolute share; the errors' default 0: one failed request more, in proportion, than the controls
  had fails the canary, at once), and passes with ``min_points`` requests per group otherwise.
- The verdict: fail if any metric fails, pass if every metric passes, inconclusive otherwise (a
  metric without samples is inconclusive), with each metric's comparison for the record.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from scipy import stats

CONFIDENCE = 0.98  # Kayenta's default for its Mann-Whitney classifier
MIN_POINTS = 8  # rates per group before a canary may pass (Kayenta asks ~50: see docs/serving.md)
MIN_POINTS_PER_ARM = 50  # Kayenta's figure: values per metric and per group before judge_metrics passes

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass(frozen=True)
class Comparison:
    """One metric's comparison: what was tested, on how many points, and the outcome."""

    outcome: str  # PASS, FAIL or INCONCLUSIVE
    n_canary: int
    n_control: int
    ratio: float  # Hodges-Lehmann estimate of canary / control (nan without points)
    floor: float  # the limit ratio: below it (higher is better) or above it (lower is better) the canary fails
    p_below_floor: float  # one-sided p-value that the canary is worse than floor x its control group
    confidence: float
    min_points: int
    metric: str = "rate"
    lower_is_better: bool = False

    def describe(self) -> str:
        if math.isnan(self.ratio):
            return f"{self.metric}: no values to compare"
        side = "above" if self.lower_is_better else "below"
        return (f"{self.metric} {self.ratio:.2f}x its control group (Hodges-Lehmann; {self.n_canary} vs "
                f"{self.n_control} values, p={self.p_below_floor:.3f} that it is {side} {self.floor:.2f}x)")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ShareComparison:
    """A share metric's comparison (errors, goodput): events per request in each group, the margin."""

    outcome: str
    metric: str
    n_canary: int  # requests
    n_control: int
    canary_events: int  # failed requests (errors) or good ones (goodput)
    control_events: int
    margin: float  # how much worse (an absolute share) the canary's share may be than its control group's
    lower_is_better: bool
    min_points: int

    @property
    def canary_share(self) -> float:
        return self.canary_events / self.n_canary if self.n_canary else math.nan

    @property
    def control_share(self) -> float:
        return self.control_events / self.n_control if self.n_control else math.nan

    def describe(self) -> str:
        return (f"{self.metric} {self.canary_events} of {self.n_canary} vs {self.control_events} of "
                f"{self.n_control} (margin {self.margin:.0%})")

    def as_dict(self) -> dict:
        return {**asdict(self), "canary_share": self.canary_share, "control_share": self.control_share}


CONTINUOUS, SHARE = "continuous", "share"


@dataclass(frozen=True)
class Metric:
    """One metric a canary is judged on: its name, direction, kind and tolerance (continuous: the
    ratio canary/control may be this much worse, or where negative must be this much better;
    share: the margin, an absolute share)."""

    name: str
    lower_is_better: bool
    tolerance: float
    kind: str = CONTINUOUS
    min_points: int = MIN_POINTS_PER_ARM

    def __post_init__(self) -> None:
        if self.kind not in (CONTINUOUS, SHARE):
            raise ValueError(f"metric {self.name}: kind must be {CONTINUOUS!r} or {SHARE!r}, not {self.kind!r}")
        # a share's margin is a share in [0, 1); a continuous metric's limit (1 -+ tolerance) must be a
        # positive ratio: a negative tolerance asks the canary to be better than its controls
        low, high = ((0.0, 1.0) if self.kind == SHARE else (-1.0, math.inf) if self.lower_is_better
                     else (-math.inf, 1.0))
        if not (low <= self.tolerance < high) or (self.kind == CONTINUOUS and self.tolerance == low):
            raise ValueError(f"metric {self.name}: tolerance {self.tolerance!r} outside [{low:g}, {high:g})")
        if self.min_points < 1:
            raise ValueError(f"metric {self.name}: min_points must be >= 1")

    @property
    def limit(self) -> float:
        """A continuous metric's limit ratio canary/control: 1 + tolerance (lower is better) or
        1 - tolerance (higher is better)."""
        return 1 + self.tolerance if self.lower_is_better else 1 - self.tolerance


# The served canary's metrics by name: (lower is better, kind); their tolerances are the caller's
# (orchestrator.canary holds the defaults, measured by bench/canary_real.py)
METRICS = {
    "ttft": (True, CONTINUOUS),  # seconds to the first token
    "itl": (True, CONTINUOUS),  # seconds per generated token after the first
    "tps": (False, CONTINUOUS),  # the user's own tokens/s (1 / itl)
    "rate": (False, CONTINUOUS),  # the objective's rate, per request
    "goodput": (False, SHARE),  # requests that met the SLO, of all requests
    "errors": (True, SHARE),  # failed requests, of all requests
}


def metric(name: str, tolerance: float, min_points: int = MIN_POINTS_PER_ARM) -> Metric:
    """The named metric of ``METRICS`` with its direction and kind, at ``tolerance``."""
    if name not in METRICS:
        raise ValueError(f"unknown canary metric {name!r}; one of {', '.join(METRICS)}")
    lower, kind = METRICS[name]
    return Metric(name, lower, tolerance, kind, min_points)


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


def compare_metric(canary: Sequence[float | None], control: Sequence[float | None], rule: Metric,
                   confidence: float = CONFIDENCE) -> Comparison | ShareComparison:
    """One metric of ``judge_metrics``: a continuous one by Mann-Whitney's U against its limit
    (lower-is-better values as their reciprocals, so one test serves both directions), a share one
    by its margin."""
    if rule.kind == SHARE:
        return _compare_share(canary, control, rule)
    if not rule.lower_is_better:
        return replace(compare(canary, control, rule.limit, confidence, rule.min_points), metric=rule.name)
    # lower is better: the canary fails when its values are shown above limit x its controls', that
    # is when their reciprocals are shown below 1/limit x theirs; the ratio recorded is the values'
    inverse = compare([1 / v for v in canary if _positive(v)], [1 / v for v in control if _positive(v)],
                      1 / rule.limit, confidence, rule.min_points)
    return replace(inverse, ratio=1 / inverse.ratio if inverse.ratio else math.nan, floor=rule.limit,
                   metric=rule.name, lower_is_better=True)


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _compare_share(canary: Sequence[float | None], control: Sequence[float | None], rule: Metric) -> ShareComparison:
    """Flags (1: the event, 0: not; None: no flag) as a share of requests. Fail when the canary's
    share is worse than its control group's by more than the margin, whatever the number of
    requests; pass with ``min_points`` requests in each group otherwise. Without control requests
    the canary's share is held to none (errors) or all (goodput) and passes on its own requests."""
    a = [1 if f else 0 for f in canary if f is not None]
    b = [1 if f else 0 for f in control if f is not None]
    outcome = INCONCLUSIVE
    if a:
        share_a = sum(a) / len(a)
        share_b = sum(b) / len(b) if b else (0.0 if rule.lower_is_better else 1.0)
        worse_by = share_a - share_b if rule.lower_is_better else share_b - share_a
        if worse_by > rule.tolerance + 1e-12:
            outcome = FAIL
        elif len(a) >= rule.min_points and (not b or len(b) >= rule.min_points):
            outcome = PASS
    return ShareComparison(outcome, rule.name, len(a), len(b), sum(a), sum(b), rule.tolerance,
                           rule.lower_is_better, rule.min_points)


@dataclass(frozen=True)
class Judgement:
    """The verdict on several metrics: fail if any fails, pass if every one passes, else inconclusive."""

    outcome: str
    comparisons: dict[str, Comparison | ShareComparison]

    @property
    def failed(self) -> list[str]:
        return [name for name, c in self.comparisons.items() if c.outcome == FAIL]

    @property
    def undecided(self) -> list[str]:
        return [name for name, c in self.comparisons.items() if c.outcome == INCONCLUSIVE]

    def describe(self) -> str:
        return "; ".join(c.describe() + f": {c.outcome}" for c in self.comparisons.values())

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "metrics": {name: c.as_dict() for name, c in self.comparisons.items()}}


def judge_metrics(canary: Mapping[str, Sequence[float | None]], control: Mapping[str, Sequence[float | None]],
                  metrics: Sequence[Metric], confidence: float = CONFIDENCE) -> Judgement:
    """The canary's and its control group's per-request samples, per metric name, judged on every
    metric of ``metrics`` (a metric without samples is inconclusive): one verdict, each metric's
    comparison with it."""
    if not metrics:
        raise ValueError("judge_metrics needs at least one metric")
    comparisons = {rule.name: compare_metric(canary.get(rule.name, ()), control.get(rule.name, ()), rule, confidence)
                   for rule in metrics}
    outcomes = [c.outcome for c in comparisons.values()]
    outcome = FAIL if FAIL in outcomes else PASS if all(o == PASS for o in outcomes) else INCONCLUSIVE
    return Judgement(outcome, comparisons)
