"""The canary analysis of nodes that serve with llama-server: streamed load, per-request metrics.

llama-server streams every token (llama-cpp-python 0.3.36 ends its streams after the first chunk,
so its nodes keep orchestrator.canary's rate-only probe). Here the canary and its control group
are loaded at the same moment, in rounds: every node of the analysis runs the same closed-loop load
for ``ROUND_S`` seconds (``workers.timedload.run_for`` on the node, through ``Applier.load``), all
nodes' rounds started together, so each request of the canary has requests of its controls over
the same stretch of time, and no node idles while another finishes. Each streamed request gives
one value per metric (``request_samples``): time to first token, inter-token latency, the user's
tok/s, the objective's rate, and whether it failed. After each round the samples so far are judged
(``judgement``: orchestrator.canarystats.judge_metrics, Kayenta's rules per metric); the rounds go
on while the verdict is inconclusive, until each arm has ``MAX_POINTS_PER_ARM`` requests or the
analysis's time budget is spent.

The metrics and their tolerances (``metrics_for``):

- ``ttft`` (lower is better) within ``TTFT_TOLERANCE`` of the control group's;
- ``itl`` (lower is better) within ``ITL_TOLERANCE`` (the default measured on real servers by
  bench/canary_real.py: docs/serving.md, "Canary statistics");
- ``rate``, the objective's rate per request (higher is better), at least the rollout's floor
  (1 - ``--tolerance``, raised where the canary's config is expected to be faster);
- ``errors``: no larger a share of failed requests than the control group's (margin
  ``ERROR_MARGIN``).

Without a control node the canary's rates are held to its expected figure (Wilcoxon's signed-rank
test, as orchestrator.canary does), and any failed request fails it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from orchestrator import canarystats
from orchestrator.canarystats import Judgement, Metric
from workers.loadgen import LoadSpec
from workers.slo import RequestRecord

STREAMING_KIND = "llama-server"  # the server kind (workers.serve) whose nodes are judged here
METHOD = "served-load"  # the figures' method, as the rollout's record names it
ROUND_S = 8.0  # every node's load in one round
CONCURRENCY = 1  # users per node: `fleettune serve` runs llama-server with one slot (-np 1)
MAX_POINTS_PER_ARM = 120  # the analysis ends when each arm has this many requests (or at its time budget)
TTFT_TOLERANCE = 0.3  # a canary's TTFT may be this much above its control group's
ITL_TOLERANCE = 0.10  # and its ITL this much: the largest of those measured that met both targets (docs/serving.md)
ERROR_MARGIN = 0.0  # and its share of failed requests no larger than theirs
# The compact form of a request in the record: [start_s, ttft_s, e2e_s, gen_tokens, error]
RECORD_FIELDS = ("start_s", "ttft_s", "e2e_s", "gen_tokens", "error")


def compact(record: RequestRecord) -> list:
    """A measured request as the rollout's record keeps it (``RECORD_FIELDS``)."""
    return [round(record.start_s, 4), record.ttft_s, record.e2e_s, record.gen_tokens, record.error]


def expand(row: Sequence, prompt_tokens: int = 0) -> RequestRecord:
    start_s, ttft_s, e2e_s, gen_tokens, error = row
    return RequestRecord(start_s=start_s, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, ttft_s=ttft_s,
                         e2e_s=e2e_s, error=error)


def request_samples(records: Sequence[RequestRecord], objective=None, n_prompt: int = 0,
                    n_gen: int = 0) -> dict[str, list]:
    """Per metric, one value per measured request (warm-up ones left out): ``ttft``, ``itl``, ``tps``
    and ``rate`` (the objective's, from the request's prompt rate ``n_prompt / ttft`` and its
    generation rate ``1 / itl``, over the workload's ``n_prompt`` and ``n_gen``) for every request
    that succeeded, ``errors`` (1: failed, 0: succeeded) for every one."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    out: dict[str, list] = {"ttft": [r.ttft_s for r in ok], "itl": [r.itl_s for r in ok if r.itl_s],
                            "tps": [r.tps for r in ok if r.tps], "errors": [0 if r.ok else 1 for r in measured]}
    if objective is not None:
        out["rate"] = [rate for r in ok
                       if (rate := objective.rate(n_prompt / r.ttft_s if r.ttft_s else None, r.tps, n_prompt, n_gen))]
    return out


def median_rate(summary: dict, objective, n_prompt: int, n_gen: int) -> float | None:
    """A node's served rate in the objective: the median of its requests' rates (None on any
    failed request, as orchestrator.canary.served_rate, or without a rate)."""
    if not summary.get("served") or any(row[4] is not None for row in summary.get("records", [])):
        return None
    rates = request_samples([expand(r, n_prompt) for r in summary.get("records", [])], objective, n_prompt,
                            n_gen)["rate"]
    return statistics.median(rates) if rates else None


def pooled(groups: Sequence[dict[str, list]]) -> dict[str, list]:
    """Several nodes' samples as one group's (the control group's), metric by metric."""
    out: dict[str, list] = {}
    for group in groups:
        for name, values in group.items():
            out.setdefault(name, []).extend(values)
    return out


def metrics_for(rate_floor: float | None, min_points: int = canarystats.MIN_POINTS_PER_ARM,
                itl_tolerance: float = ITL_TOLERANCE, ttft_tolerance: float = TTFT_TOLERANCE) -> list[Metric]:
    """The served canary's metrics (the module's list); ``rate`` only where a floor is given."""
    rules = [canarystats.metric("ttft", ttft_tolerance, min_points), canarystats.metric("itl", itl_tolerance, min_points)]
    if rate_floor is not None:
        rules.append(canarystats.metric("rate", 1 - rate_floor, min_points))
    rules.append(canarystats.metric("errors", ERROR_MARGIN, min_points))
    return rules


def judgement(canary: dict[str, list], controls: dict[str, list] | None, rules: Sequence[Metric],
              expected_rate: float | None = None) -> Judgement:
    """The verdict on the samples: against the control group's where there is one
    (``judge_metrics``); without one, the objective's rates against ``expected_rate`` at the rate
    rule's floor (one-sample test) and any failed request a failure."""
    if controls is not None:
        return canarystats.judge_metrics(canary, controls, rules)
    rate_rule = next((r for r in rules if r.name == "rate"), None)
    comparisons: dict = {}
    if rate_rule is not None and expected_rate:
        comparisons["rate"] = canarystats.compare_to_figure(canary.get("rate", []), expected_rate, rate_rule.limit,
                                                            min_points=rate_rule.min_points)
    errors_rule = next(r for r in rules if r.name == "errors")
    comparisons["errors"] = canarystats.compare_metric(canary.get("errors", []), [], errors_rule)  # held to none
    outcomes = [c.outcome for c in comparisons.values()]
    outcome = (canarystats.FAIL if canarystats.FAIL in outcomes else
               canarystats.PASS if all(o == canarystats.PASS for o in outcomes) else canarystats.INCONCLUSIVE)
    return Judgement(outcome, comparisons)


def load_spec(n_prompt: int, n_gen: int, round_no: int, node_index: int, vocab_size: int | None,
              salt: int = 0, concurrency: int | None = None) -> LoadSpec:
    """One node's load in one round: the workload's prompt and generated lengths, ``concurrency``
    users (default ``CONCURRENCY``), the first request of each user in the first round a warm-up (a
    server that has just started pays first-use costs), prompts seeded by ``salt`` (one per
    analysis: the rollout's config version), round and node, so that no two are alike, not even
    across analyses (a control's server would find an earlier analysis's prompt in its prompt
    cache, and answer it faster than the canary's freshly started server)."""
    users = concurrency or CONCURRENCY
    return LoadSpec(prompt_tokens=n_prompt, gen_tokens=n_gen, concurrency=users,
                    max_requests=10_000, max_s=ROUND_S, warmup_requests=users if round_no == 0 else 0,
                    seed=1 + ((salt * 10_000 + round_no) * 64 + node_index), vocab_size=vocab_size or LoadSpec.vocab_size)


def load_rounds(load: Callable[[str, int, int], dict], node_ids: list[str],
                enough: Callable[[dict[str, dict]], bool] | None = None, budget_s: float = 240.0,
                max_points: int = MAX_POINTS_PER_ARM) -> dict[str, dict]:
    """Rounds of load on every node at once (``load(node_id, node_index, round_no)`` runs one
    node's round and returns ``{"served": True, "records": [...RequestRecord dicts], "config_version",
    "config_version_after"}`` or ``{"served": False, "error"}``) until ``enough`` (given the
    summaries so far) says yes, the canary (the first node) has ``max_points`` measured requests
    and the others together as many, or a round would start after ``budget_s``. Per node: its
    summary (``summarise``), each request compact (``RECORD_FIELDS``)."""
    taken: dict[str, list[RequestRecord]] = {n: [] for n in node_ids}
    versions: dict[str, set] = {n: set() for n in node_ids}
    refused: dict[str, dict] = {}
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(node_ids), thread_name_prefix="canary-load") as pool:
        for round_no in range(10_000):
            summaries = summarise(taken, versions, refused)
            if round_no and (time.monotonic() - started > budget_s or _full(taken, node_ids, max_points)
                             or (enough is not None and enough(summaries))):
                return summaries
            live = [n for n in node_ids if n not in refused]
            if not live:
                return summaries
            futures = {n: pool.submit(load, n, node_ids.index(n), round_no) for n in live}
            for node_id, future in futures.items():
                out = node_answer(future.result, node_id, refused, versions)
                if out is not None:
                    taken[node_id] += [RequestRecord.from_dict(r) for r in out.get("records", [])]
    return summarise(taken, versions, refused)


def node_answer(call: Callable[[], dict], node_id: str, refused: dict[str, dict],
                versions: dict[str, set]) -> dict | None:
    """One node's answer in a round of an analysis, with the config versions it served noted; None
    where it gave no figures (a node lost mid-analysis, or one that did not serve: it is then in
    ``refused`` with why, and asked nothing more)."""
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 - a node lost mid-analysis: no figures from it
        out = {"served": False, "error": f"{type(exc).__name__}: {exc}"}
    if not out.get("served"):
        refused[node_id] = out
        return None
    versions[node_id] |= {out.get("config_version"), out.get("config_version_after")}
    return out


def _full(taken: dict[str, list[RequestRecord]], node_ids: list[str], max_points: int) -> bool:
    def measured(n: str) -> int:
        return sum(not r.warmup for r in taken[n])

    return measured(node_ids[0]) >= max_points and sum(measured(n) for n in node_ids[1:]) >= max_points


def summarise(taken: dict[str, list[RequestRecord]], versions: dict[str, set],
              refused: dict[str, dict]) -> dict[str, dict]:
    """Per node: requests and failures (warm-up left out), medians of TTFT and ITL, the config
    versions it served, and every measured request compact."""
    out = {}
    for node_id, records in taken.items():
        if node_id in refused:
            out[node_id] = refused[node_id]
            continue
        measured = [r for r in records if not r.warmup]
        ok = [r for r in measured if r.ok]
        itl = [r.itl_s for r in ok if r.itl_s]
        out[node_id] = {"served": True, "requests": len(measured), "errors": len(measured) - len(ok),
                        "failures": [r.error for r in measured if not r.ok][:3],
                        "ttft_s": statistics.median(r.ttft_s for r in ok) if ok else None,
                        "itl_s": statistics.median(itl) if itl else None,
                        "config_versions": sorted(v for v in versions[node_id] if v is not None),
                        "records": [compact(r) for r in measured]}
    return out
