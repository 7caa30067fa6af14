"""The head's Optuna storage: the results database, with the study's trials mirrored in memory.

Optuna's RDB storage caches finished trials but reads every running one from the database on each
``ask``; a fleet keeps as many trials running as it has nodes, so the head's cost per trial grows
with the fleet (73 ms a trial at 256 nodes, see docs/benchmarks.md). Only the head writes to its
studies, so it can keep them in memory: every write goes through to the database (the dashboard and
``--resume`` see the same rows as before), every read is served from the mirror.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Container, Sequence
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage, RDBStorage
from optuna.study._frozen import FrozenStudy
from optuna.study._study_direction import StudyDirection
from optuna.trial import FrozenTrial, TrialState


class HeadStorage(BaseStorage):
    """Write-through to an ``RDBStorage``; trials read from memory (one writer per study).

    Study-level calls go straight to the database. A study's trials are loaded once, the first time
    they are asked for, and then kept current by this object's own writes.
    """

    def __init__(self, backend: RDBStorage) -> None:
        self.backend = backend
        self._lock = threading.RLock()
        self._trials: dict[int, dict[int, FrozenTrial]] = {}  # study id -> trial id -> trial
        self._study_of: dict[int, int] = {}  # trial id -> study id

    # -- studies: straight through

    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self.backend.create_new_study(directions, study_name)

    def delete_study(self, study_id: int) -> None:
        with self._lock:
            self._trials.pop(study_id, None)
        self.backend.delete_study(study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self.backend.set_study_user_attr(study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self.backend.set_study_system_attr(study_id, key, value)

    def get_study_id_from_name(self, study_name: str) -> int:
        return self.backend.get_study_id_from_name(study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self.backend.get_study_name_from_id(study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self.backend.get_study_directions(study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self.backend.get_study_user_attrs(study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self.backend.get_study_system_attrs(study_id)

    def get_all_studies(self) -> list[FrozenStudy]:
        return self.backend.get_all_studies()

    # -- trials: write through, read from memory

    def _study_trials(self, study_id: int) -> dict[int, FrozenTrial]:
        with self._lock:
            if study_id not in self._trials:
                loaded = self.backend.get_all_trials(study_id, deepcopy=False)
                self._trials[study_id] = {t._trial_id: t for t in loaded}
                self._study_of.update({t._trial_id: study_id for t in loaded})
            return self._trials[study_id]

    def _refresh(self, trial_id: int) -> None:
        trial = self.backend.get_trial(trial_id)
        with self._lock:
            study_id = self._study_of[trial_id]
            self._trials[study_id][trial_id] = trial

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        trials = self._study_trials(study_id)
        trial_id = self.backend.create_new_trial(study_id, template_trial)
        with self._lock:
            self._study_of[trial_id] = study_id
            trials[trial_id] = self.backend.get_trial(trial_id)
        return trial_id

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        self.backend.set_trial_param(trial_id, param_name, param_value_internal, distribution)
        with self._lock:
            if trial_id in self._study_of:
                trial = self._cached(trial_id)
                trial.params[param_name] = distribution.to_external_repr(param_value_internal)
                trial.distributions[param_name] = distribution

    def set_trial_state_values(self, trial_id: int, state: TrialState,
                               values: Sequence[float] | None = None) -> bool:
        changed = self.backend.set_trial_state_values(trial_id, state, values)
        if trial_id in self._study_of:
            self._refresh(trial_id)  # state, values and timestamps as the database has them
        return changed

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self.backend.set_trial_intermediate_value(trial_id, step, intermediate_value)
        with self._lock:
            if trial_id in self._study_of:
                self._cached(trial_id).intermediate_values[step] = intermediate_value

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.backend.set_trial_user_attr(trial_id, key, value)
        with self._lock:
            if trial_id in self._study_of:
                self._cached(trial_id).user_attrs[key] = value

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.backend.set_trial_system_attr(trial_id, key, value)
        with self._lock:
            if trial_id in self._study_of:
                self._cached(trial_id).system_attrs[key] = value

    def _cached(self, trial_id: int) -> FrozenTrial:
        """The mirrored trial; a trial of a study this object never loaded is a KeyError."""
        return self._trials[self._study_of[trial_id]][trial_id]

    def get_trial(self, trial_id: int) -> FrozenTrial:
        with self._lock:
            if trial_id in self._study_of:
                return copy.deepcopy(self._cached(trial_id))
        return self.backend.get_trial(trial_id)

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        with self._lock:
            for trial_id, trial in self._study_trials(study_id).items():
                if trial.number == trial_number:
                    return trial_id
        return self.backend.get_trial_id_from_study_id_trial_number(study_id, trial_number)

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        with self._lock:
            trials = sorted(self._study_trials(study_id).values(), key=lambda t: t.number)
            if states is not None:
                trials = [t for t in trials if t.state in states]
            return copy.deepcopy(trials) if deepcopy else list(trials)

    def remove_session(self) -> None:
        self.backend.remove_session()
