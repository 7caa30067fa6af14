"""What a study optimises: one type per objective, with its direction and unit.

Modelled on Optuna's ``StudyDirection`` (an enum, not strings): every place that ranks results,
turns samples into a value, or compares a measurement with an expectation asks the objective,
instead of comparing ``"e2e"`` by hand.

Two figures exist per objective:

- ``value``: what Optuna optimises, in ``unit`` (tok/s for tg and pp, seconds for e2e);
- ``rate``: tokens per second, always higher-is-better, which is what recommendations report and
  what rollouts verify (e2e as an effective rate: prompt plus generated tokens over the seconds).
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from workers.errors import BadInput


class Direction(enum.Enum):
    """Whether a larger or a smaller value is better (Optuna's direction names)."""

    MAXIMIZE = "maximize"
    MINIMIZE = "minimize"


def e2e_seconds(pp_tps: float | None, tg_tps: float | None, n_prompt: int, n_gen: int) -> float | None:
    """Time to process an ``n_prompt`` prompt and generate ``n_gen`` tokens at the given rates."""
    total = 0.0
    for tokens, rate in ((n_prompt, pp_tps), (n_gen, tg_tps)):
        if tokens:
            if not rate or not math.isfinite(rate) or rate <= 0:
                return None
            total += tokens / rate
    return total


@dataclass(frozen=True)
class Objective:
    """One objective: ``name`` as the CLI and the database spell it, and what it is made of.

    ``kinds``: the measured rates it combines, llama-bench's tests ("pp": prompt processing, "tg":
    generation). One kind: its value is that rate (tok/s, higher is better). Several: its value is
    the seconds one request of the workload takes at those rates (lower is better). Every question
    about an objective is answered from these fields, never by comparing its name (rule 21.3).
    """

    name: str
    direction: Direction
    unit: str
    description: str
    kinds: tuple[str, ...]
    rate_unit: str = "tok/s"  # the unit of ``rate``, as reports print it
    workload_hint: str = ""  # what a workload must hold for it to measure anything

    def __str__(self) -> str:
        return self.name

    @property
    def maximize(self) -> bool:
        return self.direction is Direction.MAXIMIZE

    @property
    def needs_prompt(self) -> bool:
        """Whether the prompt's processing is part of the objective (a prompt must be measured)."""
        return "pp" in self.kinds

    @property
    def needs_generation(self) -> bool:
        """Whether generation is part of the objective (generated tokens must be measured)."""
        return "tg" in self.kinds

    @property
    def main_kind(self) -> str:
        """The rate whose spread a trial's listing shows (the first the objective combines)."""
        return self.kinds[0]

    @property
    def served(self) -> bool:
        """Whether it is judged on a real server under load (issue 22), not on one llama-bench stream."""
        return all(kind in SERVED_KINDS for kind in self.kinds)

    def _tokens(self, n_prompt: int, n_gen: int) -> tuple[int, int]:
        return (n_prompt if self.needs_prompt else 0), (n_gen if self.needs_generation else 0)

    def value_of(self, rates: Mapping[str, float | None], n_prompt: int = 0, n_gen: int = 0) -> float | None:
        """The optimised value of a measurement given the median rate of each kind it combines
        (``{"pp": ..., "tg": ...}``, or a served kind); None when not measurable."""
        if len(self.kinds) == 1:
            return rates.get(self.kinds[0])
        return e2e_seconds(rates.get("pp"), rates.get("tg"), *self._tokens(n_prompt, n_gen))

    def value(self, pp_tps: float | None, tg_tps: float | None, n_prompt: int, n_gen: int) -> float | None:
        """The optimised value of a measurement (median pp and tg rates); None when not measurable."""
        return self.value_of({"pp": pp_tps, "tg": tg_tps}, n_prompt, n_gen)

    def rate_of(self, rates: Mapping[str, float | None], n_prompt: int = 0, n_gen: int = 0) -> float | None:
        """The same measurement as a higher-is-better rate in ``rate_unit``: a combined objective
        as its tokens over its seconds."""
        value = self.value_of(rates, n_prompt, n_gen)
        if len(self.kinds) == 1:
            return value
        return sum(self._tokens(n_prompt, n_gen)) / value if value else None

    def rate(self, pp_tps: float | None, tg_tps: float | None, n_prompt: int, n_gen: int) -> float | None:
        """``rate_of`` for llama-bench's two kinds."""
        return self.rate_of({"pp": pp_tps, "tg": tg_tps}, n_prompt, n_gen)

    def rate_spread_of(self, per_kind: Mapping[str, list[float]], n_prompt: int = 0,
                       n_gen: int = 0) -> dict | None:
        """``rate`` of the medians of per-sample rates, with the lowest and highest it takes over
        the samples (``{"value", "low", "high"}``); None when nothing it needs was measured."""
        if len(self.kinds) == 1:
            rates = per_kind.get(self.kinds[0]) or []
            if not rates:
                return None
            return {"value": statistics.median(rates), "low": min(rates), "high": max(rates)}
        pp, tg = per_kind.get("pp") or [], per_kind.get("tg") or []
        value = self.rate(statistics.median(pp) if pp else None, statistics.median(tg) if tg else None,
                          n_prompt, n_gen)
        if not value:
            return None
        ends = [self.rate(min(pp) if pp else None, min(tg) if tg else None, n_prompt, n_gen),
                self.rate(max(pp) if pp else None, max(tg) if tg else None, n_prompt, n_gen)]
        ends = [e for e in ends if e]
        return {"value": value, "low": min(ends), "high": max(ends)}

    def rate_spread(self, pp: list[float], tg: list[float], n_prompt: int, n_gen: int) -> dict | None:
        """``rate_spread_of`` for llama-bench's two kinds."""
        return self.rate_spread_of({"pp": pp, "tg": tg}, n_prompt, n_gen)

    def better(self, a: float, b: float) -> bool:
        """Whether value ``a`` is strictly better than value ``b``."""
        return a > b if self.maximize else a < b

    def best_first(self, value: float) -> float:
        """A sort key that orders values best first."""
        return -value if self.maximize else value

    def check_workload(self, n_prompt: int, n_gen: int) -> None:
        """Refuse a workload in which this objective measures nothing."""
        if self.served:
            if n_prompt < 1 or n_gen < 2:
                raise BadInput(f"objective {self.name} needs {self.workload_hint}")
            return
        if sum(self._tokens(n_prompt, n_gen)) < 1:
            raise BadInput(f"objective {self.name} needs {self.workload_hint}")


TG = Objective("tg", Direction.MAXIMIZE, "tok/s", "generation speed (tokens per second)", ("tg",),
               workload_hint="--gen-tokens >= 1")
PP = Objective("pp", Direction.MAXIMIZE, "tok/s", "prompt processing speed (tokens per second)", ("pp",),
               workload_hint="--prompt-tokens >= 1")
E2E = Objective("e2e", Direction.MINIMIZE, "s", "seconds for one request: the prompt plus the generated tokens",
                ("pp", "tg"), rate_unit="tok/s (prompt+gen tokens / e2e seconds)",
                workload_hint="prompt or generated tokens")
# served kinds (issue 22.2): one sample per measured window of a served trial (workers/served.py)
GOOD, THRU, CAP = "good", "thru", "cap"  # good requests / generated tokens / users, per window
SERVED_KINDS = (GOOD, THRU, CAP)
_SERVED_HINT = "--prompt-tokens >= 1 and --gen-tokens >= 2 (the requests' lengths)"
GOODPUT = Objective("goodput", Direction.MAXIMIZE, "req/s",
                    "requests per second that meet every SLO limit, at a fixed load", (GOOD,), rate_unit="req/s",
                    workload_hint=_SERVED_HINT)
CAPACITY = Objective("capacity", Direction.MAXIMIZE, "users", "the most concurrent users served within the SLO",
                     (CAP,), rate_unit="users", workload_hint=_SERVED_HINT)
THROUGHPUT = Objective("throughput", Direction.MAXIMIZE, "tok/s",
                       "generated tokens per second of all users together, at a fixed load", (THRU,),
                       workload_hint=_SERVED_HINT)
OBJECTIVES: dict[str, Objective] = {o.name: o for o in (TG, PP, E2E, GOODPUT, CAPACITY, THROUGHPUT)}
OBJECTIVE_NAMES = tuple(OBJECTIVES)


def objective(name: str | Objective) -> Objective:
    """The objective called ``name``; one clear error for an unknown one."""
    if isinstance(name, Objective):
        return name
    try:
        return OBJECTIVES[name]
    except (KeyError, TypeError):
        raise BadInput(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVE_NAMES)}") from None
