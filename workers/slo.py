"""A latency service-level objective (SLO) for served traffic, and the figures judged against it.

One record per served request (``RequestRecord``), the metrics AIPerf and vLLM's ``bench serve``
report from it, and one SLO type: limits on percentiles of those metrics, parsed from
``ttft_p90=1s,itl_p90=50ms,tps_p10=20``. Pure: no server, no clock, no I/O (the load loop in
workers/loadgen.py measures, the study loop ranks).

Metrics of one request (AIPerf's definitions):

- ``ttft``: seconds from sending the request to its first generated token;
- ``itl``: inter-token latency, ``(e2e - ttft) / (gen_tokens - 1)`` seconds (per request, AIPerf's
  "inter token latency"; vLLM calls the same figure TPOT);
- ``e2e``: seconds from sending the request to its last token;
- ``tps``: the user's own generation rate, ``1 / itl`` tokens per second.

Rules (numbered as the code cites them):

1. Latencies (ttft, itl, e2e) are limited from above at a high percentile (``ttft_p90=1s``: the
   90th percentile is at most 1 s); the per-user rate (tps) from below at a low one (``tps_p10=20``:
   the 10th percentile is at least 20 tok/s). Percentiles interpolate linearly (numpy's default,
   as AIPerf and vLLM compute them).
2. A level of load meets the SLO when every limit holds over its measured requests and no more
   than ``max_error_rate`` of them failed (default 0: a dropped request breaks the SLO).
3. A request is *good* when it succeeded and its own figures meet every limit (vLLM's goodput);
   goodput is good requests per second of the measured window.
4. Warm-up requests are never judged (they are dropped before any figure is taken).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from workers.errors import BadInput

METRICS = {  # name -> (unit, lower is better)
    "ttft": ("s", True),
    "itl": ("s", True),
    "e2e": ("s", True),
    "tps": ("tok/s", False),
}
_DURATION = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
_TERM = re.compile(r"\s*([a-z0-9]+)_p(\d{1,2}(?:\.\d+)?)\s*(<=|>=|=)\s*([0-9.eE+-]+)\s*([a-z/]*)\s*")


@dataclass(frozen=True)
class RequestRecord:
    """One served request, as the load loop timed it (seconds relative to the load's start)."""

    start_s: float
    prompt_tokens: int
    gen_tokens: int = 0  # tokens received
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    warmup: bool = False
    users: int | None = None  # the concurrency this request was sent at (closed loop), if any

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.e2e_s is not None

    @property
    def itl_s(self) -> float | None:
        if not self.ok or self.gen_tokens < 2:
            return None
        return max(self.e2e_s - self.ttft_s, 0.0) / (self.gen_tokens - 1)

    @property
    def tps(self) -> float | None:
        itl = self.itl_s
        return 1.0 / itl if itl else None

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_s is None else self.start_s + self.e2e_s

    def metric(self, name: str) -> float | None:
        return {"ttft": self.ttft_s, "itl": self.itl_s, "e2e": self.e2e_s, "tps": self.tps}[name]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        return cls(**data)


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (0..100) with linear interpolation; None for no values."""
    ordered = sorted(v for v in values if v is not None and math.isfinite(v))
    if not ordered:
        return None
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Limit:
    """One term of an SLO: ``metric``'s ``pct``-th percentile at most (latency) or at least (rate)
    ``value`` (seconds or tok/s)."""

    metric: str
    pct: float
    value: float

    @property
    def lower_is_better(self) -> bool:
        return METRICS[self.metric][1]

    def holds(self, figure: float | None) -> bool:
        if figure is None:
            return False
        return figure <= self.value if self.lower_is_better else figure >= self.value

    def __str__(self) -> str:
        unit = METRICS[self.metric][0]
        shown = f"{self.value * 1000:g}ms" if unit == "s" and self.value < 1 else (
            f"{self.value:g}s" if unit == "s" else f"{self.value:g}")
        return f"{self.metric}_p{self.pct:g}={shown}"


@dataclass(frozen=True)
class LoadFigures:
    """What one level of load measured: counts, the window, percentiles, rates and the verdict."""

    requests: int
    failed: int
    window_s: float
    throughput_tps: float  # generated tokens per second, all users together
    request_rate: float  # completed requests per second
    goodput: float  # good requests per second (rule 3)
    meets_slo: bool
    percentiles: dict[str, float | None] = field(default_factory=dict)  # "ttft_p50" -> seconds
    why: str = ""  # the first limit broken, or ""


@dataclass(frozen=True)
class SLO:
    """Limits on percentiles of served-request metrics (rules 1 and 2)."""

    limits: tuple[Limit, ...]
    max_error_rate: float = 0.0

    def __str__(self) -> str:
        return ",".join(str(limit) for limit in self.limits)

    def to_dict(self) -> dict:
        return {"limits": [asdict(limit) for limit in self.limits], "max_error_rate": self.max_error_rate}

    @classmethod
    def from_dict(cls, data: dict) -> SLO:
        return cls(tuple(Limit(**limit) for limit in data["limits"]), data.get("max_error_rate", 0.0))

    def good(self, record: RequestRecord) -> bool:
        """Rule 3: the request succeeded and its own figures meet every limit."""
        return record.ok and all(limit.holds(record.metric(limit.metric)) for limit in self.limits)

    def breach(self, records: Iterable[RequestRecord]) -> str:
        """Rule 2: "" when the measured (non-warm-up) requests meet the SLO, else the first reason."""
        measured = [r for r in records if not r.warmup]
        if not measured:
            return "no requests measured"
        failed = sum(not r.ok for r in measured)
        if failed > self.max_error_rate * len(measured):
            return f"{failed} of {len(measured)} requests failed"
        for limit in self.limits:
            figure = percentile([r.metric(limit.metric) for r in measured if r.ok], limit.pct)
            if not limit.holds(figure):
                shown = "none" if figure is None else f"{figure:.4g}"
                return f"{limit.metric}_p{limit.pct:g} {shown} breaks {limit}"
        return ""


DEFAULT_SLO_TEXT = "ttft_p90=1s,tps_p10=20"  # issue 22's: first token within 1 s, 20 tok/s each


def parse_slo(text: str, *, option: str = "--slo") -> SLO:
    """``ttft_p90=1s,itl_p90=50ms,tps_p10=20`` as an SLO; one BadInput line for anything else.

    Latencies take s, ms or us (bare numbers are seconds); ``tps`` is tokens per second. Each
    metric may appear once. ``err=0.01`` sets the tolerated error rate (default 0, rule 2).
    """
    limits: list[Limit] = []
    max_error = 0.0
    if not isinstance(text, str) or not text.strip():
        raise BadInput(f"{option}: empty; e.g. {DEFAULT_SLO_TEXT}")
    for term in text.split(","):
        if term.strip().startswith("err="):
            try:
                max_error = float(term.split("=", 1)[1])
            except ValueError:
                max_error = -1.0
            if not 0.0 <= max_error < 1.0:
                raise BadInput(f"{option} {term.strip()!r}: the error rate must be a fraction in [0, 1)")
            continue
        match = _TERM.fullmatch(term)
        if not match:
            raise BadInput(f"{option} {term.strip()!r}: not METRIC_pNN=VALUE (e.g. ttft_p90=1s, tps_p10=20)")
        metric, pct, _, number, unit = match.groups()
        if metric not in METRICS:
            raise BadInput(f"{option} {term.strip()!r}: unknown metric {metric!r}; one of {', '.join(METRICS)}")
        if any(limit.metric == metric for limit in limits):
            raise BadInput(f"{option}: {metric} is limited twice")
        try:
            value = float(number)
        except ValueError:
            raise BadInput(f"{option} {term.strip()!r}: {number!r} is not a number") from None
        if METRICS[metric][0] == "s":
            if unit not in _DURATION:
                raise BadInput(f"{option} {term.strip()!r}: a latency takes s, ms or us, not {unit!r}")
            value *= _DURATION[unit]
        elif unit not in ("", "tok/s"):
            raise BadInput(f"{option} {term.strip()!r}: tps is in tokens per second, not {unit!r}")
        pct_value = float(pct)
        if not (0 < pct_value < 100) or not math.isfinite(value) or value <= 0:
            raise BadInput(f"{option} {term.strip()!r}: the percentile must be in (0, 100) and the value > 0")
        limits.append(Limit(metric, pct_value, value))
    if not limits:
        raise BadInput(f"{option}: no limit given; e.g. {DEFAULT_SLO_TEXT}")
    return SLO(tuple(limits), max_error)


SHOWN_PERCENTILES = (50, 90, 99)


def figures(records: Sequence[RequestRecord], slo: SLO) -> LoadFigures:
    """Rule 4 then rules 1-3 over one level's records: the window runs from the first measured
    request's start to the last one's end."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    if measured:
        start = min(r.start_s for r in measured)
        end = max((r.end_s for r in measured if r.end_s is not None), default=start)
        window = max(end - start, 1e-9)
    else:
        window = 0.0
    pcts: dict[str, float | None] = {}
    for metric in METRICS:
        values = [r.metric(metric) for r in ok]
        for p in SHOWN_PERCENTILES:
            pcts[f"{metric}_p{p}"] = percentile(values, p)
        pcts[f"{metric}_p10"] = percentile(values, 10)
    why = slo.breach(records)

    def rate(n: float) -> float:
        return n / window if window else 0.0

    return LoadFigures(
        requests=len(measured), failed=len(measured) - len(ok), window_s=window,
        throughput_tps=rate(sum(r.gen_tokens for r in ok)), request_rate=rate(len(ok)),
        goodput=rate(sum(slo.good(r) for r in ok)), meets_slo=not why, percentiles=pcts, why=why)
