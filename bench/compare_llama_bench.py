"""fleettune's measurement against llama.cpp's own llama-bench: same model, same flags, interleaved.

Each configuration is given as llama-bench flags (``-d N`` sets the workload's depth); both tools
measure it alternately, ``--rounds`` times (who goes first alternates), and the table gives each
tool's median over the rounds with its range and the ratio of the medians:

    python bench/compare_llama_bench.py --llama-bench PATH/llama-bench --model MODEL.gguf \
        --config "-ngl 0 -t 1" --config "-ngl 0 -t 16" --config "-ngl 99 -t 16" \
        --config "-ngl 99 -t 16 -fa on -d 4096" --rounds 5 -r 3 --json out.json

llama-bench must be built from the llama.cpp that llama-cpp-python vendors (same commit). Flags a
configuration leaves out are fleettune's defaults (``-b 2048 -ub 512 -fa off``), given to both
tools explicitly. A configuration with ``-ngl 0`` on a GPU build gets op offload off in both tools
(``-nopo 1``) unless it names ``-nopo`` itself: with op offload on, llama.cpp runs large prompt
batches on the GPU even at ``-ngl 0``, and the comparison would measure the GPU, not the threads.
Each fleettune measurement is one measuring process (workers.bench.measure), as in a study.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers import llamatools  # noqa: E402
from workers.bench import cpu_only, measure  # noqa: E402
from workers.errors import BadInput  # noqa: E402
from workers.hardware import Fingerprint, fingerprint_live  # noqa: E402
from workers.knobs import check_on_node  # noqa: E402
from workers.models import read_model_info  # noqa: E402
from workers.trial import BenchParams, TrialSpec, Workload, validate_workload  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One configuration to compare: its label as given, the params and the depth."""

    label: str
    params: BenchParams
    depth: int


def parse_case(text: str, n_layer: int, fp: Fingerprint) -> Case:
    words = text.split()
    depth = 0
    if "-d" in words:
        at = words.index("-d")
        if at + 1 >= len(words) or not words[at + 1].isdigit():
            raise BadInput(f"{text!r}: -d takes a whole number")
        depth = int(words[at + 1])
        del words[at:at + 2]
    params = BenchParams.from_llama_flags(" ".join(words), n_layer)
    names_op_offload = any(w in ("-nopo", "--no-op-offload", "--op-offload") for w in words)
    return Case(text, cpu_only(params, fp, keep_op_offload=names_op_offload), depth)


def run_fleettune(model, sha256: str, case: Case, p: int, n: int, r: int) -> dict[str, float]:
    workload = Workload(n_prompt=p, n_gen=n, reps=r, depth=case.depth)
    result = measure(TrialSpec(model.path, sha256, case.params, workload, timeout_s=600, trial_key="compare"))
    if not result.ok:
        raise RuntimeError(f"fleettune {case.label}: {result.error}")
    out = {}
    if p:
        out[f"pp{p}"] = result.pp.mean  # llama-bench's avg_ts: the mean of the repetitions' rates
    if n:
        out[f"tg{n}"] = result.tg.mean
    return out


def llama_bench_argv(exe: str, model: str, case: Case, p: int, n: int, r: int, repack: bool) -> list[str]:
    return llamatools.llama_bench_argv(exe, model, case.params, n_prompt=p, n_gen=n, reps=r, depth=case.depth,
                                       repack=repack)


run_llama_bench = llamatools.run_llama_bench  # the library's: one run, its JSON read as rates


def join_configs(argv: list[str]) -> list[str]:
    """``--config "-ngl 0 -t 4"`` as ``--config=-ngl 0 -t 4`` (argparse takes a value that starts
    with a dash for an option)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            out.append(f"--config={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def render(log: list[dict]) -> str:
    """The markdown table of a run's log (also of a run cut short: ``--from-json``)."""
    results: dict[tuple[str, str, str], list[float]] = {}
    flags: dict[str, str] = {}
    for entry in log:
        for test, ts in entry["figures"].items():
            results.setdefault((entry["config"], test, entry["tool"]), []).append(ts)
        if entry["argv"]:
            argv = entry["argv"]
            flags[entry["config"]] = " ".join(argv[argv.index("-d") + 2:argv.index("--repack")]) + (
                f" -d {argv[argv.index('-d') + 1]}" if argv[argv.index("-d") + 1] != "0" else "")
    paired: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for entry in log:  # the two tools' runs of one round ran back to back: their ratio drifts least
        for test, ts in entry["figures"].items():
            paired.setdefault((entry["config"], test), {}).setdefault(entry["round"], {})[entry["tool"]] = ts
    lines = ["| configuration (llama-bench flags) | test | runs | fleettune median (range) "
             "| llama-bench median (range) | ratio of medians | per-round ratios: median (range) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for config in dict.fromkeys(e["config"] for e in log):
        for test in sorted({k[1] for k in results if k[0] == config}):
            ft, lb = results.get((config, test, "fleettune"), []), results.get((config, test, "llama-bench"), [])
            if not ft or not lb:
                continue
            ratio = statistics.median(ft) / statistics.median(lb)
            rounds = [r["fleettune"] / r["llama-bench"] for r in paired[(config, test)].values() if len(r) == 2]
            lines.append(f"| `{flags.get(config, config)}` | {test} | {min(len(ft), len(lb))} | {summary(ft)} "
                         f"| {summary(lb)} | {ratio:.3f} | {statistics.median(rounds):.3f} "
                         f"({min(rounds):.3f}–{max(rounds):.3f}) |")
    return "\n".join(lines)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench")
    ap.add_argument("--model")
    ap.add_argument("--from-json", help="only print the table of an earlier run's --json")
    ap.add_argument("--config", action="append",
                    help="llama-bench flags of one configuration, e.g. '-ngl 0 -t 4' (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args(join_configs(sys.argv[1:]))
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())["rounds"]))
        return 0
    if not (args.llama_bench and args.model and args.config):
        ap.error("--llama-bench, --model and --config are required")
    from workers.digests import sha256_cached
    from workers.llamacompat import extra_buffers_usable

    model = read_model_info(args.model)
    fp = fingerprint_live()
    try:
        cases = [parse_case(text, model.n_layer, fp) for text in args.config]
        for case in cases:
            check_on_node(case.params, fp, model)
            validate_workload(Workload(args.p, args.n, args.r, depth=case.depth), model)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sha256 = sha256_cached(model.path)
    repack = extra_buffers_usable(model.path)  # llama-bench's --repack: the same CPU buffer types
    results: dict[tuple[str, str, str], list[float]] = {}
    log = []
    for round_no in range(args.rounds):
        for case in cases:
            argv = llama_bench_argv(args.llama_bench, model.path, case, args.p, args.n, args.r, repack)
            runs = [("fleettune", lambda c=case: run_fleettune(model, sha256, c, args.p, args.n, args.r)),
                    ("llama-bench", lambda a=argv: run_llama_bench(a))]
            if round_no % 2:
                runs.reverse()  # alternate who goes first
            for tool, run in runs:
                started = time.time()
                try:
                    figures = run()
                except (RuntimeError, ValueError, KeyError, llamatools.ToolError) as exc:  # one failed run; the rest go on
                    print(f"round {round_no + 1} {case.label} {tool}: {exc}", file=sys.stderr, flush=True)
                    figures = {}
                log.append({"round": round_no, "config": case.label, "tool": tool, "started": started,
                            "figures": figures, "argv": argv if tool == "llama-bench" else None,
                            "params": case.params.to_dict()})
                for test, ts in figures.items():
                    results.setdefault((case.label, test, tool), []).append(ts)
            if args.json:  # after every configuration, so a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps({"model": model.path, "rounds": log, "p": args.p,
                                                       "n": args.n, "r": args.r, "repack": repack}, indent=1))
            print(f"round {round_no + 1}/{args.rounds} {case.label}: "
                  + ", ".join(f"{t} {results[(case.label, t, tool)][-1]:.1f} ({tool})"
                              for t in sorted({k[1] for k in results if k[0] == case.label})
                              for tool in ("fleettune", "llama-bench") if (case.label, t, tool) in results),
                  file=sys.stderr, flush=True)
    print(render(log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
