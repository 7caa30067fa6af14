"""How noisy is the served canary analysis? An A/A test: three `fleettune serve` servers with the SAME
config under tests/test_serve_fleet.py's request loop (one openai client, round robin, 8-token
completions), judged as a canary against two controls, many times, by the old method and the new.

- old: each node probed in turn, 4 samples, each a one-token request and the full request of the
  same prompt (the server reuses the prompt it just processed, or not if another client's request
  came in between), medians;
- new: a warm-up round, then rounds of one sample per node in rotating order, the two requests of a
  sample on different prompts, the full one generating at least PROBE_MIN_GEN tokens, rates from the
  fastest samples (orchestrator.canary.probe_interleaved).

For identical configs the canary/control ratio should be 1; a ratio below 1 - tolerance is a
spurious rollback. Prints, per method and objective, the median ratio, its range and how many
analyses would have rolled back at tolerance 0.2 and 0.4.

    python bench/serve_canary_noise.py --analyses 8
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_load import RoundRobinLoop  # noqa: E402 (after the path is set)
from bench.serve_rollout import wait_for  # noqa: E402

FLEETTUNE = str(Path(sys.executable).with_name("fleettune"))
N_PROMPT, N_GEN = 64, 8
PARAMS = {"n_gpu_layers": 0, "n_threads": 2, "n_batch": 512, "n_ubatch": 512, "flash_attn": False,
          "n_threads_batch": None}


def old_sample(address: str, model: str, prompt: str) -> tuple[float, float, int, int]:
    """The old probe's sample: the one-token and the full request of the same prompt."""
    times, usage = [], {}
    for max_tokens in (1, N_GEN):
        conn = http.client.HTTPConnection("127.0.0.1", int(address.rsplit(":", 1)[1].split("/")[0]), timeout=120)
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0.0}).encode(),
                     {"Content-Type": "application/json"})
        usage = json.loads(conn.getresponse().read())["usage"]
        times.append(time.perf_counter() - started)
        conn.close()
    return times[0], times[1], usage["prompt_tokens"], usage["completion_tokens"]


def old_method(statuses: list[dict], objectives) -> dict[str, list[float | None]]:
    """Per objective, each node's rate: nodes in turn, 4 samples each, medians."""
    from workers import probe

    rates: dict[str, list[float | None]] = {o.name: [] for o in objectives}
    for s in statuses:
        samples = [old_sample(s["address"], s["model"], probe.prompt_of(N_PROMPT, i)) for i in range(4)]
        pp = statistics.median(p / t for t, _, p, _ in samples)
        tg = [(g - 1) / (total - t) for t, total, _, g in samples if total > t and g > 1]
        for o in objectives:
            rates[o.name].append(o.rate(pp, statistics.median(tg) if tg else None, N_PROMPT, N_GEN))
    return rates


class Direct:
    """The rollout's Applier.probe, without Ray: the probe runs here against the server's address."""

    def __init__(self, statuses: dict[str, dict]) -> None:
        self.statuses = statuses

    def probe(self, node_id, n_prompt, n_gen, n_requests=1, first=0):
        from workers import probe

        s = self.statuses[node_id]
        return {"served": True, "config_version": 1, "config_version_after": 1,
                **probe.probe(s["address"], s["model"], n_prompt, n_gen, n_requests, first=first)}


def new_method(statuses: list[dict], objectives) -> dict[str, list[float | None]]:
    """Per objective, each node's median rate over the interleaved rounds (6, as the analysis took
    them when this bench was written; the analysis now takes rounds until its test decides)."""
    from orchestrator import canary

    nodes = [f"n{i}" for i in range(len(statuses))]
    figures = canary.probe_interleaved(Direct(dict(zip(nodes, statuses, strict=True))), nodes, N_PROMPT,
                                       max(N_GEN, canary.PROBE_MIN_GEN), rounds=6)
    print("  new: " + "; ".join(f"{n} ttft {figures[n]['best_ttft_s'] * 1000:.0f} ms, full "
                                f"{figures[n]['best_total_s'] * 1000:.0f} ms, tg {figures[n]['best_tg_tps'] or 0:.1f}"
                                for n in nodes), flush=True)
    return {o.name: [canary.served_rate(o, figures[n], N_PROMPT, N_GEN) for n in nodes] for o in objectives}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--analyses", type=int, default=8)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still stops the servers
    home = Path(tempfile.mkdtemp(prefix="fleettune-canary-noise-"))
    os.environ["FLEETTUNE_HOME"] = str(home)
    from workers import nodeconfig, serve
    from workers.models import fetch_known_model, read_model_info
    from workers.objective import objective

    model_path = fetch_known_model("smollm2-135m", home / "models")
    sha = read_model_info(model_path).sha256
    nodes = [f"{i:02x}" * 16 for i in (0xa1, 0xb2, 0xc3)]
    for node in nodes:
        nodeconfig.write(node, {"version": 1, "rollout_id": 1, "model_sha256": sha, "model_name": "m",
                                "objective": "tg", "expected_tps": 1.0, "params": PARAMS})
    procs = [subprocess.Popen([FLEETTUNE, "serve", "--model", str(model_path), "--node-id", n, "--port", "0",
                               "--server", "llama-cpp-python"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for n in nodes]
    try:
        statuses = [wait_for(lambda n=n: (s := serve.read_status(n)) and s["healthy"] and s["config_version"] == 1
                             and s, 180) for n in nodes]
        with RoundRobinLoop(statuses, max_requests=5000, max_s=1200) as loop:
            wait_for(lambda: loop.ok >= 3, 120)
            ratios: dict[tuple[str, str], list[float]] = {}
            objectives = [objective(name) for name in ("tg", "pp", "e2e")]
            for analysis in range(args.analyses):
                line = []
                for method, run in (("old", old_method), ("new", new_method)):
                    for name, rates in run(statuses, objectives).items():
                        canary, controls = rates[analysis % 3], [r for i, r in enumerate(rates) if i != analysis % 3]
                        ratio = canary / statistics.median(controls) if canary and all(controls) else float("nan")
                        ratios.setdefault((method, name), []).append(ratio)
                        line.append(f"{method} {name} {ratio:.2f}")
                print(f"analysis {analysis + 1}/{args.analyses} ({loop.ok} loop requests so far): {', '.join(line)}",
                      flush=True)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=120)
    first_failure = f" (first: {loop.failures[0]})" if loop.failures else ""
    print(f"\nrequest loop: {loop.ok} answered, {len(loop.failures)} failed{first_failure}")
    print(f"\nA/A canary/control ratio, {args.analyses} analyses per cell, workload {N_PROMPT}+{N_GEN} tokens, "
          f"params {PARAMS}")
    print(f"{'method':6} {'objective':9} {'median':>7} {'min':>6} {'max':>6} {'<0.8':>5} {'<0.6':>5}")
    for (method, name), values in sorted(ratios.items()):
        values = [v for v in values if v == v]  # an analysis without a rate is left out
        print(f"{method:6} {name:9} {statistics.median(values):7.2f} {min(values):6.2f} {max(values):6.2f} "
              f"{sum(v < 0.8 for v in values):5d} {sum(v < 0.6 for v in values):5d}")


if __name__ == "__main__":
    main()
