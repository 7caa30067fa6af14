"""Rollout: put a model's recommended configuration into service on every node, safely.

Per chip: a plan (the newest recommendation, its expected speed, the gain over what the nodes run
now); a canary share of the chip's nodes gets the new config first and each canary is verified by
a short benchmark against the expected speed (within a tolerance); all canaries pass → the rest of
the chip's nodes get it in waves; one fails → every node this rollout touched, on every chip, goes
back to the configuration it had, and the reason is recorded. Every step is stored before the next
one starts, so a rollout whose head was killed resumes where it stopped (or is rolled back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator import dispatch
from orchestrator.db import Database, repo
from orchestrator.db.models import Rollout, RolloutNode, utcnow
from workers.errors import BadInput
from workers.models import ModelInfo
from workers.trial import BenchParams, TrialSpec, Workload

VERIFY_WORKLOAD = Workload(n_prompt=64, n_gen=16, reps=2)


@dataclass(frozen=True)
class ChipPlan:
    chip_key: str
    payload: dict
    nodes: list[str]  # ray node ids, canaries first
    n_canary: int
    expected_tps: float
    current: str | None  # what the nodes run now (flags), if any rollout put it there
    simulated: bool


def _payload(rec, model: ModelInfo, objective: str, version: int, rollout_id: int) -> dict:
    params = BenchParams.from_dict(rec.params)
    return {"version": version, "rollout_id": rollout_id, "model_sha256": model.sha256,
            "model_name": model.name, "objective": objective, "params": params.to_dict(),
            "expected_tps": float(rec.expected_tps)}


def plan(db: Database, model: ModelInfo, objective: str = "tg", chips: list[str] | None = None,
         canary_share: float = 0.1) -> list[ChipPlan]:
    """Per chip with a recommendation and live nodes: the config, its canaries and waves."""
    if not 0 < canary_share <= 1:
        raise BadInput(f"canary share {canary_share:g}: must be in (0, 1]")
    nodes_by_chip: dict[str, list[str]] = {}
    for node in dispatch.bench_nodes():
        nodes_by_chip.setdefault(node.chip_key or "?", []).append(node.ray_node_id)
    out = []
    with db.session() as s:
        models = repo.find_models(s, model.sha256)
        recs = repo.latest_recommendations(s, [m.id for m in models], None, objective) if models else []
        for rec in recs:
            key = rec.chip.key
            if (chips and key not in chips) or key not in nodes_by_chip:
                continue
            if any(p.chip_key == key for p in out):
                continue  # real before simulated (latest_recommendations orders them so)
            nodes = sorted(nodes_by_chip[key])
            current = repo.active_rollout_config(s, rec.model_id, key)
            out.append(ChipPlan(
                chip_key=key, payload=_payload(rec, model, objective, rec.version, 0), nodes=nodes,
                n_canary=max(1, math.ceil(canary_share * len(nodes))), expected_tps=rec.expected_tps,
                current=BenchParams.from_dict(current["params"]).llama_cpp_flags() if current else None,
                simulated=rec.simulated,
            ))
    if chips:
        missing = set(chips) - {p.chip_key for p in out}
        if missing:
            raise BadInput(f"no recommendation or no live node for chip(s): {', '.join(sorted(missing))}")
    if not out:
        raise BadInput(f"nothing to roll out for {model.name}: no chip has both a recommendation "
                       f"({objective}) and a live node")
    return out


class Applier:
    """The Ray side of a rollout: write a node's config, benchmark a node (both pinned to it)."""

    def __init__(self) -> None:
        import ray

        from workers import agent

        self._ray = ray
        self._apply = ray.remote(agent.apply_config)
        self.dispatcher = dispatch.RayDispatcher()

    def apply(self, node_id: str, payload: dict | None, timeout_s: float = 60) -> dict | None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ref = self._apply.options(
            num_cpus=0, max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, payload)
        ready, _ = self._ray.wait([ref], timeout=timeout_s)
        if not ready:
            self._ray.cancel(ref, force=True)
            raise TimeoutError(f"node {node_id[:12]} did not answer in {timeout_s:g}s")
        return self._ray.get(ref)

    def verify(self, node_id: str, chip_key: str, model: ModelInfo, payload: dict, timeout_s: float = 600
               ) -> float | None:
        """The objective's speed on that node with the new config (None: the benchmark failed)."""
        spec = TrialSpec(model_path=model.path, model_sha256=model.sha256,
                         params=BenchParams.from_dict(payload["params"]), workload=VERIFY_WORKLOAD,
                         timeout_s=timeout_s, trial_key=f"verify-{node_id[:8]}")
        ref = self.dispatcher.submit(spec, chip_key, node_id)
        if not self.dispatcher.wait([ref], timeout_s):
            self.dispatcher.cancel(ref)
            return None
        result = self.dispatcher.result(ref, spec.trial_key)
        if not result.ok:
            return None
        stats = result.stats("pp" if payload["objective"] == "pp" else "tg")
        return stats.median if stats else None


def start(db: Database, model: ModelInfo, *, objective: str = "tg", chips: list[str] | None = None,
          canary_share: float = 0.1, tolerance: float = 0.05, applier: Applier | None = None,
          on_step: Callable[[str], None] | None = None) -> int:
    """Create a rollout and carry it out; returns its id. A running one for the model is resumed."""
    if not 0 <= tolerance < 1:
        raise BadInput(f"tolerance {tolerance:g}: must be in [0, 1)")
    with db.session() as s:
        unfinished = repo.unfinished_rollout(s, model.sha256)
        rollout_id = unfinished.id if unfinished else None
    if rollout_id is None:
        plans = plan(db, model, objective, chips, canary_share)
        with db.session() as s:
            model_row = repo.find_models(s, model.sha256)[0]
            rollout = Rollout(model_id=model_row.id, objective=objective, state="running",
                              canary_share=canary_share, tolerance=tolerance, plan={})
            s.add(rollout)
            s.flush()
            rollout_id = rollout.id
            payloads = {p.chip_key: {**p.payload, "rollout_id": rollout_id, "version": rollout_id}
                        for p in plans}
            rollout.plan = payloads  # a new dict: SQLAlchemy does not see a JSON value change in place
            for p in plans:
                payload = payloads[p.chip_key]
                wave = max(p.n_canary, 1)
                for i, node_id in enumerate(p.nodes):
                    stage = 0 if i < p.n_canary else 1 + (i - p.n_canary) // wave
                    rollout.nodes.append(RolloutNode(ray_node_id=node_id, chip_key=p.chip_key, stage=stage,
                                                     config=payload, state="pending"))
    run(db, rollout_id, model, applier or Applier(), on_step or (lambda text: None))
    return rollout_id


def run(db: Database, rollout_id: int, model: ModelInfo, applier: Applier, on_step) -> None:
    """Carry out (or continue) a rollout: canaries, verification, waves; roll back on a failure."""
    with db.session() as s:
        rollout = s.get(Rollout, rollout_id)
        tolerance = rollout.tolerance
        stages = sorted({n.stage for n in rollout.nodes})
    for stage in stages:
        with db.session() as s:
            todo = [(n.id, n.ray_node_id, n.chip_key, n.config, n.state)
                    for n in s.get(Rollout, rollout_id).nodes if n.stage == stage]
        for row_id, node_id, chip_key, payload, state in todo:
            if state == "pending":
                try:
                    previous = applier.apply(node_id, payload)
                except Exception as exc:  # noqa: BLE001 - any failure to apply is a failed step
                    _set(db, row_id, state="failed", reason=f"apply failed: {exc}")
                    rollback(db, rollout_id, applier, f"node {node_id[:12]} could not apply: {exc}")
                    return
                _set(db, row_id, state="applied", previous=previous)
                on_step(f"{chip_key} stage {stage}: applied on {node_id[:12]}")
                state = "applied"
            if stage == 0 and state == "applied":  # canaries are verified before anyone else moves
                measured = applier.verify(node_id, chip_key, model, payload)
                floor = payload["expected_tps"] * (1 - tolerance)
                if measured is None or measured < floor:
                    got = "the benchmark failed" if measured is None else f"{measured:.2f} tok/s"
                    reason = (f"canary {node_id[:12]} ({chip_key}): {got}, expected at least {floor:.2f} "
                              f"({payload['expected_tps']:.2f} - {tolerance:.0%})")
                    _set(db, row_id, state="failed", measured_tps=measured, reason=reason)
                    on_step(reason)
                    rollback(db, rollout_id, applier, reason)
                    return
                _set(db, row_id, state="verified", measured_tps=measured)
                on_step(f"{chip_key} canary {node_id[:12]}: {measured:.2f} tok/s, verified")
    with db.session() as s:
        rollout = s.get(Rollout, rollout_id)
        rollout.state, rollout.message, rollout.updated_at = "promoted", None, utcnow()


def _set(db: Database, row_id: int, **fields) -> None:
    with db.session() as s:
        row = s.get(RolloutNode, row_id)
        for key, value in fields.items():
            setattr(row, key, value)
        row.updated_at = utcnow()


def rollback(db: Database, rollout_id: int, applier: Applier | None = None, reason: str = "rolled back by hand"
             ) -> int:
    """Every node this rollout touched gets back the configuration it had; returns how many."""
    applier = applier or Applier()
    with db.session() as s:
        rollout = s.get(Rollout, rollout_id)
        if rollout is None:
            raise BadInput(f"no rollout {rollout_id}")
        touched = [(n.id, n.ray_node_id, n.previous) for n in rollout.nodes
                   if n.state in ("applied", "verified", "failed")]
    restored = 0
    for row_id, node_id, previous in touched:
        applier.apply(node_id, previous)
        _set(db, row_id, state="rolled_back")
        restored += 1
    with db.session() as s:
        rollout = s.get(Rollout, rollout_id)
        rollout.state, rollout.message, rollout.updated_at = "rolled_back", reason, utcnow()
    return restored


def status_rows(db: Database, rollout_id: int | None = None) -> list[dict]:
    with db.session() as s:
        rollout = s.get(Rollout, rollout_id) if rollout_id else repo.latest_rollout(s)
        if rollout is None:
            raise BadInput("no rollout yet" if rollout_id is None else f"no rollout {rollout_id}")
        return [{"rollout": rollout.id, "rollout_state": rollout.state, "chip": n.chip_key,
                 "node": n.ray_node_id[:12], "ray_node_id": n.ray_node_id, "stage": n.stage,
                 "state": n.state, "flags": BenchParams.from_dict(n.config["params"]).llama_cpp_flags(),
                 "version": n.config["version"], "measured_tps": n.measured_tps,
                 "expected_tps": n.config["expected_tps"], "reason": n.reason} for n in rollout.nodes]


def history_rows(db: Database) -> list[dict]:
    with db.session() as s:
        return [{"rollout": r.id, "model": r.model.name, "objective": r.objective, "state": r.state,
                 "chips": ", ".join(sorted(r.plan)), "nodes": len(r.nodes),
                 "canary_share": r.canary_share, "tolerance": r.tolerance, "message": r.message,
                 "created_at": r.created_at} for r in repo.list_rollouts(s)]


def sync(db: Database, model: ModelInfo | None = None, applier: Applier | None = None) -> list[dict]:
    """Give every live node its chip's current configuration (the newest promoted rollout's) where
    it lacks it: for nodes that joined after the rollout, or whose file was lost."""
    applier = applier or Applier()
    out = []
    with db.session() as s:
        promoted = [r for r in repo.list_rollouts(s) if r.state == "promoted"
                    and (model is None or r.model.sha256 == model.sha256)]
        current: dict[str, dict] = {}
        for rollout in promoted:  # oldest first: newer rollouts overwrite
            current.update(rollout.plan)
    for node in dispatch.bench_nodes():
        payload = current.get(node.chip_key or "")
        if payload is None:
            continue
        previous = applier.apply(node.ray_node_id, payload)
        out.append({"node": node.ray_node_id[:12], "chip": node.chip_key, "version": payload["version"],
                    "changed": previous != payload})
    return out
