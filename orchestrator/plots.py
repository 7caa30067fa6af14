"""Pictures of results: a study's landscape (ngl x threads heat map), its optimisation history
(with both baselines as levels to beat), parameter importance, and the recommended speed per chip
(with its gain over each baseline).

Each plot is two steps, as the printers are: a function turns database rows into a small figure
description (``Heatmap``, ``Bars``, ``Lines``), and a renderer draws any description as PNG
(matplotlib) or as one self-contained HTML file (plotly, its JavaScript inlined). The output format
follows the file's extension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import queries
from orchestrator.db import Database
from workers.errors import BadInput
from workers.files import atomic_output
from workers.knobs import PLOT_AXES
from workers.objective import objective

METRICS = {"tg": ("tg_tps", "generation tok/s"), "pp": ("pp_tps", "prompt tok/s"),
           "objective": ("objective_value", None)}
AXES = PLOT_AXES
OUTPUT_SUFFIXES = (".png", ".html")


@dataclass(frozen=True)
class Heatmap:
    title: str
    x_label: str
    y_label: str
    x: list[int]
    y: list[int]
    z: list[list[float | None]]  # z[row y][column x]; None where nothing was measured
    value_label: str
    best: tuple[int, int] | None = None  # (x, y) of the best measured point
    note: str = ""


@dataclass(frozen=True)
class Bars:
    title: str
    labels: list[str]
    values: list[float]
    value_label: str
    annotations: list[str] = field(default_factory=list)
    horizontal: bool = True


@dataclass(frozen=True)
class Lines:
    title: str
    x_label: str
    y_label: str
    series: dict[str, tuple[list[float], list[float]]]  # name -> (x, y)
    markers: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    log_y: bool = False


Figure = Heatmap | Bars | Lines


# ---------------------------------------------------------------- figures from the database


def _study_rows(db: Database, study: str) -> list[dict]:
    rows = queries.trial_rows(db, study=study, state="complete")  # exactly this study's
    if not rows:
        raise BadInput(f"study {study!r} has no completed trials")
    return rows


def _metric(rows: list[dict], metric: str) -> tuple[str, str, bool]:
    """(row key, label, higher is better) of a metric name."""
    if metric not in METRICS:
        raise BadInput(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    key, label = METRICS[metric]
    if metric != "objective":
        return key, label, True
    study_objective = objective(rows[0]["objective"])
    if study_objective.unit == "s":
        return key, "prompt+generation seconds", study_objective.maximize
    return key, f"{study_objective} {study_objective.unit}", study_objective.maximize


def heatmap(db: Database, study: str, metric: str = "tg", x_axis: str = "threads",
            y_axis: str | None = None) -> Heatmap:
    """Each cell: the best value measured at that (x, y), over every other parameter.

    The y axis defaults to ngl, or to batch on a machine that cannot offload (one ngl value).
    """
    rows = _study_rows(db, study)
    key, label, higher = _metric(rows, metric)
    if y_axis is None:
        y_axis = "ngl" if len({r["params"]["n_gpu_layers"] for r in rows}) > 1 else "batch"
    for axis in (x_axis, y_axis):
        if axis not in AXES:
            raise BadInput(f"unknown axis {axis!r}; choose from {', '.join(AXES)}")
    cells: dict[tuple[int, int], float] = {}
    for row in rows:
        value = row[key]
        if value is None:
            continue
        cell = (row["params"][AXES[x_axis]], row["params"][AXES[y_axis]])
        if cell not in cells or (value > cells[cell]) == higher:
            cells[cell] = value
    if not cells:
        raise BadInput(f"study {study!r} has no {metric} measurements")
    xs, ys = sorted({c[0] for c in cells}), sorted({c[1] for c in cells})
    z = [[cells.get((x, y)) for x in xs] for y in ys]
    best = (max if higher else min)(cells, key=cells.get)
    simulated = " (simulated)" if any(r["sim"] for r in rows) else ""
    return Heatmap(
        title=f"{study}{simulated}", x_label=x_axis, y_label=y_axis, x=xs, y=ys, z=z,
        value_label=label, best=best,
        note=f"best {cells[best]:.4g} at {x_axis}={best[0]}, {y_axis}={best[1]}; "
             f"{len(rows)} measurements, best per cell",
    )


def history(db: Database, study: str) -> Lines:
    """The objective of each search trial in order, and the best so far."""
    rows = sorted((r for r in _study_rows(db, study) if r["phase"] == "search"),
                  key=lambda r: r["optuna_number"])
    if not rows:  # an imported study, or one stopped before its search
        raise BadInput(f"study {study!r} has no search trials to draw")
    _, label, higher = _metric(rows, "objective")
    xs = [float(r["optuna_number"]) for r in rows]
    values = [r["objective_value"] for r in rows]
    best, best_so_far = None, []
    for v in values:
        best = v if best is None or (v > best) == higher else best
        best_so_far.append(best)
    series = {"best so far": (xs, best_so_far)}
    for name, value in baseline_values(_study_rows(db, study)).items():  # each a level to beat
        series[name] = ([xs[0], xs[-1]], [value, value])
    positive = [v for v in values if v > 0] + [ys[0] for _, ys in series.values() if ys[0] > 0]
    spread = max(positive) / min(positive) if positive else 1.0
    return Lines(title=f"{study}: optimisation history", x_label="trial", y_label=label,
                 series=series, markers={"trial": (xs, values)}, log_y=spread > 20)


def baseline_values(rows: list[dict]) -> dict[str, float]:
    """Each baseline's median objective value over its trials (baseline and confirm phases), named
    in the study's order: llama-cpp-python's defaults first, llama.cpp's second."""
    import json
    import statistics

    from orchestrator.learn import LLAMA_CPP, LLAMA_CPP_PYTHON

    def key(row):
        return json.dumps(row["params"], sort_keys=True)

    order = []
    for row in sorted((r for r in rows if r["phase"] == "baseline"), key=lambda r: r["id"]):
        if key(row) not in order:
            order.append(key(row))
    out = {}
    for name, config in zip((LLAMA_CPP_PYTHON, LLAMA_CPP), order, strict=False):
        values = [r["objective_value"] for r in rows if key(r) == config and r["objective_value"] is not None]
        if values:
            out[name] = statistics.median(values)
    return out


def importance(db: Database, study: str) -> Bars:
    """Optuna's fANOVA importance of each parameter for the study's objective."""
    import optuna

    _study_rows(db, study)  # a clear error for an unknown or empty study
    try:
        optuna_study = optuna.load_study(study_name=study, storage=db.url_string)
    except KeyError:  # an imported study: measured elsewhere, never searched by Optuna
        raise BadInput(f"study {study!r} has no Optuna trials (imported?): no importance to compute") from None
    complete = [t for t in optuna_study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if len(complete) < 3:
        raise BadInput(f"study {study!r}: parameter importance needs 3 or more completed trials")
    scores = optuna.importance.get_param_importances(optuna_study)
    labels = list(scores)[::-1]
    return Bars(title=f"{study}: parameter importance (fANOVA)", labels=labels,
                values=[scores[k] for k in labels], value_label="importance")


def chips(db: Database, model: str, objective: str | None = None) -> Bars:
    """The recommended configuration's expected speed on every chip that has one."""
    rows = queries.best_rows(db, model, None, objective)
    if not rows:
        raise BadInput(f"no recommendation for {model!r} yet: run `fleettune tune` first")
    rows = sorted(rows, key=lambda r: r["expected_tps"] or 0)
    unit = {r["objective"] for r in rows}
    return Bars(
        title=f"{rows[0]['model']}: recommended configuration per chip",
        labels=[r["chip"] + (" (sim)" if r["simulated"] else "") for r in rows],
        values=[r["expected_tps"] or 0 for r in rows],
        value_label=" / ".join(sorted(unit)) + " expected tok/s",
        annotations=[f"{r['flags']}  " + "  ".join(
            f"{gain} vs {name}" for gain, name in ((r["improvement_pct"], "llama-cpp-python"),
                                                   (r.get("improvement_llama_cpp_pct"), "llama.cpp")) if gain)
            for r in rows],
    )


# ---------------------------------------------------------------- renderers


def save(figure: Figure, path: str | Path) -> Path:
    """Write the figure as PNG or self-contained HTML, chosen by the file's extension."""
    out = Path(path)
    if out.suffix.lower() not in OUTPUT_SUFFIXES:
        raise BadInput(f"{out}: write .png or .html")
    with atomic_output(out, "wb") as file:
        if out.suffix.lower() == ".png":
            _png(figure, file)
        else:
            _html(figure, file)
    return out


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise BadInput(f"plots need {module.split('.')[0]}: pip install 'fleettune[plots]'") from None


def _png(figure: Figure, path) -> None:
    matplotlib = _need("matplotlib")
    matplotlib.use("Agg")
    plt = _need("matplotlib.pyplot")
    with matplotlib.rc_context({"text.parse_math": False}):  # a "$" in a name is no formula
        _draw_png(plt, figure, path)


def _draw_png(plt, figure: Figure, path) -> None:
    if isinstance(figure, Heatmap):
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(figure.x) + 3), max(4, 0.3 * len(figure.y) + 2)))
        import numpy as np

        z = np.array([[math.nan if v is None else v for v in row] for row in figure.z], dtype=float)
        image = ax.imshow(z, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(figure.x)), [str(v) for v in figure.x])
        ax.set_yticks(range(len(figure.y)), [str(v) for v in figure.y])
        if figure.best:
            bx, by = figure.x.index(figure.best[0]), figure.y.index(figure.best[1])
            ax.plot(bx, by, marker="*", markersize=18, color="red", markeredgecolor="white")
        fig.colorbar(image, ax=ax, label=figure.value_label)
        ax.set_xlabel(figure.x_label)
        ax.set_ylabel(figure.y_label)
        ax.set_title(figure.title, fontsize=9)
        if figure.note:
            fig.text(0.01, 0.01, figure.note, fontsize=7)
    elif isinstance(figure, Bars):
        fig, ax = plt.subplots(figsize=(9, max(3, 0.45 * len(figure.labels) + 1.5)))
        ax.barh(figure.labels, figure.values, color="tab:blue")
        for i, text in enumerate(figure.annotations):
            ax.text(figure.values[i], i, " " + text, va="center", fontsize=7)
        ax.set_xlabel(figure.value_label)
        ax.set_title(figure.title, fontsize=9)
        ax.margins(x=0.45 if figure.annotations else 0.05)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, (xs, ys) in figure.markers.items():
            ax.plot(xs, ys, "o", alpha=0.6, label=name)
        for name, (xs, ys) in figure.series.items():
            ax.step(xs, ys, where="post", color="red", label=name)
        ax.set_xlabel(figure.x_label)
        ax.set_ylabel(figure.y_label + (" (log scale)" if figure.log_y else ""))
        if figure.log_y:
            ax.set_yscale("log")
        ax.set_title(figure.title, fontsize=9)
        ax.legend()
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _html(figure: Figure, file) -> None:
    """Plotly reads its texts as HTML: names are escaped, so markup in one is shown, not run."""
    go = _need("plotly.graph_objects")
    figure = _escaped(figure)
    if isinstance(figure, Heatmap):
        fig = go.Figure(go.Heatmap(x=[str(v) for v in figure.x], y=[str(v) for v in figure.y], z=figure.z,
                                   colorscale="Viridis", colorbar={"title": figure.value_label}))
        if figure.best:
            fig.add_trace(go.Scatter(x=[str(figure.best[0])], y=[str(figure.best[1])], mode="markers",
                                     marker={"symbol": "star", "size": 18, "color": "red"}, name="best"))
        fig.update_layout(xaxis_title=figure.x_label, yaxis_title=figure.y_label, xaxis_type="category",
                          yaxis_type="category")
    elif isinstance(figure, Bars):
        fig = go.Figure(go.Bar(x=figure.values, y=figure.labels, orientation="h", text=figure.annotations or None))
        fig.update_layout(xaxis_title=figure.value_label)
    else:
        fig = go.Figure()
        for name, (xs, ys) in figure.markers.items():
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=name))
        for name, (xs, ys) in figure.series.items():
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line_shape="hv", name=name))
        fig.update_layout(xaxis_title=figure.x_label, yaxis_title=figure.y_label,
                          yaxis_type="log" if figure.log_y else "linear")
    title = figure.title + (f"<br><sub>{figure.note}</sub>" if getattr(figure, "note", "") else "")
    fig.update_layout(title=title)
    file.write(fig.to_html(include_plotlyjs=True, full_html=True).encode())


def _escaped(figure: Figure) -> Figure:
    """The figure with every text HTML-escaped (titles, labels, notes, annotations)."""
    import dataclasses
    import html

    texts = {}
    for f in dataclasses.fields(figure):
        value = getattr(figure, f.name)
        if isinstance(value, str):
            texts[f.name] = html.escape(value, quote=False)
        elif f.name in ("labels", "annotations"):
            texts[f.name] = [html.escape(v, quote=False) for v in value]
    return dataclasses.replace(figure, **texts)
