"""Rows for the query commands (`results`, `best`), from the database, ready for a printer."""

from __future__ import annotations

from orchestrator import learn
from orchestrator.db import Database, repo
from orchestrator.registry import model_key
from orchestrator.report import claim_fields, llama_bench_form
from workers.errors import BadInput
from workers.objective import objective
from workers.trial import BenchParams


def trial_rows(
    db: Database,
    *,
    chip: str | None = None,
    model: str | None = None,
    study: str | None = None,
    state: str | None = "complete",
    top: int | None = None,
) -> list[dict]:
    flt = repo.ResultFilter(chip=chip, model=model and model_key(db, model), study=study, state=state, top=top)
    with db.session() as s:
        trials = repo.query_trials(s, flt)
        return [
            {
                "id": t.id,
                "study": t.study.name,
                "chip": t.study.chip.key,
                "model": t.study.model.name,
                "model_sha256": t.study.model.sha256,
                "phase": t.phase,
                "optuna_number": t.optuna_number,
                "state": t.state,
                "error": t.error,
                "params": t.params,
                "flags": BenchParams.from_dict(t.params).llama_cpp_flags(),
                # what llama.cpp ran (issue 20.1), the confirmation's round and arm (20.2), the
                # KL divergence of a lossy cache (20.4)
                "effective": t.effective,
                "effective_flags": BenchParams.from_dict(t.effective).llama_cpp_flags() if t.effective else None,
                "confirm_round": t.confirm_round,
                "confirm_arm": t.confirm_arm,
                "kl_divergence": t.kl_divergence,
                "objective": t.study.objective,
                "objective_value": t.objective_value,
                "pp_tps": t.pp_tps_median,
                "pp_stddev": t.pp_tps_stddev,
                "tg_tps": t.tg_tps_median,
                "tg_stddev": t.tg_tps_stddev,
                "cv": {"pp": t.pp_cv, "tg": t.tg_cv}.get(objective(t.study.objective).main_kind),
                **served_fields(t.served),
                "e2e_s": t.e2e_s,
                "load_s": t.load_s,
                "peak_rss_bytes": t.peak_rss_bytes,
                "gpu_bytes": t.gpu_bytes,
                "gpu_device_bytes": t.gpu_device_bytes,
                "node": t.node.hostname if t.node else None,
                "sim": t.simulated,
                "started_at": t.started_at,
                "finished_at": t.finished_at,
            }
            for t in trials
        ]


def served_fields(served: dict | None) -> dict:
    """A served trial's figures at its last level (issue 22.8): users, goodput, aggregate and
    per-user rates, TTFT and ITL percentiles; {} for a benchmark trial."""
    if not served or not served.get("levels"):
        return {}
    levels = served["levels"]
    meeting = [level for level in levels if level["figures"]["meets_slo"]]
    shown = (meeting or levels)[-1]
    figures = shown["figures"]
    pcts = figures["percentiles"]
    return {"users": shown["users"], "goodput": figures["goodput"], "throughput_tps": figures["throughput_tps"],
            "ttft_p90": pcts.get("ttft_p90"), "itl_p90": pcts.get("itl_p90"), "tps_p10": pcts.get("tps_p10"),
            "meets_slo": figures["meets_slo"], "failed_requests": served.get("failed_requests"),
            "llama_build": (served.get("build") or {}).get("commit")}


def best_rows(db: Database, model_ref: str, chip: str | None, objective: str | None) -> list[dict]:
    with db.session() as s:
        models = repo.find_models(s, model_key(db, model_ref))
        if not models:
            raise BadInput(f"unknown model {model_ref!r}")
        recs = repo.latest_recommendations(s, [m.id for m in models], chip, objective)
        rows = []
        for rec in recs:
            params = BenchParams.from_dict(rec.params)
            baselines = rec.baselines or {}
            vs_llama_cpp = _gain(rec.expected_tps, baselines.get(learn.LLAMA_CPP))
            paired = (rec.claims or {}).get("vs", {})
            if learn.LLAMA_CPP in paired:  # the paired rounds' ratio (issue 20.3; None: unbounded)
                ratio = paired[learn.LLAMA_CPP]["ratio"]
                vs_llama_cpp = ratio - 1 if ratio is not None else None
            elif rec.claims and rec.claims.get("winner") == learn.LLAMA_CPP:  # llama.cpp's defaults recommended
                vs_llama_cpp = 0.0
            elif rec.claims:  # llama.cpp's defaults failed (over the GPU budget, issue 23.3): no figure
                vs_llama_cpp = None
            vs_fit = None
            if learn.FIT in paired and paired[learn.FIT]["ratio"] is not None:
                vs_fit = paired[learn.FIT]["ratio"] - 1
            elif (rec.claims or {}).get("winner") == learn.FIT:  # --fit's placement recommended
                vs_fit = 0.0
            rows.append({
                "chip": rec.chip.key,
                "model": rec.model.name,
                "objective": rec.objective,
                "n_prompt": rec.n_prompt,
                "n_gen": rec.n_gen,
                "depth": rec.depth,
                "flags": params.llama_cpp_flags(),
                "llama_bench_flags": llama_bench_form(params, rec.objective),
                "llama_cpp_python": params.llama_cpp_python_kwargs(),
                "baselines": baselines,
                "improvement_llama_cpp": vs_llama_cpp,
                "improvement_llama_cpp_pct": f"{vs_llama_cpp:+.0%}" if vs_llama_cpp is not None else None,
                "improvement_fit": vs_fit,  # over llama.cpp's --fit under the GPU budget (issue 23.3)
                "expected_tps": rec.expected_tps,
                "interval": [rec.interval_low, rec.interval_high],
                "pp_tps": rec.expected_pp_tps,
                "tg_tps": rec.expected_tg_tps,
                "baseline_tps": rec.baseline_tps,
                "improvement": rec.improvement,
                "improvement_pct": f"{rec.improvement:+.0%}" if rec.improvement is not None else None,
                "version": rec.version,
                "evidence": rec.evidence,
                "simulated": rec.simulated,
                "created_at": rec.created_at,
                "claims": rec.claims,
                **claim_fields(rec.claims),
            })
        return rows


def _gain(value: float, base: float | None) -> float | None:
    """The gain of ``value`` over a baseline's (rates: higher is better); None where not measured."""
    return value / base - 1 if base else None


def export_rows(db: Database, *, chip: str | None = None, model: str | None = None,
                study: str | None = None, simulated: bool = False) -> list[dict]:
    """Completed trials with what llama-bench's rows need: samples, chip, backend, build, model."""
    from orchestrator.llamabench import utc_iso

    flt = repo.ResultFilter(chip=chip, model=model and model_key(db, model), study=study, state="complete", top=None,
                            simulated=simulated)  # never real and simulated rows in one file
    with db.session() as s:
        return [
            {
                "params": t.params,
                "samples": [{"kind": x.kind, "n_tokens": x.n_tokens, "seconds": x.seconds} for x in t.samples],
                "chip": t.study.chip.key,
                "chip_name": t.study.chip.name,
                "gpu_name": t.study.chip.gpu_name,
                "backend": t.study.chip.backend,
                "llama_build": t.node.llama_build if t.node else None,
                "model": t.study.model.name,
                "model_path": t.study.model.path,
                "architecture": t.study.model.architecture,
                "file_type": t.study.model.file_type,
                "model_size": t.study.model.size_bytes,
                "model_n_params": t.study.model.n_params,
                "started_at": utc_iso(t.started_at),
                "depth": t.study.depth,
                "simulated": t.simulated,
            }
            for t in repo.query_trials(s, flt)
        ]
