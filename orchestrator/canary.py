"""Canary analysis, as Argo Rollouts splits it: ``collect`` measures (the calls to the canary and its
control group, over one stretch of time) and returns figures; ``judge`` is a pure function of those
figures, the expected figure and the tolerance, with three outcomes (utils/evaluate/evaluate.go):

- ``pass``: enough rates, and the canary is not shown slower than its control group (or its
  expected figure) by more than the tolerance;
- ``fail``: it is shown slower by more than the tolerance (Mann-Whitney's U at 98 %, Kayenta's
  test: orchestrator.canarystats), a request failed, or its config does not serve;
- ``inconclusive``: the figures cannot decide (too few rates yet, the canary served another config
  while measured, its requests gave no rate in the objective, or its control group gave no
  figures). ``collect`` goes on measuring while the verdict is inconclusive, within
  ``ANALYSIS_BUDGET_S``; inconclusive at the end never promotes: the rollout pauses, with the
  reason (rule 24.4, issue 22.7).

A node that serves (``fleettune serve``) is judged on served traffic: once it serves the new config,
the workload's fixed prompt set goes through its OpenAI API and through those of up to
``MAX_CONTROLS`` same-chip nodes still on the old config (A/B), in interleaved rounds
(``probe_interleaved``), each sample's rate in the objective (``sample_rates``) one point of the
test. Served traffic carries HTTP and sampling costs a benchmark does not, so the expected figure
is compared in kind: the canary must reach (1 - tolerance) x its control group, raised by the ratio
of its expected figure over the control config's where that is known. A node that does not serve
is judged by a benchmark on the same workload, against the expected figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator import canaryload, canarystats
from orchestrator.nodecalls import Applier, workload
from workers.models import ModelInfo
from workers.objective import objective as objective_named

SWITCH_TIMEOUT_S = 300.0  # a serving canary has this long to start serving the new config
PROBE_ROUNDS = 40  # at most this many served A/B rounds (one sample per node each), after a warm-up round
MIN_ROUNDS = 3  # rounds always taken; then more while the verdict is inconclusive, within the budget
ANALYSIS_BUDGET_S = 240.0  # the served analysis's rounds start within this long of its first
PROBE_MAX_PROMPT, PROBE_MAX_GEN = 1024, 128  # the workload, bounded to what a 2048 context holds
# A sample's full request generates at least this many tokens: its generation rate is the difference
# of two request times, and with fewer that difference is no larger than what another client's
# request or a busy CPU adds to either time (bench/serve_canary_noise.py)
PROBE_MIN_GEN = 32
MAX_CONTROLS = 2  # same-chip nodes on the old config measured beside each canary
SNAPSHOT_ROUNDS = 5  # served samples per node before its apply and after promotion (the record)

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass(frozen=True)
class Verdict:
    outcome: str  # PASS, FAIL or INCONCLUSIVE
    rate: float | None  # the canary's rate in the objective (tok/s)
    reason: str | None  # why it did not pass
    analysis: dict  # the figures, with the floors they were held to
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


def served_rate(objective, summary: dict, n_prompt: int, n_gen: int) -> float | None:
    """A node's served rate in the objective: the median of its samples' rates (None on any failed
    request). The median, not the fastest sample: on a shared machine a sample is slowed by a
    request queued ahead of it and sped up by a moment with the CPU to itself, and a control's
    figure so inflated makes a canary look slow."""
    if not summary.get("served") or summary.get("errors"):
        return None
    rates = sample_rates(objective, summary, n_prompt, n_gen)
    return statistics.median(rates) if rates else None


def probe_interleaved(applier: Applier, node_ids: list[str], n_prompt: int, n_gen: int,
                      rounds: int = PROBE_ROUNDS, budget_s: float = ANALYSIS_BUDGET_S,
                      enough: Callable[[dict[str, dict]], bool] | None = None) -> dict[str, dict]:
    """Served samples from several nodes, in turn: a warm-up round whose timings are dropped (a
    server that has just started pays first-use costs; its failures still count), then rounds of
    one sample per node, the order rotated each round, so that every node is measured across the
    same stretch of time and background load (on a shared machine that load moves by more than
    the differences being judged). After ``MIN_ROUNDS`` rounds, another round starts only while
    ``enough`` (given the summaries so far) says no and within ``budget_s`` of the first. Per
    node: the summary of its samples (workers.probe.summarise) with the config versions it served."""
    from workers.probe import RequestResult

    samples: dict[str, list[RequestResult]] = {n: [] for n in node_ids}
    versions: dict[str, set] = {n: set() for n in node_ids}
    refused: dict[str, dict] = {}
    started = time.monotonic()
    for round_no in range(rounds + 1):
        if round_no > MIN_ROUNDS and (time.monotonic() - started > budget_s
                                      or (enough is not None and enough(_summaries(samples, versions, refused,
                                                                                   n_prompt)))):
            break
        shift = round_no % len(node_ids)
        for node_id in node_ids[shift:] + node_ids[:shift]:
            if node_id in refused:
                continue
            out = canaryload.node_answer(lambda n=node_id, r=round_no: applier.probe(n, n_prompt, n_gen, 1, first=r),
                                         node_id, refused, versions)
            if out is None:
                continue
            results = [RequestResult(**r) for r in out.get("results", [])]
            samples[node_id] += results if round_no else [r for r in results if not r.ok]
    return _summaries(samples, versions, refused, n_prompt)


def _summaries(samples: dict[str, list], versions: dict[str, set], refused: dict[str, dict],
               n_prompt: int) -> dict[str, dict]:
    from workers.probe import summarise

    summaries = {}
    for node_id, taken in samples.items():
        if node_id in refused:
            summaries[node_id] = refused[node_id]
            continue
        summaries[node_id] = {"served": True, **summarise(taken, n_prompt),
                              "config_versions": sorted(v for v in versions[node_id] if v is not None),
                              "samples": [[r.ttft_s, r.total_s, r.n_prompt, r.n_gen] for r in taken if r.ok]}
    return summaries


def generated_per_sample(obj, n_gen: int) -> int:
    """Tokens a sample's full request generates: at least PROBE_MIN_GEN where the objective needs a
    generation rate; one for pp, whose samples are then two prompt timings each (twice the samples
    in the same time)."""
    return min(max(n_gen, PROBE_MIN_GEN), PROBE_MAX_GEN) if obj.needs_generation else 1


def probe_workload(payload: dict) -> tuple[int, int]:
    """The payload's workload as probed: bounded to what a 2048 context holds, at least 2 tokens."""
    n_prompt, n_gen = workload(payload)
    return min(n_prompt, PROBE_MAX_PROMPT), min(max(n_gen, 2), PROBE_MAX_GEN)


def wait_serving(applier: Applier, node_id: str, version: int, timeout_s: float = SWITCH_TIMEOUT_S) -> bool:
    """Poll the node until its server answers with config ``version`` (deadline ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = applier.serve_status(node_id)
        if status and status.get("ready") and status.get("config_version") == version \
                and not status.get("switching_to"):
            return True
        time.sleep(0.5)  # polling the node's state with a deadline
    return False


def collect(node_id: str, chip_key: str, payload: dict, control_ids: list[str], model: ModelInfo | None,
            applier: Applier, enough: Callable[[dict], bool] | None = None) -> dict:
    """The canary's figures, in the payload's own objective (a higher-is-better rate): a benchmark
    on a node that does not serve; on one that serves, once it serves the payload's version, its
    served samples and those of up to ``MAX_CONTROLS`` serving nodes of ``control_ids`` (still on
    the old config), over one stretch of time, taken until ``enough`` (given the figures so far)
    says they decide, or the rounds' budget is spent."""
    obj = objective_named(payload["objective"])
    base = {"node": node_id, "chip": chip_key, "objective": obj.name, "version": int(payload["version"])}
    status = applier.serve_status(node_id)
    if status is None:
        return {**base, "method": "benchmark", "rate": applier.verify(node_id, chip_key, model, payload)}
    n_prompt, n_gen = probe_workload(payload)
    n_gen_measured = generated_per_sample(obj, n_gen)
    if not wait_serving(applier, node_id, int(payload["version"])):
        return {**base, "method": "served", "switched": False, "status": status, "switch_timeout_s": SWITCH_TIMEOUT_S}
    serving_controls = [c for c in control_ids if applier.serve_status(c) is not None][:MAX_CONTROLS]
    expected_of = {}
    for control in serving_controls:
        try:
            held = applier.read(control)
        except Exception:  # noqa: BLE001 - its expected figure is then unknown
            held = None
        same_measure = held and held["objective"] == obj.name and held.get("workload") == payload.get("workload")
        expected_of[control] = held["expected_tps"] if same_measure else None
    if status.get("kind") == canaryload.STREAMING_KIND:
        return _collect_load(base, node_id, payload, serving_controls, expected_of, model, applier, enough)
    served = {**base, "method": "served", "switched": True, "workload": [n_prompt, n_gen],
              "generated_per_sample": n_gen_measured}

    def figures_from(summaries: dict[str, dict]) -> dict:
        canary = summaries[node_id]
        controls = [{**summaries[c], "rate": served_rate(obj, summaries[c], n_prompt, n_gen),
                     "expected": expected_of[c], "node": c} for c in serving_controls]
        rates = [c["rate"] for c in controls if c["rate"]]
        return {**served, "canary": canary, "rate": served_rate(obj, canary, n_prompt, n_gen), "controls": controls,
                "control_rate": statistics.median(rates) if rates else None}  # of two: their mean

    summaries = probe_interleaved(applier, [node_id, *serving_controls], n_prompt, n_gen_measured,
                                  enough=None if enough is None else lambda s: enough(figures_from(s)))
    return figures_from(summaries)


def _collect_load(base: dict, node_id: str, payload: dict, controls: list[str], expected_of: dict,
                  model: ModelInfo | None, applier: Applier, enough: Callable[[dict], bool] | None) -> dict:
    """A llama-server canary's figures: streamed load on it and on its controls of the same server
    kind, round by round at the same moment (orchestrator.canaryload), every request a record."""
    obj = objective_named(payload["objective"])
    n_prompt, n_gen = probe_workload(payload)
    # every request generates: its ITL is judged whatever the objective
    n_gen_load = min(max(n_gen, PROBE_MIN_GEN), PROBE_MAX_GEN)
    same_kind = [c for c in controls if (applier.serve_status(c) or {}).get("kind") == canaryload.STREAMING_KIND]
    nodes = [node_id, *same_kind]
    vocab = model.n_vocab if model is not None else None
    loaded = {**base, "method": canaryload.METHOD, "switched": True, "kind": canaryload.STREAMING_KIND,
              "workload": [n_prompt, n_gen], "generated_per_request": n_gen_load,
              "load": {"round_s": canaryload.ROUND_S, "concurrency": canaryload.CONCURRENCY,
                       "max_points_per_arm": canaryload.MAX_POINTS_PER_ARM},
              "left_out": [c for c in controls if c not in same_kind]}

    def load(node: str, index: int, round_no: int) -> dict:
        spec = canaryload.load_spec(n_prompt, n_gen_load, round_no, index, vocab, salt=int(payload["version"]))
        return applier.load(node, spec, canaryload.ROUND_S)

    def figures_from(summaries: dict[str, dict]) -> dict:
        canary = summaries[node_id]
        rated = [{**summaries[c], "node": c, "expected": expected_of.get(c),
                  "rate": canaryload.median_rate(summaries[c], obj, n_prompt, n_gen)} for c in same_kind]
        pooled = [r for c in rated if c.get("served") for r in c.get("records", [])]
        return {**loaded, "canary": canary, "controls": rated,
                "rate": canaryload.median_rate(canary, obj, n_prompt, n_gen),
                "control_rate": canaryload.median_rate({"served": True, "records": pooled}, obj, n_prompt, n_gen)
                if pooled else None}

    summaries = canaryload.load_rounds(load, nodes, enough=None if enough is None else
                                       lambda s: enough(figures_from(s)), budget_s=ANALYSIS_BUDGET_S)
    return figures_from(summaries)


def judge(figures: dict, expected: float, tolerance: float, min_points: int = canarystats.MIN_POINTS) -> Verdict:
    """The verdict on a canary's ``figures`` (``collect``), held to ``expected`` (tok/s) and to its
    control group, each within ``tolerance``. Pure: no node, no clock, no database."""
    where = f"canary {str(figures.get('node', '?'))[:12]} ({figures.get('chip', '?')})"
    rate = figures.get("rate")
    analysis = {**figures, "expected": expected, "tolerance": tolerance}
    if figures["method"] == canaryload.METHOD:
        return _judge_load(figures, expected, tolerance, where, analysis)
    if figures["method"] == "benchmark":
        floor = expected * (1 - tolerance)
        analysis["floor"] = floor
        got = "the benchmark failed" if rate is None else f"{rate:.2f} tok/s"
        if rate is None or rate < floor:
            return Verdict(FAIL, rate, f"{where}: {got}, expected at least {floor:.2f} ({expected:.2f} - "
                           f"{tolerance:.0%})", analysis, got)
        return Verdict(PASS, rate, None, analysis, got)
    version = figures.get("version")
    if not figures.get("switched"):
        return Verdict(FAIL, None, f"{where}: does not serve config {version} within "
                       f"{figures.get('switch_timeout_s', SWITCH_TIMEOUT_S):g}s", analysis, "not switched")
    canary, controls = figures.get("canary") or {}, figures.get("controls") or []
    if canary.get("served") and canary.get("config_versions") != [version]:
        return Verdict(INCONCLUSIVE, None, f"{where}: served config(s) {canary.get('config_versions')} while "
                       f"measured, not {version} only", analysis, "switched away")
    if rate is None:
        if not canary.get("served"):
            return Verdict(FAIL, None, f"{where}: no served figures ({canary.get('error')})", analysis, "no rate")
        if canary.get("errors"):
            return Verdict(FAIL, None, f"{where}: {canary['errors']} of {canary.get('requests', '?')} served "
                           f"requests failed ({'; '.join(canary.get('failures') or [])})", analysis, "no rate")
        return Verdict(INCONCLUSIVE, None, f"{where}: no {figures.get('objective')} rate from its served requests "
                       f"({canary.get('n_gen')} tokens generated)", analysis, "no rate")
    control_rate = figures.get("control_rate")
    if controls and not control_rate:
        return Verdict(INCONCLUSIVE, rate, f"{where}: its control group of {len(controls)} gave no figures "
                       f"({'; '.join(str(c.get('error') or c.get('errors')) for c in controls)})", analysis,
                       "no control")
    obj = objective_named(figures["objective"])
    n_prompt, n_gen = figures.get("workload") or (0, 0)
    canary_rates = sample_rates(obj, canary, n_prompt, n_gen)
    summary = f"{rate:.2f} tok/s served ({figures.get('objective')}), ttft {canary['ttft_s'] * 1000:.0f} ms"
    if control_rate:
        # the canary's floor against its controls: 1 - tolerance, raised where its config is expected
        # to be faster than theirs (the expected figures' ratio, both measured by benchmark)
        old_expected = next((c["expected"] for c in controls if c.get("rate") and c.get("expected")), None)
        gain = max(1.0, expected / old_expected) if old_expected else 1.0
        floor = (1 - tolerance) * gain
        control_rates = [r for c in controls if c.get("rate") for r in sample_rates(obj, c, n_prompt, n_gen)]
        comparison = canarystats.compare(canary_rates, control_rates, floor, min_points=min_points)
        analysis.update(ab_floor=control_rate * (1 - tolerance), floor_ratio=floor, comparison=comparison.as_dict())
        if gain > 1.0:
            analysis["expected_floor"] = control_rate * floor
        if comparison.outcome == canarystats.FAIL:
            why = (f"slower by more than {tolerance:.0%}" if gain == 1.0 else
                   f"expected at least {floor:.2f}x it ({expected:.2f} over its {old_expected:.2f} tok/s by "
                   f"benchmark - {tolerance:.0%})")
            return Verdict(FAIL, rate, f"{where}: {rate:.2f} tok/s served, control group {control_rate:.2f}: "
                           f"{why}; {comparison.describe()}", analysis, summary)
        summary += f", control {control_rate:.2f}, {comparison.describe()}"
    else:  # no node of the chip left on the old config: the benchmark's figure is the reference
        comparison = canarystats.compare_to_figure(canary_rates, expected, 1 - tolerance, min_points=min_points)
        analysis.update(expected_floor=expected * (1 - tolerance), comparison=comparison.as_dict())
        if comparison.outcome == canarystats.FAIL:
            return Verdict(FAIL, rate, f"{where}: {rate:.2f} tok/s served, expected at least "
                           f"{analysis['expected_floor']:.2f} ({expected:.2f} - {tolerance:.0%}); "
                           f"{comparison.describe()}", analysis, summary)
    if comparison.outcome == canarystats.INCONCLUSIVE:
        return Verdict(INCONCLUSIVE, rate, f"{where}: {comparison.n_canary} served rates, {min_points} needed "
                       f"to pass; {comparison.describe()}", analysis, summary)
    return Verdict(PASS, rate, None, analysis, summary)


def _judge_load(figures: dict, expected: float, tolerance: float, where: str, analysis: dict) -> Verdict:
    """``judge`` for a llama-server canary: every metric of orchestrator.canaryload judged at once
    (canarystats.judge_metrics), the objective's rate held to the same floor as ``judge``'s."""
    version = figures.get("version")
    canary, controls = figures.get("canary") or {}, figures.get("controls") or []
    rate = figures.get("rate")
    if not canary.get("served"):
        return Verdict(FAIL, None, f"{where}: no served figures ({canary.get('error')})", analysis, "no rate")
    if canary.get("config_versions") != [version]:
        return Verdict(INCONCLUSIVE, rate, f"{where}: served config(s) {canary.get('config_versions')} while "
                       f"measured, not {version} only", analysis, "switched away")
    answering = [c for c in controls if c.get("served")]
    if controls and not answering:
        return Verdict(INCONCLUSIVE, rate, f"{where}: its control group of {len(controls)} gave no figures "
                       f"({'; '.join(str(c.get('error')) for c in controls)})", analysis, "no control")
    obj = objective_named(figures["objective"])
    n_prompt, n_gen = figures.get("workload") or (0, 0)

    def samples(node: dict) -> dict[str, list]:
        records = [canaryload.expand(r, n_prompt) for r in node.get("records", [])]
        return canaryload.request_samples(records, obj, n_prompt, n_gen)

    # the rate's floor as judge's: 1 - tolerance, raised where the canary's config is expected to be
    # faster than its controls' (the expected figures' ratio, both measured by benchmark)
    old_expected = next((c["expected"] for c in answering if c.get("expected")), None)
    gain = max(1.0, expected / old_expected) if old_expected else 1.0
    floor = (1 - tolerance) * gain
    rules = canaryload.metrics_for(floor)
    if answering:
        verdict = canaryload.judgement(samples(canary), canaryload.pooled([samples(c) for c in answering]), rules)
    else:  # no node of the chip left on the old config: the benchmark's figure is the rate's reference
        verdict = canaryload.judgement(samples(canary), None, rules, expected_rate=expected)
    analysis.update(floor_ratio=floor, judgement=verdict.as_dict())
    shown = "no rate" if rate is None else f"{rate:.2f} tok/s"
    summary = (f"{shown} served ({figures.get('objective')}, streamed), ttft "
               f"{(canary.get('ttft_s') or 0) * 1000:.0f} ms, itl {(canary.get('itl_s') or 0) * 1000:.1f} ms")
    if figures.get("control_rate"):
        summary += f", control {figures['control_rate']:.2f}"
    if verdict.outcome == canarystats.FAIL:
        worse = "; ".join(verdict.comparisons[m].describe() for m in verdict.failed)
        return Verdict(FAIL, rate, f"{where}: worse than {'its control group' if answering else 'expected'} "
                       f"beyond the tolerance in {', '.join(verdict.failed)}: {worse}", analysis, summary)
    if verdict.outcome == canarystats.INCONCLUSIVE:
        open_ = "; ".join(verdict.comparisons[m].describe() for m in verdict.undecided)
        return Verdict(INCONCLUSIVE, rate, f"{where}: undecided on {', '.join(verdict.undecided)} "
                       f"({canarystats.MIN_POINTS_PER_ARM} requests per group needed to pass): {open_}",
                       analysis, summary)
    return Verdict(PASS, rate, None, analysis, summary + "; " + verdict.describe())


def analyse(node_id: str, chip_key: str, payload: dict, control_ids: list[str], model: ModelInfo | None,
            applier: Applier, tolerance: float) -> Verdict:
    """A canary's analysis: its figures collected while the verdict on them is inconclusive (within
    the rounds' budget), then the verdict."""
    expected = float(payload["expected_tps"])
    figures = collect(node_id, chip_key, payload, control_ids, model, applier,
                      enough=lambda interim: judge(interim, expected, tolerance).outcome != INCONCLUSIVE)
    return judge(figures, expected, tolerance)


def served_snapshot(applier: Applier, node_id: str, payload: dict) -> dict | None:
    """A few requests of the payload's workload through the node's server (None: it serves
    nothing): its rate in the payload's objective, time to first token, errors, config served."""
    if applier.serve_status(node_id) is None:
        return None
    obj = objective_named(payload["objective"])
    n_prompt, n_gen = probe_workload(payload)
    try:
        summary = probe_interleaved(applier, [node_id], n_prompt, generated_per_sample(obj, n_gen),
                                    SNAPSHOT_ROUNDS)[node_id]
    except Exception as exc:  # noqa: BLE001 - a record we could not take is left out, said why
        return {"error": str(exc)}
    return {"rate": served_rate(obj, summary, n_prompt, n_gen),
            "sample_rates": sample_rates(obj, summary, n_prompt, n_gen),
            "ttft_s": summary.get("ttft_s"),
            "best_ttft_s": summary.get("best_ttft_s"), "tg_tps": summary.get("tg_tps"),
            "pp_tps": summary.get("pp_tps"), "best_tg_tps": summary.get("best_tg_tps"),
            "best_pp_tps": summary.get("best_pp_tps"), "requests": summary.get("requests"),
            "errors": summary.get("errors"), "config_versions": summary.get("config_versions")}
