"""A study whose model file is not the study's model any more stops at the first trial that finds
out, with that trial's line (issue 24): every later trial would fail the same way. Real Ray
cluster, the real bench node, real llama.cpp child (which hashes the file before loading it)."""

from __future__ import annotations

import dataclasses

import pytest

from orchestrator import queries
from orchestrator.db import open_database
from orchestrator.studies import StudyConfig, StudyPaused
from orchestrator.tune import tune
from workers.trial import Workload


@pytest.mark.cluster
def test_a_study_whose_model_changed_pauses_at_the_first_trial(sqlite_url, ray_cluster, model_info, local_fingerprint):
    changed = dataclasses.replace(model_info, sha256="0" * 64)  # the file on disk is another model now
    db = open_database(sqlite_url)
    cfg = StudyConfig(model=changed, n_trials=10, seed=1, workload=Workload(n_prompt=16, n_gen=4, reps=1))
    with pytest.raises(StudyPaused, match="model changed"):
        tune(db, cfg, chip_key=local_fingerprint.chip_key, warm=False)
    failed = queries.trial_rows(db, state="failed")
    assert len(failed) == 1 and failed[0]["error"].startswith("model changed"), failed
    assert not [r for r in queries.trial_rows(db, state=None) if r["state"] == "complete"]
