"""A placement landscape measured by llama-bench under GPU memory budgets (issue 23.6b, and the
done-when's "no configuration beats --fit by more than 3 %"): every combination of the placements
given (GPU layers for a dense model, experts kept on the CPU for a mixture), threads, flash
attention and micro-batch (a prompt test's ``--ubatch``; a generation test's ``--gen-ubatch``, by
default llama.cpp's 512 alone), each point's rates (llama-bench's samples, ``-r``
repetitions) and the peak GPU memory of the llama-bench process that measured it (nvidia-smi,
less what was in use before), and llama.cpp's own ``--fit`` placement for each budget
(``llama-fit-params`` of the same build, as bench/fit_referee.py plans it) measured alone, as a
user gets it, and crossed with the same threads, attention and micro-batches.

One llama-bench process per placement and test (and micro-batch, whose compute buffers change the
peak): the points of a process share its model load and its peak. The points are single runs of
``-r`` repetitions, not interleaved rounds: a grid's best point is a candidate, to be confirmed
against ``--fit`` by bench/fit_referee.py (a maximum over many noisy points is biased high).

    python bench/placement_grid.py --model M.gguf --budget 8GiB --budget 16GiB \\
        --ngl 30,33,36,38,40,41 --threads 4,8,16 --fa off,on --ubatch 128,256,512 \\
        --tests tg128,pp512 -r 2 --json grid.json
    python bench/placement_grid.py --model MOE.gguf --budget 16GiB --ncmoe 2,3,4,6,8 ...
    python bench/placement_grid.py --model MOE.gguf --budget 16GiB --ncmoe 1,2,3,4,5 \
        --threads 8,16 --fa on --gen-ubatch 64,128,256,512 --tests tg128 ...

The JSON is what ``bench/search_efficiency.py --landscape`` reads; ``python bench/placement_grid.py
--best GRID.json:TEST:BUDGET`` prints the llama-bench flags of its best point within the budget
(in every test: ``run_peaks``), ``--summary GRID.json`` the summary again. The tools are found as
fleettune finds them (FLEETTUNE_LLAMA_BENCH, FLEETTUNE_LLAMA_FIT_PARAMS, ``fleettune tools
build``, PATH).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fit_referee import PeakMemory, fit_placement  # noqa: E402
from orchestrator.llamabench import parse_record  # noqa: E402
from orchestrator.space import LLAMA_CPP_BATCH, LLAMA_CPP_UBATCH, next_power_of_two  # noqa: E402
from workers import knobs, llamatools, placement  # noqa: E402
from workers.errors import BadInput  # noqa: E402
from workers.models import read_model_info  # noqa: E402
from workers.trial import BenchParams  # noqa: E402

FIT_PREFIX = "--fit "  # the label of llama.cpp's --fit placement for a budget: "--fit 8GiB"
PLACEMENT_FLAGS = ("-ngl", "-ncmoe")  # what a placement of --fit's own (-ngl N -ot ...) stands in for


@dataclass
class Group:
    """The points one llama-bench process measures: one placement, one test, one micro-batch."""

    label: str  # the placement: "ngl 36", "ncmoe 4", "--fit 8GiB"
    test: str  # tg128, pp512
    points: list[BenchParams]
    placement_flags: list[str] = field(default_factory=list)  # --fit's -ngl/-ot, in place of the knobs'
    alone: bool = False  # --fit's flags and nothing else: llama.cpp's defaults for the rest


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BadInput(f"{text!r}: give whole numbers separated by commas") from None
    if not values or min(values) < 0:
        raise BadInput(f"{text!r}: give whole numbers >= 0 separated by commas")
    return values


def parse_test(test: str) -> tuple[int, int]:
    """(n_prompt, n_gen) of "pp512" or "tg128"."""
    kind, tokens = test[:2], test[2:]
    if kind not in ("pp", "tg") or not tokens.isdigit() or int(tokens) < 1:
        raise BadInput(f"test {test!r}: give ppN or tgN")
    return (int(tokens), 0) if kind == "pp" else (0, int(tokens))


def placements(args, n_layer: int) -> list[tuple[str, BenchParams]]:
    """The knob placements of the grid: GPU layers (dense), or every layer with the experts of the
    first N layers on the CPU (a mixture)."""
    if bool(args.ngl) == bool(args.ncmoe):
        raise BadInput("give --ngl (GPU layers) or --ncmoe (experts kept on the CPU), one of them")
    if args.ngl:
        return [(f"ngl {n}", BenchParams(n_gpu_layers=min(n, n_layer + 1))) for n in int_list(args.ngl)]
    return [(f"ncmoe {n}", BenchParams(n_gpu_layers=n_layer + 1, n_cpu_moe=n)) for n in int_list(args.ncmoe)]


def grid_points(base: BenchParams, threads: list[int], fa: list[str], batch: int, ubatch: int) -> list[BenchParams]:
    return [replace(base, n_threads=t, flash_attn=f, n_batch=batch, n_ubatch=min(ubatch, batch))
            for t in threads for f in fa]


def study_batch(test: str) -> int:
    """The batch a study of this test runs (SearchSpace.default_batch: llama.cpp's 2048 clipped to
    the tokens one decode can get: the prompt's, or for a tg study the workload's 512-token prompt)."""
    n_prompt, _ = parse_test(test)
    return min(LLAMA_CPP_BATCH, next_power_of_two(n_prompt or 512))


def group_argv(bench: str, model: str, group: Group, reps: int) -> list[str]:
    """One llama-bench command for every point of ``group``: each knob's flag as the knob table
    prints it, its values across the points joined by commas (llama-bench runs their product)."""
    n_prompt, n_gen = parse_test(group.test)
    head = [bench, "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps)]
    if group.alone:
        return [*head, *group.placement_flags, "-o", "json"]
    merged: dict[str, list[str]] = {}
    for point in group.points:
        words = knobs.flags(point, "llama-bench").split()
        pairs = list(zip(words[::2], words[1::2], strict=True))
        if merged and [f for f, _ in pairs] != list(merged):
            raise BadInput(f"{group.label}: the points' flags differ ({words} against {list(merged)})")
        for flag, value in pairs:
            values = merged.setdefault(flag, [])
            if value not in values:
                values.append(value)
    if group.placement_flags:
        merged = {f: v for f, v in merged.items() if f not in PLACEMENT_FLAGS}
    flags = [w for f, v in merged.items() for w in (f, ",".join(v))]
    return [*head, *group.placement_flags, *flags, "-o", "json"]


def key(params: BenchParams) -> tuple:
    return params.n_threads, params.flash_attn, params.n_ubatch


def measure(bench: str, model: str, group: Group, reps: int, timeout_s: float) -> list[dict]:
    """The group's points, each with its samples (tok/s), median, and the process's peak GPU MiB."""
    argv = group_argv(bench, model, group, reps)
    started = time.monotonic()
    error, rows = None, []
    with PeakMemory() as peak:
        try:
            rows = json.loads(llamatools.run_tool("llama-bench", argv, timeout_s))
        except (llamatools.ToolError, ValueError) as exc:
            error = str(exc)
    seconds = round(time.monotonic() - started, 1)
    by_key: dict[tuple, tuple[BenchParams, list[float]]] = {}
    for number, record in enumerate(rows if isinstance(rows, list) else []):
        row = parse_record(number, record)
        by_key[key(row.params)] = row.params, [round(1e9 * row.n_tokens / ns, 3) for ns in row.samples_ns]
    out = []
    for point in group.points or [None]:
        if point is None:  # --fit alone: llama-bench's own defaults for the rest, as its row says them
            params, samples = next(iter(by_key.values()), (None, []))
        else:  # the point as asked (a CPU build's row says -ngl 0 whatever was asked)
            params, samples = point, by_key.get(key(point), (None, []))[1]
        out.append({"placement": group.label, "test": group.test,
                    "params": None if params is None else asdict(params), "alone": group.alone,
                    "samples": samples, "median": statistics.median(samples) if samples else None,
                    "peak_mib": peak.mib, "seconds": seconds,
                    "error": error or (None if samples else "no row for this point")})
    return out


def plan(args, model_path: str) -> tuple[list[Group], dict]:
    info = read_model_info(model_path)
    tests = args.tests.split(",")
    threads = int_list(args.threads)
    fa = [knobs.knob("flash_attn").parse("-fa", v, None) for v in args.fa.split(",")]
    ubatches = int_list(args.ubatch)
    gen_ubatches = int_list(args.gen_ubatch)
    n_ctx = max(sum(parse_test(t)) for t in tests)
    fitter = args.fit_params or llamatools.find_tool("llama-fit-params")
    if not fitter:
        raise BadInput("llama-fit-params is needed: `fleettune tools build`, or FLEETTUNE_LLAMA_FIT_PARAMS")
    budgets = {}
    places: list[tuple[str, BenchParams, list[str]]] = [(label, p, []) for label, p in placements(args, info.n_layer)]
    for text in args.budget:
        size = placement.parse_positive_size(text)
        fitted = fit_placement(fitter, model_path, n_ctx, size)
        flags = fitted.llama_bench_args()
        knob_form = placement.from_llama_fit(fitted, BenchParams(), info)
        budgets[text] = {"bytes": size, "fit_flags": flags, "fit_knobs": {
            "n_gpu_layers": knob_form.n_gpu_layers, "n_cpu_moe": knob_form.n_cpu_moe}}
        places.append((FIT_PREFIX + text, BenchParams(n_gpu_layers=fitted.n_gpu_layers), flags))
    groups = []
    for label, base, flags in places:
        for test in tests:
            prompt = parse_test(test)[0] > 0
            batch = study_batch(test)
            # a generation test decodes one token at a time, but its micro-batch sizes the compute
            # buffers: a smaller one can buy a placement the budget refuses at llama.cpp's 512 (the
            # MoE under 16 GiB on the H200: -ncmoe 2 at -ub 64, lease 5)
            for ub in ubatches if prompt else sorted({min(u, batch) for u in gen_ubatches}):
                groups.append(Group(label, test, grid_points(base, threads, fa, batch, ub), flags))
            if flags:
                groups.append(Group(label, test, [], flags, alone=True))
    meta = {"model": model_path, "n_layer": info.n_layer, "n_expert": info.n_expert, "size_bytes": info.size_bytes,
            "budgets": budgets, "tests": tests, "reps": args.reps,
            "axes": {"placement": [label for label, _, _ in places if not label.startswith(FIT_PREFIX)],
                     "n_threads": threads, "flash_attn": fa, "n_ubatch": ubatches,
                     "n_ubatch_gen": gen_ubatches}}
    return groups, meta


def run_peaks(points: list[dict]) -> dict[tuple, int]:
    """The peak GPU memory of each placement at each micro-batch over every test of the grid: a run
    that processes a prompt before it generates needs the prompt's buffers too (on the H200, CUDA's
    pool grew 150-190 MiB more in pp512 than in tg128 at the same -ub), so a configuration is within a
    budget only if every test of it was."""
    peaks: dict[tuple, int] = {}
    for p in points:
        if p["params"] is not None and p["peak_mib"] is not None:
            at = (p["placement"], p["alone"], p["params"]["n_ubatch"])
            peaks[at] = max(peaks.get(at, 0), p["peak_mib"])
    return peaks


def within_budget(point: dict, peaks: dict[tuple, int], limit_mib: float) -> bool:
    """Whether ``point``'s configuration stayed within the budget in every test (True where no peak
    was measured: no nvidia-smi)."""
    if point["params"] is None:
        return point["peak_mib"] is None or point["peak_mib"] <= limit_mib
    peak = peaks.get((point["placement"], point["alone"], point["params"]["n_ubatch"]))
    return peak is None or peak <= limit_mib


def best_within(report: dict, test: str, budget: str) -> tuple[dict | None, int]:
    """The best point of ``test`` within ``budget`` among the searched placements (not --fit's),
    and how many points were within it."""
    limit_mib = report["budgets"][budget]["bytes"] / llamatools.MIB
    peaks = run_peaks(report["points"])
    inside = [p for p in report["points"] if p["test"] == test and p["median"] and not p["alone"]
              and not p["placement"].startswith(FIT_PREFIX) and within_budget(p, peaks, limit_mib)]
    return max(inside, key=lambda p: p["median"], default=None), len(inside)


def summary(report: dict) -> list[str]:
    """Per budget and test: the best point within the budget, and --fit's placement alone."""
    lines = []
    for name in report["budgets"]:
        for test in report["tests"]:
            best, count = best_within(report, test, name)
            fit = next((p for p in report["points"] if p["test"] == test and p["alone"]
                        and p["placement"] == FIT_PREFIX + name), None)
            if best is None or fit is None or not fit["median"]:
                lines.append(f"{name} {test}: best {best and best['median']}, --fit {fit and fit['median']}")
                continue
            params = best["params"]
            lines.append(f"{name} {test}: --fit alone {fit['median']:.2f} tok/s (peak {fit['peak_mib']} MiB); "
                         f"best of {count} points within the budget in every test {best['median']:.2f} "
                         f"({best['placement']} -t {params['n_threads']} -fa {params['flash_attn']} "
                         f"-ub {params['n_ubatch']}, peak {best['peak_mib']} MiB): "
                         f"{best['median'] / fit['median']:.3f}x (single runs: confirm with bench/fit_referee.py)")
    return lines


def run(args) -> dict:
    bench = args.llama_bench or llamatools.find_tool("llama-bench")
    if not bench:
        raise BadInput("llama-bench is needed: `fleettune tools build`, or FLEETTUNE_LLAMA_BENCH")
    groups, report = plan(args, args.model)
    points = []
    started = time.time()
    for number, group in enumerate(groups, 1):
        measured = measure(bench, args.model, group, args.reps, args.timeout)
        points += measured
        medians = ", ".join(f"{m['median']:.1f}" if m["median"] else "failed" for m in measured)
        print(f"[{number}/{len(groups)}] {group.label} {group.test}"
              f"{' alone' if group.alone else ''} ub {group.points[0].n_ubatch if group.points else '-'}: "
              f"{medians} (peak {measured[0]['peak_mib']} MiB, {measured[0]['seconds']} s)", flush=True)
        if args.json:  # written as it goes: a grid cut short by its time limit keeps what it measured
            Path(args.json).write_text(json.dumps({**report, "points": points}, indent=1) + "\n")
    report |= {"points": points, "seconds": round(time.time() - started, 1)}
    return report


def best_flags(spec: str) -> str:
    """``GRID.json:TEST:BUDGET``: the llama-bench flags of the grid's best point of TEST within
    BUDGET (by its measured peaks, in every test), for bench/fit_referee.py's --config."""
    path, _, rest = spec.partition(":")
    test, _, budget = rest.partition(":")
    grid = json.loads(Path(path).read_text())
    if budget not in grid["budgets"] or test not in grid["tests"]:
        raise BadInput(f"{spec}: the grid has budgets {', '.join(grid['budgets'])} and tests {', '.join(grid['tests'])}")
    best, _ = best_within(grid, test, budget)
    if best is None:
        raise BadInput(f"{spec}: no point of {test} within {budget}")
    return knobs.flags(BenchParams(**best["params"]), "llama-bench")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] in ("--best", "--summary"):
        try:
            if sys.argv[1] == "--best":
                print(best_flags(sys.argv[2]))
            else:
                print("\n".join(summary(json.loads(Path(sys.argv[2]).read_text()))))
        except (BadInput, OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", action="append", required=True, help="GPU memory budget, e.g. 8GiB (repeatable)")
    ap.add_argument("--ngl", help="GPU layers of a dense model's placements, e.g. 30,36,41")
    ap.add_argument("--ncmoe", help="a mixture's placements: every layer offloaded, these layers' experts "
                                    "on the CPU, e.g. 2,4,6")
    ap.add_argument("--threads", default="4,8,16")
    ap.add_argument("--fa", default="off,on")
    ap.add_argument("--ubatch", default="128,256,512", help="micro-batches of the prompt tests")
    ap.add_argument("--gen-ubatch", default=str(LLAMA_CPP_UBATCH),
                    help="micro-batches of the generation tests (they size the buffers), e.g. 64,512")
    ap.add_argument("--tests", default="tg128,pp512")
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600, help="seconds for one llama-bench process")
    ap.add_argument("--llama-bench")
    ap.add_argument("--fit-params")
    ap.add_argument("--json", help="write the landscape here (as it is measured)")
    args = ap.parse_args()
    try:
        report = run(args)
    except (BadInput, llamatools.ToolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in summary(report):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
