"""``fleettune verify``: a study's claims refereed by llama.cpp's own llama-bench (issue 20 item 7).

The study's recommendation and its baselines (llama-cpp-python's defaults, llama.cpp's defaults,
and under a GPU budget llama.cpp's --fit placement, as the study measured them) are measured again by llama-bench on this machine, in interleaved
rounds whose order rotates (A B C, B C A, C A B, ...) so that time and position touch each alike,
``-r`` repetitions each, at the study's workload (``-p/-n/-d``). Each round gives one rate per
configuration in the study's objective; the ratio of the recommendation over each baseline comes
with its interval from ``orchestrator.pairedstats`` and is printed beside the ratio the study
claimed. The measuring is the worker's (``workers.llamatools.measure_with_llama_bench``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from orchestrator import learn
from orchestrator.db import Database, repo
from orchestrator.pairedstats import RatioInterval, ratio_interval
from workers import llamatools
from workers.errors import BadInput
from workers.objective import Objective, objective
from workers.trial import BenchParams, Workload

RECOMMENDATION = "recommendation"
DEFAULT_ROUNDS = 5

T = TypeVar("T")


@dataclass(frozen=True)
class VerifyPlan:
    """What to measure: a study's three configurations at its workload, and what it claimed."""

    study: str
    chip_key: str
    model_path: str
    objective: Objective
    workload: Workload
    configs: dict[str, BenchParams]  # recommendation first, then the baselines in the study's order
    claims: dict[str, dict]  # baseline name -> the study's claim: {"ratio", "low", "high"} (recommendation over it)
    simulated: bool = False


@dataclass
class VerifyReport:
    plan: VerifyPlan
    binary: str
    build: dict
    orders: list[list[str]] = field(default_factory=list)
    rates: dict[str, list[float | None]] = field(default_factory=dict)  # per configuration, per round

    def ratio(self, baseline: str) -> RatioInterval:
        rec = self.rates[RECOMMENDATION]
        return ratio_interval([x if x is not None else float("nan") for x in rec],
                              [x if x is not None else float("nan") for x in self.rates[baseline]])

    def rows(self) -> list[dict]:
        """One row per configuration: its flags, its median rate, and (baselines) the ratios."""
        out = []
        for name, params in self.plan.configs.items():
            measured = [x for x in self.rates.get(name, []) if x is not None]
            row = {"config": name, "llama_bench_flags": _flags_shown(params, self.plan.workload),
                   "median_tps": statistics.median(measured) if measured else None, "rounds": len(measured)}
            if name != RECOMMENDATION:
                interval = self.ratio(name)
                claim = self.plan.claims.get(name) or {}
                claimed, low, high = claim.get("ratio"), claim.get("low"), claim.get("high")
                row.update({
                    "claimed_ratio": claimed,
                    "claimed_low": low,
                    "claimed_high": high,
                    "claimed": claim.get("text") or (f"{(claimed - 1) * 100:+.1f} %" if claimed else None),
                    "measured_ratio": interval.ratio,
                    "low": interval.low,
                    "high": interval.high,
                    "verdict": interval.verdict.value,
                    "measured": interval.describe(),
                    # rule 20.7: the referee's ratio must lie inside the interval the study claimed
                    "inside_claim": low <= interval.ratio <= high if low is not None and high is not None
                    and interval.rounds >= 1 and math.isfinite(interval.ratio) else None,
                    "claim_inside": interval.contains(claimed) if claimed is not None and interval.rounds >= 2
                    else None,
                })
            out.append(row)
        return out


def _flags_shown(params: BenchParams, workload: Workload) -> str:
    """The llama-bench flags of a configuration as verify runs it: where the prompt threads differ
    from the generation threads, the pp run's ``-t`` is the prompt threads (llama-bench has no -tb)."""
    runs = llamatools.bench_runs("llama-bench", "MODEL", params, workload)
    flags = [" ".join(argv[argv.index("-d") + 2:argv.index("-o")]) for argv in runs]
    return flags[0] if len(flags) == 1 else f"pp: {flags[0]}; tg: {flags[1]}"


def rotation(names: list[T], rounds: int) -> list[list[T]]:
    """Round ``i`` starts at the ``i``-th name: A B C, B C A, C A B, A B C, ..."""
    k = len(names)
    return [[names[(i + j) % k] for j in range(k)] for i in range(rounds)]


def plan(db: Database, study_name: str, reps: int | None = None) -> VerifyPlan:
    """The study's recommendation and baselines, its workload and its claims; BadInput when the
    study is unknown or has no recommendation."""
    with db.session() as s:
        study = repo.get_study(s, study_name)
        if study is None:
            raise BadInput(f"unknown study {study_name!r}")
        rec = repo.study_recommendation(s, study.id)  # its own, whatever later studies recommended since
        if rec is None:
            raise BadInput(f"study {study_name!r} has no recommendation (not finished?)")
        baselines = learn.stored_baselines(repo.study_trials(s, study.id, phase="baseline"), bool(study.served))
        if rec.baselines:  # a baseline the study could not measure (over its GPU budget) is not refereed
            baselines = {name: params for name, params in baselines.items() if name in rec.baselines}
        claims = _claims(rec)
        if not study.model.path:
            raise BadInput(f"study {study_name!r}'s model has no file path on record")
        return VerifyPlan(
            study=study.name, chip_key=study.chip.key, model_path=study.model.path,
            objective=objective(study.objective),
            workload=Workload(n_prompt=study.n_prompt, n_gen=study.n_gen, reps=reps or study.reps,
                              depth=study.depth or 0),
            configs={RECOMMENDATION: BenchParams.from_dict(rec.params), **baselines},
            claims=claims, simulated=study.simulated,
        )


def verify_study(db: Database, study_name: str, *, rounds: int = DEFAULT_ROUNDS, reps: int | None = None,
                 on_round: Callable[[int, dict[str, float | None]], None] | None = None) -> VerifyReport:
    """Re-measure the study's recommendation and baselines with llama-bench, interleaved."""
    from workers.hardware import fingerprint_live
    from workers.llamacompat import extra_buffers_usable

    if rounds < 2:
        raise BadInput(f"--rounds {rounds}: an interval needs at least 2 rounds")
    binary = llamatools.find_tool("llama-bench")
    if binary is None:
        raise BadInput("llama-bench not found (FLEETTUNE_LLAMA_BENCH, fleettune's build, PATH): "
                       "run `fleettune tools build` (Linux) or `brew install llama.cpp` (macOS)")
    todo = plan(db, study_name, reps)
    if todo.simulated:
        raise BadInput(f"study {study_name!r} is simulated: llama-bench referees real measurements only")
    here = fingerprint_live().chip_key
    if here != todo.chip_key:
        raise BadInput(f"study {todo.study!r} measured chip {todo.chip_key}; this machine is {here}: "
                       "run verify on a node of that chip")
    repack = extra_buffers_usable(todo.model_path)  # llama-bench's --repack: the buffers fleettune used
    report = VerifyReport(todo, binary, llamatools.identity(binary))
    report.rates = {name: [] for name in todo.configs}
    w = todo.workload
    for number, order in enumerate(rotation(list(todo.configs), rounds), start=1):
        report.orders.append(order)
        measured: dict[str, float | None] = {}
        for name in order:
            figures = llamatools.measure_with_llama_bench(binary, todo.model_path, todo.configs[name], w, repack)
            measured[name] = todo.objective.rate(figures.pp_tps, figures.tg_tps, w.n_prompt, w.n_gen)
        for name in todo.configs:
            report.rates[name].append(measured[name])
        if on_round:
            on_round(number, measured)
    return report


def _claims(rec) -> dict[str, dict]:
    """The study's claim over each baseline: the paired rounds' ratio with its interval (issue 20.3);
    a recommendation stored before claims had intervals gives its point ratio alone."""
    claims = rec.claims or {}
    paired = dict(claims.get("vs") or {})
    reference = claims.get("reference", learn.LLAMA_CPP)  # llama.cpp's defaults, or its --fit (issue 23.3)
    if reference not in paired and claims.get("winner") == reference and claims.get("noise"):
        paired[reference] = same_configuration_claim(claims["noise"])  # the reference recommended
    out = {name: {k: paired[name].get(k) for k in ("ratio", "low", "high", "text")} for name in paired}
    for name, value in (rec.baselines or {}).items():
        if name not in out and value:
            out[name] = {"ratio": rec.expected_tps / value, "low": None, "high": None, "text": None}
    return out


def same_configuration_claim(noise: dict) -> dict:
    """The claim over the reference where the study recommended the reference itself: a
    configuration over itself is 1 exactly; its interval is the A/A arm's (the reference measured
    twice a round), centred on 1: the spread a referee of one configuration sees on that machine.
    The A/A arm's own ratio is noise (issue 20: on the H200's CPU one left out 1 at -6.7 %)."""
    ratio, low, high = noise.get("ratio"), noise.get("low"), noise.get("high")
    if not ratio or low is None or high is None:
        return {"ratio": 1.0, "low": None, "high": None, "text": "the same configuration"}
    low, high = low / ratio, high / ratio
    rounds = f", {noise['rounds']} rounds" if noise.get("rounds") else ""
    return {"ratio": 1.0, "low": low, "high": high,
            "text": f"the same configuration ({(low - 1) * 100:+.1f} % … {(high - 1) * 100:+.1f} %, the A/A arm's "
                    f"width{rounds})"}
