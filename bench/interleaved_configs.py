"""fleettune's own measurement of several configurations in rotating order (A B C, B C A, ...), no
referee: is a difference a study reported there when nothing else runs beside it?

Each configuration is given in llama.cpp's flags (``-tb`` too, which llama-bench lacks); each round
measures every one once with ``workers.bench.measure`` (one measuring process, as in a study), the
order rotating so that time and position touch each alike. It prints each one's effective
configuration (what llama.cpp ran) once, then the median pp and tg tok/s over the rounds with the
range:

    python bench/interleaved_configs.py MODEL.gguf --config "-t 1 -tb 2 -b 512 -ub 512" \\
        --config "-t 2 -b 256 -ub 256" -p 256 -n 0 -r 3 --rounds 8 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compare_llama_bench import join_configs  # noqa: E402
from orchestrator.space import llama_cpp_defaults  # noqa: E402
from orchestrator.verify import rotation  # noqa: E402
from workers.bench import measure  # noqa: E402
from workers.errors import BadInput  # noqa: E402
from workers.hardware import fingerprint_live  # noqa: E402
from workers.models import read_model_info  # noqa: E402
from workers.trial import BenchParams, TrialSpec, Workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--config", action="append", required=True, help="llama.cpp flags of one configuration")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args(join_configs(sys.argv[1:]))
    info = read_model_info(args.model)
    base = llama_cpp_defaults(fingerprint_live(), info)  # flags left out are llama.cpp's defaults
    try:
        configs = {text: BenchParams.from_llama_flags(text, info.n_layer, base=base) for text in args.config}
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    workload = Workload(n_prompt=args.p, n_gen=args.n, reps=args.r)
    rates: dict[str, dict[str, list[float]]] = {text: {"pp": [], "tg": []} for text in configs}
    for round_no, order in enumerate(rotation(list(configs), args.rounds)):
        for text in order:
            result = measure(TrialSpec(info.path, info.sha256, configs[text], workload, timeout_s=600,
                                       trial_key=f"{round_no}"))
            if not result.ok:
                print(f"round {round_no + 1} {text}: {result.error}", file=sys.stderr, flush=True)
                continue
            for kind, summary in (("pp", result.pp), ("tg", result.tg)):
                if summary is not None:
                    rates[text][kind].append(summary.mean)
            if round_no == 0:
                print(f"{text}: llama.cpp ran {result.effective}", flush=True)
    for text, kinds in rates.items():
        for kind, values in kinds.items():
            if values:
                print(f"{text:40} {kind}: median {statistics.median(values):9.2f} tok/s "
                      f"({min(values):.2f}-{max(values):.2f}, {len(values)} rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": info.path, "workload": workload.to_dict(),
                                               "rates": rates}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
