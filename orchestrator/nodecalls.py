"""The calls a rollout makes to a node: read or write its config, read what it serves, probe its
server, benchmark it. Each is one Ray task pinned to the node (``dispatch.ask_nodes``); a node that
does not answer within the call's timeout is unreachable for that step.
"""

from __future__ import annotations

from orchestrator import dispatch
from workers import agent
from workers.loadgen import LoadSpec
from workers.models import ModelInfo
from workers.objective import objective as objective_named
from workers.trial import BenchParams, TrialSpec, Workload

VERIFY_REPS = 2
APPLY_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 600.0  # a probe's requests have their own deadline on the node (300 s)


def workload(payload: dict) -> tuple[int, int]:
    """The recommendation's (prompt, generated) token counts; older payloads: a short tg run."""
    counts = payload.get("workload") or {"n_prompt": 64, "n_gen": 16}
    return int(counts["n_prompt"]), int(counts["n_gen"])


class Applier:
    """A rollout's calls to one node at a time: read or write its config, what it serves, a probe
    of its server, a benchmark pinned to it. A node that does not answer within ``apply_timeout_s``
    is unreachable for this step."""

    def __init__(self, apply_timeout_s: float = APPLY_TIMEOUT_S) -> None:
        self.apply_timeout_s = apply_timeout_s
        self.dispatcher = dispatch.RayDispatcher()

    def _on_node(self, function, node_id: str, *args, timeout_s: float | None = None):
        """``function(node_id, *args)`` on the node; its answer, or the reason for none raised."""
        answer = dispatch.ask_nodes(function, [node_id], timeout_s or self.apply_timeout_s,
                                    args=lambda _: (node_id, *args))[node_id]
        if isinstance(answer, Exception):
            raise answer
        return answer

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
        return self._on_node(agent.probe_served, node_id, n_prompt, n_gen, n_requests, 300, first,
                             timeout_s=PROBE_TIMEOUT_S)

    def load(self, node_id: str, spec: LoadSpec, duration_s: float) -> dict:
        """Streamed closed-loop load ``spec`` on the node's own server for ``duration_s``; every
        request's record (workers.timedload)."""
        return self._on_node(agent.load_served, node_id, spec.to_dict(), duration_s,
                             timeout_s=duration_s + spec.request_timeout_s + APPLY_TIMEOUT_S)

    def verify(self, node_id: str, chip_key: str, model: ModelInfo, payload: dict, timeout_s: float = 600
               ) -> float | None:
        """The payload's objective as a rate (tok/s, higher is better) on that node with the new
        config, on the recommendation's own workload (None: the benchmark failed)."""
        n_prompt, n_gen = workload(payload)
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
