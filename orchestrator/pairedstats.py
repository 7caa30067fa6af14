"""Ratios of two configurations measured in paired rounds, with a confidence interval.

A claim of speed compares configuration A with configuration B measured in the same rounds (A and
B interleaved, on the same node, so that the machine's drift over time touches both alike). Each
round gives one ratio a_i / b_i; the claim is the geometric mean of those ratios with a Student-t
interval on their logarithms (a ratio of rates is symmetric on the log scale: A 10 % faster than B
is B 9.1 % slower than A). Rule 1: a gain is claimed only when the whole interval lies above 1;
where it includes 1 the verdict is "no measurable difference". Rule 2: zeros (``ratio_interval``).

Used by the study's confirmation (every recommendation's gain over each baseline), by the A/A
noise check (one configuration against itself) and by ``fleettune verify`` (llama-bench's rounds).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

CONFIDENCE = 0.95  # two-sided level of every interval a report prints


class Verdict(enum.Enum):
    """What an interval of a ratio says about A against B."""

    FASTER = "faster"  # the whole interval above 1
    SLOWER = "slower"  # the whole interval below 1
    NO_DIFFERENCE = "no measurable difference"  # the interval includes 1
    UNKNOWN = "unknown"  # fewer than two rounds: no interval


@dataclass(frozen=True)
class RatioInterval:
    """The geometric-mean ratio of A over B across ``rounds`` paired rounds and its interval."""

    ratio: float
    low: float
    high: float
    rounds: int
    confidence: float = CONFIDENCE
    zeros: bool = False  # rule 2: one side (or both) was zero in every round; the ratio is 0, inf or 1

    @property
    def verdict(self) -> Verdict:
        if self.rounds >= 2 and self.zeros:
            return Verdict.FASTER if self.low > 1.0 else Verdict.SLOWER if self.high < 1.0 else Verdict.NO_DIFFERENCE
        if self.rounds < 2 or not (math.isfinite(self.low) and math.isfinite(self.high)):
            return Verdict.UNKNOWN
        if self.low > 1.0:
            return Verdict.FASTER
        if self.high < 1.0:
            return Verdict.SLOWER
        return Verdict.NO_DIFFERENCE

    @property
    def half_width(self) -> float:
        """Half the interval's width on the log scale (0.02 is about ±2 %)."""
        if self.rounds >= 2 and self.zeros:
            return 0.0  # every round said the same: nothing left to narrow
        return (math.log(self.high) - math.log(self.low)) / 2 if self.rounds >= 2 else math.inf

    def contains(self, ratio: float) -> bool:
        return self.low <= ratio <= self.high

    def describe(self) -> str:
        """``+4.1 % (+1.2 … +7.0 %, 5 rounds)``, or the verdict where the interval includes 1."""
        if self.rounds >= 2 and self.zeros:
            return {Verdict.FASTER: f"+inf (the other scored 0 in every one of {self.rounds} rounds)",
                    Verdict.SLOWER: f"-100 % (scored 0 in every one of {self.rounds} rounds)",
                    }.get(self.verdict, f"no measurable difference (both scored 0 in every one of {self.rounds} rounds)")
        if self.rounds < 2:
            return f"{_percent(self.ratio)} (1 round, no interval)"
        span = f"{_percent(self.low)} … {_percent(self.high)}, {self.rounds} rounds"
        if self.verdict is Verdict.NO_DIFFERENCE:
            return f"no measurable difference ({span})"
        return f"{_percent(self.ratio)} ({span})"


def _percent(ratio: float) -> str:
    return f"{(ratio - 1.0) * 100:+.1f} %"


def ratio_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE
) -> RatioInterval:
    """The ratio of ``a`` over ``b`` from paired rounds (``a[i]`` and ``b[i]`` from round ``i``).

    Both are higher-is-better rates (tok/s). Rounds where either figure is missing, zero or not
    finite are left out; with fewer than two rounds left the interval is unbounded. Rule 2: a served
    figure can be 0 (no request met the SLO); where one side was 0 and the other not in every one
    of two or more rounds, the ratio is infinite (or 0) and the verdict certain; both 0: 1.
    """
    if len(a) != len(b):
        raise ValueError(f"paired rounds need as many figures on each side ({len(a)} != {len(b)})")
    both = [(x, y) for x, y in zip(a, b, strict=True) if _measured(x) and _measured(y)]
    if len(both) >= 2 and sum(x > 0 and y > 0 for x, y in both) < 2:
        n = len(both)
        if all(x > 0 and y == 0 for x, y in both):
            return RatioInterval(math.inf, math.inf, math.inf, n, confidence, zeros=True)
        if all(x == 0 and y > 0 for x, y in both):
            return RatioInterval(0.0, 0.0, 0.0, n, confidence, zeros=True)
        if all(x == 0 and y == 0 for x, y in both):
            return RatioInterval(1.0, 1.0, 1.0, n, confidence, zeros=True)
    logs = [
        math.log(x / y)
        for x, y in zip(a, b, strict=True)
        if _usable(x) and _usable(y)
    ]
    if not logs:
        return RatioInterval(math.nan, -math.inf, math.inf, 0, confidence)
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return RatioInterval(math.exp(mean), 0.0, math.inf, 1, confidence)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    margin = float(stats.t.ppf(0.5 + confidence / 2, len(logs) - 1)) * sd / math.sqrt(len(logs))
    return RatioInterval(
        math.exp(mean), math.exp(mean - margin), math.exp(mean + margin), len(logs), confidence
    )


def _usable(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def _measured(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0
