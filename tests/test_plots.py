"""Plots from a simulated fleet study: the figures' data, PNG and self-contained HTML files."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator import plots, queries
from orchestrator.cli import main
from orchestrator.db import open_database
from orchestrator.studies import StudyConfig
from orchestrator.tune import tune
from tests.conftest import SIM_CHIPS
from workers.errors import BadInput
from workers.simulated import sim_model_info
from workers.trial import Workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sim_study(tmp_path_factory, ray_cluster):
    url = f"sqlite:///{tmp_path_factory.mktemp('plots') / 'results.db'}"
    cfg = StudyConfig(model=sim_model_info("sim://llama2-7b/q4_0"), n_trials=8, seed=11,
                      workload=Workload(n_prompt=256, n_gen=16, reps=1))
    outcome = tune(open_database(url), cfg, chip_key=SIM_CHIPS["M2 Ultra/76"])
    return url, outcome.name


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_heatmap_cells_hold_the_best_measurement(sim_study):
    url, name = sim_study
    db = open_database(url)
    figure = plots.heatmap(db, name, "tg")
    rows = queries.trial_rows(db, study=name)
    best = max(rows, key=lambda r: r["tg_tps"])
    assert figure.best == (best["params"]["n_threads"], best["params"]["n_gpu_layers"])
    cell = figure.z[figure.y.index(figure.best[1])][figure.x.index(figure.best[0])]
    assert cell == pytest.approx(best["tg_tps"])
    measured = sum(v is not None for row in figure.z for v in row)
    assert measured == len({(r["params"]["n_threads"], r["params"]["n_gpu_layers"]) for r in rows})
    assert "(simulated)" in figure.title


def test_history_is_monotone(sim_study):
    url, name = sim_study
    figure = plots.history(open_database(url), name)
    xs, best = figure.series["best so far"]
    assert len(xs) == 8
    assert all(b2 >= b1 for b1, b2 in zip(best, best[1:], strict=False))  # tg: higher is better
    assert best[-1] == max(figure.markers["trial"][1])


@pytest.mark.parametrize("kind", ["heatmap", "history", "importance"])
@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_plot_commands_write_files(sim_study, tmp_path, kind, suffix):
    url, name = sim_study
    out = tmp_path / f"{kind}{suffix}"
    assert "wrote" in run_cli("plot", kind, "--study", name, "--db", url, "-o", out)
    data = out.read_bytes()
    if suffix == ".png":
        assert data.startswith(PNG_MAGIC)
        import matplotlib.image

        assert matplotlib.image.imread(out).shape[0] > 200
    else:
        text = data.decode()
        assert "<script src=\"http" not in text  # self-contained: plotly.js is inlined
        assert "Plotly.newPlot" in text
    assert not list(tmp_path.glob("*.part"))


def test_chips_plot_names_each_chips_recommendation(sim_study, tmp_path):
    url, _ = sim_study
    figure = plots.chips(open_database(url), "llama2-7b-q4_0")
    best = json.loads(run_cli("best", "--model", "llama2-7b-q4_0", "--db", url, "--json"))
    assert figure.labels == [f"{b['chip']} (sim)" for b in best]
    assert figure.values == [pytest.approx(b["expected_tps"]) for b in best]
    run_cli("plot", "chips", "--model", "llama2-7b-q4_0", "--db", url, "-o", tmp_path / "chips.png")


def test_plot_errors_are_one_line(sim_study, tmp_path):
    url, name = sim_study
    with pytest.raises(BadInput, match="no completed trials"):
        plots.heatmap(open_database(url), "no-such-study")
    result = CliRunner().invoke(main, ["plot", "heatmap", "--study", name, "--db", url, "-o",
                                       str(tmp_path / "x.svg")])
    assert result.exit_code == 2 and "write .png or .html" in result.output
