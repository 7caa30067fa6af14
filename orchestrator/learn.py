"""Recommendations: the best confirmed configuration of a study, with the evidence behind it.

Pure computation over trial records; the caller stores the result. Simulated and real measurements
are never pooled: a study is one or the other, and ``recommend`` refuses a mixed set.
"""

from __future__ import annotations

import json
import math
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
    effective: dict | None = None  # what llama.cpp ran (issue 20.1); None: not read back
    confirm_round: int | None = None  # the interleaved confirmation's round and arm (issue 20.2)
    confirm_arm: str | None = None
    kl_divergence: float | None = None

    @property
    def key(self) -> str:
        """The configuration's identity: its effective values where llama.cpp reported them."""
        return identity(self.params, self.effective)


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
    claims: dict = field(default_factory=dict)  # issue 20.3: paired ratios with intervals (see ``paired_claims``)

    def improvement_over(self, name: str) -> float | None:
        """The gain over one baseline (0.25: 25 % faster), None where the study did not measure it.
        From the paired rounds where the study confirmed in rounds, else from the pooled medians.
        Every value here is a rate (e2e as tokens per second), so higher is better."""
        paired = self.claims.get("vs", {}).get(name)
        if paired is not None:
            return paired["ratio"] - 1 if paired["ratio"] is not None and math.isfinite(paired["ratio"]) else None
        base = self.baselines.get(name)
        return self.expected_tps / base - 1 if base else None


def _rates(samples, kind: str) -> list[float]:
    return [s.tokens_per_s for s in samples if s.kind == kind]


def config_key(params: BenchParams) -> str:
    """One string per distinct configuration as asked for, for grouping trials."""
    return json.dumps(params.to_dict(), sort_keys=True)


def identity(params: BenchParams, effective: dict | None) -> str:
    """One string per configuration llama.cpp actually ran (issue 20.1): two configurations with
    equal effective values (``-fa auto`` resolved to on, and ``-fa on``) are one; where the values
    were not read back (older records), the configuration as asked for."""
    return json.dumps(effective, sort_keys=True) if effective else config_key(params)


LLAMA_CPP_PYTHON = "llama-cpp-python defaults"
LLAMA_CPP = "llama.cpp defaults"  # in a served study: llama-server's own defaults
SINGLE_STREAM = "single-stream recommendation"  # a served study's: the chip's tg recommendation, served as it is
# issue 23.3: llama.cpp's --fit placement for the study's GPU budget, where llama.cpp's plain defaults
# (every layer on the GPU) do not fit it; where they fit, --fit changes nothing and it is not measured
FIT = "llama.cpp --fit"
OTHER_BASELINES = (LLAMA_CPP_PYTHON, SINGLE_STREAM, FIT)  # beside llama.cpp's defaults
# the reference of the claims: llama.cpp's defaults, or --fit's placement where the defaults failed
REFERENCES = (LLAMA_CPP, FIT)
def noise_arm(reference: str) -> str:
    """The A/A arm: the reference measured a second time each round, the machine's own noise."""
    return f"{reference} (A/A)"


NOISE_ARM = noise_arm(LLAMA_CPP)
WARMUP_ARM = "warm-up"  # measured before the first round, not counted
CANDIDATE = "candidate "  # arms "candidate 1", "candidate 2", ...
# a confirmation after more search is a new one: its rounds are numbered from the next multiple of
# this, and the claims rest on the last generation's rounds only
ROUND_GENERATION = 1000


def paired_claims(records: list[TrialRecord], target: Objective, n_prompt: int, n_gen: int) -> dict | None:
    """What the interleaved confirmation's rounds show (issue 20.3), or None where it had none.

    Each candidate's ratio over llama.cpp's defaults comes from the paired rounds (pairedstats);
    the best candidate by that ratio is the winner only where its whole interval lies above 1, else
    llama.cpp's defaults win (the simpler configuration wins ties). The winner's ratios over both
    baselines and the A/A ratio (the machine's noise) are kept with the rounds they rest on."""
    from orchestrator.pairedstats import Verdict, ratio_interval

    rounds: dict[int, dict[str, float | None]] = {}
    arms: dict[str, BenchParams] = {}
    paired = [r for r in records if r.phase == "confirm" and r.confirm_arm is not None
              and r.confirm_round is not None and r.confirm_arm != WARMUP_ARM]
    generation = max((r.confirm_round // ROUND_GENERATION for r in paired), default=0)
    for r in paired:
        if r.confirm_round // ROUND_GENERATION != generation:
            continue
        arms.setdefault(r.confirm_arm, r.params)
        rounds.setdefault(r.confirm_round, {})[r.confirm_arm] = trial_rate(r.samples, target, n_prompt, n_gen)
    reference = reference_arm(rounds)
    if reference is None:
        return None  # neither llama.cpp's defaults nor its --fit ran here: nothing to claim against
    order = sorted(rounds)

    def interval(a: str, b: str):
        return ratio_interval([rounds[i].get(a) for i in order], [rounds[i].get(b) for i in order])

    def as_dict(ri) -> dict:
        return {"ratio": _number(ri.ratio), "low": _number(ri.low), "high": _number(ri.high), "rounds": ri.rounds,
                "verdict": ri.verdict.value, "text": ri.describe()}

    candidates = sorted((a for a in arms if a.startswith(CANDIDATE)), key=lambda a: int(a.split()[-1]))
    ranked = sorted(((interval(a, reference), a) for a in candidates),
                    key=lambda item: -math.inf if math.isnan(item[0].ratio) else item[0].ratio, reverse=True)
    best = ranked[0] if ranked else None
    winner = best[1] if best and best[0].verdict is Verdict.FASTER else reference
    for other in OTHER_BASELINES:
        if other in arms and other != reference and interval(other, winner).verdict is Verdict.FASTER:
            winner = other  # never measurably slower than any baseline (rule 20.3)
    claims: dict = {"winner": winner, "reference": reference, "rounds": len(order), "params": arms[winner].to_dict(),
                    "vs": {}}
    for name in (*OTHER_BASELINES, LLAMA_CPP):
        if name in arms and name != winner and any(values.get(name) is not None for values in rounds.values()):
            claims["vs"][name] = as_dict(interval(winner, name))
    if best is not None:
        claims["best_candidate"] = {"arm": best[1], "params": arms[best[1]].to_dict(), **as_dict(best[0])}
    if noise_arm(reference) in arms:
        claims["noise"] = as_dict(interval(noise_arm(reference), reference))
    over = REFERENCE_TEXT[reference]
    if winner != reference and winner in BASELINE_TEXT:
        claims["outcome"] = f"{BASELINE_TEXT[winner]}: {claims['vs'][reference]['text']} over {over}"
    elif winner != reference:
        claims["outcome"] = f"{claims['vs'][reference]['text']} over {over}"
    elif best is not None and best[0].verdict is Verdict.SLOWER:
        claims["outcome"] = f"{over}: every candidate was slower"
    else:
        claims["outcome"] = f"no measurable difference from {over}"
    return claims


REFERENCE_TEXT = {LLAMA_CPP: "llama.cpp's defaults", FIT: "llama.cpp's --fit"}
BASELINE_TEXT = {LLAMA_CPP_PYTHON: "llama-cpp-python's defaults", SINGLE_STREAM: "the single-stream recommendation",
                 FIT: "llama.cpp's --fit"}


def stored_baselines(baseline_trials: list, served: bool = False) -> dict[str, BenchParams]:
    """A study's baselines by name, from its ``baseline`` trials (records or rows with ``params``
    and ``confirm_arm``): each trial names its baseline; trials stored before they did are named
    by the study's order (llama-cpp-python's defaults, then llama.cpp's; a served study's:
    llama-server's defaults, then the single-stream recommendation)."""
    named: dict[str, BenchParams] = {}
    unnamed: dict[str, BenchParams] = {}
    for trial in baseline_trials:
        params = trial.params if isinstance(trial.params, BenchParams) else BenchParams.from_dict(trial.params)
        if trial.confirm_arm:
            named.setdefault(trial.confirm_arm, params)
        else:
            unnamed.setdefault(config_key(params), params)
    if named:
        return named
    order = (LLAMA_CPP, SINGLE_STREAM) if served else (LLAMA_CPP_PYTHON, LLAMA_CPP)
    return dict(zip(order, unnamed.values(), strict=False))


def reference_arm(rounds: dict[int, dict[str, float | None]]) -> str | None:
    """The baseline the claims are made against: llama.cpp's defaults where they ran in some round,
    else --fit's placement (the defaults did not fit the GPU budget, issue 23.3), else None."""
    for name in REFERENCES:
        if any(values.get(name) is not None for values in rounds.values()):
            return name
    return None


def _number(value: float) -> float | None:
    """A ratio as stored (JSON, PostgreSQL): None for an infinite one (a baseline that scored 0,
    pairedstats rule 2) or none at all; the claim's text and verdict say which."""
    return value if math.isfinite(value) else None


def trial_rate(samples, target: str | Objective, n_prompt: int, n_gen: int) -> float | None:
    """One trial's figure in the objective's rate (e2e as tokens per second): its median."""
    target = objective(target)
    medians = {kind: statistics.median(rates) if (rates := _rates(samples, kind)) else None for kind in target.kinds}
    return target.rate_of(medians, n_prompt, n_gen)


def recommend(
    records: list[TrialRecord], target: str | Objective, n_prompt: int, n_gen: int,
    baselines: dict[str, BenchParams] | None = None,
) -> RecommendationDraft | None:
    """The study's recommendation: where the interleaved confirmation ran, the winner of its paired
    claims (``paired_claims``, issue 20.3: a gain only where its interval lies above 1); in studies
    stored before it, the confirmed configuration with the best pooled median.

    Candidates are the configurations that have a ``confirm`` trial; each is summarised on all its
    samples together. The interval is the range of its per-repetition rates in the objective's unit.

    ``baselines`` names the study's baseline configurations (default: the first configuration of the
    ``baseline`` trials is llama-cpp-python's defaults, a second one llama.cpp's). A baseline is a candidate like any other, so where no searched
    configuration beats it on the study's own evidence, the baseline is the recommendation: the
    result is never slower than a baseline the study measured.
    """
    target = objective(target)
    if len({r.simulated for r in records}) > 1:
        raise FleettuneError("refusing to learn from simulated and real measurements together")
    by_config: dict[str, list[TrialRecord]] = {}  # by identity: equal effective values pool (issue 20.1)
    asked: dict[str, str] = {}  # a configuration as asked for -> its identity
    for record in records:
        by_config.setdefault(record.key, []).append(record)
        asked.setdefault(config_key(record.params), record.key)
    confirmed = [rs for rs in by_config.values() if any(r.phase == "confirm" for r in rs)]
    candidates = confirmed or list(by_config.values())

    def summary(group: list[TrialRecord]) -> dict | None:
        samples = [s for r in group for s in r.samples]
        pp, tg = _rates(samples, "pp"), _rates(samples, "tg")
        pp_med = statistics.median(pp) if pp else None
        tg_med = statistics.median(tg) if tg else None
        # a combined objective: its effective rate; a served one: its own kind's
        spread = target.rate_spread_of({kind: _rates(samples, kind) for kind in target.kinds}, n_prompt, n_gen)
        return {**spread, "pp": pp_med, "tg": tg_med} if spread else None

    baseline_group = [r for r in records if r.phase == "baseline"]
    if baselines is None:
        baselines = stored_baselines(baseline_group, target.served)
    baseline_keys = {name: asked.get(config_key(params), config_key(params)) for name, params in baselines.items()}
    for key in baseline_keys.values():  # a measured baseline always competes
        if key in by_config and by_config[key] not in candidates:
            candidates = [*candidates, by_config[key]]
    claims = paired_claims(records, target, n_prompt, n_gen)
    if claims is not None:  # the interleaved rounds decide (issue 20.3), not the pooled medians
        winner = next(r for r in records if r.confirm_arm == claims["winner"])
        candidates = [by_config[winner.key]]
    scored = [(summary(group), group) for group in candidates]
    scored = [(s, g) for s, g in scored if s is not None]
    if not scored:
        return None
    best, group = max(scored, key=lambda item: item[0]["value"])
    params = group[0].params
    if claims is not None:
        params = BenchParams.from_dict(claims["params"])
        kl = [r.kl_divergence for r in group if r.kl_divergence is not None]
        if kl:
            claims["kl_divergence"] = statistics.fmean(kl)
    values = {}
    for name, key in baseline_keys.items():
        measured = summary(by_config[key]) if key in by_config else None
        if measured is not None:
            values[name] = measured["value"]
    baseline_tps = values.get(LLAMA_CPP_PYTHON)
    if claims is not None and LLAMA_CPP_PYTHON in claims["vs"]:
        ratio = claims["vs"][LLAMA_CPP_PYTHON]["ratio"]
        baseline_gain = ratio - 1 if ratio is not None else None
    else:
        baseline_gain = (best["value"] / baseline_tps - 1) if baseline_tps else None
    return RecommendationDraft(
        params=params,
        expected_tps=best["value"],
        interval_low=best["low"],
        interval_high=best["high"],
        expected_pp_tps=best["pp"],
        expected_tg_tps=best["tg"],
        baseline_tps=baseline_tps,
        improvement=baseline_gain,
        evidence=sorted(r.trial_id for r in group),
        simulated=group[0].simulated,
        baselines=values,
        claims=claims or {},
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
        key = record.key  # configurations llama.cpp ran alike are one (issue 20.1)
        if key not in seen:
            seen.add(key)
            out.append(record.params)
        if len(out) == k:
            break
    return out
