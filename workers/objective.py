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
    """One objective: ``name`` as the CLI and the database spell it."""

    name: str
    direction: Direction
    unit: str
    description: str

    def __str__(self) -> str:
        return self.name

    @property
    def maximize(self) -> bool:
        return self.direction is Direction.MAXIMIZE

    def value(self, pp_tps: float | None, tg_tps: float | None, n_prompt: int, n_gen: int) -> float | None:
        """The optimised value of a measurement (median pp and tg rates); None when not measurable."""
        if self.name == "tg":
            return tg_tps
        if self.name == "pp":
            return pp_tps
        return e2e_seconds(pp_tps, tg_tps, n_prompt, n_gen)

    def rate(self, pp_tps: float | None, tg_tps: float | None, n_prompt: int, n_gen: int) -> float | None:
        """The same measurement as tokens per second (higher is better, whatever the direction)."""
        if self.name == "e2e":
            seconds = e2e_seconds(pp_tps, tg_tps, n_prompt, n_gen)
            return (n_prompt + n_gen) / seconds if seconds else None
        return self.value(pp_tps, tg_tps, n_prompt, n_gen)

    def better(self, a: float, b: float) -> bool:
        """Whether value ``a`` is strictly better than value ``b``."""
        return a > b if self.maximize else a < b

    def best_first(self, value: float) -> float:
        """A sort key that orders values best first."""
        return -value if self.maximize else value

    def check_workload(self, n_prompt: int, n_gen: int) -> None:
        """Refuse a workload in which this objective measures nothing."""
        if self.name == "tg" and n_gen < 1:
            raise BadInput("objective tg needs --gen-tokens >= 1")
        if self.name == "pp" and n_prompt < 1:
            raise BadInput("objective pp needs --prompt-tokens >= 1")
        if self.name == "e2e" and n_prompt + n_gen < 1:
            raise BadInput("objective e2e needs prompt or generated tokens")


TG = Objective("tg", Direction.MAXIMIZE, "tok/s", "generation speed (tokens per second)")
PP = Objective("pp", Direction.MAXIMIZE, "tok/s", "prompt processing speed (tokens per second)")
E2E = Objective("e2e", Direction.MINIMIZE, "s",
                "seconds for one request: the prompt plus the generated tokens")
OBJECTIVES: dict[str, Objective] = {o.name: o for o in (TG, PP, E2E)}
OBJECTIVE_NAMES = tuple(OBJECTIVES)


def objective(name: str | Objective) -> Objective:
    """The objective called ``name``; one clear error for an unknown one."""
    if isinstance(name, Objective):
        return name
    try:
        return OBJECTIVES[name]
    except (KeyError, TypeError):
        raise BadInput(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVE_NAMES)}") from None
