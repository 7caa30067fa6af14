"""The simulator's outputs over a large fixed grid, as JSON: run before and after a refactor of the
simulator or the model record and compare the files (they must be equal byte for byte).

Every chip bin (at its base memory and at 192 GB) x every named shape and "tiny" x six quantisations
x 12 seeded random configurations (ngl, threads, prompt threads, batch, ubatch, flash attention,
K/V cache types, n_cpu_moe, op offload, workload, depth) x both scenarios; the grid optimum of tg,
pp and e2e for every third chip; seeded measurements of a simulated node; each shape's record and
expert layout. Floats are written with repr, so equal files mean equal values.

    python bench/sim_outputs.py /tmp/before.json   # then change the code
    python bench/sim_outputs.py /tmp/after.json && cmp /tmp/before.json /tmp/after.json

A change that adds chip bins (M5) draws the random configurations of later chips differently: compare
the bins that existed before with ``--generations M1,M2,M3,M4`` on the new code.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator import space  # noqa: E402
from workers import simulated  # noqa: E402
from workers.models import ModelInfo  # noqa: E402
from workers.simulated import BenchParams, Prediction, SimulatedNode, Workload, optimum, predict  # noqa: E402
from workers.trial import TrialSpec  # noqa: E402

QUANTS = ("f16", "q8_0", "q6_k", "q4_k_m", "q4_0", "q2_k")
MODELS = (*simulated.NAMED_SHAPES, "tiny")
CACHES = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("q4_0", "q8_0"))


def model_shape(name: str, quant: str) -> ModelInfo:
    """A named shape, or the test shape "tiny" (not a named one)."""
    return simulated.named_model(name, quant) if name == "tiny" else simulated.model_shape(name, quant)


def pred(p: Prediction) -> list:
    return [repr(p.pp_tps), repr(p.tg_tps), repr(p.gpu_bytes), p.fits, p.reason]


def main(out: str, generations: str | None = None) -> None:
    rng = random.Random(20261130)
    res = {"constants": repr(simulated.fitted_constants()), "dims": repr(simulated.fitted_dims())}
    models = {}
    for name in MODELS:
        for q in QUANTS:
            info = model_shape(name, q)
            models[f"{name}/{q}"] = {"summary": info.summary(), "moe": repr(space.moe_layout(info)) if name != "tiny" else None,
                                     "n_params": info.n_params, "size": info.size_bytes}
            if name != "tiny":
                models[f"{name}/{q}"]["eq"] = [simulated.sim_model_info(f"sim://{name}/{q}") == info,
                                               simulated.shape_for_path(f"sim://{name}/{q}") == info]
    res["models"] = models
    chips = simulated.all_chips()
    if generations:
        chips = [c for c in chips if c.generation in generations.split(",")]
    cases = []
    for chip in chips:
        for mem in (None, 192):
            c = chip if mem is None else simulated.with_memory(chip, mem)
            cores = c.p_cores + (c.m_cores or 0) + c.e_cores
            for name in MODELS:
                for q in QUANTS:
                    shape = model_shape(name, q)
                    L = shape.n_layer
                    for _ in range(12):
                        ngl = rng.choice((0, 1, L // 2, L - 1, L, L + 1, 99))
                        ctk, ctv = rng.choice(CACHES)
                        fa = rng.choice(("off", "on", "auto"))
                        if ctv != "f16":
                            fa = "on"
                        ub = rng.choice((1, 16, 32, 64, 256, 512, 1024))
                        params = BenchParams(
                            n_gpu_layers=ngl, n_threads=rng.randint(1, cores + 4),
                            n_batch=rng.choice((ub, 2048, 4096)), n_ubatch=ub, flash_attn=fa,
                            n_threads_batch=rng.choice((None, 1, cores)), type_k=ctk, type_v=ctv,
                            n_cpu_moe=rng.choice((0, 0, 1, L // 4, L // 2, L, L + 5)),
                            op_offload=rng.random() < 0.7)
                        n_prompt, n_gen = rng.choice(((512, 128), (512, 0), (0, 128), (2048, 256), (1, 1)))
                        depth = rng.choice((0, 0, 512, 4096, 32768))
                        for sc in ("calibrated", "seed"):
                            p = predict(c, shape, params, n_prompt, n_gen, sc, depth=depth)
                            cases.append([c.label, name, q, repr(params), n_prompt, n_gen, depth, sc, pred(p)])
    res["predict"] = cases
    optima = []
    for chip in chips[::3]:
        c = simulated.with_memory(chip, 128)
        for name in MODELS:
            q = rng.choice(QUANTS)
            shape = model_shape(name, q)
            for objective in ("tg", "pp", "e2e"):
                depth = rng.choice((0, 4096))
                try:
                    params, p, value = optimum(c, shape, objective, 512, 128, rng.choice(("calibrated", "seed")),
                                               depth=depth)
                    optima.append([c.label, name, q, objective, depth, repr(params), pred(p), repr(value)])
                except Exception as exc:  # noqa: BLE001 - an error is an output too
                    optima.append([c.label, name, q, objective, depth, "error", repr(exc)])
    res["optimum"] = optima
    measured = []
    for chip in chips[::2]:
        for name in MODELS[:-1]:
            q = rng.choice(QUANTS)
            node = SimulatedNode(simulated.with_memory(chip, 96), shape_for=simulated.shape_for_path, seed=7)
            for k in range(3):
                L = model_shape(name, q).n_layer
                params = BenchParams(rng.choice((0, L // 2, 99)), rng.randint(1, 8), 512, 512,
                                     flash_attn=rng.choice(("off", "on", "auto")), n_cpu_moe=rng.choice((0, L // 2)))
                spec = TrialSpec(f"sim://{name}/{q}", "x", params, Workload(512, 128, 2), trial_key=f"k{k}")
                r = node.measure(spec)
                measured.append([chip.label, name, q, r.ok, r.error if not r.ok else None,
                                 [repr(s.seconds) for s in r.samples], repr(r.load_s), r.peak_rss_bytes,
                                 r.thermal_after, repr(r.measure_s)])
    res["measure"] = measured
    with open(out, "w") as fh:
        json.dump(res, fh)
    print(f"{len(cases)} predict cases, {len(optima)} optima, {len(measured)} measurements, "
          f"{len(models)} model records -> {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--generations", help="only the bins of these generations, e.g. M1,M2,M3,M4")
    args = parser.parse_args()
    main(args.out, args.generations)
