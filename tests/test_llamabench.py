"""llama-bench interop: real llama-bench output files import with their values; our trials export in
llama-bench's shapes and import back unchanged; bad rows are reported by line, nothing half-imported."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import llamabench, queries
from orchestrator.cli import main
from orchestrator.db import open_database, repo

FIXTURES = Path(__file__).parent / "fixtures" / "llama-bench"


def run_cli(*args, ok=True):
    result = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.output
    return result


def imported(url):
    rows = queries.trial_rows(open_database(url), state="complete")
    return {(r["params"]["n_threads"], r["params"]["n_batch"]): r for r in rows}


@pytest.mark.parametrize("name", ["smollm2.json", "smollm2.jsonl", "smollm2.csv"])
def test_real_llama_bench_output_imports_with_its_values(db_url, name):
    path = FIXTURES / name
    source = llamabench.read_records(path.read_text())[0]
    out = json.loads(run_cli("import", "llama-bench", path, "--db", db_url, "--json").output)
    assert out["skipped"] == 0 and out["rows"] == len(source)
    trials = imported(db_url)
    assert out["trials"] == len(trials) == len(source) // 2  # a pp and a tg row per configuration
    for _, record in source:
        trial = trials[(int(record["n_threads"]), int(record["n_batch"]))]
        kind = "pp" if int(record["n_prompt"]) else "tg"
        assert trial["params"]["n_gpu_layers"] == 0  # a CPU build (backends "CPU") offloads nothing
        assert trial["params"]["n_ubatch"] == min(int(record["n_ubatch"]), int(record["n_batch"]))
        assert trial[f"{kind}_stddev"] == pytest.approx(float(record["stddev_ts"]))
        if "samples_ts" in record:  # JSON carries every repetition: the median is of them
            ts = sorted(record["samples_ts"])
            assert trial[f"{kind}_tps"] == pytest.approx(ts[len(ts) // 2], rel=1e-3)
        else:  # CSV carries the mean only
            assert trial[f"{kind}_tps"] == pytest.approx(float(record["avg_ts"]))
        assert trial["model"] == Path(record["model_filename"]).stem
        assert not trial["sim"]


def test_our_trials_round_trip_through_llama_bench_json(sqlite_url, tmp_path, model_info,
                                                        local_fingerprint, ray_cluster):
    from orchestrator.studies import StudyConfig
    from orchestrator.tune import tune
    from workers.trial import Workload

    cfg = StudyConfig(model=model_info, workload=Workload(n_prompt=16, n_gen=4, reps=2), n_trials=2,
                      seed=3, confirm_top=1)
    tune(open_database(sqlite_url), cfg, chip_key=local_fingerprint.chip_key)
    out = tmp_path / "ours.json"
    run_cli("export", "--format", "llama-bench-json", "--db", sqlite_url, "-o", out)
    records = json.loads(out.read_text())
    assert set(llamabench.FIELDS) <= set(records[0])
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    run_cli("import", "llama-bench", out, "--chip", local_fingerprint.chip_key, "--model", model_info.path,
            "--db", fresh)
    original = queries.trial_rows(open_database(sqlite_url))
    back = queries.trial_rows(open_database(fresh))
    assert len(back) == len(original)
    for a, b in zip(original, back, strict=True):
        assert b["chip"] == a["chip"] and b["model_sha256"] == a["model_sha256"]
        assert {k: v for k, v in b["params"].items() if k != "n_threads_batch"} == \
               {k: v for k, v in a["params"].items() if k != "n_threads_batch"}
        assert b["pp_tps"] == pytest.approx(a["pp_tps"], rel=1e-6)
        assert b["tg_tps"] == pytest.approx(a["tg_tps"], rel=1e-6)
    csv_text = run_cli("export", "--format", "llama-bench-csv", "--db", sqlite_url).output
    assert list(csv.DictReader(csv_text.splitlines()))[0]["n_threads"] == str(original[0]["params"]["n_threads"])
    md = run_cli("export", "--format", "md", "--db", sqlite_url).output
    assert md.startswith("| model | size | params | backend |") and "| pp16 |" in md


def test_bad_rows_are_reported_by_line_and_the_rest_imported(sqlite_url, tmp_path):
    lines = (FIXTURES / "smollm2.jsonl").read_text().splitlines()
    broken = [lines[0], "{not json", lines[1].replace('"n_threads": ', '"n_threads": -'),
              json.dumps({**json.loads(lines[0]), "n_gen": 8}),  # a -pg test
              *lines[2:]]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(broken) + "\n")
    result = run_cli("import", "llama-bench", path, "--db", sqlite_url, "--json")
    out = json.loads(result.stdout)
    assert out["skipped"] == 3 and out["rows"] == len(lines) - 1
    assert f"{path}:2: skipped: malformed JSON" in result.stderr
    assert f"{path}:3: skipped: out-of-range parameters" in result.stderr
    assert f"{path}:4: skipped: prompt+generation tests (-pg) are not imported" in result.stderr


def test_a_file_that_fails_midway_leaves_the_database_as_it_was(sqlite_url, tmp_path, monkeypatch):
    db = open_database(sqlite_url)
    calls = []

    def failing(*args, **kwargs):  # after the trials and samples are written, before the commit
        calls.append(1)
        raise RuntimeError("disk full")

    monkeypatch.setattr(repo, "set_trials_llama_bench_stats", failing)
    with pytest.raises(RuntimeError):
        llamabench.import_file(db, FIXTURES / "smollm2.json")
    assert queries.trial_rows(db, state=None) == []
    with db.session() as s:
        assert repo.list_models(s) == []


def test_not_llama_bench_output_is_one_line(sqlite_url, tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    result = run_cli("import", "llama-bench", path, "--db", sqlite_url, ok=False)
    assert result.exit_code == 2 and "not llama-bench output" in result.output


@pytest.mark.parametrize("fmt", ["llama-bench-json", "llama-bench-jsonl", "llama-bench-csv"])
def test_imported_trials_export_and_import_back_unchanged(sqlite_url, tmp_path, fmt):
    """No Ray, no llama.cpp: the fixture in, out in each of llama-bench's formats, and in again."""
    run_cli("import", "llama-bench", FIXTURES / "smollm2.json", "--db", sqlite_url)
    out = tmp_path / f"ours.{fmt}"
    run_cli("export", "--format", fmt, "--db", sqlite_url, "-o", out)
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    run_cli("import", "llama-bench", out, "--db", fresh)
    original, back = queries.trial_rows(open_database(sqlite_url)), queries.trial_rows(open_database(fresh))
    assert len(back) == len(original) == 4
    means = [r["avg_ts"] for r in llamabench.export_records(queries.export_rows(open_database(sqlite_url)))
             if r["n_prompt"]]  # what llama-bench's CSV carries instead of the samples
    for a, b, mean in zip(original, back, means, strict=True):
        assert (b["chip"], b["model"], b["params"]) == (a["chip"], a["model"], a["params"])
        if fmt == "llama-bench-csv":  # six decimals, no samples: the median is the mean
            assert b["pp_tps"] == pytest.approx(mean, rel=1e-6)
        else:
            assert b["pp_tps"] == pytest.approx(a["pp_tps"], rel=1e-6)
        assert b["tg_stddev"] == pytest.approx(a["tg_stddev"], rel=1e-3)
