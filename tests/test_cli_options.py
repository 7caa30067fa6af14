"""The CLI's shared options: each declared once, the same everywhere it is taken (the fast tier)."""

from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from orchestrator import cli
from orchestrator.cli import main
from workers import simulated
from workers.objective import OBJECTIVE_NAMES

OBJECTIVE_COMMANDS = [  # every command that takes an objective, with what else it needs to parse
    ["tune", "sim://llama2-7b/q4_0", "--quiet", "--objective"],
    ["best", "--model", "m", "--objective"],
    ["recommend", "--model", "m", "--chip", "apple-m1", "--workload"],
    ["rollout", "plan", "--model", "m", "--objective"],
    ["rollout", "start", "--model", "m", "--objective"],
    ["sim", "optimum", "--chip", "M1/8", "--model-shape", "llama2-7b", "--objective"],
    ["plot", "chips", "--model", "m", "-o", "x.png", "--objective"],
]


def commands(group: click.Group = main, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def category(kind: click.ParamType) -> str:
    """What kind of value an option takes, whatever its range or choices (a path or a choice is text:
    a command may narrow what it accepts)."""
    for cls, name in ((click.types.IntParamType, "int"),
                      (click.types.FloatParamType, "float"), (click.types.BoolParamType, "bool")):
        if isinstance(kind, cls):
            return name
    return "text"


def test_no_option_is_declared_twice_in_the_cli_source():
    tree = ast.parse(Path(cli.__file__).read_text())
    spellings = Counter(
        node.args[0].value for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "option"
        and node.args and isinstance(node.args[0], ast.Constant)
    )
    assert [s for s, n in spellings.items() if n > 1] == []


def test_an_option_spelled_alike_is_the_same_kind_of_option_in_every_command():
    seen: dict[str, tuple] = {}
    for path, command in commands():
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            kind = (param.is_flag, param.multiple, category(param.type))
            for spelling in param.opts:
                assert seen.setdefault(spelling, kind) == kind, (" ".join(path), spelling)


def test_every_command_parses_its_help():
    runner = CliRunner()
    for path, _ in commands():
        result = runner.invoke(main, [*path, "--help"], prog_name="fleettune")
        assert result.exit_code == 0, (path, result.output)
        assert result.output.startswith(f"Usage: fleettune {' '.join(path)}")


@pytest.mark.parametrize("args", OBJECTIVE_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_objective_option_lists_the_objectives_and_refuses_others_in_one_line(args, tmp_path):
    help_text = CliRunner().invoke(main, [*args[:-1], "--help"]).output
    assert "[" + "|".join(OBJECTIVE_NAMES) + "]" in help_text
    url = f"sqlite:///{tmp_path / 'r.db'}"
    result = CliRunner().invoke(main, [*args, "speed", "--db", url] if args[0] != "sim" else [*args, "speed"])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: unknown objective 'speed'; choose one of {', '.join(OBJECTIVE_NAMES)}\n"
    assert not (tmp_path / "r.db").exists() or args[0] == "tune"  # refused while parsing


def test_the_scenarios_the_cli_offers_are_the_simulators():
    assert set(cli.SCENARIOS) == set(simulated.SCENARIOS)


def test_a_reused_option_keeps_its_spelling_and_takes_per_command_help():
    tune_params = {p.name: p for p in main.commands["tune"].params}
    bench_params = {p.name: p for p in main.commands["bench"].params}
    assert tune_params["prompt_tokens"].opts == bench_params["prompt_tokens"].opts == ["-p", "--prompt-tokens"]
    assert tune_params["reps"].default is None and bench_params["reps"].default == 3
    assert tune_params["timeout"].help != bench_params["timeout"].help


def test_sim_commands_print_the_named_shape_and_the_simulators_figures():
    from workers.trial import BenchParams

    runner = CliRunner()
    args = ["--chip", "M2 Max/38", "--model-shape", "llama3-8b", "--quant", "q4_k_m", "--json"]
    predicted = json.loads(runner.invoke(main, ["sim", "predict", *args, "--ngl", "99", "-t", "8"]).output)
    truth = simulated.predict(simulated.parse_chip("M2 Max/38"), simulated.model_shape("llama3-8b", "q4_k_m"),
                              BenchParams(99, 8, 512, 512))
    assert predicted["model"] == "llama3-8b q4_k_m" and predicted["tg128_tps"] == round(truth.tg_tps, 2)
    best = json.loads(runner.invoke(main, ["sim", "optimum", *args, "--objective", "pp"]).output)
    assert best["model"] == "llama3-8b q4_k_m" and best["objective"] == "pp" and best["unit"] == "tok/s"
    assert best["value"] >= round(truth.pp_tps, 3)  # the grid's optimum beats one of its points
