"""The invariants a study's records must keep, whatever happened to its driver, nodes or database.

Checked by the fault-injection tests and ``bench/faults.py`` after every fault, and usable on any
results database:

- no Optuna trial number stored twice; nothing left RUNNING in either table (once the study is
  not running);
- Optuna's trial states equal fleettune's, trial by trial (a complete row is a COMPLETE trial
  with the same value; a failed row a FAIL one, or a COMPLETE one told a penalised value; an
  Optuna trial without a row was asked ahead and never dispatched, and must be FAIL, or is queued
  and still WAITING, or was a failed configuration proposed again and told its penalty);
- every sample belongs to a complete trial;
- search trials complete == budget for a complete study (never more: nothing counted twice);
- one recommendation version per real change (a study that ran once has at most one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import optuna
from optuna.trial import TrialState

from orchestrator.db import Database, repo
from orchestrator.studies import PENALISED


@dataclass
class StudyAudit:
    """What was found in one study: counts, and each broken invariant as a sentence."""

    name: str
    state: str
    budget: int
    complete: int = 0
    failed: int = 0
    running: int = 0
    recommendation_versions: int = 0
    lost: int = 0  # results Optuna knows that fleettune's tables do not (or the other way)
    duplicated: int = 0  # results stored more than once, or beyond the budget
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def audit_study(db: Database, name: str, *, max_versions: int | None = 1) -> StudyAudit:
    """Check one study's invariants; ``max_versions``: how many recommendation versions the
    study's history can justify (None: do not check)."""
    with db.session() as s:
        study = repo.get_study(s, name)
        if study is None:
            raise LookupError(f"no study {name!r}")
        report = StudyAudit(name, study.state, study.budget)
        rows = repo.study_trials(s, study.id)
        orphan_samples = repo.samples_of_unfinished_trials(s, study.id)
        report.recommendation_versions = repo.recommendation_versions(s, study.id)
    search = [r for r in rows if r.phase == "search"]
    report.complete = sum(r.state == "complete" for r in search)
    report.failed = sum(r.state == "failed" for r in search)
    report.running = sum(r.state == "running" for r in rows)
    problems = report.problems

    numbers = [r.optuna_number for r in search if r.optuna_number is not None]
    twice = len(numbers) - len(set(numbers))
    if twice:
        report.duplicated += twice
        problems.append(f"{twice} Optuna trial numbers stored twice")
    if study.state != "running" and report.running:
        problems.append(f"{report.running} trials left running in a {study.state} study")
    if orphan_samples:
        report.lost += orphan_samples
        problems.append(f"{orphan_samples} samples belong to trials that are not complete")
    if study.state == "complete" and report.complete != study.budget:
        if report.complete > study.budget:
            report.duplicated += report.complete - study.budget
        problems.append(f"{report.complete} search trials complete for a budget of {study.budget}")
    if max_versions is not None and report.recommendation_versions > max_versions:
        problems.append(f"{report.recommendation_versions} recommendation versions (at most "
                        f"{max_versions} expected)")

    trials = optuna.load_study(study_name=name, storage=db.url_string).get_trials(deepcopy=False)
    by_number = {t.number: t for t in trials}
    for row in search:
        trial = by_number.get(row.optuna_number)
        if trial is None:
            report.lost += 1
            problems.append(f"trial row {row.id} has no Optuna trial {row.optuna_number}")
            continue
        expected = {"complete": TrialState.COMPLETE, "failed": TrialState.FAIL,
                    "running": TrialState.RUNNING}[row.state]
        if row.state == "failed" and PENALISED in trial.user_attrs:  # told a penalised value (issue 20.6)
            expected = TrialState.COMPLETE
        if trial.state != expected:
            report.lost += 1
            problems.append(f"trial {row.optuna_number}: {row.state} in fleettune, {trial.state.name} in Optuna")
        elif row.state == "complete" and not math.isclose(trial.value, row.objective_value, rel_tol=1e-9):
            problems.append(f"trial {row.optuna_number}: value {row.objective_value} vs Optuna {trial.value}")
    stored = set(numbers)
    for trial in trials:
        if trial.number in stored:
            continue
        if trial.state == TrialState.COMPLETE and PENALISED in trial.user_attrs:
            continue  # a configuration that failed before, proposed again: told its penalty, never run
        if trial.state not in (TrialState.FAIL, TrialState.WAITING):  # asked ahead and failed, or queued
            report.lost += 1
            problems.append(f"Optuna trial {trial.number} is {trial.state.name} with no fleettune row")
    if study.state != "running":
        still = [t.number for t in trials if t.state == TrialState.RUNNING]
        if still:
            problems.append(f"Optuna trials left RUNNING: {still[:5]}")
    return report
