"""Every command through click's CliRunner, against the real model, real Ray and real databases."""

from __future__ import annotations

import csv
import io
import json

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from orchestrator.cli import main
from orchestrator.db import open_database
from orchestrator.db.models import Model, Recommendation, SampleRow, Study, Trial

TINY_TUNE = ["--prompt-tokens", "16", "--gen-tokens", "4", "-r", "1", "--quiet"]


def run(*args, ok=True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output + (result.stderr or "")
    return result


def counts(url: str) -> dict:
    db = open_database(url)
    with db.session() as s:
        out = {m.__tablename__: s.scalar(select(func.count()).select_from(m))
               for m in (Model, Study, Trial, SampleRow, Recommendation)}
    db.dispose()
    return out


def test_hw_show_json():
    data = json.loads(run("hw", "show", "--json").output)
    assert data["backend"] in ("cpu", "cuda", "metal") and data["logical_cores"] >= 1


def test_hw_show_table_fits_80_columns():
    assert max(len(line) for line in run("hw", "show").output.splitlines()) <= 80


def test_model_add_and_list(db_url, model_path, model_info):
    run("model", "add", model_path, "--db", db_url)
    rows = json.loads(run("model", "list", "--db", db_url, "--format", "json").output)
    assert [r["sha256"] for r in rows] == [model_info.sha256]
    assert rows[0]["n_layer"] == 30


def test_bench_json_is_llama_bench_shaped(sqlite_url, model_path):
    rows = json.loads(run("bench", model_path, "-t", "1", "-p", "16", "-n", "4", "-r", "2",
                          "-b", "16", "--json", "--db", sqlite_url).output)
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    for row in rows:
        assert len(row["samples_ts"]) == 2 and row["avg_ts"] > 0 and row["threads"] == 1


def test_bench_at_a_depth_names_its_tests_as_llama_bench_does(sqlite_url, model_path):
    rows = json.loads(run("bench", model_path, "-t", "1", "-p", "16", "-n", "4", "-r", "1", "-d", "32",
                          "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "--json", "--db", sqlite_url).output)
    assert [r["test"] for r in rows] == ["pp16 @ d32", "tg4 @ d32"]
    assert all(r["avg_ts"] > 0 for r in rows)


def test_tune_results_best_end_to_end(db_url, model_path, ray_cluster, local_fingerprint):
    out = run("tune", model_path, "--trials", "4", "--address", ray_cluster["address"], "--db", db_url,
              "--chip", local_fingerprint.chip_key,
              "--seed", "1", "--json", *TINY_TUNE).output
    outcome = json.loads(out)
    assert outcome["state"] == "complete" and outcome["trials_complete"] == 4
    # the recommendation is never worse than the defaults measured in the same study
    assert outcome["expected_tg_tps"] >= outcome["baseline_tg_tps"]
    assert outcome["expected_tg_tps"] >= outcome["llama_cpp_baseline_tg_tps"]  # llama.cpp's own defaults

    rows = json.loads(run("results", "--db", db_url, "--format", "json").output)
    phases = [r["phase"] for r in rows]
    # two baselines (llama-cpp-python's defaults, llama.cpp's), differing here in batch and flash attention
    assert phases.count("baseline") == 2 and phases.count("search") == 4 and "confirm" in phases
    assert all(r["tg_tps"] > 0 and r["sim"] is False for r in rows)
    assert len({r["optuna_number"] for r in rows if r["phase"] == "search"}) == 4

    top = json.loads(run("results", "--db", db_url, "--top", "2", "--json").output)
    assert len(top) == 2 and top[0]["objective_value"] >= top[1]["objective_value"]

    csv_rows = list(csv.DictReader(io.StringIO(run("results", "--db", db_url, "--format", "csv").output)))
    assert len(csv_rows) == len(rows)

    best = json.loads(run("best", "--model", model_path, "--db", db_url, "--json").output)
    assert len(best) == 1 and best[0]["objective"] == "tg"
    assert best[0]["flags"].startswith("-ngl 0 -t ")
    assert set(best[0]["llama_cpp_python"]) >= {"n_gpu_layers", "n_threads", "n_batch"}
    assert best[0]["expected_tps"] == pytest.approx(outcome["expected_tg_tps"], rel=1e-3)
    table = run("best", "--model", model_path, "--db", db_url).output
    assert "llama_cpp.Llama(model_path, n_gpu_layers=0" in table

    c = counts(db_url)
    assert c["ft_trials"] == len(rows) and c["ft_samples"] == 2 * len(rows)


def test_db_upgrade_and_current(db_url):
    from orchestrator.db.session import head_revision

    up = run("db", "upgrade", "--db", db_url).output
    assert f"empty -> {head_revision()}" in up
    assert "up to date" in run("db", "current", "--db", db_url).output


# ---------------------------------------------------------------- bad input: one line, exit 2


@pytest.fixture
def tuned_db(sqlite_url, model_path, ray_cluster, local_fingerprint):
    run("tune", model_path, "--trials", "1", "--address", ray_cluster["address"], "--db", sqlite_url,
        "--study", "taken", "--chip", local_fingerprint.chip_key, *TINY_TUNE)
    return sqlite_url, ray_cluster["address"]


def _bad(tuned_db, *args, match: str):
    url, address = tuned_db
    before = counts(url)
    result = run(*args, "--db", url, ok=False)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and match in err, err
    assert "Traceback" not in result.output
    assert counts(url) == before  # nothing written


def test_bad_inputs(tuned_db, model_path, tmp_path):
    url, address = tuned_db
    notgguf = tmp_path / "notes.gguf"
    notgguf.write_text("not a model")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(model_path.read_bytes()[:4096])
    from workers.hardware import fingerprint_live

    tune = ["tune", model_path, "--address", address, "--chip", fingerprint_live().chip_key, *TINY_TUNE]
    _bad(tuned_db, "tune", tmp_path / "missing.gguf", match="no such model file")
    _bad(tuned_db, "tune", notgguf, "--address", address, match="not a GGUF")
    _bad(tuned_db, "bench", corrupt, match="corrupt GGUF")
    _bad(tuned_db, "bench", model_path, "--ngl", "1", "-t", "1", match="ngl 1")
    _bad(tuned_db, "bench", model_path, "--ngl", "99", "-t", "1", match="ngl 31")  # read as every layer
    _bad(tuned_db, "bench", model_path, "--ngl", "lots", match="whole number")
    _bad(tuned_db, "bench", model_path, "-t", "1", "-ctv", "q4_0", "-fa", "off", match="flash attention on")
    _bad(tuned_db, "bench", model_path, "-t", "999", match="threads 999")
    _bad(tuned_db, "bench", model_path, "-t", "1", "-b", "64", "--ub", "128", match="ubatch 128")
    _bad(tuned_db, *tune, "--sampler", "annealing", match="unknown sampler")
    _bad(tuned_db, *tune, "--objective", "speed", match="unknown objective")
    _bad(tuned_db, *tune, "--study", "taken", match="already exists")
    _bad(tuned_db, "tune", model_path, "--address", "127.0.0.1:1", *TINY_TUNE, match="cannot reach")
    _bad(tuned_db, "tune", "no-such-model", match="unknown model")
    _bad(tuned_db, "tune", model_path, "--address", address, "--chip", "apple-m9-99g", *TINY_TUNE,
         match="unknown chip")
    _bad(tuned_db, "tune", "sim://llama2-7b/q4_0", "--address", address, "--chip",
         fingerprint_live().chip_key, *TINY_TUNE, match="simulated model")


def test_bad_database_url_is_one_line():
    result = run("model", "list", "--db", "nosuch://x", ok=False)
    assert result.exit_code == 2 and result.stderr.startswith("error: bad database URL")


def test_head_start_refuses_a_port_in_use():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(main, ["head", "start", "--port", str(port)])
    assert result.exit_code == 2
    assert f"127.0.0.1:{port} is already in use" in result.output


def test_best_and_results_take_a_sim_reference(sqlite_url):
    """A simulated study's model is named by its sim:// reference, as `tune` took it (not a stored
    name, so it once matched nothing: `best` said "unknown model", `results` printed no rows)."""
    from functools import partial

    from orchestrator.studies import ChipTarget, StudyConfig, StudyRunner
    from orchestrator.virtual import VirtualFleet
    from workers import simulated
    from workers.trial import Workload

    ref = "sim://llama2-7b/q4_0"
    chip = simulated.parse_chip("M2 Ultra/76/192")
    fleet = VirtualFleet(chip, 2, seed=3)
    config = StudyConfig(model=simulated.sim_model_info(ref), workload=Workload(512, 128, 1), n_trials=6,
                         sampler="tpe", seed=1)
    StudyRunner(open_database(sqlite_url), fleet, config, ChipTarget(chip, {}, simulated=True),
                alive_nodes=partial(fleet.alive_nodes, chip.chip_key)).run()
    by_name = json.loads(run("best", "--model", "llama2-7b-q4_0", "--db", sqlite_url, "--json").output)
    by_ref = json.loads(run("best", "--model", ref, "--db", sqlite_url, "--json").output)
    assert len(by_ref) == 1 and by_ref == by_name and by_ref[0]["chip"] == chip.chip_key
    trials = json.loads(run("results", "--model", ref, "--db", sqlite_url, "--json").output)
    assert trials and trials == json.loads(run("results", "--model", "llama2-7b-q4_0", "--db", sqlite_url,
                                               "--json").output)
    other = run("best", "--model", "sim://llama3-8b/q4_0", "--db", sqlite_url, ok=False)
    assert other.exit_code != 0 and "unknown model 'sim://llama3-8b/q4_0'" in other.output
