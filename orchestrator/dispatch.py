"""Dispatch: the ``Dispatcher`` protocol the study loop runs trials through, and its Ray
implementation (connect, find bench nodes by chip label, run trials one per node at a time).

Every worker node offers one unit of the custom resource ``fleettune_bench`` and a label
``fleettune.io/chip=<chip_key>``. A trial asks for one unit and selects its chip's label, so it
runs only on a node of that chip and never beside another benchmark. Trials are never retried by
Ray (``max_retries=0``): a lost node is a failed trial the study decides about.

The other implementation is ``orchestrator.virtual.VirtualFleet``: simulated nodes in this process
(the tests' and benchmarks' fleet).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Protocol

from workers import agent
from workers.agent import NodeInfo
from workers.errors import BadInput
from workers.join import split_address
from workers.labels import BENCH_RESOURCE, CHIP_LABEL, SIMULATE_LABEL
from workers.trial import FailureKind, TrialResult, TrialSpec

__all__ = ["BENCH_RESOURCE", "CHIP_LABEL", "BenchNode", "Dispatcher", "RayDispatcher", "ask_nodes", "connect",
           "on_node"]
CONNECT_TIMEOUT_S = 5.0


class Dispatcher(Protocol):
    """What the study loop needs from a fleet: run a trial on a node of a chip, and hear back.

    Ownership: a submitted trial belongs to the caller from ``submit`` until it has called
    ``result`` or ``cancel`` for it. Until then the dispatcher keeps the trial's node for it alone
    (one trial per node), never retries it, and never drops it: a trial whose node is lost still
    finishes, as a failed result ("node lost"). Every call returns within its timeout; none
    blocks forever.
    """

    def submit(self, spec: TrialSpec, chip_key: str | None, node_id: str | None = None) -> Hashable:
        """Start ``spec`` on an idle node of ``chip_key`` (on exactly ``node_id`` when given; the
        caller picks one that is alive) and return a ref for it at once. The caller submits at
        most as many trials as ``alive_nodes`` lists."""
        ...

    def wait(self, refs: list, timeout_s: float) -> list:
        """The refs among ``refs`` whose trials have finished and are not collected yet; waits up
        to ``timeout_s`` for the first (0: a poll that never blocks), then returns at once."""
        ...

    def result(self, ref: Hashable, trial_key: str) -> TrialResult:
        """Collect a finished trial's result (once per ref; the ref is forgotten afterwards). A
        lost node, a crashed worker or a cancelled trial is a failed result with that reason,
        never an exception."""
        ...

    def cancel(self, ref: Hashable) -> None:
        """Stop a trial and forget its ref (its result is never collected); its node is free
        again. A ref already collected or cancelled is ignored."""
        ...

    def alive_nodes(self, chip_key: str) -> list[str]:
        """The ids of the chip's live nodes: how many trials may run at once, and which a pinned
        trial may name. May lag the fleet by a moment; a node lost meanwhile fails its trial."""
        ...


@cache
def _remote(func: Callable):
    """``func`` as a Ray remote function, made once per process (Ray exports it to each job)."""
    import ray

    return ray.remote(func)


def on_node(func: Callable, node_id: str | None = None, **options):
    """``func`` as a Ray task that takes no CPU slot and is never retried (a lost node is the
    caller's to decide about), pinned to exactly ``node_id`` when given: ``on_node(f, id).remote()``."""
    options = {"num_cpus": 0, "max_retries": 0, **options}
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return _remote(func).options(**options)


def ask_nodes(function: Callable, node_ids: list[str], timeout_s: float,
              args: Callable[[str], tuple] = lambda node_id: (node_id,)) -> dict[str, object]:
    """``function(*args(node_id))`` on every node at once (pinned to it, no CPU slot, never retried);
    waits up to ``timeout_s`` for all and cancels the late ones. Per node: its answer, or the
    exception that stands for none (``TimeoutError`` when late, Ray's error when the call failed)."""
    import ray

    refs = {on_node(function, node_id).remote(*args(node_id)): node_id for node_id in node_ids}
    if not refs:
        return {}
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    out: dict[str, object] = {}
    for ref in ready:
        try:
            out[refs[ref]] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            out[refs[ref]] = exc
    for ref in late:
        ray.cancel(ref, force=True)
        out[refs[ref]] = TimeoutError(f"node {refs[ref][:12]} did not answer in {timeout_s:g}s")
    return out


@dataclass(frozen=True)
class BenchNode:
    """A live Ray node that offers a bench slot."""

    ray_node_id: str
    chip_key: str | None
    address: str
    labels: dict

    @property
    def simulated(self) -> bool:
        return SIMULATE_LABEL in self.labels


def check_reachable(address: str) -> None:
    """Fail fast with one line instead of letting ray.init retry an unreachable head for minutes."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
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
        check_reachable(address)
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
    """Ask each node to fingerprint itself (pinned to that node, not using its bench slot); a node
    that cannot describe itself in time is left out."""
    answers = ask_nodes(agent.node_info, [node.ray_node_id for node in nodes], timeout_s, args=lambda _: ())
    return [info for info in answers.values() if not isinstance(info, Exception)]


class RayDispatcher:
    """The ``Dispatcher`` over a Ray cluster: a trial holds its node's one bench slot."""

    def __init__(self, nodes_ttl_s: float = 1.0) -> None:
        import ray

        self._ray = ray
        self._nodes_ttl_s = nodes_ttl_s
        self._nodes: dict[str, ChipNodes] = {}
        self._pinned: dict = {}  # ref -> the node a trial was pinned to
        self._gone: set[str] = set()  # nodes Ray declared dead under a trial (a node id never returns)

    def submit(self, spec: TrialSpec, chip_key: str | None, node_id: str | None = None):
        """Run a trial on a node of ``chip_key`` (or on exactly ``node_id``), holding its slot."""
        options: dict = {
            "resources": {BENCH_RESOURCE: 1},
            "retry_exceptions": False,
            "name": f"fleettune-trial {spec.trial_key}",
        }
        if chip_key:
            options["label_selector"] = {CHIP_LABEL: chip_key}
        ref = on_node(agent.run_trial, node_id, **options).remote(spec)
        if node_id:
            self._pinned[ref] = node_id
        return ref

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
        node = self._pinned.pop(ref, None)
        try:
            return ray.get(ref)
        except (ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError,
                ray.exceptions.TaskUnschedulableError) as exc:  # the last: pinned to a node that is gone
            if node and isinstance(exc, ray.exceptions.NodeDiedError | ray.exceptions.TaskUnschedulableError):
                self._gone.add(node)
            self._nodes.clear()  # the next alive_nodes asks Ray again
            return TrialResult.failure(trial_key, "node lost", FailureKind.NODE_LOST)
        except ray.exceptions.TaskCancelledError:
            return TrialResult.failure(trial_key, "interrupted", FailureKind.INTERRUPTED)
        except ray.exceptions.RayTaskError as exc:
            return TrialResult.failure(trial_key, f"worker error: {exc.cause!r}")
        except ray.exceptions.RayError as exc:
            return TrialResult.failure(trial_key, f"ray error: {type(exc).__name__}")

    def cancel(self, ref) -> None:
        self._pinned.pop(ref, None)
        self._ray.cancel(ref, force=True)

    def alive_nodes(self, chip_key: str) -> list[str]:
        """The chip's live bench nodes, asked of Ray at most once every ``nodes_ttl_s`` seconds and
        again after a lost node; never one that died under a trial pinned to it, which Ray's node
        table can list as alive for a while after its tasks fail (a pinned trial sent there fails at
        once, and the study loop would send the next)."""
        if chip_key not in self._nodes:
            self._nodes[chip_key] = ChipNodes(chip_key, self._nodes_ttl_s)
        return [node for node in self._nodes[chip_key]() if node not in self._gone]


PUSH_CHUNK = 64 << 20
PUSH_CALL_TIMEOUT_S = 300.0  # one call to a node (a chunk of PUSH_CHUNK, or hashing the copy)
LOST_NODE_ERRORS = ("NodeDiedError", "WorkerCrashedError", "ObjectLostError", "OwnerDiedError",
                    "TaskUnschedulableError", "ActorDiedError", "RaySystemError")


def push_model(path: str, sha256: str, nodes: list[BenchNode], *, force: bool = False,
               dest: str | None = None, chunk_bytes: int = PUSH_CHUNK,
               timeout_s: float = PUSH_CALL_TIMEOUT_S) -> dict[str, str]:
    """Copy the model at ``path`` to ``dest`` (default: the same path) on every node that lacks it.

    Returns node id -> outcome: "present", "copied", "replaced" (only with ``force``),
    ``agent.REFUSED`` (a different file is there), or "failed: REASON" (a node lost mid-push, a
    disk full, a copy whose sha256 does not verify). A node's file is replaced only by a rename
    after the copy verified there, so a failed push leaves it as it was, without a temp file
    (one left on a node that died is removed by the next push to that path).
    """
    from workers import digests

    try:
        here = digests.sha256_cached(path)
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from None
    if here != sha256:
        raise BadInput(f"{path} has changed since it was registered (sha256 {here[:12]}, "
                       f"registered {sha256[:12]}); register it again")
    push = _Push(path, dest or path, sha256, force, chunk_bytes, timeout_s)
    return {node.ray_node_id: push.to(node) for node in nodes}


class _Push:
    """One model pushed to nodes one at a time; every failure is that node's outcome line."""

    def __init__(self, source: str, dest: str, sha256: str, force: bool, chunk_bytes: int,
                 timeout_s: float) -> None:
        import ray

        self._ray = ray
        self.source, self.dest, self.sha256, self.force = source, dest, sha256, force
        self.chunk_bytes, self.timeout_s = chunk_bytes, timeout_s

    def _call(self, node: BenchNode, func, *args, timeout_s: float | None = None):
        ref = on_node(func, node.ray_node_id).remote(*args)
        try:
            return self._ray.get(ref, timeout=timeout_s or self.timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            self._ray.cancel(ref, force=True)
            raise

    def to(self, node: BenchNode) -> str:
        part = None
        try:
            status = self._call(node, agent.model_status, self.dest, self.sha256)
            if status == "present":
                return "present"
            if status == "different" and not self.force:
                return agent.REFUSED
            part = self._call(node, agent.begin_model, self.dest)
            with open(self.source, "rb") as handle:
                offset = 0
                while chunk := handle.read(self.chunk_bytes):
                    self._call(node, agent.write_model_chunk, part, offset, chunk)
                    offset += len(chunk)
            outcome = self._call(node, agent.finish_model, self.dest, part, self.sha256, self.force)
            part = None  # finish_model removes it, whatever its outcome
            return outcome
        except self._ray.exceptions.RayError as exc:
            return f"failed: {self._reason(exc)}"
        except OSError as exc:  # the head's own copy became unreadable midway
            return f"failed: reading {self.source}: {exc.strerror or exc}"
        finally:
            if part is not None:
                self._discard(node, part)

    def _reason(self, exc) -> str:
        if isinstance(exc, self._ray.exceptions.GetTimeoutError):
            return f"the node did not answer within {self.timeout_s:g}s"
        if isinstance(exc, self._ray.exceptions.RayTaskError) and not isinstance(
                exc.cause, self._ray.exceptions.RayError):
            return str(exc.cause) or type(exc.cause).__name__  # e.g. the node's disk is full
        if type(exc).__name__ in LOST_NODE_ERRORS or isinstance(
                exc, self._ray.exceptions.NodeDiedError | self._ray.exceptions.WorkerCrashedError):
            return "node lost"
        return f"ray error: {type(exc).__name__}"

    def _discard(self, node: BenchNode, part: str) -> None:
        """Remove the temp file of a push that failed midway (if the node still answers)."""
        with contextlib.suppress(self._ray.exceptions.RayError):  # a lost node: the next push
            self._call(node, agent.discard_model_part, part, timeout_s=10)  # to this path does it
