"""Rollout: put a model's recommended configuration into service on every node, safely.

Per chip: a plan (the newest recommendation, its expected speed, the gain over what the nodes run
now); a canary share of the chip's nodes gets the new config first and each canary is verified by
a short benchmark against the expected speed (within a tolerance); all canaries pass → the rest of
the chip's nodes get it in waves; one fails → every node this rollout touched, on every chip, goes
back to the configuration it had, and the reason is recorded. Every step is stored before the next
one starts, so a rollout whose head was killed resumes where it stopped (or is rolled back).

Trust, step by step:

- write-ahead: a node's current config is read and recorded with the intended one (state
  ``intent``) BEFORE the apply is sent, so a head killed between the apply and its record resumes
  knowing the node's true previous config;
- applies and restores are conditional on the node (``only_if``): an apply happens only over the
  recorded previous config, a restore only over this rollout's config, so a failed apply never
  deletes a config and a rollback never undoes a later change;
- a failed row stops promotion: resuming a rollout with one rolls it back instead;
- rollback reaches every node it can; one that does not answer is ``restore_pending`` (the rollout
  stays ``rolling_back``) and is restored when it answers again (`rollout rollback`, `rollout sync`);
  the config hub forgets a rollout's config before its first node is restored, and a rollout rolled
  back already is left as it is (its reason kept);
- one driver at a time: a lease per model (``ft_models.rollout_lease_owner``, with a heartbeat, as
  studies have) is held by whoever starts, resumes or rolls back its rollouts; a second one is
  refused while the holder is alive, a stale one taken over (rule 24.4);
- a canary's verdict is pass, fail or inconclusive (orchestrator.canary); inconclusive pauses the
  rollout (state ``paused``, its reason the rollout's message) and `rollout start` judges it again.

The calls to a node live in orchestrator.nodecalls, the canary analysis in orchestrator.canary;
this module is the state machine.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from orchestrator import canary, dispatch, lease
from orchestrator.db import Database, repo
from orchestrator.nodecalls import Applier
from workers import knobs
from workers.errors import BadInput, FleettuneError
from workers.models import ModelInfo
from workers.nodeconfig import NodeConfig, ServedWorkload, validate_params
from workers.objective import objective as objective_named
from workers.trial import BenchParams

UNFINISHED = repo.UNFINISHED_ROLLOUT_STATES  # running, rolling_back, paused: `rollout start` resumes them


@dataclass(frozen=True)
class ChipPlan:
    chip_key: str
    payload: dict
    nodes: list[str]  # ray node ids, canaries first
    n_canary: int
    expected_tps: float
    current: str | None  # what the nodes run now (flags), if any rollout put it there
    simulated: bool


def parse_pin(text: str, n_layer: int | None = None) -> dict:
    """An operator's pin, "-ngl 99 -t 4 -b 512 -ctk q8_0 -fa auto" (flags of any llama.cpp tool, read
    by the knob table), as the stored params it sets; ``n_layer``: the model's, for -ngl all."""
    if not text.split():
        raise BadInput(f"--params {text!r}: expected flags such as '-ngl 99 -t 4 -b 512'")
    try:
        return knobs.stored_form(knobs.parse_flags(text, n_layer))
    except BadInput as exc:
        raise BadInput(f"--params: {exc}") from None


def _payload(rec, model: ModelInfo, objective: str, version: int, rollout_id: int, pin: dict | None = None
             ) -> dict:
    """A chip's config: the recommendation's, or an operator's pin over it (judged against the same
    expected figure: a pin must do at least as well as the recommendation it replaces)."""
    params = BenchParams.from_dict(knobs.over(rec.params, pin or {}))
    if pin and "n_ubatch" not in pin:
        params = BenchParams.from_dict({**params.to_dict(), "n_ubatch": min(params.n_ubatch, params.n_batch)})
    return NodeConfig(version=version, rollout_id=rollout_id, model_sha256=model.sha256, model_name=model.name,
                      objective=objective_named(objective), params=validate_params(params.to_dict()),
                      expected_tps=float(rec.expected_tps), source="pin" if pin else "recommendation",
                      workload=ServedWorkload(int(rec.n_prompt), int(rec.n_gen))).to_dict()


def plan(db: Database, model: ModelInfo, objective: str = "tg", chips: list[str] | None = None,
         canary_share: float = 0.1, pin: dict | None = None) -> list[ChipPlan]:
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
                chip_key=key, payload=_payload(rec, model, objective, rec.version, 0, pin), nodes=nodes,
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


class RolloutTakenOver(FleettuneError):
    """Another driver took the model's rollouts over (this one's heartbeat went stale): this one
    stops before its next write."""


class _Fenced:
    """The database as one driver of a model's rollouts sees it: every transaction first proves the
    driver still holds the model's rollout lease and refreshes its heartbeat (the lease is the
    fence, rule 24.4: a driver that lost it writes nothing more)."""

    def __init__(self, db: Database, model_id: int, model_sha256: str, owner: str) -> None:
        self.db, self.model_id, self.model_sha256, self.owner = db, model_id, model_sha256, owner

    @contextlib.contextmanager
    def session(self) -> Iterator:
        with self.db.session() as s:
            if not repo.renew_rollout_lease(s, self.model_id, self.owner):
                raise RolloutTakenOver("another driver took this model's rollouts over; this one stopped")
            yield s


def _beat(db: Database, model_id: int, owner: str, stop: threading.Event) -> None:
    """Refresh the lease while a long step (a benchmark, a server switch) writes nothing."""
    while not stop.wait(lease.HEARTBEAT_S):  # the heartbeat's period, not a synchronisation
        try:
            with db.session() as s:
                if not repo.renew_rollout_lease(s, model_id, owner):
                    return
        except Exception:  # noqa: BLE001 - the database away: the next beat tries again
            continue


@contextlib.contextmanager
def _driving(db: Database, model_id: int, model_name: str) -> Iterator[_Fenced]:
    """Be the one driver of the model's rollouts (start, resume, rollback) for the block (rule 24.4).
    Refused in one line (BadInput) while another driver holds them and is alive; a stale holder
    (its process gone on this host, or its heartbeat older than the lease's time to live) is taken
    over."""
    owner = lease.new_owner()
    with db.session() as s:
        holder = repo.acquire_rollout_lease(s, model_id, owner, lease.stale_before(), lease.holder_is_gone)
        model_sha256 = repo.model_sha256(s, model_id)
    if holder is not None:
        raise BadInput(f"rollouts of {model_name} are being driven by another process ({lease.describe(holder)}); "
                       f"wait for it, or stop it first")
    stop = threading.Event()
    beat = threading.Thread(target=_beat, args=(db, model_id, owner, stop), name="rollout-lease", daemon=True)
    beat.start()
    try:
        yield _Fenced(db, model_id, model_sha256, owner)
    finally:
        stop.set()
        beat.join(timeout=30)
        with contextlib.suppress(Exception), db.session() as s:  # a stale lease is taken over anyway
            repo.release_rollout_lease(s, model_id, owner)


def _model_id(db: Database, model: ModelInfo, objective: str) -> int:
    with db.session() as s:
        rows = repo.find_models(s, model.sha256)
    if not rows:
        raise BadInput(f"nothing to roll out for {model.name}: no chip has both a recommendation "
                       f"({objective}) and a live node")
    return rows[0].id


def refuse_unservable(plans: list[ChipPlan], applier: Applier) -> None:
    """BadInput, one line, where a node's server kind cannot apply its chip's config (the
    llama-cpp-python server has no field for -ncmoe or --no-op-offload): refused, never dropped."""
    for p in plans:
        params = BenchParams.from_dict(p.payload["params"])
        for node_id in p.nodes:
            status = applier.serve_status(node_id)
            problem = knobs.unservable(params, status.get("kind", "")) if status else None
            if problem:
                raise BadInput(f"node {node_id[:12]} ({p.chip_key}): {problem}")


def start(db: Database, model: ModelInfo, *, objective: str = "tg", chips: list[str] | None = None,
          canary_share: float = 0.1, tolerance: float = 0.05, applier: Applier | None = None,
          on_step: Callable[[str], None] | None = None, pin: str | None = None) -> int:
    """Create a rollout and carry it out; returns its id. An unfinished one for the model is resumed.
    Refused (BadInput) while another process drives the model's rollouts.

    ``pin``: llama.cpp flags ("-ngl 99 -t 4 -b 512") rolled out instead of the recommendation, over
    its other params, judged by the same canary analysis."""
    _check_tolerance(tolerance)
    pinned = parse_pin(pin, model.n_layer) if pin else None
    on_step = on_step or (lambda text: None)
    with _driving(db, _model_id(db, model, objective), model.name) as fenced:
        with fenced.session() as s:
            unfinished = repo.unfinished_rollout(s, model.sha256)
            rollout_id = unfinished.id if unfinished else None
        if rollout_id is not None and pinned:
            raise BadInput(f"rollout {rollout_id} of this model is unfinished: resume or roll it back first")
        if rollout_id is None:
            plans = plan(db, model, objective, chips, canary_share, pinned)
            applier = applier or Applier()
            refuse_unservable(plans, applier)
            with fenced.session() as s:
                rollout_id = repo.create_rollout(
                    s, model_id=fenced.model_id, objective=objective, source="pin" if pinned else "recommendation",
                    canary_share=canary_share, tolerance=tolerance, plan={p.chip_key: p.payload for p in plans},
                    nodes=_stages(plans))
        run(fenced, rollout_id, model, applier or Applier(), on_step)
        publish(fenced, on_step)
    return rollout_id


def _check_tolerance(tolerance: float) -> None:
    if not 0 <= tolerance < 1:
        raise BadInput(f"tolerance {tolerance:g}: must be in [0, 1)")


def _stages(plans: list[ChipPlan]) -> list[tuple[str, str, int]]:
    """(node, chip, stage) of every planned node: its chip's canaries at stage 0, then waves of as
    many nodes as there are canaries."""
    nodes = []
    for p in plans:
        wave = max(p.n_canary, 1)
        nodes += [(node_id, p.chip_key, 0 if i < p.n_canary else 1 + (i - p.n_canary) // wave)
                  for i, node_id in enumerate(p.nodes)]
    return nodes


@dataclass(frozen=True)
class Preview:
    """What ``start`` would do with these options (``--dry-run``): resume an unfinished rollout, or
    roll out each chip's plan, its canaries held to a floor of expected x (1 - tolerance)."""

    resumes: int | None  # the unfinished rollout that would be resumed instead of planning
    plans: list[ChipPlan]
    tolerance: float
    stages: list[tuple[str, str, int]]


def preview(db: Database, model: ModelInfo, *, objective: str = "tg", chips: list[str] | None = None,
            canary_share: float = 0.1, tolerance: float = 0.05, pin: str | None = None) -> Preview:
    """``start`` with the same options, changing nothing: its checks, the rollout it would resume or
    the plan (the pin over the recommendation) it would roll out."""
    _check_tolerance(tolerance)
    pinned = parse_pin(pin, model.n_layer) if pin else None
    with db.session() as s:
        unfinished = repo.unfinished_rollout(s, model.sha256)
    if unfinished is not None:
        if pinned:
            raise BadInput(f"rollout {unfinished.id} of this model is unfinished: resume or roll it back first")
        return Preview(unfinished.id, [], unfinished.tolerance, [])
    plans = plan(db, model, objective, chips, canary_share, pinned)
    return Preview(None, plans, tolerance, _stages(plans))


def publish(db: Database | _Fenced, on_step=None) -> None:
    """Tell the config hub what each chip runs now (joining nodes ask it through Ray): a driver
    its own model's configs, ``sync`` every model's."""
    from orchestrator import serving

    try:
        serving.publish_configs(db, db.model_sha256 if isinstance(db, _Fenced) else None)
    except RolloutTakenOver:
        raise
    except Exception as exc:  # noqa: BLE001 - the rollout stands; joining nodes then wait for `rollout sync`
        (on_step or print)(f"config hub not updated: {exc}")


@dataclass
class _Row:
    """A rollout node row, read out of its session."""

    id: int
    node_id: str
    chip_key: str
    stage: int
    config: dict
    previous: dict | None
    state: str
    intent: bool
    reason: str | None
    analysis: dict | None = None

    @classmethod
    def of(cls, n) -> _Row:
        return cls(n.id, n.ray_node_id, n.chip_key, n.stage, n.config, n.previous, n.state,
                   n.intent_at is not None, n.reason, n.analysis)


def _rows(db: Database, rollout_id: int) -> tuple[str, float, list[_Row]]:
    with db.session() as s:
        rollout = repo.get_rollout(s, rollout_id)
        return rollout.state, rollout.tolerance, [_Row.of(n) for n in repo.rollout_nodes(s, rollout_id)]


def _set(db: Database, row_id: int, **fields) -> None:
    with db.session() as s:
        repo.set_rollout_node(s, row_id, **fields)


def _set_state(db: Database, rollout_id: int, state: str, message: str | None = None) -> None:
    with db.session() as s:
        repo.set_rollout_state(s, rollout_id, state, message)


def run(db: _Fenced, rollout_id: int, model: ModelInfo, applier: Applier, on_step) -> None:
    """Carry out (or continue) a rollout: canaries, verification, waves; roll back on a failure,
    pause on an inconclusive canary (a later `rollout start` judges it again)."""
    state, tolerance, rows = _rows(db, rollout_id)
    if state == "rolling_back":
        _rollback(db, rollout_id, applier, on_step=on_step)
        return
    failed = [r for r in rows if r.state == "failed"]
    if failed:  # a head killed during its rollback: never promote past a failure
        _rollback(db, rollout_id, applier, failed[0].reason or f"node {failed[0].node_id[:12]} failed",
                  on_step=on_step)
        return
    if state == "paused":
        _set_state(db, rollout_id, "running")
    for stage in sorted({r.stage for r in rows}):
        for row in (r for r in rows if r.stage == stage):
            controls = [r.node_id for r in rows if r.chip_key == row.chip_key and r.stage > 0 and r.state == "pending"]
            stopped = _advance(db, row, model, applier, tolerance, on_step, controls)
            if stopped is None:
                continue
            outcome, reason = stopped
            on_step(reason)
            if outcome == canary.INCONCLUSIVE:  # never promotes: the rollout waits for a person
                _set_state(db, rollout_id, "paused", f"inconclusive: {reason}")
            else:
                _rollback(db, rollout_id, applier, reason, on_step=on_step)
            return
    _, _, rows = _rows(db, rollout_id)
    for row in rows:  # the record: what each serving node serves now, in the rollout's objective
        if applier.serve_status(row.node_id) and canary.wait_serving(applier, row.node_id, int(row.config["version"])):
            after = canary.served_snapshot(applier, row.node_id, row.config)
            if after:
                _set(db, row.id, analysis={**(row.analysis or {}), "after": after})
    _set_state(db, rollout_id, "promoted")


def _advance(db: _Fenced, row: _Row, model: ModelInfo, applier: Applier, tolerance: float, on_step,
             control_ids: list[str]) -> tuple[str, str] | None:
    """Take one node through intent, apply and (for a canary) verification; (outcome, reason) when
    the rollout cannot go on: canary.FAIL (rolled back) or canary.INCONCLUSIVE (paused)."""
    where = f"{row.chip_key} stage {row.stage} node {row.node_id[:12]}"
    if row.state == "pending":
        try:
            previous = applier.read(row.node_id)
        except Exception as exc:  # noqa: BLE001 - a node we cannot read is a failed step
            reason = f"{where}: could not read its config: {exc}"
            _set(db, row.id, state="failed", reason=reason)
            return canary.FAIL, reason
        before = canary.served_snapshot(applier, row.node_id, row.config)
        with db.session() as s:
            repo.record_intent(s, row.id, previous)
            if before:
                row.analysis = {**(row.analysis or {}), "before": before}
                repo.set_rollout_node(s, row.id, analysis=row.analysis)
        row.state, row.previous, row.intent = "intent", previous, True
    if row.state == "intent":
        try:
            result = applier.apply(row.node_id, row.config, only_if=[row.previous, row.config])
        except Exception as exc:  # noqa: BLE001 - any failure to apply is a failed step
            reason = f"{where}: could not apply: {exc}"
            _set(db, row.id, state="failed", reason=reason)
            return canary.FAIL, reason
        if not result["applied"]:
            reason = f"{where}: its config changed since it was read; left as it is"
            _set(db, row.id, state="failed", reason=reason)
            return canary.FAIL, reason
        _set(db, row.id, state="applied")
        on_step(f"{where}: applied")
        row.state = "applied"
    if row.stage == 0 and row.state == "applied":  # canaries are verified before anyone else moves
        verdict = canary.analyse(row.node_id, row.chip_key, row.config, control_ids, model, applier, tolerance)
        row.analysis = {**(row.analysis or {}), **verdict.analysis}
        if verdict.outcome == canary.INCONCLUSIVE:
            _set(db, row.id, measured_tps=verdict.rate, analysis=row.analysis, reason=verdict.reason)
            return canary.INCONCLUSIVE, verdict.reason
        failed = verdict.outcome == canary.FAIL
        _set(db, row.id, state="failed" if failed else "verified", measured_tps=verdict.rate,
             analysis=row.analysis, reason=verdict.reason)
        if failed:
            return canary.FAIL, verdict.reason
        on_step(f"{row.chip_key} canary {row.node_id[:12]}: {verdict.summary}, verified")
    return None


@dataclass(frozen=True)
class RollbackResult:
    rollout_id: int
    restored: int  # nodes given back their previous config
    pending: int  # nodes that did not answer: restored when they do
    kept: int  # nodes that held neither config (a later change): left as they are
    already: bool = False  # it was rolled back before: nothing changed
    message: str | None = None  # the rollout's recorded reason


def latest_rollout_id(db: Database) -> int:
    with db.session() as s:
        latest = repo.latest_rollout(s)
        if latest is None:
            raise BadInput("no rollout yet")
        return latest.id


def rollback(db: Database, rollout_id: int | None = None, applier: Applier | None = None,
             reason: str = "rolled back by hand", on_step: Callable[[str], None] | None = None
             ) -> RollbackResult:
    """Every node this rollout touched gets back the configuration it had (default: the latest
    rollout). Refused (BadInput) while another process drives the model's rollouts; a rollout
    rolled back already changes nothing (rule 24.4)."""
    rollout_id = latest_rollout_id(db) if rollout_id is None else rollout_id
    with db.session() as s:
        rollout = repo.get_rollout(s, rollout_id)
        model_id, model_name = rollout.model_id, rollout.model.name
    with _driving(db, model_id, model_name) as fenced:
        return _rollback(fenced, rollout_id, applier or Applier(), reason, on_step or (lambda text: None))


def _rollback(db: _Fenced, rollout_id: int, applier: Applier, reason: str = "rolled back by hand",
              on_step: Callable[[str], None] = lambda text: None) -> RollbackResult:
    """Give every node the rollout touched its recorded previous config, if it holds this
    rollout's (or the previous one already). The config hub stops handing out the rollout's config
    before any node gives it up, so a node left with no config is not handed it again (rule 24.4).
    A node that does not answer is recorded ``restore_pending`` and the rollout stays
    ``rolling_back`` until a later call (or ``sync``) reaches it."""
    state, _, rows = _rows(db, rollout_id)
    with db.session() as s:
        recorded = repo.get_rollout(s, rollout_id).message
    if state == "rolled_back":
        return RollbackResult(rollout_id, 0, 0, 0, already=True, message=recorded)
    message = recorded if state == "rolling_back" else reason
    _set_state(db, rollout_id, "rolling_back", message)
    publish(db, on_step)  # no longer promoted: the hub forgets its config before a node is restored
    restored = kept = 0
    for row in rows:
        if row.state == "pending":
            _set(db, row.id, state="cancelled")
        elif row.intent and row.state in ("intent", "applied", "verified", "failed", "restore_pending"):
            outcome = _restore(db, row, applier, on_step)
            restored += outcome == "rolled_back"
            kept += outcome == "kept"
        # a failed row without an intent never reached its node: nothing to undo
    with db.session() as s:
        pending = repo.rollout_nodes_left_to_restore(s, rollout_id)
        if not pending:
            repo.set_rollout_state(s, rollout_id, "rolled_back", message)
    publish(db, on_step)
    return RollbackResult(rollout_id, restored, pending, kept, message=message)


def _restore(db: Database | _Fenced, row: _Row, applier: Applier, on_step) -> str:
    """Give one node back its recorded previous config, if it holds this rollout's (or already the
    previous one); the row's new state."""
    try:
        result = applier.apply(row.node_id, row.previous, only_if=[row.config, row.previous])
    except Exception as exc:  # noqa: BLE001 - an unreachable node is restored later
        _set(db, row.id, state="restore_pending", reason=f"restore pending: {exc}")
        on_step(f"node {row.node_id[:12]}: restore pending ({exc})")
        return "restore_pending"
    outcome = "rolled_back" if result["applied"] else "kept"
    fields = {"state": outcome}
    if row.state == "restore_pending":
        fields["reason"] = "restored after it answered again"
    elif outcome == "kept":
        fields["reason"] = "held another config since; left as it is"
    _set(db, row.id, **fields)
    on_step(f"node {row.node_id[:12]}: {outcome.replace('_', ' ')}")
    return outcome


def restore_pending(db: Database, applier: Applier | None = None, node_ids: list[str] | None = None,
                    on_step: Callable[[str], None] = lambda text: None) -> int:
    """Retry every pending restore (of ``node_ids`` only, when given), each model's as the driver of
    its rollouts (one another process drives is left to it); finishes the rollbacks that have none
    left. Returns how many nodes were restored."""
    applier = applier or Applier()
    with db.session() as s:
        rows = [(n.rollout_id, _Row.of(n)) for n in repo.pending_restores(s)
                if node_ids is None or n.ray_node_id in node_ids]
        model_of = {rollout_id: (repo.get_rollout(s, rollout_id).model_id, repo.get_rollout(s, rollout_id).model.name)
                    for rollout_id, _ in rows}
    restored = 0
    for model_id, model_name in sorted(set(model_of.values())):
        try:
            with _driving(db, model_id, model_name) as fenced:
                for rollout_id, row in rows:
                    if model_of[rollout_id] != (model_id, model_name):
                        continue
                    restored += _restore(fenced, row, applier, on_step) == "rolled_back"
                    with fenced.session() as s:
                        if not repo.rollout_nodes_left_to_restore(s, rollout_id):
                            rollout = repo.get_rollout(s, rollout_id)
                            repo.set_rollout_state(s, rollout_id, "rolled_back", rollout.message)
        except BadInput as exc:  # its driver restores them
            on_step(str(exc))
    return restored


def status_rows(db: Database, rollout_id: int | None = None) -> list[dict]:
    with db.session() as s:
        rollout = repo.get_rollout(s, rollout_id) if rollout_id else repo.latest_rollout(s)
        if rollout is None:
            raise BadInput("no rollout yet")
        return [{"rollout": rollout.id, "rollout_state": rollout.state, "chip": n.chip_key,
                 "node": n.ray_node_id[:12], "ray_node_id": n.ray_node_id, "stage": n.stage,
                 "state": n.state, "flags": BenchParams.from_dict(n.config["params"]).llama_cpp_flags(),
                 "version": n.config["version"], "measured_tps": n.measured_tps,
                 "control_tps": (n.analysis or {}).get("control_rate"),
                 "expected_tps": n.config["expected_tps"], "analysis": n.analysis, "reason": n.reason,
                 "rollout_message": rollout.message}
                for n in repo.rollout_nodes(s, rollout.id)]


def history_rows(db: Database) -> list[dict]:
    with db.session() as s:
        return [{"rollout": r.id, "model": r.model.name, "objective": r.objective, "state": r.state,
                 "source": r.source, "chips": ", ".join(sorted(r.plan)), "nodes": len(r.nodes),
                 "canary_share": r.canary_share, "tolerance": r.tolerance, "message": r.message,
                 "created_at": r.created_at} for r in repo.list_rollouts(s)]


def sync(db: Database, model: ModelInfo | None = None, applier: Applier | None = None) -> list[dict]:
    """Finish pending restores, then give every live node its chip's current configuration (the
    newest promoted rollout's) where it lacks it: for nodes that joined after the rollout, or whose
    file was lost."""
    applier = applier or Applier()
    restore_pending(db, applier)
    with db.session() as s:
        current = repo.current_chip_configs(s, model.sha256 if model else None)
    out = []
    for node in dispatch.bench_nodes():
        payload = current.get(node.chip_key or "")
        if payload is None:
            continue
        result = applier.apply(node.ray_node_id, payload)
        out.append({"node": node.ray_node_id[:12], "chip": node.chip_key, "version": payload["version"],
                    "changed": result["previous"] != payload})
    publish(db)
    return out
