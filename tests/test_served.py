"""Served trials (issue 22.1): the real llama-server with a trial's config, under a real load; and a
served study end to end on this machine (embedded Ray, SQLite, the real SmolLM2 model).

Skipped where no llama-server binary is found, except in CI (CI=true), where that fails: .ci/run
builds it first (`fleettune tools build`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator import learn
from orchestrator.db import open_database, repo
from orchestrator.space import llama_cpp_defaults
from orchestrator.studies import StudyConfig
from tests.conftest import require_llama_tool
from workers import served
from workers.models import read_model_info
from workers.objective import CAP, GOOD, THRU
from workers.trial import BenchParams, FailureKind, ServedWorkload, TrialSpec, Workload

SMALL = Workload(n_prompt=32, n_gen=8, reps=1)
LOAD = ServedWorkload(users=2, requests=6, windows=2, slo="ttft_p90=30s,tps_p10=0.5", window_s=60)


@pytest.fixture(scope="module", autouse=True)
def llama_server_binary() -> str:
    return require_llama_tool("llama-server")


def spec(model_path, params: BenchParams, load: ServedWorkload = LOAD, workload: Workload = SMALL) -> TrialSpec:
    info = read_model_info(model_path)
    return TrialSpec(model_path=str(model_path), model_sha256=info.sha256, params=params, workload=workload,
                     timeout_s=240, trial_key="served-1", served=load)


def server_processes(port_marker: str = "fleettune-served") -> list[str]:
    import subprocess

    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.split(" ")[0].endswith("llama-server") and "--alias model" in line]


def test_a_served_trial_measures_every_request_of_its_windows_and_reads_back_what_the_server_ran(
        model_path, local_fingerprint):
    params = replace(llama_cpp_defaults(local_fingerprint, read_model_info(model_path)), n_parallel=2, n_ctx=1024)
    result = served.measure(spec(model_path, params))
    assert result.ok, result.error
    levels = result.served["levels"]
    assert len(levels) == 1 and levels[0]["users"] == 2
    records = levels[0]["records"]
    measured = [r for r in records if not r["warmup"]]
    assert len([r for r in records if r["warmup"]]) == 2  # one warm-up request per user, dropped
    assert len(measured) >= LOAD.requests * LOAD.windows and all(r["error"] is None for r in measured)
    assert all(r["gen_tokens"] == SMALL.n_gen and r["prompt_tokens"] == SMALL.n_prompt for r in measured)
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in measured)
    kinds = [s.kind for s in result.samples]
    assert kinds.count(GOOD) == LOAD.windows and kinds.count(THRU) == LOAD.windows
    for sample in result.samples:
        assert sample.seconds > 0 and sample.n_tokens > 0
    # what the server ran, read back from it: the slots and the context it was given, the batch it chose
    assert result.effective["n_parallel"] == 2 and result.effective["n_ctx"] == 1024
    assert result.effective["n_ubatch"] == params.n_ubatch
    assert levels[0]["metrics"], "llama-server's /metrics (--metrics) was scraped"
    assert result.served["build"]["backend"] and "-np" in result.served["argv"]
    assert not server_processes()  # the trial's server is gone with it


def test_llama_servers_own_defaults_are_read_back_from_the_server(model_path, local_fingerprint):
    defaults = llama_cpp_defaults(local_fingerprint, read_model_info(model_path))
    result = served.measure(spec(model_path, defaults, replace(LOAD, windows=1)))
    assert result.ok, result.error
    assert defaults.n_parallel is None and defaults.n_ctx is None  # nothing said: the server decides
    assert result.effective["n_parallel"] == 4  # -np auto (tools/server/server.cpp)
    assert result.effective["kv_unified"] is True  # and one unified KV cache with it
    assert result.effective["n_ctx"] == read_model_info(model_path).context_length


def test_a_capacity_trial_searches_the_users_and_a_strict_slo_serves_none(model_path, local_fingerprint):
    params = replace(llama_cpp_defaults(local_fingerprint, read_model_info(model_path)), n_parallel=4, n_ctx=2048)
    # generous enough to hold on a busy 2-core machine at 4 users (per-user rate seen as low as 0.5 tok/s)
    load = replace(LOAD, capacity=True, max_users=4, requests=4, slo="ttft_p90=120s,tps_p10=0.05")
    result = served.measure(spec(model_path, params, load))
    assert result.ok, result.error
    (sample,) = result.samples
    assert sample.kind == CAP and sample.n_tokens == 4  # a generous SLO: every level up to the ceiling
    assert [level["users"] for level in result.served["levels"]] == [1, 2, 4]
    strict = served.measure(spec(model_path, params, replace(load, slo="ttft_p90=1us")))
    assert strict.ok and strict.samples[0].n_tokens == 0
    assert [level["users"] for level in strict.served["levels"]] == [1]


def test_a_config_the_server_cannot_start_is_a_failed_trial_with_its_reason(model_path, local_fingerprint):
    params = replace(llama_cpp_defaults(local_fingerprint, read_model_info(model_path)), n_ctx=1 << 22,
                     n_parallel=1)
    result = served.measure(spec(model_path, params))
    assert not result.ok
    assert result.kind in (FailureKind.OUT_OF_MEMORY, FailureKind.CRASH)
    assert "llama-server exited" in result.error
    assert not server_processes()


def test_the_capacity_search_doubles_then_bisects_and_never_passes_its_ceiling():
    for truth in (0, 1, 3, 5, 12, 40, 64):
        found, tried = served.capacity_levels(lambda users, t=truth: users <= t, 64)
        assert found == truth and len(tried) <= served.MAX_LEVELS and max(tried) <= 64
    found, tried = served.capacity_levels(lambda users: True, 6)
    assert found == 6 and tried == [1, 2, 4, 6]


@pytest.mark.timeout(1500)
def test_a_served_study_recommends_a_config_at_least_as_good_as_llama_servers_defaults(
        sqlite_url, model_info, local_fingerprint, ray_cluster):
    from orchestrator.tune import tune

    db = open_database(sqlite_url)
    cfg = StudyConfig(model=model_info, n_trials=4, seed=3, confirm_top=1, objective="goodput", confirm_rounds=3,
                      workload=Workload(n_prompt=48, n_gen=12, reps=1),
                      served=ServedWorkload(users=3, requests=6, windows=2, slo="ttft_p90=5s,tps_p10=2"))
    outcome = tune(db, cfg, chip_key=local_fingerprint.chip_key, warm=False)
    rec = outcome.recommendation
    assert rec is not None and learn.LLAMA_CPP in rec.baselines
    assert rec.claims["winner"] and rec.claims["vs"] or rec.claims["winner"] == learn.LLAMA_CPP
    for name, paired in rec.claims.get("vs", {}).items():  # never measurably worse than a baseline
        assert paired["verdict"] != "slower", (name, paired)
    with db.session() as s:
        study = repo.get_study(s, outcome.name)
        assert study.served["users"] == 3 and study.objective == "goodput"
        trials = repo.study_trials(s, study.id)
        assert {t.phase for t in trials} >= {"baseline", "search", "confirm"}
        done = [t for t in trials if t.state == "complete"]
        assert done and all(t.served and t.served["levels"] for t in done)
        requests = repo.served_requests(s, done[0].id)
        assert len(requests) >= 12 and all(r.error is None for r in requests if not r.warmup)
        searched = [BenchParams.from_dict(t.params) for t in trials if t.phase == "search"]
        assert any(p.n_parallel for p in searched)  # llama-server's own knobs were searched
        # the first design: one slot per user, also with the host prompt cache off (the load never hits it)
        assert any(p.n_parallel == 3 and p.cache_ram == 0 for p in searched)
