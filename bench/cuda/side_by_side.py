"""llama-optimus and fleettune on one machine, model and workload, each for the same wall-clock time.

    python bench/cuda/side_by_side.py run-optimus SECONDS LOG -- llama-optimus args...
    python bench/cuda/side_by_side.py run-fleettune SECONDS LOG -- fleettune tune args...
    python bench/cuda/side_by_side.py compare --optimus-log LOG --fleettune-log LOG --db URL \
        --llama-bench PATH --model MODEL -n 192 -r 3 --rounds 5 --json OUT.json

``run-*`` starts the tool in its own process session, stamps every line it prints with the time,
and ends the whole session (llama-bench children, Ray) when the time is up: SIGTERM first (a
study pauses on it), SIGKILL 20 s later. ``compare`` reads each tool's trials (llama-optimus's
printed commands and tok/s, fleettune's trials from its database), re-measures each one's best
with llama-bench in one interleaved run (``--rounds`` rounds, who goes first alternating), and
gives the wall time each needed to reach 98 % of the better re-measured speed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

GRACE_S = 20.0


def run_for(argv: list[str], seconds: float, log: Path) -> int:
    """Run ``argv`` for at most ``seconds``; every output line goes to ``log`` as "unix-time<TAB>line"."""
    started = time.time()
    with log.open("w") as out:
        out.write(f"{started:.3f}\tSTART {json.dumps(argv)}\n")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})

        def pump() -> None:
            for line in proc.stdout:
                out.write(f"{time.time():.3f}\t{line.rstrip()}\n")
                out.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                code = -9
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever of the session is left (llama-bench, Ray)
                os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=5)
        out.write(f"{time.time():.3f}\tEND rc={code} after {time.time() - started:.1f}s\n")
    return code


def _lines(log: Path) -> list[tuple[float, str]]:
    rows = []
    for raw in log.read_text().splitlines():
        stamp, _, text = raw.partition("\t")
        rows.append((float(stamp), text))
    return rows


BENCH_OWN = {"--model", "-m", "-r", "-o", "-n", "-p"}  # options the re-measurement sets itself


def optimus_trials(log: Path) -> tuple[float, list[dict]]:
    """(start, trials): each trial's finish time, llama-bench flags and printed tok/s (0 on error)."""
    rows = _lines(log)
    start, trials, cmd = rows[0][0], [], None
    for stamp, text in rows:
        for stage in ("cmd_1: ", "cmd_2: ", "cmd_3: "):
            if text.startswith(stage):
                cmd = ast.literal_eval(text[len(stage):].strip())
        if cmd and (text.startswith("Token generation speed:") or text.startswith("Error:")):
            value = float(text.split(":")[1].split()[0]) if text.startswith("Token") else 0.0
            flags, words = [], cmd[1:]
            i = 0
            while i < len(words):
                if words[i] == "--no-warmup":
                    i += 1
                elif words[i] in BENCH_OWN:
                    i += 2
                else:
                    flags += words[i:i + 2]
                    i += 2
            trials.append({"t": stamp, "flags": flags, "tg": value})
            cmd = None
    return start, trials


def fleettune_trials(log: Path, db: str) -> tuple[float, list[dict]]:
    from workers.trial import BenchParams

    start = _lines(log)[0][0]
    con = sqlite3.connect(db.removeprefix("sqlite:///"))
    rows = con.execute("SELECT finished_at, params, tg_tps_mean, phase FROM ft_trials "
                       "WHERE tg_tps_mean IS NOT NULL ORDER BY finished_at").fetchall()
    trials = []
    for finished, params, tg, phase in rows:
        when = datetime.fromisoformat(finished)
        if when.tzinfo is None:  # SQLite keeps the UTC time without its zone
            when = when.replace(tzinfo=UTC)
        flags = BenchParams.from_dict(json.loads(params)).llama_cpp_flags("llama-bench").split()
        trials.append({"t": when.timestamp(), "flags": flags, "tg": tg, "phase": phase})
    return start, trials


def bench_tg(exe: str, model: str, flags: list[str], n: int, r: int) -> float:
    from workers.llamatools import run_llama_bench

    argv = [exe, "-m", model, "-p", "0", "-n", str(n), "-r", str(r), "-o", "json", *flags]
    return run_llama_bench(argv)[f"tg{n}"]


def compare(args) -> dict:
    tools = {"llama-optimus": optimus_trials(Path(args.optimus_log)),
             "fleettune": fleettune_trials(Path(args.fleettune_log), args.db)}
    best = {name: max(trials, key=lambda t: t["tg"]) for name, (_, trials) in tools.items() if trials}
    remeasured: dict[str, list[float]] = {name: [] for name in best}
    for round_no in range(args.rounds):
        order = list(best) if round_no % 2 == 0 else list(reversed(best))
        for name in order:
            remeasured[name].append(bench_tg(args.llama_bench, args.model, best[name]["flags"], args.n, args.r))
    medians = {name: statistics.median(v) for name, v in remeasured.items()}
    target = 0.98 * max(medians.values()) if medians else None
    out = {"n_gen": args.n, "reps": args.r, "rounds": args.rounds, "target_tg": target, "tools": {}}
    for name, (start, trials) in tools.items():
        reached = next((t for t in trials if target and t["tg"] >= target), None)
        top = best.get(name)
        out["tools"][name] = {
            "trials": len(trials), "best_flags": " ".join(top["flags"]) if top else None,
            "best_trial_tg": top["tg"] if top else None,
            "best_found_after_s": top["t"] - start if top else None, "remeasured": remeasured.get(name, []),
            "remeasured_median": medians.get(name),
            "time_to_98pct_s": None if reached is None else reached["t"] - start,
            "all_trials": [{"after_s": round(t["t"] - start, 1), "tg": t["tg"], "flags": " ".join(t["flags"])}
                           for t in trials],
        }
    return out


def table(result: dict) -> str:
    lines = ["| tool | trials | best configuration (llama-bench flags) | re-measured tg tok/s, median (range) "
             "| time to 98 % of the better |", "| --- | ---: | --- | ---: | ---: |"]
    for name, t in result["tools"].items():
        r = t["remeasured"]
        reach = "not reached" if t["time_to_98pct_s"] is None else f"{t['time_to_98pct_s']:.0f} s"
        if not r:
            lines.append(f"| {name} | {t['trials']} | (no trial finished) | – | {reach} |")
            continue
        lines.append(f"| {name} | {t['trials']} | `{t['best_flags']}` | {t['remeasured_median']:.1f} "
                     f"({min(r):.1f}–{max(r):.1f}) | {reach} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run-optimus", "run-fleettune"):
        p = sub.add_parser(name)
        p.add_argument("seconds", type=float)
        p.add_argument("log")
        p.add_argument("argv", nargs=argparse.REMAINDER)
    c = sub.add_parser("compare")
    c.add_argument("--optimus-log", required=True)
    c.add_argument("--fleettune-log", required=True)
    c.add_argument("--db", required=True)
    c.add_argument("--llama-bench", required=True)
    c.add_argument("--model", required=True)
    c.add_argument("-n", type=int, default=192)
    c.add_argument("-r", type=int, default=3)
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--json")
    args = ap.parse_args()
    if args.cmd.startswith("run-"):
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        run_for(argv, args.seconds, Path(args.log))
        return 0
    result = compare(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
