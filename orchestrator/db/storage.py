"""The head's Optuna storage: trials in memory, written to the results database in batches.

Optuna's RDB storage commits every call (a trial costs its creation, one commit per parameter,
one for its state and value) and re-reads the running trials on each ``ask``: 16 ms of the head's
time a trial on SQLite, which is what held a 256-node fleet of 1 s trials at 22 % busy
(docs/benchmarks.md). Only the head writes to its studies, so it keeps them in Optuna's own
``InMemoryStorage`` and writes what changed when the study loop says so (``flush``), in the same
transaction as the loop's own trial rows: one transaction per scheduling round, whatever the
number of trials in it, and the Optuna tables never disagree with fleettune's.

What lands in the database is what ``RDBStorage`` would have written (same tables, numbers, states,
values, parameters and attributes), so ``optuna.load_study``, optuna-dashboard and
``tune --resume`` read it as before; the rows are written with Optuna's table definitions and
value encodings, and tests/test_storage.py compares them with RDBStorage's own.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Container, Sequence
from datetime import datetime
from typing import Any

from optuna.distributions import BaseDistribution, distribution_to_json
from optuna.storages import BaseStorage, InMemoryStorage, RDBStorage
from optuna.storages._rdb import models
from optuna.study._frozen import FrozenStudy
from optuna.study._study_direction import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import bindparam, delete, event, insert, update
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

TRIALS = models.TrialModel.__table__
PARAMS = models.TrialParamModel.__table__
VALUES = models.TrialValueModel.__table__
INTERMEDIATE = models.TrialIntermediateValueModel.__table__
USER_ATTRS = models.TrialUserAttributeModel.__table__
SYSTEM_ATTRS = models.TrialSystemAttributeModel.__table__
CHILD_TABLES = (PARAMS, VALUES, INTERMEDIATE, USER_ATTRS, SYSTEM_ATTRS)
# Optuna's private table models this storage writes through (tests/test_optuna_private.py checks
# them against the installed Optuna; pyproject pins the versions they hold on): the columns written
# per table, and the encoders called. FrozenTrial._trial_id is read too.
COLUMNS_WRITTEN = {
    TRIALS: ("trial_id", "number", "study_id", "state", "datetime_start", "datetime_complete"),
    PARAMS: ("trial_id", "param_name", "param_value", "distribution_json"),
    VALUES: ("trial_id", "objective", "value", "value_type"),
    INTERMEDIATE: ("trial_id", "step", "intermediate_value", "intermediate_value_type"),
    USER_ATTRS: ("trial_id", "key", "value_json"),
    SYSTEM_ATTRS: ("trial_id", "key", "value_json"),
}
ENCODERS = (("TrialValueModel", "value_to_stored_repr"),
            ("TrialIntermediateValueModel", "intermediate_value_to_stored_repr"))
# the mapped attribute behind the datetime_start column: Optuna 5 stores UTC through a property
_START_KEY = sa_inspect(models.TrialModel).get_property_by_column(TRIALS.c.datetime_start).key


def require_optuna_tables(engine, display_url: str) -> None:
    """BadInput unless Optuna's tables are in the database (optuna-dashboard reads them; issue 24)."""
    from sqlalchemy import inspect

    from workers.errors import BadInput

    tables = set(inspect(engine).get_table_names())
    missing = sorted({models.StudyModel.__tablename__, models.VersionInfoModel.__tablename__, TRIALS.name} - tables)
    if missing:
        raise BadInput(f"database {display_url} has no Optuna studies (no table {', '.join(missing)}): "
                       "run `fleettune tune` first")


def _stored_datetime(value: datetime | None) -> datetime | None:
    """A trial datetime as Optuna's own model would store it (naive local or naive UTC)."""
    if value is None:
        return None
    model = models.TrialModel()
    model.datetime_start = value
    return getattr(model, _START_KEY)


class HeadStorage(BaseStorage):
    """Optuna's in-memory storage for the head's studies, persisted to an ``RDBStorage``'s tables.

    Study-level calls go straight to the database. A study's trials are loaded from it the first
    time they are needed; after that every trial write changes memory and marks the trial dirty,
    and ``flush`` writes the dirty trials. Trial numbers are Optuna's (0, 1, 2, ... in creation
    order) and every created trial is written by the next flush, so they are the same in memory
    and in the database.
    """

    def __init__(self, backend: RDBStorage) -> None:
        self.backend = backend
        self.memory = InMemoryStorage()
        self._lock = threading.RLock()
        self._mem_study: dict[int, int] = {}  # database study id -> in-memory study id
        self._db_study_of: dict[int, int] = {}  # in-memory trial id -> database study id
        self._db_trial: dict[int, int] = {}  # in-memory trial id -> database trial id (once written)
        self._dirty: dict[int, set] = {}  # in-memory trial id -> the tables its changes touch

    # -- studies: straight through

    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self.backend.create_new_study(directions, study_name)

    def delete_study(self, study_id: int) -> None:
        with self._lock:
            self._mem_study.pop(study_id, None)
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

    # -- trials: in memory

    def _memory_study(self, study_id: int) -> int:
        """The in-memory copy of a database study, loaded on first use."""
        with self._lock:
            if study_id in self._mem_study:
                return self._mem_study[study_id]
            name = self.backend.get_study_name_from_id(study_id)
            mem_id = self.memory.create_new_study(self.backend.get_study_directions(study_id), name)
            stored = sorted(self.backend.get_all_trials(study_id, deepcopy=False), key=lambda t: t.number)
            for trial in stored:
                trial_id = self.memory.create_new_trial(mem_id, template_trial=trial)
                if self.memory.get_trial_number_from_id(trial_id) != trial.number:
                    raise RuntimeError(f"study {name!r}: trial numbers in the database have gaps")
                self._db_trial[trial_id] = trial._trial_id
                self._db_study_of[trial_id] = study_id
            self._mem_study[study_id] = mem_id
            return mem_id

    def _changed(self, trial_id: int, *tables) -> None:
        """Mark what a trial write changed: its row, and the child tables named (a new trial is
        written whole whatever is marked)."""
        self._dirty.setdefault(trial_id, set()).update(tables)

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        with self._lock:
            trial_id = self.memory.create_new_trial(self._memory_study(study_id), template_trial)
            self._db_study_of[trial_id] = study_id
            self._changed(trial_id, TRIALS, *CHILD_TABLES)
            return trial_id

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        with self._lock:
            self.memory.set_trial_param(trial_id, param_name, param_value_internal, distribution)
            self._changed(trial_id, PARAMS)

    def set_trial_state_values(self, trial_id: int, state: TrialState,
                               values: Sequence[float] | None = None) -> bool:
        with self._lock:
            changed = self.memory.set_trial_state_values(trial_id, state, values)
            if changed:
                self._changed(trial_id, TRIALS, VALUES)
            return changed

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        with self._lock:
            self.memory.set_trial_intermediate_value(trial_id, step, intermediate_value)
            self._changed(trial_id, INTERMEDIATE)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        with self._lock:
            self.memory.set_trial_user_attr(trial_id, key, value)
            self._changed(trial_id, USER_ATTRS)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        with self._lock:
            self.memory.set_trial_system_attr(trial_id, key, value)
            self._changed(trial_id, SYSTEM_ATTRS)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self.memory.get_trial(trial_id)

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self.memory.get_trial_id_from_study_id_trial_number(self._memory_study(study_id), trial_number)

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self.memory.get_all_trials(self._memory_study(study_id), deepcopy, states)

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self.memory.get_best_trial(self._memory_study(study_id))

    # -- writing to the database

    def pending(self) -> int:
        """How many trials have changes not yet written."""
        return len(self._dirty)

    def flush(self, session: Session | None = None) -> int:
        """Write every changed trial, in ``session``'s transaction if given, else in a new one.

        Returns the number of trials written. The trials count as written once that transaction
        commits; if it rolls back they stay changed and the next flush writes them again.
        """
        with self._lock:
            dirty = {trial_id: set(tables) for trial_id, tables in self._dirty.items()}
            trials = sorted((self.memory.get_trial(i) for i in dirty), key=lambda t: t.number)
            if not trials:
                return 0
            if session is None:
                with self.backend.engine.begin() as own:
                    written = self._write(own, trials, dirty)
                self._written(written, dirty)
            else:
                written = self._write(session.connection(), trials, dirty)
                event.listen(session, "after_commit", lambda _: self._written(written, dirty), once=True)
            return len(trials)

    def _written(self, db_ids: dict[int, int], dirty: dict[int, set]) -> None:
        with self._lock:
            self._db_trial.update(db_ids)
            for trial_id, tables in dirty.items():
                left = self._dirty.get(trial_id, set()) - tables  # changed again since: kept
                if left:
                    self._dirty[trial_id] = left
                else:
                    self._dirty.pop(trial_id, None)

    def _write(self, conn: Connection, trials: list[FrozenTrial], dirty: dict[int, set]) -> dict[int, int]:
        """Insert new trials whole; of known ones, update the row and replace the child rows of the
        tables their changes touched (a finished trial: its row and its values, not its parameters)."""
        new = [t for t in trials if t._trial_id not in self._db_trial]
        known = [t for t in trials if t._trial_id in self._db_trial]
        ids = {t._trial_id: self._db_trial[t._trial_id] for t in known}
        touched = {t._trial_id: CHILD_TABLES for t in new} | {t._trial_id: dirty[t._trial_id] for t in known}
        if new:
            rows = [{"number": t.number, "study_id": self._db_study_of[t._trial_id], **self._trial_row(t)}
                    for t in new]
            inserted = conn.execute(
                insert(TRIALS).returning(TRIALS.c.trial_id, sort_by_parameter_order=True), rows
            ).scalars().all()
            ids.update(zip([t._trial_id for t in new], inserted, strict=True))
        rows = [{"db_trial_id": ids[t._trial_id], **self._trial_row(t)} for t in known if TRIALS in dirty[t._trial_id]]
        if rows:
            conn.execute(update(TRIALS).where(TRIALS.c.trial_id == bindparam("db_trial_id")), rows)
        for table in CHILD_TABLES:
            replaced = [ids[t._trial_id] for t in known if table in dirty[t._trial_id]]
            if replaced:
                conn.execute(delete(table).where(table.c.trial_id.in_(replaced)))
        children: dict = {table: [] for table in CHILD_TABLES}
        for t in trials:
            db_id, tables = ids[t._trial_id], touched[t._trial_id]
            if PARAMS in tables:
                children[PARAMS] += [
                    {"trial_id": db_id, "param_name": name,
                     "param_value": t.distributions[name].to_internal_repr(value),
                     "distribution_json": distribution_to_json(t.distributions[name])}
                    for name, value in t.params.items()
                ]
            if VALUES in tables:
                for objective, value in enumerate(t.values or ()):
                    stored, kind = models.TrialValueModel.value_to_stored_repr(value)
                    children[VALUES].append({"trial_id": db_id, "objective": objective, "value": stored,
                                             "value_type": kind})
            if INTERMEDIATE in tables:
                for step, value in t.intermediate_values.items():
                    stored, kind = models.TrialIntermediateValueModel.intermediate_value_to_stored_repr(value)
                    children[INTERMEDIATE].append({"trial_id": db_id, "step": step, "intermediate_value": stored,
                                                   "intermediate_value_type": kind})
            if USER_ATTRS in tables:
                children[USER_ATTRS] += [{"trial_id": db_id, "key": k, "value_json": json.dumps(v)}
                                         for k, v in t.user_attrs.items()]
            if SYSTEM_ATTRS in tables:
                children[SYSTEM_ATTRS] += [{"trial_id": db_id, "key": k, "value_json": json.dumps(v)}
                                           for k, v in t.system_attrs.items()]
        for table, rows in children.items():
            if rows:
                conn.execute(insert(table), rows)
        return ids

    @staticmethod
    def _trial_row(trial: FrozenTrial) -> dict:
        return {"state": trial.state, "datetime_start": _stored_datetime(trial.datetime_start),
                "datetime_complete": _stored_datetime(trial.datetime_complete)}

    def remove_session(self) -> None:
        self.backend.remove_session()
