"""Bad input and unsafe output, through the CLI (CliRunner): one line on stderr, exit 2, nothing
written; names printed as text (never markup or formulas); filters that mean what they say.

No Ray, no PostgreSQL server: a fresh SQLite file per test (fast tier). The cases are issue 12's
list ("tracebacks instead of one line") and issue 14's output-safety items, each of which failed
on the code before them.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from orchestrator import llamabench
from orchestrator.cli import main
from orchestrator.db import open_database, repo
from orchestrator.db.models import Chip, Model, SampleRow, Study, Trial

FIXTURES = Path(__file__).parent / "fixtures" / "llama-bench"


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def ok(*args):
    result = cli(*args)
    assert result.exit_code == 0, result.output + (result.stderr or "")
    return result


def one_line_error(result, match: str = "") -> str:
    """Exit 2 with exactly one line, "error: ...", on stderr and no traceback anywhere."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "Traceback" not in result.output and match in err, err
    assert result.stdout == ""
    return err


def counts(url: str) -> dict:
    db = open_database(url)
    with db.session() as s:
        out = {m.__tablename__: s.scalar(select(func.count()).select_from(m))
               for m in (Chip, Model, Study, Trial, SampleRow)}
    db.dispose()
    return out


EMPTY = {"ft_chips": 0, "ft_models": 0, "ft_studies": 0, "ft_trials": 0, "ft_samples": 0}


@pytest.fixture
def imported_url(sqlite_url):
    """A database holding the real llama-bench fixture (4 trials of chip amd-epyc)."""
    ok("import", "llama-bench", FIXTURES / "smollm2.json", "--db", sqlite_url)
    return sqlite_url


# ---------------------------------------------------------------- issue 12: one line, exit 2


@pytest.mark.parametrize("url", [
    "postgresql://u:secretpw@localhost:abc/db",  # a port that is not a number
    "postgresql://u:secretpw@[::1:5/db",  # an unclosed IPv6 host
    "sqlite:///%00x",  # a NUL in the path
    "sqlite:////proc/fleettune-test.db",  # a place nothing can be created
])
def test_a_bad_database_url_is_one_line(url):
    err = one_line_error(cli("results", "--db", url), "database")
    assert "secretpw" not in err  # the password never reaches the terminal
    assert not Path("/proc/fleettune-test.db").exists()


@pytest.mark.parametrize("chip", ["M2 Ultra/abc", "M2 Ultra/76/abc", "M2 Ultra/76/0", "M2 Ultra/76/192/8",
                                  "M2 Ultra/" + "9" * 5000, "M2 Ultra/-76"])
def test_sim_predict_with_a_malformed_chip_is_one_line(chip):
    one_line_error(cli("sim", "predict", "--chip", chip, "--model-shape", "llama2-7b"), "chip")


@pytest.mark.parametrize("option", [["-t", "0"], ["-b", "0"], ["--ub", "0"], ["-p", "-5"], ["--ngl", "-3"]])
def test_sim_predict_refuses_impossible_configurations(option):
    result = cli("sim", "predict", "--chip", "M2 Ultra/76", "--model-shape", "llama2-7b", *option)
    assert result.exit_code == 2 and "Traceback" not in result.output and result.stdout == ""


def test_sim_optimum_of_an_objective_with_no_tokens_is_one_line():
    one_line_error(cli("sim", "optimum", "--chip", "M2 Ultra/76", "--model-shape", "llama2-7b", "-n", "0",
                       "--objective", "tg"), "needs --gen-tokens")


@pytest.mark.parametrize("option, match", [
    (["--chip", "M2 Ultra/abc"], "chip"),
    (["--chip", "M2 Ultra/76", "--slo", "ttft_p90=fast"], "--slo"),
    (["--chip", "M2 Ultra/76", "--slo", "tps_p10=20,tps_p50=30"], "tps is limited twice"),
    (["--chip", "M2 Ultra/76", "--slots", "2", "--ctx-per-slot", "100"], "context per slot 100"),
])
def test_sim_capacity_with_bad_input_is_one_line(option, match):
    one_line_error(cli("sim", "capacity", "--model-shape", "llama3-8b", *option), match)


def test_fleet_simulate_with_a_malformed_mix_is_one_line_and_starts_nothing():
    one_line_error(cli("fleet", "simulate", "--mix", "M2 Ultra/x:2"), "GPU cores 'x'")


@pytest.mark.parametrize("name,text", [
    ("system_profiler.json", "[]"),
    ("system_profiler.json", '"SPHardwareDataType"'),
    ("system_profiler.json", '{"SPHardwareDataType": {}}'),
    ("system_profiler.json", '{"SPHardwareDataType": [1]}'),
    ("system_profiler.json", '{"SPHardwareDataType": [{"physical_memory": 5}]}'),
    ("system_profiler.json", '{"SPHardwareDataType": [{"chip_type": ["Apple M1"]}]}'),
    ("system_profiler.json", '{"SPDisplaysDataType": [{"sppci_model": {"a": 1}}]}'),
    ("system_profiler.json", "[" * 100_000),
    ("system_profiler.json", "{not json"),
    ("sysctl.txt", "hw.perflevel0.physicalcpu: 8\nhw.memsize: " + "9" * 5000),
])
def test_hw_show_from_a_malformed_capture_is_one_line(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    one_line_error(cli("hw", "show", "--from-dir", tmp_path), "cannot parse captured output")


def test_hw_show_from_a_huge_capture_is_one_line(tmp_path):
    with open(tmp_path / "sysctl.txt", "wb") as f:
        f.truncate(17 * 1024**2)  # sparse: no disk used
    one_line_error(cli("hw", "show", "--from-dir", tmp_path), "not a captured output")


@pytest.mark.parametrize("target", ["/nonexistent/dir/x.json", "/proc/x.json", "{tmp}/sub/x.json"])
def test_export_to_an_unwritable_place_is_one_line_and_writes_nothing(imported_url, tmp_path, target):
    target = target.format(tmp=tmp_path)  # a missing folder, a pseudo file system
    before = sorted(tmp_path.iterdir())
    one_line_error(cli("export", "--db", imported_url, "-o", target), f"cannot write {target}")
    assert sorted(tmp_path.iterdir()) == before and not Path(target + ".part").exists()


def test_export_to_a_file_writes_it_whole(imported_url, tmp_path):
    out = tmp_path / "out.json"
    ok("export", "--db", imported_url, "-o", out)
    assert len(json.loads(out.read_text())) == 8 and not (tmp_path / "out.json.part").exists()


def test_model_synth_into_an_unwritable_place_is_one_line(sqlite_url, model_path):
    one_line_error(cli("model", "synth", "--shape", "tiny", "--vocab-from", model_path, "-o", "/proc/x.gguf",
                       "--db", sqlite_url), "cannot write /proc/x.gguf")
    assert not Path("/proc/x.gguf.part").exists()
    assert counts(sqlite_url) == EMPTY


def test_model_fetch_into_an_unwritable_place_is_one_line(sqlite_url):
    one_line_error(cli("model", "fetch", "smollm2-135m", "--dest", "/proc/fleettune-models", "--db", sqlite_url),
                   "cannot fetch smollm2-135m into /proc/fleettune-models")
    assert counts(sqlite_url) == EMPTY


def test_plot_into_an_unwritable_place_is_one_line(imported_url):
    study = json.loads(ok("results", "--db", imported_url, "--json").stdout)[0]["study"]
    one_line_error(cli("plot", "heatmap", "--study", study, "-o", "/proc/x.png", "--db", imported_url),
                   "cannot write /proc/x.png")


def test_the_importance_of_an_imported_study_is_one_line(imported_url, tmp_path):
    study = json.loads(ok("results", "--db", imported_url, "--json").stdout)[0]["study"]
    one_line_error(cli("plot", "importance", "--study", study, "-o", tmp_path / "i.png", "--db", imported_url),
                   "no Optuna trials")


def test_the_history_of_a_study_without_search_trials_is_one_line(imported_url, tmp_path):
    study = json.loads(ok("results", "--db", imported_url, "--json").stdout)[0]["study"]
    one_line_error(cli("plot", "history", "--study", study, "-o", tmp_path / "h.png", "--db", imported_url),
                   "no search trials")
    assert not (tmp_path / "h.png").exists()


def _bench_json(**changes) -> str:
    records = json.loads((FIXTURES / "smollm2.json").read_text())
    for key, value in changes.items():
        records[0][key] = value
    return json.dumps(records, indent=2)


@pytest.mark.parametrize("text", [
    _bench_json().replace('"avg_ts": ', '"avg_ts": 1e400, "x": ', 1),  # inf as a speed
    _bench_json().replace('"n_threads": ', '"n_threads": 1e400, "x": ', 1),  # inf as a count
    _bench_json().replace('"samples_ns": [', '"samples_ns": [1e400, ', 1),  # inf as a sample
    _bench_json().replace('"avg_ts": ', '"avg_ts": NaN, "x": ', 1),  # JSON's non-standard constants
    _bench_json().replace('"avg_ts": ', '"avg_ts": Infinity, "x": ', 1),
    _bench_json().replace('"n_threads": ', '"n_threads": 1' + "0" * 30 + ', "x": ', 1),  # beyond any column
    _bench_json().replace('"avg_ts": ', '"avg_ts": 1e-300, "x": ', 1),  # a trial of 10^290 years
    _bench_json().replace('"cpu_info": "AMD EPYC"', '"cpu_info": "' + "x" * 300 + '"', 1),  # beyond the column
])
def test_non_finite_or_out_of_range_numbers_are_refused(sqlite_url, tmp_path, text):
    """Each file holds one poisoned row among good ones: that row is skipped and named, the rest
    go in, and no inf or overflow ever reaches the database."""
    path = tmp_path / "poisoned.json"
    path.write_text(text)
    result = ok("import", "llama-bench", path, "--db", sqlite_url, "--json")
    assert json.loads(result.stdout)["skipped"] == 1
    assert f"{path}:2: skipped: " in result.stderr
    rows = json.loads(ok("results", "--db", sqlite_url, "--json").stdout)
    assert rows and all(0 < r["tg_tps"] < 1e6 for r in rows)


@pytest.mark.parametrize("text", [
    "[" + "[" * 100_000 + "]" * 100_000 + "]",  # a JSON array nested 100,000 deep
    '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}\n",  # a JSONL line nested as deep
    json.dumps([{**json.loads(_bench_json())[0], "avg_ts": 1e400}]).replace("Infinity", "1e400"),
])
def test_a_file_of_nothing_but_bad_rows_is_one_line(sqlite_url, tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    one_line_error(cli("import", "llama-bench", path, "--db", sqlite_url), "nothing imported (line 1")
    assert counts(sqlite_url) == EMPTY


def test_an_import_past_the_size_limit_is_one_line(sqlite_url, monkeypatch):
    monkeypatch.setattr(llamabench, "MAX_IMPORT_BYTES", 4096)
    one_line_error(cli("import", "llama-bench", FIXTURES / "smollm2.json", "--db", sqlite_url),
                   "larger than the import limit")
    assert counts(sqlite_url) == EMPTY


@pytest.mark.parametrize("name", ["smollm2.json", "smollm2.jsonl", "smollm2.csv"])
def test_streamed_reading_is_the_same_at_any_chunk_size(name, monkeypatch):
    """The reader holds only what it has not parsed yet: a record cut by a chunk's end, anywhere,
    reads the same as from one piece (7-byte chunks cut every number and string somewhere)."""
    text = (FIXTURES / name).read_text()
    broken = text.replace('"n_threads": 2', '"n_threads": ,', 1) if name.endswith("json") else text
    whole = llamabench.read_records(broken)
    monkeypatch.setattr(llamabench, "CHUNK_BYTES", 7)
    assert llamabench.read_records(broken) == whole
    assert len(whole[0]) == (7 if name == "smollm2.json" else 8)


# ---------------------------------------------------------------- markup in names


def test_markup_in_a_chip_key_is_printed_as_text(sqlite_url):
    """`import --chip '[/x]'` used to make every later table crash (rich read it as a closing tag)."""
    ok("import", "llama-bench", FIXTURES / "smollm2.json", "--chip", "[/x]", "--db", sqlite_url)
    table = ok("results", "--db", sqlite_url).stdout
    assert table.count("[/x]") == 4
    assert "[/x]" in ok("results", "--db", sqlite_url, "--chip", "[/x]").stdout
    assert ok("results", "--db", sqlite_url, "--format", "md").stdout.count("[/x]") == 4


def test_markup_in_a_model_name_is_printed_as_text(sqlite_url, tmp_path):
    path = tmp_path / "bold.json"
    path.write_text(_bench_json().replace("SmolLM2-135M-Instruct.Q4_1", "[red]m[bold]"))
    ok("import", "llama-bench", path, "--db", sqlite_url)
    assert "[red]m[bold]" in ok("model", "list", "--db", sqlite_url).stdout


def test_a_dollar_in_a_study_name_is_no_formula_in_a_png(sqlite_url, tmp_path):
    """matplotlib reads $...$ as mathtext: an unknown command in a name crashed the plot."""
    path = tmp_path / "x$\\nosuchcommand$.json"
    path.write_text((FIXTURES / "smollm2.json").read_text())
    ok("import", "llama-bench", path, "--db", sqlite_url)
    study = json.loads(ok("results", "--db", sqlite_url, "--json").stdout)[0]["study"]
    ok("plot", "heatmap", "--study", study, "-o", tmp_path / "h.png", "--db", sqlite_url)
    assert (tmp_path / "h.png").read_bytes().startswith(b"\x89PNG")


def test_html_in_a_study_name_is_shown_not_run_in_an_html_plot(sqlite_url, tmp_path):
    path = tmp_path / "<img src=x onerror=alert(1)>.json"
    path.write_text((FIXTURES / "smollm2.json").read_text())
    ok("import", "llama-bench", path, "--db", sqlite_url)
    study = json.loads(ok("results", "--db", sqlite_url, "--json").stdout)[0]["study"]
    ok("plot", "heatmap", "--study", study, "-o", tmp_path / "h.html", "--db", sqlite_url)
    page = (tmp_path / "h.html").read_text()
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "<img src=x" not in page


# ---------------------------------------------------------------- issue 14: output safety


FORMULA = '=HYPERLINK("http://198.51.100.1/x")'


def test_formulas_from_an_imported_file_are_neutralised_in_every_csv(sqlite_url, tmp_path):
    path = tmp_path / "formula.json"
    path.write_text(_bench_json().replace('"AMD EPYC"', json.dumps(FORMULA))
                    .replace("SmolLM2-135M-Instruct.Q4_1", "@SUM(A1)"))
    ok("import", "llama-bench", path, "--db", sqlite_url)
    exported = list(csv.DictReader(io.StringIO(
        ok("export", "--format", "llama-bench-csv", "--db", sqlite_url).stdout)))
    assert exported and all(r["cpu_info"] == "'" + FORMULA for r in exported)
    assert all(r["model_filename"].startswith("/tmp") for r in exported)
    results = list(csv.DictReader(io.StringIO(ok("results", "--db", sqlite_url, "--format", "csv").stdout)))
    assert {r["model"] for r in results} == {"'@SUM(A1)"}
    assert not any(v.startswith(("=", "@", "+")) for r in results + exported for v in r.values())


def test_negative_numbers_stay_numbers_in_csv():
    from orchestrator.report import render

    rows = [{"n": -1, "x": -2.5, "text": "-3", "sci": "-1.5e3", "flag": "-ngl 1", "f": "=1+2", "t": "\tx",
             "cr": "\rx", "plus": "+SUM(1)", "at": "@x", "plain": "x=1"}]
    out = next(csv.DictReader(io.StringIO(render(rows, [], "csv"))))
    assert out == {"n": "-1", "x": "-2.5", "text": "-3", "sci": "-1.5e3", "flag": "'-ngl 1", "f": "'=1+2",
                   "t": "'\tx", "cr": "'\rx", "plus": "'+SUM(1)", "at": "'@x", "plain": "x=1"}


def test_llama_bench_csv_keeps_negative_numbers_and_neutralises_text():
    record = llamabench.export_records([])  # no trials: header only
    assert record == []
    out = io.StringIO()
    row = dict.fromkeys(llamabench.FIELDS, "")
    row.update(cpu_info="-cmd", n_gpu_layers=-1, avg_ts=-0.5, n_prompt=1, n_gen=0, model_size=0,
               model_n_params=0, stddev_ts=0.0, model_type="m", backends="CPU")
    llamabench.write([row], "llama-bench-csv", out)
    parsed = next(csv.DictReader(io.StringIO(out.getvalue())))
    assert (parsed["cpu_info"], parsed["n_gpu_layers"], parsed["avg_ts"]) == ("'-cmd", "-1", "-0.500000")


@pytest.mark.parametrize("option,value", [("--chip", "%"), ("--chip", "a%"), ("--chip", "am_"),
                                          ("--model", "%"), ("--model", "8a11e2_")])
def test_like_wildcards_in_filters_match_only_themselves(imported_url, option, value):
    assert json.loads(ok("results", "--db", imported_url, option, value, "--json").stdout) == []


def test_filters_still_match_by_prefix(imported_url):
    assert len(json.loads(ok("results", "--db", imported_url, "--chip", "amd", "--json").stdout)) == 4
    assert len(json.loads(ok("results", "--db", imported_url, "--model", "8a11e24a", "--json").stdout)) == 4


# ---------------------------------------------------------------- issue 12: ranking, re-imports


def _study_with_values(url: str, objective: str, values: list[float]) -> None:
    from workers.hardware import Fingerprint
    from workers.models import ModelInfo
    from workers.trial import BenchParams, Sample, TrialResult

    db = open_database(url)
    fp = Fingerprint(chip="Test Chip", chip_key=f"test-{objective}", vendor=None, p_cores=4, e_cores=0,
                     logical_cores=4, gpu_cores=None, gpu_name=None, gpu_memory_bytes=None, memory_bytes=None,
                     bandwidth_gbs=None, os=None, backend="cpu", gpu_offload=False)
    info = ModelInfo(sha256=objective * 20, path="/m.gguf", name=f"m-{objective}", architecture="llama",
                     n_layer=2, n_params=1000, file_type="Q4_0", size_bytes=1000, context_length=None)
    with db.session() as s:
        chip, model = repo.upsert_chip(s, fp), repo.upsert_model(s, info)
        study = repo.add_study(s, repo.NewStudy(
            name=f"s-{objective}", chip_id=chip.id, model_id=model.id, objective=objective, n_prompt=16, n_gen=4,
            reps=1, sampler="random", budget=len(values), space={}, simulated=False, state="complete"))
        for threads, value in enumerate(values, start=1):
            params = BenchParams(n_gpu_layers=0, n_threads=threads, n_batch=16, n_ubatch=16)
            trial = repo.start_trial(s, study_id=study.id, optuna_number=threads, phase="search",
                                     params=params.to_dict(), simulated=False)
            result = TrialResult(trial_key=str(threads), ok=True, samples=[Sample("tg", 0, 4, 0.1)])
            repo.finish_trial(s, trial, result, objective_value=value, e2e_s=None, node_id=None)
    db.dispose()


def test_results_top_lists_the_best_first_in_each_objectives_direction(sqlite_url):
    _study_with_values(sqlite_url, "e2e", [3.0, 1.0, 2.0, 5.0])  # seconds: smaller is better
    _study_with_values(sqlite_url, "tg", [30.0, 10.0, 50.0, 20.0])  # tok/s: larger is better
    e2e = json.loads(ok("results", "--db", sqlite_url, "--study", "s-e2e", "--top", "2", "--json").stdout)
    assert [r["objective_value"] for r in e2e] == [1.0, 2.0]
    tg = json.loads(ok("results", "--db", sqlite_url, "--study", "s-tg", "--top", "2", "--json").stdout)
    assert [r["objective_value"] for r in tg] == [50.0, 30.0]


def test_results_top_must_be_positive(sqlite_url):
    assert cli("results", "--db", sqlite_url, "--top", "0").exit_code == 2


def test_importing_the_same_bytes_twice_changes_nothing(imported_url, tmp_path):
    before = counts(imported_url)
    copy = tmp_path / "renamed.json"
    copy.write_bytes((FIXTURES / "smollm2.json").read_bytes())
    result = ok("import", "llama-bench", copy, "--db", imported_url)
    name = "llama-bench/amd-epyc/SmolLM2-135M-Instruct.Q4_1/smollm2"
    assert result.stdout == f"{copy}: already imported as study {name}; nothing written\n"
    assert counts(imported_url) == before
    db = open_database(imported_url)
    with db.session() as s:
        assert repo.studies_from_source(s, __import__("hashlib").sha256(copy.read_bytes()).hexdigest()) == [name]
    # other bytes (the same results as CSV) are another file: imported
    ok("import", "llama-bench", FIXTURES / "smollm2.csv", "--db", imported_url)
    assert counts(imported_url)["ft_trials"] == before["ft_trials"] + 4
