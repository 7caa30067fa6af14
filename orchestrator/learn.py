"""Recommendations: the best confirmed configuration of a study, with the evidence behind it.

Pure computation over trial records; the caller stores the result. Simulated and real measurements
are never pooled: a study is one or the other, and ``recommend`` refuses a mixed set.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

from workers.errors import FleettuneError
from workers.objective import Objective, objective
from workers.trial import BenchParams, Sample


@dataclass(frozen=True)
class TrialRecord:
    """The part of a stored trial that learning needs."""

    trial_id: int
    phase: str  # baseline | search | confirm
    params: BenchParams
    samples: tuple[Sample, ...]
    simulated: bool


@dataclass(frozen=True)
class RecommendationDraft:
    params: BenchParams
    expected_tps: float
    interval_low: float
    interval_high: float
    expected_pp_tps: float | None
    expected_tg_tps: float | None
    baseline_tps: float | None  # llama-cpp-python's defaults
    improvement: float | None
    evidence: list[int]
    simulated: bool
    baselines: dict[str, float] = field(default_factory=dict)  # name -> its value, each measured in the study

    def improvement_over(self, name: str) -> float | None:
        """The gain over one baseline (0.25: 25 % faster), None where the study did not measure it.
        Every value here is a rate (e2e as tokens per second), so higher is better."""
        base = self.baselines.get(name)
        return self.expected_tps / base - 1 if base else None


def _rates(samples, kind: str) -> list[float]:
    return [s.tokens_per_s for s in samples if s.kind == kind]


def config_key(params: BenchParams) -> str:
    """One string per distinct configuration, for grouping trials."""
    return json.dumps(params.to_dict(), sort_keys=True)


LLAMA_CPP_PYTHON = "llama-cpp-python defaults"
LLAMA_CPP = "llama.cpp defaults"


def recommend(
    records: list[TrialRecord], target: str | Objective, n_prompt: int, n_gen: int,
    baselines: dict[str, BenchParams] | None = None,
) -> RecommendationDraft | None:
    """Pick the configuration with the best pooled median among those that were confirmed.

    Candidates are the configurations that have a ``confirm`` trial (the study re-measures its top
    configurations and the baselines in one round); each is judged on all its samples together. The
    interval is the range of its per-repetition rates in the objective's unit.

    ``baselines`` names the study's baseline configurations (default: the first configuration of the
    ``baseline`` trials is llama-cpp-python's defaults, a second one llama.cpp's). A baseline is a candidate like any other, so where no searched
    configuration beats it on the study's own evidence, the baseline is the recommendation: the
    result is never slower than a baseline the study measured.
    """
    target = objective(target)
    if len({r.simulated for r in records}) > 1:
        raise FleettuneError("refusing to learn from simulated and real measurements together")
    by_config: dict[str, list[TrialRecord]] = {}
    for record in records:
        by_config.setdefault(config_key(record.params), []).append(record)
    confirmed = [rs for rs in by_config.values() if any(r.phase == "confirm" for r in rs)]
    candidates = confirmed or list(by_config.values())

    def summary(group: list[TrialRecord]) -> dict | None:
        samples = [s for r in group for s in r.samples]
        pp, tg = _rates(samples, "pp"), _rates(samples, "tg")
        pp_med = statistics.median(pp) if pp else None
        tg_med = statistics.median(tg) if tg else None
        spread = target.rate_spread(pp, tg, n_prompt, n_gen)  # a combined objective: its effective rate
        return {**spread, "pp": pp_med, "tg": tg_med} if spread else None

    baseline_group = [r for r in records if r.phase == "baseline"]
    if baselines is None:  # the study's order: llama-cpp-python's defaults, then llama.cpp's
        distinct = list({config_key(r.params): r.params for r in baseline_group}.values())
        baselines = dict(zip((LLAMA_CPP_PYTHON, LLAMA_CPP), distinct, strict=False))
    baseline_keys = {name: config_key(params) for name, params in baselines.items()}
    for key in baseline_keys.values():  # a measured baseline always competes
        if key in by_config and by_config[key] not in candidates:
            candidates = [*candidates, by_config[key]]
    scored = [(summary(group), group) for group in candidates]
    scored = [(s, g) for s, g in scored if s is not None]
    if not scored:
        return None
    best, group = max(scored, key=lambda item: item[0]["value"])
    values = {}
    for name, key in baseline_keys.items():
        measured = summary(by_config[key]) if key in by_config else None
        if measured is not None:
            values[name] = measured["value"]
    baseline_tps = values.get(LLAMA_CPP_PYTHON)
    return RecommendationDraft(
        params=group[0].params,
        expected_tps=best["value"],
        interval_low=best["low"],
        interval_high=best["high"],
        expected_pp_tps=best["pp"],
        expected_tg_tps=best["tg"],
        baseline_tps=baseline_tps,
        improvement=(best["value"] / baseline_tps - 1) if baseline_tps else None,
        evidence=sorted(r.trial_id for r in group),
        simulated=group[0].simulated,
        baselines=values,
    )


def top_configs(records: list[TrialRecord], values: dict[int, float], target: str | Objective,
                k: int) -> list[BenchParams]:
    """The ``k`` best distinct configurations of the search, by their objective value."""
    if k <= 0:
        return []
    target = objective(target)
    ranked = sorted(
        (r for r in records if r.phase == "search" and r.trial_id in values),
        key=lambda r: target.best_first(values[r.trial_id]),
    )
    seen, out = set(), []
    for record in ranked:
        key = config_key(record.params)
        if key not in seen:
            seen.add(key)
            out.append(record.params)
        if len(out) == k:
            break
    return out
