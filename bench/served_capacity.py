"""Capacity at an SLO of several llama-server configurations, side by side (issue 22's done-when).

Each configuration is one served capacity trial (workers/served.py: a real llama-server with the
config's flags, closed-loop users doubling from 1 while the SLO holds, then bisected), in rounds
whose order rotates (A B C, B C A, ...) on this machine, so drift touches each alike. Per level it
keeps the aggregate and per-user generation rates: the per-user against aggregate tok/s curve
(``--plot``) is drawn from them.

    python bench/served_capacity.py MODEL.gguf --config "defaults=" --config "obvious=-np 32 -c 65536" \\
        --config "study=-np 64 -c 131072 -cram 0" -p 280 -n 128 --slo ttft_p90=1s,tps_p10=20 \\
        --max-users 128 --requests 64 --rounds 1 -o capacity.json [--plot pareto.png]

A config of no flags ("defaults=") gives llama-server nothing: every knob is its own default. Flags
are read over llama.cpp's defaults (every layer on the GPU, -t the physical cores, -b 2048 -ub 512,
-fa auto), so "-np 32 -c 65536" changes only the slots and the context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from orchestrator.verify import rotation  # noqa: E402 (after the path is set)
from workers import served  # noqa: E402
from workers.models import read_model_info  # noqa: E402
from workers.trial import BenchParams, ServedWorkload, TrialSpec, Workload  # noqa: E402


def parse_config(text: str, info, base: BenchParams) -> tuple[str, BenchParams | None]:
    """NAME=FLAGS: the flags over llama.cpp's own defaults (``base``); no flags: None."""
    name, _, flags = text.partition("=")
    if not name or not _:
        raise SystemExit(f"--config {text!r}: NAME=FLAGS")
    return name, (BenchParams.from_llama_flags(flags, info.n_layer, base=base) if flags.strip() else None)


def one(model: str, sha256: str, params: BenchParams | None, workload: Workload, load: ServedWorkload,
        timeout_s: float, key: str) -> dict:
    spec = TrialSpec(model_path=model, model_sha256=sha256, params=params or BenchParams(), workload=workload,
                     timeout_s=timeout_s, trial_key=key, served=load)
    result = served.measure(spec, give_flags=params is not None)  # None: llama-server's own defaults
    out = {"ok": result.ok, "error": result.error, "effective": result.effective,
           "capacity": result.samples[0].n_tokens if result.ok and result.samples else None,
           "argv": (result.served or {}).get("argv"), "build": (result.served or {}).get("build")}
    out["levels"] = [{"users": lv["users"], **{k: lv["figures"][k] for k in
                                                ("meets_slo", "why", "throughput_tps", "goodput", "failed")},
                      "ttft_p90": lv["figures"]["percentiles"]["ttft_p90"],
                      "tps_p10": lv["figures"]["percentiles"]["tps_p10"],
                      "tps_p50": lv["figures"]["percentiles"]["tps_p50"],
                      "busy_slots_per_decode": lv["metrics"].get("llamacpp:n_busy_slots_per_decode"),
                      "deferred": lv["metrics"].get("llamacpp:requests_deferred")}
                     for lv in (result.served or {}).get("levels", [])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--config", action="append", required=True, help="NAME=llama-server flags")
    parser.add_argument("-p", "--prompt-tokens", type=int, default=280)
    parser.add_argument("-n", "--gen-tokens", type=int, default=128)
    parser.add_argument("--slo", default="ttft_p90=1s,tps_p10=20")
    parser.add_argument("--max-users", type=int, default=128)
    parser.add_argument("--requests", type=int, default=64, help="measured requests per level (at least the users)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("-o", "--out", required=True)
    parser.add_argument("--plot", help="PNG: per-user p10 against aggregate tok/s, each config's levels")
    args = parser.parse_args()
    info = read_model_info(args.model)
    from orchestrator.space import llama_cpp_defaults
    from workers.hardware import fingerprint_live

    base = llama_cpp_defaults(fingerprint_live(), info)  # what llama-server runs with unless told
    configs = [parse_config(text, info, base) for text in args.config]
    workload = Workload(n_prompt=args.prompt_tokens, n_gen=args.gen_tokens, reps=1)
    load = ServedWorkload(requests=args.requests, windows=1, capacity=True, max_users=args.max_users, slo=args.slo,
                          window_s=args.timeout)
    rounds: list[dict] = []
    for r, order in enumerate(rotation(configs, args.rounds)):
        for name, params in order:
            measured = one(args.model, info.sha256, params, workload, load, args.timeout, f"{name}-{r}")
            rounds.append({"round": r, "config": name, "flags": params.llama_cpp_flags() if params else "",
                           **measured})
            print(f"round {r} {name:<10} capacity {measured['capacity']} "
                  f"({'ok' if measured['ok'] else measured['error']})", flush=True)
    summary = {}
    for name, _ in configs:
        caps = [x["capacity"] for x in rounds if x["config"] == name and x["capacity"] is not None]
        summary[name] = {"capacity": caps, "median": statistics.median(caps) if caps else None}
    Path(args.out).write_text(json.dumps({"workload": vars(args), "summary": summary, "rounds": rounds}, indent=1))
    for name, figures in summary.items():
        print(f"{name:<10} users at the SLO: {figures['capacity']} (median {figures['median']})")
    if args.plot:
        plot(rounds, args.plot, args.slo)


def plot(rounds: list[dict], path: str, slo: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(x["config"] for x in rounds):
        levels = [lv for x in rounds if x["config"] == name for lv in x["levels"] if lv["tps_p10"]]
        levels.sort(key=lambda lv: lv["users"])
        ax.plot([lv["throughput_tps"] for lv in levels], [lv["tps_p10"] for lv in levels], marker="o", label=name)
        for lv in levels:
            ax.annotate(str(lv["users"]), (lv["throughput_tps"], lv["tps_p10"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("aggregate generation tok/s (all users)")
    ax.set_ylabel("per-user tok/s, 10th percentile")
    ax.set_title(f"served: per-user against aggregate tok/s (labels: users; SLO {slo})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
