"""`fleettune import llama-bench` on hostile files (issue 24, case 12): values no database or node
config can hold are refused by line, a UTF-8 BOM is read, and the file is streamed twice (checked,
then written in batches) with the result identical to the trials the file holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import llamabench, queries
from orchestrator.cli import main
from orchestrator.db import open_database

FIXTURES = Path(__file__).parent / "fixtures" / "llama-bench"


def rows() -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / "smollm2.jsonl").read_text().splitlines() if line.strip()]


def import_rows(tmp_path, records: list[dict], url: str):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return CliRunner().invoke(main, ["import", "llama-bench", str(path), "--db", url])


@pytest.mark.parametrize("change, reason", [
    ({"test_time": "9999-12-31T23:59:59-14:00"}, "test_time"),  # past year 9999 once in UTC
    ({"test_time": "0001-01-01T00:00:00+14:00"}, "test_time"),  # before year 1
    ({"model_type": {"arch": "llama"}}, "model_type is not text"),
    ({"cpu_info": ["AMD EPYC"]}, "cpu_info is not text"),
    ({"build_commit": ["0c1e570"]}, "build_commit is not text"),
    ({"n_threads": 5000}, "n_threads 5000"),
    ({"n_gpu_layers": 5000, "backends": "Metal", "gpu_info": "Apple M2 Ultra"}, "n_gpu_layers 5000"),
])
def test_a_value_no_database_or_node_config_holds_is_one_line(tmp_path, sqlite_url, change, reason):
    result = import_rows(tmp_path, [{**rows()[0], **change}], sqlite_url)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and reason in err and "Traceback" not in result.output, err
    assert queries.trial_rows(open_database(sqlite_url), state=None) == []


@pytest.mark.parametrize("name", ["smollm2.json", "smollm2.jsonl", "smollm2.csv"])
def test_a_utf8_bom_is_read_like_the_file_without_it(tmp_path, sqlite_url, name):
    plain = llamabench.import_file(open_database(sqlite_url), FIXTURES / name)
    with_bom = tmp_path / name
    with_bom.write_bytes(b"\xef\xbb\xbf" + (FIXTURES / name).read_bytes())
    other = f"sqlite:///{tmp_path / 'bom.db'}"
    report = llamabench.import_file(open_database(other), with_bom)
    assert (report.trials, report.rows, report.problems) == (plain.trials, plain.rows, plain.problems)


def test_trials_are_grouped_across_interleaved_rows_and_batches(tmp_path, sqlite_url, monkeypatch):
    """Two configurations' pp rows, then their tg rows, then the first again (a repeated run):
    three trials in file order, whatever the batch size."""
    monkeypatch.setattr(llamabench, "IMPORT_BATCH_TRIALS", 1)
    pp, tg = rows()[0], next(r for r in rows() if r["n_gen"])
    a = {"n_threads": 1}
    b = {"n_threads": 2}
    records = [{**pp, **a}, {**pp, **b}, {**tg, **a}, {**tg, **b}, {**pp, **a}]
    result = import_rows(tmp_path, records, sqlite_url)
    assert result.exit_code == 0, result.output
    trials = sorted(queries.trial_rows(open_database(sqlite_url), state=None), key=lambda t: t["id"])
    assert [(t["params"]["n_threads"], t["pp_tps"] is not None, t["tg_tps"] is not None) for t in trials] == [
        (1, True, True), (2, True, True), (1, True, False)]
