"""Issue 20's repeated protocol on this machine: real studies, each refereed by `fleettune verify`.

Runs ``--studies`` studies of one model (objectives taken in turn from ``--objectives``, seeds
1..N, each a real `fleettune tune` on embedded Ray with the study's interleaved confirmation and its
A/A arm), then `fleettune verify` of each (llama-bench from the same llama.cpp, five interleaved
rounds), and prints one row per study and baseline: what fleettune claimed, what llama-bench
measured, and whether llama-bench's ratio lies inside the claimed interval. The summary counts the
studies that claimed a gain over llama.cpp's defaults, those whose gain llama-bench confirmed (its
interval above 1) and the A/A arms whose interval left out 1 (the noise check).

    python bench/referee_studies.py --model PATH.gguf --studies 20 --trials 6 --db sqlite:////tmp/referee.db

Each study's and verify's JSON is kept in ``--out`` (one file per study), so a run that stops can
be read, and a rerun skips the studies already there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))
WORKLOADS = {"tg": ["-p", "0", "-n", "32"], "pp": ["-p", "256", "-n", "0"]}


def run_json(argv: list[str]) -> dict | list:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... exit {done.returncode}: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


def one_study(args, n: int, objective: str) -> dict:
    path = args.out / f"study-{n}.json"
    if path.exists():
        return json.loads(path.read_text())
    name = f"referee-{n}-{objective}"
    started = time.monotonic()
    outcome = run_json([FLEETTUNE, "tune", args.model, "--trials", str(args.trials), "--objective", objective,
                        *WORKLOADS[objective], "--reps", "2", "--seed", str(n), "--study", name,
                        "--no-warm-start", "--quiet", "--db", args.db, "--json"])
    tuned_s = time.monotonic() - started
    verdicts = run_json([FLEETTUNE, "verify", name, "--rounds", "5", "--db", args.db, "--json"])
    record = {"n": n, "objective": objective, "study": name, "tune_s": round(tuned_s, 1),
              "verify_s": round(time.monotonic() - started - tuned_s, 1), "outcome": outcome, "verify": verdicts}
    path.write_text(json.dumps(record, indent=1))
    return record


def rows_of(record: dict) -> list[str]:
    out = record["outcome"]
    rec = next(r for r in record["verify"] if r["config"] == "recommendation")
    lines = []
    for r in record["verify"]:
        if r["config"] == "recommendation":
            continue
        lines.append(f"| {record['n']} | {record['objective']} | {out.get('outcome')} | `{rec['llama_bench_flags']}` "
                     f"| {r['config']} | {r.get('claimed')} | {r.get('measured')} | {r.get('inside_claim')} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--studies", type=int, default=5)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--objectives", default="tg,pp")
    parser.add_argument("--db", required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/referee-studies"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    objectives = args.objectives.split(",")
    records = []
    for n in range(1, args.studies + 1):
        record = one_study(args, n, objectives[(n - 1) % len(objectives)])
        records.append(record)
        print(f"study {n}: {record['outcome'].get('outcome')} ({record['tune_s']:.0f} s + verify "
              f"{record['verify_s']:.0f} s)", file=sys.stderr, flush=True)
    print("| study | objective | outcome | recommendation (llama-bench) | baseline | fleettune claimed "
          "| llama-bench measured | llama-bench inside the claim |")
    print("|---:|---|---|---|---|---|---|---|")
    for record in records:
        print(*rows_of(record), sep="\n")
    # a gain over llama.cpp's defaults is claimed where the claimed interval lies above 1
    against_defaults = [next(v for v in r["verify"] if v["config"] == "llama.cpp defaults") for r in records]
    claimed = [v for v in against_defaults if (v.get("claimed_low") or 0) > 1.0]
    confirmed = [v for v in claimed if v.get("verdict") == "faster"]
    # rule 20.7: llama-bench's ratio lies inside the interval fleettune claimed (verify's inside_claim)
    inside = sum(bool(v.get("inside_claim")) for r in records for v in r["verify"] if "inside_claim" in v)
    total = sum("inside_claim" in v for r in records for v in r["verify"])
    aa = [r["outcome"].get("noise_aa") for r in records]
    print(f"\n{len(records)} studies; {len(claimed)} claimed a gain over llama.cpp's defaults, {len(confirmed)} of them "
          f"confirmed by llama-bench; llama-bench's ratio inside the claimed interval {inside} of {total}; "
          f"A/A arms: {sum('no measurable' not in str(a) for a in aa)} of {len(aa)} left out 1")


if __name__ == "__main__":
    main()
