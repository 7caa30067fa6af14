"""Per-hardware schedules: recompute recommendations from all evidence, answer "what should chip C
run for model M" (measured where the fleet has measured it, predicted where it has not), and
give a new study its warm start.
"""

from __future__ import annotations

from orchestrator import learn, transfer
from orchestrator.db import Database, repo
from orchestrator.db.session import retrying
from workers.errors import BadInput
from workers.hardware import Fingerprint
from workers.models import ModelInfo
from workers.objective import CAPACITY
from workers.slo import DEFAULT_SLO_TEXT
from workers.trial import BenchParams


def hardware(db: Database, chip_key: str) -> Fingerprint:
    """A chip's hardware: from a node that has joined, else from the Apple Silicon chip table."""
    from workers import simulated

    with db.session() as s:
        row = repo.chip_by_key(s, chip_key)
        if row is not None and transfer.comparable(hw := repo.fingerprint_of_chip(row)):
            return hw
    for chip in simulated.all_chips():
        if chip.chip_key == chip_key:
            return chip
    raise BadInput(f"unknown chip {chip_key!r}: not in the fleet's database nor in the chip table")


def examples(db: Database, objective: str, simulated: bool) -> list[transfer.Example]:
    """Every chip's newest recommendation for ``objective`` as a training example."""
    out = []
    with db.session() as s:
        for rec in repo.all_latest_recommendations(s, objective, simulated):
            hw = repo.fingerprint_of_chip(rec.chip)
            model = repo.model_info_of(rec.model)
            if not transfer.comparable(hw) or rec.expected_tps <= 0 or not transfer.describable(model):
                continue  # e.g. a model imported from llama-bench output, its layers unknown
            out.append(transfer.Example(rec.chip.key, hw, model, BenchParams.from_dict(rec.params),
                                        rec.expected_tps))
    return out


def predictor(db: Database, objective: str, simulated: bool | None = None
              ) -> tuple[transfer.ConfigPredictor, bool]:
    """A predictor over real evidence where there is enough of it, else over simulated evidence."""
    kinds = [simulated] if simulated is not None else [False, True]
    for kind in kinds:
        found = examples(db, objective, kind)
        if len(found) >= transfer.MIN_EXAMPLES:
            return transfer.ConfigPredictor(found), kind
    raise BadInput(f"too little evidence to predict from: tune at least {transfer.MIN_EXAMPLES} chips "
                   f"for objective {objective} first")


def recommend(db: Database, model: ModelInfo, chip_key: str, objective: str = "tg") -> dict:
    """The measured recommendation for (chip, model, objective), or a prediction when there is none."""
    with db.session() as s:
        models = repo.find_models(s, model.sha256)
        measured = repo.latest_recommendations(s, [m.id for m in models], chip_key, objective) if models else []
        measured = [r for r in measured if r.chip.key == chip_key]
        if measured:
            rec = measured[0]
            params = BenchParams.from_dict(rec.params)
            return {"chip": chip_key, "model": model.name, "objective": objective, "source": "measured",
                    "flags": params.llama_cpp_flags(), "llama_cpp_python": params.llama_cpp_python_kwargs(),
                    "expected_tps": rec.expected_tps, "interval": [rec.interval_low, rec.interval_high],
                    "version": rec.version, "evidence": rec.evidence, "simulated": rec.simulated,
                    "baselines": rec.baselines or {}, "gains": {
                        name: rec.expected_tps / value - 1 for name, value in (rec.baselines or {}).items() if value}}
    hw = hardware(db, chip_key)
    try:
        model_predictor, simulated = predictor(db, objective)
    except BadInput:
        if objective == CAPACITY.name and hw.vendor == "Apple":  # issue 22.6: the calibrated model's
            return simulated_capacity(hw, model)
        raise
    pred = model_predictor.predict(hw, model)
    return {"chip": chip_key, "model": model.name, "objective": objective, "source": "predicted",
            "flags": pred.params.llama_cpp_flags(), "llama_cpp_python": pred.params.llama_cpp_python_kwargs(),
            "expected_tps": pred.expected_tps, "interval": list(pred.interval), "version": None,
            "evidence": [key for key, _ in pred.nearest], "simulated": simulated,
            "n_examples": pred.n_examples}


def simulated_capacity(hw, model: ModelInfo, slo_text: str = DEFAULT_SLO_TEXT, prompt_tokens: int = 280,
                       gen_tokens: int = 128) -> dict:
    """An Apple chip's capacity predicted by the calibrated model (workers/simulated_served.py), where
    no served study of this objective exists yet: the users it serves at the SLO and the config."""
    from workers import simulated, simulated_served
    from workers.slo import parse_slo

    try:
        shape = simulated.shape_for_path(model.path)
    except Exception as exc:  # noqa: BLE001 - a model the simulator cannot shape: no prediction
        raise BadInput(f"no served study of {model.name} and no simulated shape for it: {exc}") from None
    found = simulated_served.capacity(hw, shape, parse_slo(slo_text), prompt_tokens, gen_tokens)
    config = found.config
    return {"chip": hw.chip_key, "model": model.name, "objective": CAPACITY.name, "source": "predicted (simulated)",
            "flags": config.flags() if config else None,
            "llama_cpp_python": config.params.llama_cpp_python_kwargs() if config else None,
            "expected_tps": float(found.users), "interval": [float(found.users), float(found.users)],
            "version": None, "evidence": [], "simulated": True, "slo": slo_text,
            "load": f"{prompt_tokens} prompt + {gen_tokens} generated tokens per request",
            "limited_by": found.limited_by}


def warm_start(db: Database, chip_key: str, model: ModelInfo, objective: str, simulated: bool
               ) -> list[BenchParams]:
    """What a new study measures first: the predicted configuration, then the best configurations
    of the nearest known chips. Empty when the fleet knows too little (the sampler starts cold)."""
    try:
        hw = hardware(db, chip_key)
        transfer.features(hw, model)  # a model the predictor cannot place: start cold
        model_predictor, _ = predictor(db, objective, simulated)
    except BadInput:
        return []
    pred = model_predictor.predict(hw, model)
    return [pred.params, *(params for key, params in pred.nearest if key != chip_key)]


def learn_all(db: Database, model: ModelInfo | None = None) -> list[dict]:
    """Recompute every completed study's recommendation from its evidence; a new version is stored
    only where the answer changed. Returns one row per study.

    Each study is its own transaction, retried when a study finishing at the same moment stored
    the same next version first (the unique key refuses the second insert; the retry reads it)."""
    with db.session() as s:
        names = [study.name for study in repo.completed_studies(s, model.sha256 if model else None)]
    rows = []
    for name in names:
        row = retrying(lambda n=name: _learn_one(db, n), conflicts=True)
        if row is not None:
            rows.append(row)
    return rows


def _learn_one(db: Database, name: str) -> dict | None:
    with db.session() as s:
        study = repo.get_study(s, name)
        draft = learn.recommend(study_records(s, study.id), study.objective, study.n_prompt, study.n_gen)
        if draft is None:
            return None
        latest = repo.latest_recommendations(s, [study.model_id], study.chip.key, study.objective)
        latest = [r for r in latest if r.chip_id == study.chip_id and r.n_prompt == study.n_prompt
                  and r.n_gen == study.n_gen and r.depth == study.depth and r.simulated == draft.simulated]
        unchanged = latest and latest[0].params == draft.params.to_dict() and \
            abs(latest[0].expected_tps - draft.expected_tps) <= 1e-9 * max(draft.expected_tps, 1)
        new = repo.NewRecommendation(study.chip_id, study.model_id, study.id, study.objective,
                                     study.n_prompt, study.n_gen, draft, source="learn", depth=study.depth)
        version = latest[0].version if unchanged else repo.add_recommendation(s, new).version
        return {"study": study.name, "chip": study.chip.key, "objective": study.objective,
                "flags": draft.params.llama_cpp_flags(), "expected_tps": draft.expected_tps,
                "version": version, "changed": not unchanged, "simulated": draft.simulated}


def study_records(session, study_id: int) -> list[learn.TrialRecord]:
    """A study's completed trials as learning records."""
    return trial_records(repo.study_trials(session, study_id))


def trial_records(rows) -> list[learn.TrialRecord]:
    """Stored trials (their completed ones) as learning records."""
    return [
        learn.TrialRecord(
            trial_id=r.id, phase=r.phase, params=BenchParams.from_dict(r.params),
            samples=tuple(learn.Sample(x.kind, x.rep, x.n_tokens, x.seconds) for x in r.samples),
            simulated=r.simulated, effective=r.effective, confirm_round=r.confirm_round,
            confirm_arm=r.confirm_arm, kl_divergence=r.kl_divergence,
        )
        for r in rows if r.state == "complete"
    ]
