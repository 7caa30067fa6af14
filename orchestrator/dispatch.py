"""Ray: connect, find bench nodes by chip label, run trials one per node at a time.

Every worker node offers one unit of the custom resource ``fleettune_bench`` and a label
``fleettune.io/chip=<chip_key>``. A trial asks for one unit and selects its chip's label, so it
runs only on a node of that chip and never beside another benchmark. Trials are never retried by
Ray (``max_retries=0``): a lost node is a failed trial the study decides about.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from workers import agent
from workers.agent import NodeInfo
from workers.errors import BadInput
from workers.join import BENCH_RESOURCE, CHIP_LABEL
from workers.trial import TrialResult, TrialSpec

__all__ = ["BENCH_RESOURCE", "CHIP_LABEL", "BenchNode", "Dispatcher", "connect"]
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class BenchNode:
    """A live Ray node that offers a bench slot."""

    ray_node_id: str
    chip_key: str | None
    address: str
    labels: dict

    @property
    def simulated(self) -> bool:
        return agent.SIMULATE_LABEL in self.labels


def _check_reachable(address: str) -> None:
    """Fail fast with one line instead of letting ray.init retry an unreachable head for minutes."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise BadInput(f"bad Ray address {address!r}: expected HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise BadInput(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from None


def _use_token() -> None:
    """Present the fleet's token: $FLEETTUNE_RAY_TOKEN, the file $FLEETTUNE_RAY_TOKEN_FILE names,
    or the one `head start` saved here."""
    from orchestrator.fleet import token_path
    from workers import fleet_token

    ours = (fleet_token.TOKEN_ENV, fleet_token.TOKEN_FILE_ENV)
    if os.environ.get("RAY_AUTH_TOKEN") and not any(os.environ.get(k) for k in ours):
        return  # Ray's own setting, made by the caller
    token = fleet_token.resolve(None, token_path())
    if not token:
        return
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray caches its settings per process
    AuthenticationTokenLoader.instance().reset_cache()


def connect(address: str | None, *, local_chip_key: str | None = None) -> bool:
    """Join the cluster at ``address``, or start an embedded one-node cluster on this machine.

    Returns True when this call started Ray (the caller then shuts it down).
    """
    import ray

    if address:
        _check_reachable(address)
    if ray.is_initialized():  # a caller in this process already joined (tests, notebooks)
        current = ray.get_runtime_context().gcs_address
        if address and address not in ("auto", current):
            raise BadInput(f"this process is already connected to the Ray cluster at {current}")
        return False
    if address:
        _use_token()
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        except (ConnectionError, RuntimeError, ValueError) as exc:
            hint = "" if os.environ.get("RAY_AUTH_TOKEN") else " (no token: set FLEETTUNE_RAY_TOKEN_FILE or FLEETTUNE_RAY_TOKEN)"
            raise BadInput(f"cannot join the Ray cluster at {address}: {exc}{hint}") from None
        return True
    labels = {CHIP_LABEL: local_chip_key} if local_chip_key else {}
    ray.init(
        address="local",  # always a new one-node cluster, never one found on this machine
        resources={BENCH_RESOURCE: 1},
        labels=labels,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    return True


def shutdown() -> None:
    import ray

    ray.shutdown()


@contextmanager
def connected(address: str | None, *, local_chip_key: str | None = None) -> Iterator[None]:
    """``connect`` for the duration of a block; Ray is shut down after it only if this started it."""
    started = connect(address, local_chip_key=local_chip_key)
    try:
        yield
    finally:
        if started:
            shutdown()


def bench_nodes(chip_key: str | None = None) -> list[BenchNode]:
    """Alive nodes with a bench slot, optionally only those of one chip."""
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive") or node.get("Resources", {}).get(BENCH_RESOURCE, 0) < 1:
            continue
        labels = dict(node.get("Labels") or {})
        key = labels.get(CHIP_LABEL)
        if chip_key is None or key == chip_key:
            nodes.append(BenchNode(node["NodeID"], key, node.get("NodeManagerAddress", ""), labels))
    return nodes


class ChipNodes:
    """The ids of a chip's live bench nodes, asked of Ray at most once every ``ttl_s`` seconds.

    The study loop wants them every round (how many trials can run now); ``ray.nodes()`` is a
    round trip to the head's GCS that lists the whole cluster, too slow to repeat for every few
    results of a large fleet. A node lost meanwhile shows as a "node lost" trial, not a hang.
    """

    def __init__(self, chip_key: str, ttl_s: float = 1.0) -> None:
        self.chip_key, self.ttl_s = chip_key, ttl_s
        self._ids: list[str] = []
        self._at: float | None = None

    def __call__(self) -> list[str]:
        now = time.monotonic()
        if self._at is None or now - self._at >= self.ttl_s:
            self._ids = [n.ray_node_id for n in bench_nodes(self.chip_key)]
            self._at = now
        return self._ids


def describe_nodes(nodes: list[BenchNode], timeout_s: float = 120) -> list[NodeInfo]:
    """Ask each node to fingerprint itself (pinned to that node, not using its bench slot)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(agent.node_info)
    refs = [
        task.options(
            num_cpus=0,
            max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.ray_node_id, soft=False),
        ).remote()
        for node in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    infos = []
    for ref in ready:
        try:
            infos.append(ray.get(ref))
        except ray.exceptions.RayError:
            continue  # a node that cannot describe itself is left out of this study
    return infos


class Dispatcher:
    """Submits trials to a chip's nodes and waits for them with timeouts (never forever)."""

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._task = ray.remote(agent.run_trial)

    def submit(self, spec: TrialSpec, chip_key: str | None, node_id: str | None = None):
        """Run a trial on a node of ``chip_key`` (or on exactly ``node_id``), holding its slot."""
        options: dict = {
            "num_cpus": 0,
            "resources": {BENCH_RESOURCE: 1},
            "max_retries": 0,
            "retry_exceptions": False,
            "name": f"fleettune-trial {spec.trial_key}",
        }
        if chip_key:
            options["label_selector"] = {CHIP_LABEL: chip_key}
        if node_id:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return self._task.options(**options).remote(spec)

    def wait(self, refs: list, timeout_s: float) -> list:
        """The refs among ``refs`` that finished within ``timeout_s``."""
        if not refs:
            return []
        done, _ = self._ray.wait(refs, num_returns=1, timeout=timeout_s)
        if done:  # collect everything else that is already finished, without waiting
            more, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            done = list({id(r): r for r in [*done, *more]}.values())
        return done

    def result(self, ref, trial_key: str) -> TrialResult:
        """The trial's result; a lost node or a dead task is a failed trial with that reason."""
        ray = self._ray
        try:
            return ray.get(ref)
        except ray.exceptions.NodeDiedError:
            return TrialResult.failure(trial_key, "node lost")
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError,
                ray.exceptions.OwnerDiedError):
            return TrialResult.failure(trial_key, "node lost")
        except ray.exceptions.TaskCancelledError:
            return TrialResult.failure(trial_key, "interrupted")
        except ray.exceptions.RayTaskError as exc:
            return TrialResult.failure(trial_key, f"worker error: {exc.cause!r}")
        except ray.exceptions.RayError as exc:
            return TrialResult.failure(trial_key, f"ray error: {type(exc).__name__}")

    def cancel(self, ref) -> None:
        self._ray.cancel(ref, force=True)


PUSH_CHUNK = 64 << 20


def push_model(path: str, sha256: str, nodes: list[BenchNode]) -> dict[str, str]:
    """Copy a model to every node that lacks it, sha256-checked; returns node id -> outcome."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def on(node: BenchNode, func):
        return ray.remote(func).options(
            num_cpus=0, max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.ray_node_id, soft=False),
        )

    outcome = {}
    for node in nodes:
        status = ray.get(on(node, agent.model_status).remote(path, sha256))
        if status == "present":
            outcome[node.ray_node_id] = "present"
            continue
        with open(path, "rb") as handle:
            offset = 0
            while chunk := handle.read(PUSH_CHUNK):
                ray.get(on(node, agent.write_model_chunk).remote(path, offset, chunk))
                offset += len(chunk)
        ok = ray.get(on(node, agent.finish_model).remote(path, sha256))
        outcome[node.ray_node_id] = "copied" if ok else "failed: sha256 mismatch"
    return outcome
