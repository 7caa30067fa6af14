"""Every output format a user can ask for, through the CLI, over one set of stored trials (a real
llama-bench file imported into SQLite): the formats carry the same rows and the same values."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main

LLAMA_BENCH = Path(__file__).parent / "fixtures" / "llama-bench" / "smollm2.json"


def cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def url(sqlite_url) -> str:
    cli("import", "llama-bench", LLAMA_BENCH, "--db", sqlite_url)
    return sqlite_url


def test_results_formats_carry_the_same_rows(url):
    as_json = json.loads(cli("results", "--db", url, "--format", "json"))
    assert as_json and json.loads(cli("results", "--db", url, "--json")) == as_json
    ndjson = [json.loads(line) for line in cli("results", "--db", url, "--format", "ndjson").splitlines()]
    assert ndjson == as_json
    rows = list(csv.DictReader(io.StringIO(cli("results", "--db", url, "--format", "csv"))))
    assert [int(r["id"]) for r in rows] == [r["id"] for r in as_json]
    assert [float(r["tg_tps"]) for r in rows] == pytest.approx([r["tg_tps"] for r in as_json])
    table = cli("results", "--db", url, "--format", "table")
    assert all(len(line) <= 80 for line in table.splitlines())
    for row in as_json:  # every trial is a line of the table, with its generation speed
        assert f"{row['tg_tps']:.1f}" in table


def test_llama_bench_exports_agree_with_each_other(url):
    records = json.loads(cli("export", "--db", url, "--format", "llama-bench-json"))
    lines = [json.loads(line) for line in cli("export", "--db", url, "--format", "llama-bench-jsonl").splitlines()]
    assert lines == records and len(records) == 2 * len(json.loads(cli("results", "--db", url, "--json")))
    rows = list(csv.DictReader(io.StringIO(cli("export", "--db", url, "--format", "llama-bench-csv"))))
    assert [float(r["avg_ts"]) for r in rows] == pytest.approx([r["avg_ts"] for r in records])
    markdown = cli("export", "--db", url, "--format", "md").splitlines()
    assert markdown[0].startswith("|") and len(markdown) == 2 + len(records)  # header, rule, rows
