"""What a node does when the head asks: describe itself, run one trial.

These functions run inside Ray tasks on the worker node. They take and return plain dataclasses and
never import the orchestrator or the database.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import asdict, dataclass

from workers import bench, served, simulated_served
from workers.files import fsync_dir
from workers.hardware import fingerprint_live
from workers.labels import (
    HOSTNAME_LABEL,
    SCENARIO_LABEL,
    SIMULATE_LABEL,
    SPEED_LABEL,
    TIME_SCALE_LABEL,
    TRIAL_S_LABEL,
)
from workers.trial import FailureKind, TrialResult, TrialSpec

NODE_LOST = FailureKind.NODE_LOST.value  # the failure reason of a trial whose node left the cluster

_simulated_nodes: dict = {}  # per node id: its simulated Mac (keeps heat between trials)


@dataclass(frozen=True)
class NodeInfo:
    """A node as it describes itself."""

    ray_node_id: str
    hostname: str
    fingerprint: dict
    llama_build: str
    simulated: bool
    python_version: str
    ray_version: str
    labels: dict

    def to_dict(self) -> dict:
        return asdict(self)


def _ray_context() -> tuple[str, dict]:
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), dict(ctx.get_node_labels() or {})


def simulated_node(node_id: str, labels: dict):
    """The simulated Mac this node stands for, or None for a real node."""
    if SIMULATE_LABEL not in labels:
        return None
    node = _simulated_nodes.get(node_id)
    if node is None:
        from workers import simulated

        node = simulated.SimulatedNode(
            simulated.parse_chip(labels[SIMULATE_LABEL]),
            shape_for=simulated.shape_for_path,
            scenario=labels.get(SCENARIO_LABEL, "calibrated"),
            time_scale=float(labels.get(TIME_SCALE_LABEL, "0")),
            speed=float(labels.get(SPEED_LABEL, "1")),
            trial_s=float(labels[TRIAL_S_LABEL]) if TRIAL_S_LABEL in labels else None,
            seed=int(node_id[:8], 16) if node_id else 0,
        )
        _simulated_nodes[node_id] = node
    return node


def node_info() -> NodeInfo:
    """Fingerprint the node this runs on (a simulated node reports its simulated chip)."""
    import ray

    node_id, labels = _ray_context()
    sim = simulated_node(node_id, labels)
    return NodeInfo(
        ray_node_id=node_id,
        hostname=labels.get(HOSTNAME_LABEL) or socket.gethostname(),
        fingerprint=sim.chip.to_dict() if sim else fingerprint_live().to_dict(),
        llama_build=sim.backend_info() if sim else bench.llama_build_info(),
        simulated=sim is not None,
        python_version=".".join(map(str, sys.version_info[:3])),
        ray_version=ray.__version__,
        labels=labels,
    )


def run_trial(spec: TrialSpec) -> TrialResult:
    """Measure one configuration on this node (after the cool-down the study asked for)."""
    node_id, labels = _ray_context()
    sim = simulated_node(node_id, labels)
    if spec.cooldown_s > 0 and not sim:
        time.sleep(spec.cooldown_s)  # let the machine cool between trials; not synchronisation
    if sim:  # a served trial on a simulated Mac: its continuous batching (issue 22.6)
        result = simulated_served.measure(sim, spec) if spec.served else sim.measure(spec)
    else:
        # This worker's parent is its node's raylet. A busy worker can outlive a SIGKILLed raylet
        # (Ray 2.60 on Linux: still measuring 50 s later), measuring for a node the cluster has
        # written off: stop as soon as the parent is gone.
        raylet = os.getppid()
        measure = served.measure if spec.served else bench.measure  # issue 22.1: on a real llama-server
        result = measure(spec, stop_when=lambda: None if os.getppid() == raylet else NODE_LOST)
    result.node_id = node_id
    result.hostname = labels.get(HOSTNAME_LABEL) or socket.gethostname()
    return result


PLAN_FIT_TIMEOUT_S = 150.0  # inside the study's wait for the answer: never left running


def plan_fit(model_path: str, n_ctx: int, budget: int | None) -> dict:
    """llama.cpp's ``--fit`` placement of ``model_path`` on this node for ``budget`` bytes of its GPU,
    by the node's own ``llama-fit-params`` (issue 23.3): ``{"tool", "n_ctx", "n_gpu_layers",
    "overrides"}``, or ``{"error": why}`` where it has none or it failed (the study then plans with
    its estimate and says so)."""
    from workers import llamatools, placement

    tool = llamatools.find_tool("llama-fit-params")
    if not tool:
        return {"error": "no llama-fit-params on the node"}
    try:
        fitted = placement.llama_fit(tool, model_path, n_ctx, budget, timeout_s=PLAN_FIT_TIMEOUT_S)
    except llamatools.ToolError as exc:
        return {"error": f"llama-fit-params: {exc}"}
    return {"tool": tool, **asdict(fitted)}


# ---------------------------------------------------------------- model push (head -> node)

PART_SUFFIX = ".fleettune-push"  # a pushed model's temp file: ".NAME.<random>.fleettune-push"
REFUSED = "refused: a different file is there (use --force)"


def model_status(path: str, sha256: str) -> str:
    """"present" when this node has the file with that sha256, else "missing" or "different"."""
    from workers import digests

    if not os.path.isfile(path):
        return "missing"
    return "present" if digests.sha256_cached(path) == sha256 else "different"


def begin_model(path: str) -> str:
    """Start a push to ``path``: a fresh temp file beside it (same filesystem, so the final rename
    is atomic), after removing the temp files of earlier pushes to it that died midway."""
    import glob
    import tempfile
    from pathlib import Path

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*{PART_SUFFIX}"):
        stale.unlink(missing_ok=True)
    fd, part = tempfile.mkstemp(prefix=f".{target.name}.", suffix=PART_SUFFIX, dir=target.parent)
    os.close(fd)
    return part


def _check_part(part: str) -> None:
    if not part.endswith(PART_SUFFIX):
        raise ValueError(f"not a pushed model's temp file: {part}")


def write_model_chunk(part: str, offset: int, data: bytes) -> int:
    """Write one chunk of a pushed model into its temp file (from ``begin_model``)."""
    _check_part(part)
    with open(part, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)
    return len(data)


def finish_model(path: str, part: str, sha256: str, force: bool = False) -> str:
    """Verify the pushed copy and rename it over ``path``; the temp file is gone afterwards.

    Returns "copied", "replaced" (a different file was there and ``force`` was given), "present"
    (the same file arrived meanwhile), ``REFUSED`` or "failed: sha256 mismatch".
    """
    from workers import digests
    from workers.models import sha256_file

    _check_part(part)
    try:
        if sha256_file(part) != sha256:
            return "failed: sha256 mismatch"
        status = model_status(path, sha256)
        if status == "present":
            return "present"
        if status == "different" and not force:
            return REFUSED
        with open(part, "rb") as handle:
            os.fsync(handle.fileno())  # the bytes are on disk before the name points at them
        os.replace(part, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        digests.remember(path, sha256)
        return "replaced" if status == "different" else "copied"
    finally:
        discard_model_part(part)


def discard_model_part(part: str) -> bool:
    """Remove a pushed model's temp file (a push that failed midway); True if one was there."""
    _check_part(part)
    try:
        os.unlink(part)
    except FileNotFoundError:
        return False
    return True


def _check_node(node_id: str) -> None:
    import ray

    here = ray.get_runtime_context().get_node_id()
    if here != node_id:
        raise RuntimeError(f"config for node {node_id[:12]} reached node {here[:12]}")


def read_config(node_id: str) -> dict | None:
    """On a node: its active configuration (None: none). Runs pinned to ``node_id``."""
    from workers import nodeconfig

    _check_node(node_id)
    return nodeconfig.read(node_id)


def apply_config(node_id: str, payload: dict | None, only_if: list[dict | None] | None = None) -> dict:
    """On a node: make ``payload`` its active configuration (None: none), only if it holds one of
    ``only_if`` now (None: whatever it holds); ``{"previous", "applied"}`` as nodeconfig.write.

    Runs pinned to ``node_id``; refuses to write another node's file.
    """
    from workers import nodeconfig

    _check_node(node_id)
    return nodeconfig.write(node_id, payload, only_if)


# ---------------------------------------------------------------- serving (fleettune serve on the node)


def serve_status(node_id: str) -> dict | None:
    """On a node: what its `fleettune serve` supervisor serves (None: nothing)."""
    from workers import serve

    _check_node(node_id)
    return serve.read_status(node_id)


def probe_served(node_id: str, n_prompt: int, n_gen: int, n_requests: int, deadline_s: float = 300,
                 first: int = 0) -> dict:
    """On a node: send the workload's fixed prompt set (numbered from ``first``) to its own server
    (loopback) and summarise what came back, each sample's timings with it (the head pools rounds);
    with the config version served before and after, so a switch is seen."""
    from workers import probe, serve

    _check_node(node_id)
    before = serve.read_status(node_id)
    if not before or not before.get("fresh") or not before.get("ready"):
        return {"served": False, "error": "no server running on this node"}
    summary = probe.probe(before["address"], before["model"], n_prompt, n_gen, n_requests, deadline_s, first)
    after = serve.read_status(node_id) or {}
    return {"served": True, **summary, "config_version": before["config_version"],
            "config_version_after": after.get("config_version")}


def load_served(node_id: str, spec: dict, duration_s: float) -> dict:
    """On a node: closed-loop streamed load (``spec``: a workers.loadgen.LoadSpec as a dict) on its own
    server (loopback) for ``duration_s`` (workers.timedload), every request a record; with the config
    version served before and after, so a switch is seen."""
    from workers import serve, timedload
    from workers.loadgen import LoadSpec

    _check_node(node_id)
    before = serve.read_status(node_id)
    if not before or not before.get("fresh") or not before.get("ready"):
        return {"served": False, "error": "no server running on this node"}
    result = timedload.run_for(before["address"], LoadSpec.from_dict(spec), duration_s, before["model"])
    after = serve.read_status(node_id) or {}
    return {"served": True, "records": [r.to_dict() for r in result.records], "kind": before.get("kind"),
            "config_version": before["config_version"], "config_version_after": after.get("config_version")}
