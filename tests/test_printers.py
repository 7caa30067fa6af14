"""The printer registry: every format by name, the same rows through each; JSON byte-for-byte what
json.dumps writes (so streaming changed no output); tables and markdown print names as text."""

from __future__ import annotations

import csv
import io
import json
import random
from datetime import datetime

import pytest

from orchestrator import llamabench
from orchestrator.report import Column, create_printer, formats, render, render_record
from workers.errors import BadInput

COLUMNS = [Column("name", "name"), Column("value", "v", ".1f", "right")]


def _rows(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    texts = ["a", "b c", "[/x]", "[bold]y[/bold]", "é ± µ", "q\"uote", "new\nline", "pipe|d", ""]
    return [{"name": rng.choice(texts), "value": rng.choice([None, -1.25, 3, 1e300, True]),
             "when": datetime(2026, 1, 2, 3, 4, 5), "list": [1, {"k": rng.choice(texts)}]} for _ in range(n)]


def test_every_format_is_registered_by_name():
    assert set(formats()) >= {"table", "json", "ndjson", "csv", "md", "llama-bench-json", "llama-bench-jsonl",
                              "llama-bench-csv"}
    with pytest.raises(BadInput, match="unknown format 'xml'"):
        create_printer("xml", io.StringIO())


@pytest.mark.parametrize("n", [0, 1, 7])
def test_json_and_ndjson_stream_exactly_what_json_dumps_writes(n):
    rows = _rows(n, n)
    plain = [{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in r.items()} for r in rows]
    assert render(rows, COLUMNS, "json") == json.dumps(plain, indent=2, default=str)
    assert render(rows, COLUMNS, "ndjson") == "\n".join(json.dumps(r, default=str) for r in plain)
    out = io.StringIO()
    printer = create_printer("json", out)
    printer.print_header()
    for row in rows:
        printer.print_row(row)
        assert out.getvalue().count('"name"') == rows.index(row) + 1  # written as it comes, not at the end
    printer.print_footer()
    assert json.loads(out.getvalue()) == plain


def test_csv_round_trips_text_and_keeps_every_key():
    rows = [{"name": "plain, with comma", "value": 1.5}, {"name": 'q"uote\r\nline', "extra": -2}]
    back = list(csv.DictReader(io.StringIO(render(rows, COLUMNS, "csv"))))
    assert back == [{"name": "plain, with comma", "value": "1.5", "extra": ""},
                    {"name": 'q"uote\r\nline', "value": "", "extra": "-2"}]


def test_table_prints_names_as_text_never_markup():
    rows = [{"name": "[/x]", "value": 1.0}, {"name": "[bold red]loud[/]", "value": None}]
    table = render(rows, COLUMNS, "table", title="[/title]")
    assert "[/x]" in table and "[bold red]loud[/]" in table and "[/title]" in table
    assert render_record({"chip": "[/x]"}, "table").splitlines()[1].split() == ["chip", "[/x]"]


def test_markdown_cells_cannot_break_the_table():
    text = render([{"name": "a|b\nc", "value": 2.0}], COLUMNS, "md")
    assert text.splitlines() == ["| name | v |", "| --- | ---: |", "| a\\|b c | 2.0 |"]


def test_one_record_in_every_query_format():
    record = {"trials": 4, "studies": ["s"]}
    assert json.loads(render_record(record, "json")) == record
    assert json.loads(render_record(record, "ndjson")) == record
    assert list(csv.DictReader(io.StringIO(render_record(record, "csv")))) == [{"trials": "4", "studies": '["s"]'}]
    assert "| trials | 4 |" in render_record(record, "md")


def test_llama_bench_table_is_one_layout_for_bench_and_markdown():
    """`fleettune bench`'s table and `export --format md` come from one column list and one cell
    function: the same cells, short headers in the 80-column table, llama-bench's in markdown."""
    from workers.trial import BenchParams

    record = llamabench.llama_bench_record(
        params=BenchParams(n_gpu_layers=99, n_threads=4, n_batch=512, n_ubatch=256), kind="tg",
        samples=[(128, 1.0), (128, 1.1)], build_commit="abc", cpu_info="Apple M2 Ultra", gpu_info="Apple M2 Ultra",
        backend="metal", model_filename="/m/llama.gguf", model_type="llama Q4_0", model_size=3 * 1024**3,
        model_n_params=7_000_000_000, test_time="")
    cells = llamabench.table_cells(record)
    assert cells == {"model": "llama Q4_0", "size": "3.00 GiB", "params": "7.00 B", "backend": "Metal", "ngl": 99,
                     "threads": 4, "n_batch": 512, "n_ubatch": 256, "test": "tg128", "tps": "122.18 ± 8.23"}
    md = io.StringIO()
    llamabench.write([record], "md", md)
    assert md.getvalue().splitlines()[0] == ("| model | size | params | backend | ngl | threads | n_batch | n_ubatch "
                                             "| test | t/s |")
    assert md.getvalue().splitlines()[2] == ("| llama Q4_0 | 3.00 GiB | 7.00 B | Metal | 99 | 4 | 512 | 256 | tg128 "
                                             "| 122.18 ± 8.23 |")
    table = render([record], llamabench.TABLE_LAYOUT, "table").splitlines()
    assert table[0].split() == ["model", "size", "params", "backend", "ngl", "t", "b", "ub", "test", "t/s"]
    assert "122.18 ± 8.23" in table[1] and max(len(line) for line in table) <= 80


@pytest.mark.parametrize("fmt", ["table", "json", "ndjson", "csv", "md"])
def test_bench_rows_print_in_every_format(fmt):
    """`fleettune bench`'s rows carry llama-bench's cells plus the figures behind them."""
    from workers.hardware import Fingerprint
    from workers.models import ModelInfo
    from workers.trial import BenchParams, Sample, TrialResult

    fp = Fingerprint(chip="Apple M2", chip_key="apple-m2", vendor="Apple", p_cores=4, e_cores=4, logical_cores=8,
                     gpu_cores=10, gpu_name="Apple M2", gpu_memory_bytes=None, memory_bytes=None, bandwidth_gbs=None,
                     os=None, backend="metal", gpu_offload=True)
    info = ModelInfo(sha256="a" * 64, path="/m.gguf", name="m", architecture="llama", n_layer=30,
                     n_params=134_515_008, file_type="Q4_1", size_bytes=96_576_768, context_length=None)
    result = TrialResult(trial_key="k", ok=True, load_s=0.3, peak_rss_bytes=123, samples=[
        Sample("pp", 0, 16, 0.05), Sample("pp", 1, 16, 0.05), Sample("tg", 0, 4, 0.04), Sample("tg", 1, 4, 0.04)])
    rows = llamabench.bench_rows(info, fp, BenchParams(n_gpu_layers=99, n_threads=2, n_batch=16, n_ubatch=16),
                                 result)
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    assert list(rows[0])[:10] == [c.key for c in llamabench.TABLE_COLUMNS]
    assert rows[1]["tps"] == "100.00 ± 0.00" and rows[1]["samples_ts"] == [100.0, 100.0]
    text = render(rows, llamabench.BENCH_LAYOUT, fmt)
    if fmt in ("json", "ndjson"):  # JSON writes ± as \u00b1
        text = json.dumps([json.loads(line) for line in text.splitlines()] if fmt == "ndjson" else json.loads(text),
                          ensure_ascii=False)
    assert "100.00 ± 0.00" in text and "92.10 MiB" in text and "Metal" in text


def test_control_characters_in_names_are_shown_not_sent_to_the_terminal():
    rows = [{"name": "x\x1b[2Jwiped\x07", "value": 1.0}]
    for fmt in ("table", "md"):
        text = render(rows, COLUMNS, fmt, title="t\x1b]0;title\x07")
        assert "\x1b" not in text and "\x07" not in text and "x\\x1b[2Jwiped\\x07" in text


def test_the_cli_offers_exactly_the_export_formats_the_registry_has():
    from orchestrator.cli import EXPORT_FORMATS, FORMATS

    assert EXPORT_FORMATS == llamabench.EXPORT_FORMATS and set(EXPORT_FORMATS) <= set(formats())
    assert set(FORMATS) <= set(formats())
