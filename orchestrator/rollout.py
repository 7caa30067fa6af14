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
  stays ``rolling_back``) and is restored when it answers again (`rollout rollback`, `rollout sync`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator import dispatch
from orchestrator.db import Database, repo
from workers import agent, knobs
from workers.errors import BadInput
from workers.models import ModelInfo
from workers.nodeconfig import NodeConfig, ServedWorkload, validate_params
from workers.objective import objective as objective_named
from workers.trial import BenchParams, TrialSpec, Workload

VERIFY_REPS = 2
APPLY_TIMEOUT_S = 60.0
SWITCH_TIMEOUT_S = 300.0  # a serving canary has this long to start serving the new config
PROBE_ROUNDS = 6  # served A/B rounds (one sample per node each), after one warm-up round
MIN_ROUNDS = 3  # rounds always taken; more only within PROBE_BUDGET_S
PROBE_BUDGET_S = 20.0  # keeps a regression's detection well inside a minute of its apply
PROBE_MAX_PROMPT, PROBE_MAX_GEN = 1024, 128  # the workload, bounded to what a 2048 context holds
# A sample's full request generates at least this many tokens: its generation rate is the difference
# of two request times, and with a workload's 8 tokens that difference (about 70 ms here) was no
# larger than what another client's request or a busy CPU adds to either time (bench/serve_canary_noise.py)
PROBE_MIN_GEN = 32
MAX_CONTROLS = 2  # same-chip nodes on the old config measured beside each canary
SNAPSHOT_ROUNDS = 5  # served samples per node before its apply and after promotion (the record)


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


class Applier:
    """The Ray side of a rollout: read or write a node's config, benchmark a node (pinned to it).

    A node that does not answer within ``apply_timeout_s`` is unreachable for this step.
    """

    def __init__(self, apply_timeout_s: float = APPLY_TIMEOUT_S) -> None:
        import ray

        self._ray = ray
        self.apply_timeout_s = apply_timeout_s
        self.dispatcher = dispatch.RayDispatcher()

    def _on_node(self, remote, node_id: str, *args):
        ref = dispatch.on_node(remote, node_id).remote(node_id, *args)
        ready, _ = self._ray.wait([ref], timeout=self.apply_timeout_s)
        if not ready:
            self._ray.cancel(ref, force=True)
            raise TimeoutError(f"node {node_id[:12]} did not answer in {self.apply_timeout_s:g}s")
        return self._ray.get(ref)

    def read(self, node_id: str) -> dict | None:
        """The node's active config (None: it has none)."""
        return self._on_node(agent.read_config, node_id)

    def apply(self, node_id: str, payload: dict | None, only_if: list[dict | None] | None = None) -> dict:
        """Write ``payload`` on the node if it holds one of ``only_if`` (None: whatever it holds);
        ``{"previous": what it held, "applied": whether it was written}``."""
        return self._on_node(agent.apply_config, node_id, payload, only_if)

    def serve_status(self, node_id: str) -> dict | None:
        """What the node's `fleettune serve` serves (None: nothing, or it did not answer)."""
        try:
            status = self._on_node(agent.serve_status, node_id)
        except Exception:  # noqa: BLE001 - a node that does not answer serves nothing we can judge
            return None
        return status if status and status.get("fresh") else None

    def probe(self, node_id: str, n_prompt: int, n_gen: int, n_requests: int = 1, first: int = 0) -> dict:
        """The workload's prompt set (numbered from ``first``) sent to the node's own server; the
        summary with each sample (workers.probe)."""
        ref = dispatch.on_node(agent.probe_served, node_id).remote(node_id, n_prompt, n_gen, n_requests, 300, first)
        return self._ray.get(ref, timeout=600)

    def verify(self, node_id: str, chip_key: str, model: ModelInfo, payload: dict, timeout_s: float = 600
               ) -> float | None:
        """The payload's objective as a rate (tok/s, higher is better) on that node with the new
        config, on the recommendation's own workload (None: the benchmark failed)."""
        n_prompt, n_gen = _workload(payload)
        spec = TrialSpec(model_path=model.path, model_sha256=model.sha256,
                         params=BenchParams.from_dict(payload["params"]),
                         workload=Workload(n_prompt=n_prompt, n_gen=n_gen, reps=VERIFY_REPS),
                         timeout_s=timeout_s, trial_key=f"verify-{node_id[:8]}")
        ref = self.dispatcher.submit(spec, chip_key, node_id)
        if not self.dispatcher.wait([ref], timeout_s):
            self.dispatcher.cancel(ref)
            return None
        result = self.dispatcher.result(ref, spec.trial_key)
        if not result.ok:
            return None
        pp, tg = result.stats("pp"), result.stats("tg")
        return objective_named(payload["objective"]).rate(pp.median if pp else None, tg.median if tg else None,
                                                          n_prompt, n_gen)


def _workload(payload: dict) -> tuple[int, int]:
    """The recommendation's (prompt, generated) token counts; older payloads: a short tg run."""
    workload = payload.get("workload") or {"n_prompt": 64, "n_gen": 16}
    return int(workload["n_prompt"]), int(workload["n_gen"])


def start(db: Database, model: ModelInfo, *, objective: str = "tg", chips: list[str] | None = None,
          canary_share: float = 0.1, tolerance: float = 0.05, applier: Applier | None = None,
          on_step: Callable[[str], None] | None = None, pin: str | None = None) -> int:
    """Create a rollout and carry it out; returns its id. An unfinished one for the model is resumed.

    ``pin``: llama.cpp flags ("-ngl 99 -t 4 -b 512") rolled out instead of the recommendation, over
    its other params, judged by the same canary analysis."""
    if not 0 <= tolerance < 1:
        raise BadInput(f"tolerance {tolerance:g}: must be in [0, 1)")
    with db.session() as s:
        unfinished = repo.unfinished_rollout(s, model.sha256)
        rollout_id = unfinished.id if unfinished else None
    pinned = parse_pin(pin, model.n_layer) if pin else None
    if rollout_id is not None and pinned:
        raise BadInput(f"rollout {rollout_id} of this model is unfinished: resume or roll it back first")
    applier = applier or Applier()
    if rollout_id is None:
        plans = plan(db, model, objective, chips, canary_share, pinned)
        refuse_unservable(plans, applier)
        nodes = []
        for p in plans:
            wave = max(p.n_canary, 1)
            nodes += [(node_id, p.chip_key, 0 if i < p.n_canary else 1 + (i - p.n_canary) // wave)
                      for i, node_id in enumerate(p.nodes)]
        with db.session() as s:
            rollout_id = repo.create_rollout(
                s, model_id=repo.find_models(s, model.sha256)[0].id, objective=objective,
                source="pin" if pinned else "recommendation", canary_share=canary_share, tolerance=tolerance,
                plan={p.chip_key: p.payload for p in plans}, nodes=nodes)
    on_step = on_step or (lambda text: None)
    run(db, rollout_id, model, applier, on_step)
    publish(db, on_step)
    return rollout_id


def publish(db: Database, on_step=None) -> None:
    """Tell the config hub what each chip runs now (joining nodes ask it through Ray)."""
    from orchestrator import serving

    try:
        serving.publish_configs(db)
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


def run(db: Database, rollout_id: int, model: ModelInfo, applier: Applier, on_step) -> None:
    """Carry out (or continue) a rollout: canaries, verification, waves; roll back on a failure."""
    state, tolerance, rows = _rows(db, rollout_id)
    if state == "rolling_back":
        rollback(db, rollout_id, applier, on_step=on_step)
        return
    failed = [r for r in rows if r.state == "failed"]
    if failed:  # a head killed during its rollback: never promote past a failure
        rollback(db, rollout_id, applier, failed[0].reason or f"node {failed[0].node_id[:12]} failed",
                 on_step=on_step)
        return
    for stage in sorted({r.stage for r in rows}):
        for row in (r for r in rows if r.stage == stage):
            controls = [r for r in rows if r.chip_key == row.chip_key and r.stage > 0 and r.state == "pending"]
            failure = _advance(db, row, model, applier, tolerance, on_step, controls)
            if failure:
                on_step(failure)
                rollback(db, rollout_id, applier, failure, on_step=on_step)
                return
    _, _, rows = _rows(db, rollout_id)
    for row in rows:  # the record: what each serving node serves now, in the rollout's objective
        if applier.serve_status(row.node_id) and _wait_serving(applier, row.node_id, int(row.config["version"])):
            after = served_snapshot(applier, row)
            if after:
                _set(db, row.id, analysis={**(row.analysis or {}), "after": after})
    with db.session() as s:
        repo.set_rollout_state(s, rollout_id, "promoted")


def _advance(db: Database, row: _Row, model: ModelInfo, applier: Applier, tolerance: float, on_step,
             controls: list[_Row]) -> str | None:
    """Take one node through intent, apply and (for a canary) verification; the failure, if any."""
    where = f"{row.chip_key} stage {row.stage} node {row.node_id[:12]}"
    if row.state == "pending":
        try:
            previous = applier.read(row.node_id)
        except Exception as exc:  # noqa: BLE001 - a node we cannot read is a failed step
            reason = f"{where}: could not read its config: {exc}"
            _set(db, row.id, state="failed", reason=reason)
            return reason
        before = served_snapshot(applier, row)
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
            return reason
        if not result["applied"]:
            reason = f"{where}: its config changed since it was read; left as it is"
            _set(db, row.id, state="failed", reason=reason)
            return reason
        _set(db, row.id, state="applied")
        on_step(f"{where}: applied")
        row.state = "applied"
    if row.stage == 0 and row.state == "applied":  # canaries are verified before anyone else moves
        verdict = judge_canary(row, controls, model, applier, tolerance)
        row.analysis = {**(row.analysis or {}), **verdict.analysis}
        _set(db, row.id, state="failed" if verdict.failure else "verified", measured_tps=verdict.rate,
             analysis=row.analysis, reason=verdict.failure)
        if verdict.failure:
            return verdict.failure
        on_step(f"{row.chip_key} canary {row.node_id[:12]}: {verdict.summary}, verified")
    return None


@dataclass(frozen=True)
class Verdict:
    rate: float | None  # the canary's rate in the objective (tok/s)
    failure: str | None
    analysis: dict
    summary: str


def sample_rates(objective, summary: dict, n_prompt: int, n_gen: int) -> list[float]:
    """Each served sample's rate in the objective: a sample with generated tokens gives one (its
    prompt rate from the one-token request, its generation rate from the difference of the two
    times); a sample of two one-token requests (pp) gives two prompt rates."""
    out = []
    for ttft, total, prompt, generated in summary.get("samples", []):
        if generated <= 1:
            pairs = [(prompt / ttft, None), (prompt / total, None)]
        else:
            pairs = [(prompt / ttft, (generated - 1) / (total - ttft) if total > ttft else None)]
        out += [r for pp, tg in pairs if (r := objective.rate(pp, tg, n_prompt, n_gen))]
    return out


def _served_rate(objective, summary: dict, n_prompt: int, n_gen: int) -> float | None:
    """A node's served rate in the objective: the median of its samples' rates (None on any failed
    request). The median, not the fastest sample: on a shared machine a sample is slowed by a
    request queued ahead of it and sped up by a moment with the CPU to itself: one lucky sample of
    five put a node's fastest-sample pp figure at 177 tok/s, its median at 82 (the done-when runs'
    records), and a control's figure so inflated makes a canary look slow."""
    if not summary.get("served") or summary.get("errors"):
        return None
    rates = sample_rates(objective, summary, n_prompt, n_gen)
    return statistics.median(rates) if rates else None


def probe_interleaved(applier: Applier, node_ids: list[str], n_prompt: int, n_gen: int,
                      rounds: int = PROBE_ROUNDS, budget_s: float = PROBE_BUDGET_S) -> dict[str, dict]:
    """Served samples from several nodes, in turn: a warm-up round whose timings are dropped (a
    server that has just started pays first-use costs; its failures still count), then rounds of
    one sample per node, the order rotated each round, so that every node is measured across the
    same stretch of time and background load (on a shared machine that load moves by more than
    the differences being judged). Rounds past ``MIN_ROUNDS`` only within ``budget_s``. Per node:
    the summary of its samples (workers.probe.summarise) with the config versions it served."""
    from workers.probe import RequestResult, summarise

    samples: dict[str, list[RequestResult]] = {n: [] for n in node_ids}
    versions: dict[str, set] = {n: set() for n in node_ids}
    refused: dict[str, dict] = {}
    started = time.monotonic()
    for round_no in range(rounds + 1):
        if round_no > MIN_ROUNDS and time.monotonic() - started > budget_s:
            break
        shift = round_no % len(node_ids)
        for node_id in node_ids[shift:] + node_ids[:shift]:
            if node_id in refused:
                continue
            try:
                out = applier.probe(node_id, n_prompt, n_gen, 1, first=round_no)
            except Exception as exc:  # noqa: BLE001 - a node lost mid-analysis: no figures from it
                out = {"served": False, "error": f"{type(exc).__name__}: {exc}"}
            if not out.get("served"):
                refused[node_id] = out
                continue
            versions[node_id] |= {out.get("config_version"), out.get("config_version_after")}
            results = [RequestResult(**r) for r in out.get("results", [])]
            samples[node_id] += results if round_no else [r for r in results if not r.ok]
    summaries = {}
    for node_id in node_ids:
        if node_id in refused:
            summaries[node_id] = refused[node_id]
            continue
        summaries[node_id] = {"served": True, **summarise(samples[node_id], n_prompt),
                              "config_versions": sorted(v for v in versions[node_id] if v is not None),
                              "samples": [[r.ttft_s, r.total_s, r.n_prompt, r.n_gen] for r in samples[node_id]
                                          if r.ok]}
    return summaries


def judge_canary(row: _Row, controls: list[_Row], model: ModelInfo, applier: Applier, tolerance: float
                 ) -> Verdict:
    """A canary, judged in the payload's own objective (as a higher-is-better rate).

    A node that serves (``fleettune serve``) is judged on served traffic: once it serves the new
    config, the workload's fixed prompt set goes through its OpenAI API and through those of up to
    ``MAX_CONTROLS`` same-chip nodes still on the old config (A/B, as Argo Rollouts' analysis
    does), in interleaved rounds (``probe_interleaved``), each node's rate the median of its
    samples' (``_served_rate``).
    It fails on any failed request, on a rate below the control group's by more than the
    tolerance, or below the expected figure by more than the tolerance; served traffic carries
    HTTP and sampling costs a benchmark does not, so the expected figure is compared in kind: scaled
    by the control group's served rate over its own config's expected figure, where that is known.
    A node that does not serve is judged by a benchmark on the same workload, against the expected
    figure.
    """
    payload = row.config
    obj = objective_named(payload["objective"])
    n_prompt, n_gen = _workload(payload)
    expected = float(payload["expected_tps"])
    status = applier.serve_status(row.node_id)
    if status is None:
        measured = applier.verify(row.node_id, row.chip_key, model, payload)
        floor = expected * (1 - tolerance)
        analysis = {"method": "benchmark", "objective": obj.name, "rate": measured, "expected": expected,
                    "floor": floor}
        if measured is None or measured < floor:
            got = "the benchmark failed" if measured is None else f"{measured:.2f} tok/s"
            return Verdict(measured, f"canary {row.node_id[:12]} ({row.chip_key}): {got}, expected at least "
                           f"{floor:.2f} ({expected:.2f} - {tolerance:.0%})", analysis, got)
        return Verdict(measured, None, analysis, f"{measured:.2f} tok/s")
    n_prompt_p, n_gen_p = min(n_prompt, PROBE_MAX_PROMPT), min(max(n_gen, 2), PROBE_MAX_GEN)
    n_gen_measured = _generated_per_sample(obj, n_gen_p)
    where = f"canary {row.node_id[:12]} ({row.chip_key})"
    switched = _wait_serving(applier, row.node_id, int(payload["version"]))
    if not switched:
        return Verdict(None, f"{where}: does not serve config {payload['version']} within "
                       f"{SWITCH_TIMEOUT_S:g}s", {"method": "served", "status": status}, "not switched")
    serving_controls = [c for c in controls if applier.serve_status(c.node_id) is not None][:MAX_CONTROLS]
    figures_of = probe_interleaved(applier, [row.node_id, *(c.node_id for c in serving_controls)],
                                   n_prompt_p, n_gen_measured)
    canary = figures_of[row.node_id]
    rate = _served_rate(obj, canary, n_prompt_p, n_gen_p)
    control_figures = []
    for control in serving_controls:
        figures = figures_of[control.node_id]
        figures["rate"] = _served_rate(obj, figures, n_prompt_p, n_gen_p)
        try:
            held = applier.read(control.node_id)
        except Exception:  # noqa: BLE001 - its expected figure is then unknown
            held = None
        same_measure = held and held["objective"] == obj.name and held.get("workload") == payload.get("workload")
        figures["expected"] = held["expected_tps"] if same_measure else None
        figures["node"] = control.node_id
        control_figures.append(figures)
    rates = [c["rate"] for c in control_figures if c["rate"]]
    control_rate = statistics.median(rates) if rates else None  # of two: their mean, not the faster one
    analysis = {"method": "served", "objective": obj.name, "workload": [n_prompt_p, n_gen_p],
                "generated_per_sample": n_gen_measured,
                "canary": canary, "rate": rate, "controls": control_figures, "control_rate": control_rate,
                "expected": expected, "tolerance": tolerance}
    if canary.get("served") and canary.get("config_versions") != [int(payload["version"])]:
        return Verdict(None, f"{where}: served config(s) {canary.get('config_versions')} while measured, "
                       f"not {payload['version']} only", analysis, "switched away")
    if rate is None:
        if not canary.get("served"):
            why = f"no served figures ({canary.get('error')})"
        elif canary.get("errors"):
            why = (f"{canary['errors']} of {canary.get('requests', '?')} served requests failed "
                   f"({'; '.join(canary.get('failures') or [])})")
        else:
            why = f"no {obj.name} rate from its served requests ({canary.get('n_gen')} tokens generated)"
        return Verdict(None, f"{where}: {why}", analysis, "no rate")
    summary = f"{rate:.2f} tok/s served ({obj.name}), ttft {canary['ttft_s'] * 1000:.0f} ms"
    if control_rate:
        analysis["ab_floor"] = control_rate * (1 - tolerance)
        if rate < analysis["ab_floor"]:
            return Verdict(rate, f"{where}: {rate:.2f} tok/s served, control group {control_rate:.2f}: "
                           f"slower by more than {tolerance:.0%}", analysis, summary)
    old_expected = [c["expected"] for c in control_figures if c["rate"] and c.get("expected")]
    scale = (control_rate / old_expected[0]) if control_rate and old_expected else (None if control_rate else 1.0)
    if scale is not None:
        analysis["expected_floor"] = expected * scale * (1 - tolerance)
        if rate < analysis["expected_floor"]:
            return Verdict(rate, f"{where}: {rate:.2f} tok/s served, expected at least "
                           f"{analysis['expected_floor']:.2f} ({expected:.2f} x {scale:.2f} served/bench - "
                           f"{tolerance:.0%})", analysis, summary)
    if control_rate:
        summary += f", control {control_rate:.2f}"
    return Verdict(rate, None, analysis, summary)


def _generated_per_sample(obj, n_gen: int) -> int:
    """Tokens a sample's full request generates: at least PROBE_MIN_GEN where the objective needs a
    generation rate; one for pp, whose samples are then two prompt timings each (twice the samples
    in the same time)."""
    return min(max(n_gen, PROBE_MIN_GEN), PROBE_MAX_GEN) if obj.needs_generation else 1


def served_snapshot(applier: Applier, row: _Row) -> dict | None:
    """A few requests of the payload's workload through the node's server (None: it serves
    nothing): its rate in the payload's objective, time to first token, errors, config served."""
    if applier.serve_status(row.node_id) is None:
        return None
    obj = objective_named(row.config["objective"])
    n_prompt, n_gen = _workload(row.config)
    n_prompt, n_gen = min(n_prompt, PROBE_MAX_PROMPT), min(max(n_gen, 2), PROBE_MAX_GEN)
    try:
        summary = probe_interleaved(applier, [row.node_id], n_prompt, _generated_per_sample(obj, n_gen),
                                    SNAPSHOT_ROUNDS)[row.node_id]
    except Exception as exc:  # noqa: BLE001 - a record we could not take is left out, said why
        return {"error": str(exc)}
    return {"rate": _served_rate(obj, summary, n_prompt, n_gen),
            "sample_rates": sample_rates(obj, summary, n_prompt, n_gen),
            "ttft_s": summary.get("ttft_s"),
            "best_ttft_s": summary.get("best_ttft_s"), "tg_tps": summary.get("tg_tps"),
            "pp_tps": summary.get("pp_tps"), "best_tg_tps": summary.get("best_tg_tps"),
            "best_pp_tps": summary.get("best_pp_tps"), "requests": summary.get("requests"),
            "errors": summary.get("errors"), "config_versions": summary.get("config_versions")}


def _wait_serving(applier: Applier, node_id: str, version: int) -> bool:
    """Poll the node until its server answers with config ``version`` (deadline SWITCH_TIMEOUT_S)."""
    deadline = time.monotonic() + SWITCH_TIMEOUT_S
    while time.monotonic() < deadline:
        status = applier.serve_status(node_id)
        if status and status.get("ready") and status.get("config_version") == version \
                and not status.get("switching_to"):
            return True
        time.sleep(0.5)  # polling the node's state with a deadline
    return False


@dataclass(frozen=True)
class RollbackResult:
    rollout_id: int
    restored: int  # nodes given back their previous config
    pending: int  # nodes that did not answer: restored when they do
    kept: int  # nodes that held neither config (a later change): left as they are


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
    rollout). A node that does not answer is recorded ``restore_pending`` and the rollout stays
    ``rolling_back`` until a later call (or ``sync``) reaches it."""
    rollout_id = latest_rollout_id(db) if rollout_id is None else rollout_id
    state, _, rows = _rows(db, rollout_id)
    applier = applier or Applier()
    on_step = on_step or (lambda text: None)
    with db.session() as s:
        message = repo.get_rollout(s, rollout_id).message if state == "rolling_back" else reason
        repo.set_rollout_state(s, rollout_id, "rolling_back", message)
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
    return RollbackResult(rollout_id, restored, pending, kept)


def _restore(db: Database, row: _Row, applier: Applier, on_step) -> str:
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


def restore_pending(db: Database, applier: Applier | None = None, node_ids: list[str] | None = None
                    ) -> int:
    """Retry every pending restore (of ``node_ids`` only, when given); finishes the rollbacks that
    have none left. Returns how many nodes were restored."""
    applier = applier or Applier()
    with db.session() as s:
        rows = [(n.rollout_id, _Row.of(n)) for n in repo.pending_restores(s)
                if node_ids is None or n.ray_node_id in node_ids]
    restored = 0
    for rollout_id, row in rows:
        restored += _restore(db, row, applier, lambda text: None) == "rolled_back"
        with db.session() as s:
            if not repo.rollout_nodes_left_to_restore(s, rollout_id):
                rollout = repo.get_rollout(s, rollout_id)
                repo.set_rollout_state(s, rollout_id, "rolled_back", rollout.message)
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
                 "expected_tps": n.config["expected_tps"], "analysis": n.analysis, "reason": n.reason}
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
