"""fleettune bench against llama.cpp's own llama-bench, same model, threads and batch, interleaved.

This machine is noisy (llama-bench against itself varies by 7-12 % run to run), so both tools run
alternately, ``--rounds`` times per thread count, and the best and the median of each are compared.

    python bench/compare_llama_bench.py --llama-bench PATH/llama-bench --model MODEL.gguf \
        --threads 1,2 --rounds 5

llama-bench must be built from the llama.cpp that llama-cpp-python vendors (same commit). Flash
attention is off in both (`-fa 0`, fleettune's default, like llama-cpp-python's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def run_fleettune(model: str, threads: int, p: int, n: int, r: int, batch: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "bench", model, "-t", str(threads), "-p", str(p),
         "-n", str(n), "-r", str(r), "-b", str(batch), "--json"],
        capture_output=True, text=True, check=True,
    ).stdout
    return {row["test"]: row["avg_ts"] for row in json.loads(out)}


def run_llama_bench(exe: str, model: str, threads: int, p: int, n: int, r: int, batch: int) -> dict[str, float]:
    out = subprocess.run(
        [exe, "-m", model, "-t", str(threads), "-p", str(p), "-n", str(n), "-r", str(r),
         "-b", str(batch), "-fa", "0", "-o", "json"],
        capture_output=True, text=True, check=True,
    ).stdout
    rows = json.loads(out)
    return {("pp" if row["n_prompt"] else "tg") + str(row["n_prompt"] or row["n_gen"]): row["avg_ts"]
            for row in rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-b", type=int, default=2048)
    args = ap.parse_args()
    results: dict[tuple[int, str, str], list[float]] = {}
    for round_no in range(args.rounds):
        for threads in (int(t) for t in args.threads.split(",")):
            runs = [("fleettune", lambda t=threads: run_fleettune(args.model, t, args.p, args.n, args.r, args.b)),
                    ("llama-bench", lambda t=threads: run_llama_bench(args.llama_bench, args.model, t, args.p,
                                                                      args.n, args.r, args.b))]
            if round_no % 2:
                runs.reverse()  # alternate who goes first
            for tool, run in runs:
                for test, ts in run().items():
                    results.setdefault((threads, test, tool), []).append(ts)
    print("| threads | test | fleettune best | llama-bench best | diff (best) | fleettune median "
          "| llama-bench median | diff (median) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for threads in sorted({k[0] for k in results}):
        for test in sorted({k[1] for k in results if k[0] == threads}):
            ft, lb = results[(threads, test, "fleettune")], results[(threads, test, "llama-bench")]
            fb, lbb = max(ft), max(lb)
            fm, lbm = statistics.median(ft), statistics.median(lb)
            print(f"| {threads} | {test} | {fb:.2f} | {lbb:.2f} | {fb / lbb - 1:+.1%} | {fm:.2f} | {lbm:.2f} "
                  f"| {fm / lbm - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
