"""The served canary analysis's error rates on real llama-servers: A/A false rollbacks and the
detection of a seeded ITL regression (issue 22.7).

Three llama-servers of one model with the same config (``-np 2 -c 2048 --metrics``, the knob
table's flags for ``--threads``/``--batch``), all under load all the time: the analyses run one
after another, each in rounds of ``--round-s`` seconds in which every server is loaded by
``--users`` closed-loop users at the same moment (orchestrator.canaryload.load_rounds, the
rollout's own collection, with the node call made here instead of through Ray). Each analysis takes
one server as the canary (in turn) and the other two as its control group, and fresh requests
only; after every round it judges what it has (canaryload.judgement: the rollout's TTFT, ITL and
error rules) until the verdict is decisive or each arm has ``--max-points`` requests.

Every analysis is judged twice on the same requests: as measured (A/A: identical configs, so a
fail is a false rollback) and with a seeded regression, the canary's measured decode time
(e2e - TTFT) of every request multiplied by ``--seeded`` before judging (its ITL exactly that much
larger, its TTFT as measured). Each is judged at every ITL tolerance of ``--itl-tolerances``, each
with its own sequential looks and stop; the rounds go on until every one of them is decided.

    nice -n 5 python bench/canary_real.py --analyses 40 --prompt 16 --gen 8 --itl-tolerances 0.1,0.15 \
        --json docs/canary/real-aa-seeded-40.json    # the table in docs/serving.md
    python bench/canary_real.py --itl-tolerances 0.1,0.15 --table-from docs/canary/real-aa-seeded-40.json

Prints one table row per tolerance: A/A pass/fail/inconclusive (fail: false rollbacks), seeded
pass/fail/inconclusive (fail: detections), and the median analysis length (the canary's requests at
the verdict). ``--json`` writes every analysis's outcomes and lengths (after each analysis);
``--table-from`` prints the table of such files, their analyses pooled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator import canaryload, canarystats  # noqa: E402 (after the path is set)
from workers import llamatools, timedload  # noqa: E402
from workers.models import read_model_info  # noqa: E402
from workers.slo import RequestRecord  # noqa: E402
from workers.trial import BenchParams  # noqa: E402

MODEL = Path.home() / ".local/share/fleettune/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PARAMS = BenchParams(n_gpu_layers=0, n_threads=1, n_threads_batch=1, n_batch=512, n_ubatch=512, flash_attn=False)
SERVER_FLAGS = ["-np", "2", "-c", "2048", "--metrics", "--no-webui"]
ARMS = ("aa", "seeded")


def slowed(record: RequestRecord, factor: float) -> RequestRecord:
    """The seeded regression: the request's decode time (e2e - TTFT) times ``factor``, so its ITL is
    ``factor`` times the measured one and its TTFT unchanged."""
    if not record.ok:
        return record
    return dataclasses.replace(record, e2e_s=record.ttft_s + (record.e2e_s - record.ttft_s) * factor)


def start_servers(binary: str, n: int, log_dir: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """``n`` llama-servers of MODEL with PARAMS' flags and SERVER_FLAGS, each on a free port."""
    procs, urls = [], []
    for i in range(n):
        with socket.socket() as probe:  # a free port for the server to bind (llama-server takes no socket)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        # as nice as this process (run it under `nice`)
        argv = [binary, "-m", str(MODEL), *PARAMS.llama_cpp_flags("llama-server").split(),
                *SERVER_FLAGS, "--host", "127.0.0.1", "--port", str(port)]
        with open(log_dir / f"server-{i}.log", "w") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    while pending:
        if time.monotonic() > deadline:
            raise SystemExit(f"servers not healthy within {timeout_s:g}s: {sorted(pending)}")
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"a llama-server exited with {proc.returncode} (see its log)")
        for url in list(pending):
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        pending.discard(url)
            except OSError:
                pass
        if pending:
            time.sleep(0.5)  # polling a server's health, with the deadline above


def samples_of(summary: dict, factor: float | None = None) -> dict[str, list]:
    records = [canaryload.expand(r) for r in summary.get("records", [])]
    if factor is not None:
        records = [slowed(r, factor) for r in records]
    return canaryload.request_samples(records)


def run_analysis(number: int, urls: list[str], args, tolerances: list[float], vocab: int) -> dict:
    canary_at = number % len(urls)
    order = [canary_at] + [i for i in range(len(urls)) if i != canary_at]  # the canary first
    nodes = [f"s{i}" for i in order]
    decided: dict[tuple[str, float], dict] = {}
    started = time.monotonic()
    salt = 1 + number + 1000 * (os.getpid() % 1000)  # fresh prompts in every analysis of every run

    def load(node: str, index: int, round_no: int) -> dict:
        spec = canaryload.load_spec(args.prompt, args.gen, round_no, index, vocab, salt=salt, concurrency=args.users)
        result = timedload.run_for(urls[int(node[1:])], spec, args.round_s)
        return {"served": True, "records": [r.to_dict() for r in result.records], "config_version": 1,
                "config_version_after": 1}

    def look(summaries: dict[str, dict]) -> bool:
        controls = canaryload.pooled([samples_of(summaries[n]) for n in nodes[1:]])
        for arm in ARMS:
            canary = samples_of(summaries[nodes[0]], args.seeded if arm == "seeded" else None)
            for tol in tolerances:
                if (arm, tol) in decided:
                    continue
                rules = canaryload.metrics_for(None, itl_tolerance=tol, ttft_tolerance=args.ttft_tolerance)
                verdict = canaryload.judgement(canary, controls, rules)
                if verdict.outcome != canarystats.INCONCLUSIVE:
                    decided[(arm, tol)] = {"outcome": verdict.outcome, "failed": verdict.failed,
                                           "points": verdict.comparisons["itl"].n_canary,
                                           "control_points": verdict.comparisons["itl"].n_control,
                                           "itl_ratio": verdict.comparisons["itl"].ratio,
                                           "ttft_ratio": verdict.comparisons["ttft"].ratio,
                                           "seconds": time.monotonic() - started}
        return len(decided) == len(ARMS) * len(tolerances)

    summaries = canaryload.load_rounds(load, nodes, enough=look, budget_s=args.budget_s, max_points=args.max_points)
    look(summaries)  # the last round's requests are judged too
    canary = summaries[nodes[0]]
    final = canaryload.judgement(samples_of(canary), canaryload.pooled([samples_of(summaries[n]) for n in nodes[1:]]),
                                 canaryload.metrics_for(None))
    for arm in ARMS:
        for tol in tolerances:
            decided.setdefault((arm, tol), {"outcome": canarystats.INCONCLUSIVE, "failed": [],
                                            "points": final.comparisons["itl"].n_canary,
                                            "seconds": time.monotonic() - started})
    return {"analysis": number, "canary": f"s{canary_at}", "seconds": time.monotonic() - started,
            "requests": {n: summaries[n].get("requests") for n in nodes},
            "errors": {n: summaries[n].get("errors") for n in nodes},
            "final_itl_ratio": final.comparisons["itl"].ratio, "final_ttft_ratio": final.comparisons["ttft"].ratio,
            "canary_itl_ms": (canary.get("itl_s") or 0) * 1000, "canary_ttft_ms": (canary.get("ttft_s") or 0) * 1000,
            "decided": {f"{arm}@{tol:g}": v for (arm, tol), v in decided.items()}}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "?"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def summary_line(results: list[dict], args) -> str:
    ratios = [r["final_itl_ratio"] for r in results]
    return (f"{len(results)} analyses, median {statistics.median(r['seconds'] for r in results):.0f} s each; the A/A "
            f"canary's ITL over its controls' at the end (Hodges-Lehmann): median {statistics.median(ratios):.3f}, "
            f"range {min(ratios):.3f}-{max(ratios):.3f}; TTFT tolerance {args.ttft_tolerance:.0%}, errors margin "
            f"{canaryload.ERROR_MARGIN:.0%}; median canary ITL {statistics.median(r['canary_itl_ms'] for r in results):.0f} ms")


def table(results: list[dict], tolerances: list[float], args) -> str:
    lines = [f"| ITL tolerance | A/A pass / fail / inconclusive | false rollbacks (by metric) | seeded x{args.seeded:g}: "
             "pass / fail / inconclusive | detected | median canary requests at the verdict (A/A, seeded) | "
             "median seconds to the verdict (A/A, seeded) |",
             "|---:|---|---:|---|---:|---|---|"]
    n = len(results)
    for tol in tolerances:
        counts = {}
        for arm in ARMS:
            outcomes = [r["decided"][f"{arm}@{tol:g}"] for r in results]
            counts[arm] = ([sum(o["outcome"] == k for o in outcomes) for k in ("pass", "fail", "inconclusive")],
                           statistics.median(o["points"] for o in outcomes),
                           statistics.median(o["seconds"] for o in outcomes))
        (aa, aa_len, aa_s), (seeded, seeded_len, seeded_s) = counts["aa"], counts["seeded"]
        by_metric = {}
        for r in results:
            for name in r["decided"][f"aa@{tol:g}"]["failed"]:
                by_metric[name] = by_metric.get(name, 0) + 1
        why = f" ({', '.join(f'{k} {v}' for k, v in sorted(by_metric.items()))})" if by_metric else ""
        lines.append(f"| {tol:.0%} | {aa[0]} / {aa[1]} / {aa[2]} | {aa[1] / n:.1%}{why} | {seeded[0]} / {seeded[1]} / "
                     f"{seeded[2]} | {seeded[1] / n:.1%} | {aa_len:g}, {seeded_len:g} | {aa_s:.0f}, {seeded_s:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--analyses", type=int, default=40)
    parser.add_argument("--itl-tolerances", default="0.1,0.15,0.2")
    parser.add_argument("--ttft-tolerance", type=float, default=canaryload.TTFT_TOLERANCE)
    parser.add_argument("--seeded", type=float, default=1.3, help="the seeded ITL regression's factor")
    parser.add_argument("--max-points", type=int, default=canaryload.MAX_POINTS_PER_ARM)
    parser.add_argument("--round-s", type=float, default=4.0)
    parser.add_argument("--users", type=int, default=2, help="closed-loop users per server (its -np 2 slots)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--budget-s", type=float, default=600.0, help="one analysis's time budget")
    parser.add_argument("--max-minutes", type=float, default=90.0, help="no analysis starts after this")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--table-from", type=Path, nargs="+", metavar="JSON",
                        help="print the table of earlier runs' --json files (their analyses pooled); run nothing")
    args = parser.parse_args()
    tolerances = [float(t) for t in args.itl_tolerances.split(",")]
    if args.table_from:
        runs = [json.loads(path.read_text()) for path in args.table_from]
        results = [r for run in runs for r in run["results"]]
        print(summary_line(results, args))
        print(table(results, tolerances, args))
        return
    binary = llamatools.find_tool("llama-server")
    if not binary:
        raise SystemExit("llama-server not found (fleettune tools build)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still stops the servers
    vocab = read_model_info(str(MODEL)).n_vocab or 32000
    log_dir = Path(tempfile.mkdtemp(prefix="canary-real-"))
    procs, urls = start_servers(binary, 3, log_dir)
    results: list[dict] = []
    t0 = time.monotonic()
    try:
        wait_healthy(urls, procs)
        argv = Path(f"/proc/{procs[0].pid}/cmdline").read_bytes().decode().split("\0")
        print(f"{binary} ({llamatools.identity(binary).get('commit', '?')}), {cpu_name()}; servers: "
              f"{' '.join(argv[3:]).strip()}; workload {args.prompt} prompt + "
              f"{args.gen} generated tokens, {args.users} users per server, rounds of {args.round_s:g} s; logs {log_dir}",
              flush=True)
        for number in range(args.analyses):
            if time.monotonic() - t0 > args.max_minutes * 60:
                print(f"time bound: {number} analyses done", flush=True)
                break
            result = run_analysis(number, urls, args, tolerances, vocab)
            results.append(result)
            shown = ", ".join(f"{k} {v['outcome']}@{v['points']}" for k, v in result["decided"].items())
            if args.json:  # what is done so far, should the run be stopped
                args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results},
                                                indent=1, default=str))
            print(f"analysis {number + 1}/{args.analyses} (canary {result['canary']}, {result['seconds']:.0f} s, "
                  f"itl {result['canary_itl_ms']:.1f} ms x{result['final_itl_ratio']:.3f}, ttft "
                  f"x{result['final_ttft_ratio']:.3f}, errors {sum(result['errors'].values())}): {shown}", flush=True)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if not results:
        return
    print(f"\n{len(results)} analyses in {(time.monotonic() - t0) / 60:.1f} min; " + summary_line(results, args) + "\n")
    print(table(results, tolerances, args))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "cpu": cpu_name(),
                                         "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
