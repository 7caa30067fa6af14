"""A fleet in this process: the ``Dispatcher`` over N simulated nodes of one chip, without Ray.

The study loop runs on it unchanged, so the tests exercise a large fleet's every path in a second
and the dispatch benchmark measures the head's own cost (bench/dispatch_throughput.py). Each
trial's values come from the calibrated simulator; its duration is ``trial_s`` seconds of wall
time on its node (0: finished at once).

``per_wait`` models results arriving while the head blocks for them: when set, only a wait with a
timeout hands out finished trials, at most that many each time, so the loop meets both empty polls
and backlogs.
"""

from __future__ import annotations

import heapq
import time

from workers.hardware import Fingerprint
from workers.simulated import SimulatedNode, shape_for_path
from workers.trial import TrialResult, TrialSpec


class VirtualFleet:
    """N in-process nodes of one simulated chip; implements ``orchestrator.dispatch.Dispatcher``."""

    def __init__(self, chip: Fingerprint, n_nodes: int, trial_s: float = 0.0, *, per_wait: int | None = None,
                 prefix: str = "virtual", scenario: str = "calibrated", seed: int = 1) -> None:
        self.chip, self.trial_s, self.per_wait = chip, trial_s, per_wait
        self.nodes = [f"{prefix}-{i:03d}" for i in range(n_nodes)]
        self.free = list(self.nodes)
        self.node = SimulatedNode(chip, shape_for=shape_for_path, seed=seed, time_scale=0.0, scenario=scenario)
        self.running: dict[int, tuple[TrialSpec, str, float]] = {}  # ref -> (spec, node, started)
        self.due: list[tuple[float, int]] = []  # (finish time, ref) of running trials
        self.finished: dict[int, None] = {}  # refs handed out by wait, not collected (in order)
        self.spans: list[tuple[str, float, float]] = []  # (phase, started, ended) per collected trial
        self.most_running = 0
        self._next = 0

    def submit(self, spec: TrialSpec, chip_key: str | None, node_id: str | None = None) -> int:
        if not self.free:
            raise RuntimeError(f"all {len(self.nodes)} nodes are busy: more trials submitted than nodes")
        if node_id in self.free:  # pinned to a free node: that one, else any free node
            self.free.remove(node_id)
            node = node_id
        else:
            node = self.free.pop()
        ref, self._next, now = self._next, self._next + 1, time.monotonic()
        self.running[ref] = (spec, node, now)
        heapq.heappush(self.due, (now + self.trial_s, ref))
        self.most_running = max(self.most_running, len(self.running))
        return ref

    def wait(self, refs: list, timeout_s: float) -> list:
        if self.per_wait is None or timeout_s > 0:
            self._hand_out(timeout_s)
        if not self.finished:
            return []
        wanted = set(refs)
        return [ref for ref in self.finished if ref in wanted]

    def _hand_out(self, timeout_s: float) -> None:
        """Move trials whose time is up to ``finished``, first waiting (up to ``timeout_s``) for the
        next one when none is."""
        if not self.finished and self.due:
            delay = self.due[0][0] - time.monotonic()
            if delay > 0 and timeout_s > 0:
                time.sleep(min(delay, timeout_s))  # the trial's remaining duration; not synchronisation
        now, handed = time.monotonic(), 0
        while self.due and self.due[0][0] <= now and (self.per_wait is None or handed < self.per_wait):
            _, ref = heapq.heappop(self.due)
            if ref in self.running:  # else cancelled meanwhile
                self.finished[ref] = None
                handed += 1

    def result(self, ref: int, trial_key: str) -> TrialResult:
        spec, node, started = self.running.pop(ref)
        self.finished.pop(ref, None)
        self.free.append(node)
        self.spans.append((trial_key.split("-")[0], started, started + self.trial_s))
        result = self.node.measure(spec)
        result.node_id = node
        return result

    def cancel(self, ref: int) -> None:
        entry = self.running.pop(ref, None)
        self.finished.pop(ref, None)
        if entry is not None:
            self.free.append(entry[1])

    def alive_nodes(self, chip_key: str | None = None) -> list[str]:
        """Every node (all alive), for the fleet's chip; none for another chip."""
        return self.nodes if chip_key in (None, self.chip.chip_key) else []
