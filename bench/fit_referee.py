"""Placements under a GPU memory budget refereed by llama-bench against llama.cpp's own ``--fit``
(issue 23): the configurations given (a study's recommendation, say) and llama.cpp's ``--fit``
placement for the same budget, measured by llama-bench from one build in interleaved rounds whose
order rotates (A B C, B C A, ...), each run's peak GPU memory sampled from nvidia-smi where there is
one. Prints, per test (pp and tg separately), each configuration's median and each one's ratio over
``--fit`` with its interval (orchestrator.pairedstats), and whether its peak stayed in the budget.

``--fit``'s placement comes from ``llama-fit-params`` of the same build, told to leave free all but
the budget less llama.cpp's own 1 GiB margin (``-fitt``, workers.llamatools.fit_target_mib): ggml
sees the whole device whatever cap is set, so the budget is given to it, as fleettune's
``placement.fit`` plans; its context is kept at the workload's (``-fitc``).

    python bench/fit_referee.py --model M.gguf --budget 8GiB --config "rec=-ngl 33 -t 16 -fa on" \\
        [--config NAME=FLAGS ...] [--rounds 5] [-r 2] [--tests pp512,tg128] [--json out.json]

The tools are found as fleettune finds them (FLEETTUNE_LLAMA_BENCH, FLEETTUNE_LLAMA_FIT_PARAMS,
``fleettune tools build``, PATH). A configuration that llama-bench cannot run is recorded as failed
in that round, not dropped.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.pairedstats import ratio_interval  # noqa: E402
from orchestrator.verify import rotation  # noqa: E402
from workers import hardware, llamatools, placement  # noqa: E402
from workers.errors import BadInput  # noqa: E402

FIT = "llama.cpp --fit"


class PeakMemory:
    """The highest GPU memory in use (MiB, nvidia-smi, every 0.1 s) while a command runs, less
    what was in use before it; None without nvidia-smi."""

    def __init__(self) -> None:
        self.base = _gpu_used_mib()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            used = _gpu_used_mib()
            if used is not None and self.peak is not None:
                self.peak = max(self.peak, used)

    def __enter__(self) -> PeakMemory:
        if self.base is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def mib(self) -> int | None:
        return None if self.base is None or self.peak is None else self.peak - self.base


def _gpu_used_mib() -> int | None:
    return hardware.nvidia_smi_mib("memory.used")


def fit_placement(fit_params: str, model: str, n_ctx: int, budget: int) -> llamatools.FitPlacement:
    """llama.cpp's --fit placement for ``budget`` bytes of the device (the first GPU); where
    nvidia-smi gives no free memory (no NVIDIA GPU) it plans for the device as llama.cpp sees it,
    and says so."""
    free = hardware.gpu_free_bytes()
    if free is None:
        print("no free GPU memory from nvidia-smi: --fit plans for the whole device, not the budget",
              file=sys.stderr)
        return placement.llama_fit(fit_params, model, n_ctx, None)
    return placement.llama_fit(fit_params, model, n_ctx, budget, free)


def bench_argv(binary: str, model: str, flags: list[str], test: str, reps: int, depth: int = 0) -> list[str]:
    kind, tokens = test[:2], test[2:]
    p, n = (tokens, "0") if kind == "pp" else ("0", tokens)
    return [binary, "-m", model, "-p", p, "-n", n, "-r", str(reps), "-d", str(depth), *flags, "-o", "json"]


def run(args) -> dict:
    bench = args.llama_bench or llamatools.find_tool("llama-bench")
    fitter = args.fit_params or llamatools.find_tool("llama-fit-params")
    if not bench or not fitter:
        raise BadInput("llama-bench and llama-fit-params are needed: `fleettune tools build`, or "
                       "FLEETTUNE_LLAMA_BENCH / FLEETTUNE_LLAMA_FIT_PARAMS")
    budget = placement.parse_positive_size(args.budget)
    tests = args.tests.split(",")
    n_ctx = max(int(t[2:]) for t in tests) + (args.depth or 0)
    fitted = fit_placement(fitter, args.model, n_ctx, budget)
    configs: dict[str, list[str]] = {FIT: [*fitted.llama_bench_args(), *shlex.split(args.fit_extra or "")]}
    for text in args.config:
        name, _, flags = text.partition("=")
        if not flags:
            raise BadInput(f"--config {text!r}: give NAME=FLAGS")
        configs[name] = shlex.split(flags)
    names = list(configs)
    rates: dict[str, dict[str, list[float | None]]] = {t: {n: [] for n in names} for t in tests}
    peaks: dict[str, list[int | None]] = {n: [] for n in names}
    errors: dict[str, list[str]] = {n: [] for n in names}
    for number, order in enumerate(rotation(names, args.rounds), 1):
        for name in order:
            for test in tests:
                with PeakMemory() as peak:
                    try:
                        figures = llamatools.run_llama_bench(bench_argv(bench, args.model, configs[name], test,
                                                                        args.reps, args.depth))
                        value = figures.get(test)
                    except llamatools.ToolError as exc:
                        value = None
                        errors[name].append(str(exc))
                rates[test][name].append(value)
                peaks[name].append(peak.mib)
            print(f"round {number} {name}: " + ", ".join(f"{t} {rates[t][name][-1]}" for t in tests), flush=True)
    report = {"model": args.model, "budget_bytes": budget, "fit": {"argv_flags": configs[FIT],
                                                                   "n_ctx": fitted.n_ctx},
              "configs": {n: " ".join(f) for n, f in configs.items()}, "rounds": args.rounds, "tests": {}}
    for test in tests:
        rows = {}
        for name in names:
            values = [v for v in rates[test][name] if v]
            ratio = ratio_interval(rates[test][name], rates[test][FIT]) if name != FIT else None
            measured_peaks = [p for p in peaks[name] if p is not None]
            rows[name] = {"median": statistics.median(values) if values else None, "rates": rates[test][name],
                          "vs_fit": None if ratio is None else {"ratio": ratio.ratio, "low": ratio.low,
                                                                 "high": ratio.high, "text": ratio.describe()},
                          "peak_mib": max(measured_peaks) if measured_peaks else None,
                          "within_budget": (max(measured_peaks) * llamatools.MIB <= budget) if measured_peaks else None,
                          "errors": errors[name]}
        report["tests"][test] = rows
    return report


def print_table(report: dict) -> None:
    print(f"budget {report['budget_bytes'] / 1024**3:.2f} GiB; --fit: {' '.join(report['fit']['argv_flags'])}")
    print("| test | configuration | median tok/s | over --fit | peak GPU MiB | in budget |")
    print("| --- | --- | ---: | --- | ---: | --- |")
    for test, rows in report["tests"].items():
        for name, row in rows.items():
            median = f"{row['median']:.2f}" if row["median"] else "failed"
            vs = row["vs_fit"]["text"] if row["vs_fit"] else "(reference)"
            print(f"| {test} | {name}: `{report['configs'][name]}` | {median} | {vs} | {row['peak_mib']} | "
                  f"{row['within_budget']} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", required=True, help="GPU memory budget, e.g. 8GiB")
    ap.add_argument("--config", action="append", default=[], help="NAME=llama-bench flags (repeatable)")
    ap.add_argument("--fit-extra", help="flags added to --fit's placement (threads, batch: what the "
                                        "configurations share, so only the placement differs)")
    ap.add_argument("--tests", default="pp512,tg128")
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("--llama-bench")
    ap.add_argument("--fit-params")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    try:
        report = run(args)
    except (BadInput, llamatools.ToolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
