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

from workers import bench
from workers.hardware import fingerprint_live
from workers.trial import TrialResult, TrialSpec

HOSTNAME_LABEL = "fleettune.io/hostname"  # optional: a name to show instead of the OS hostname
SIMULATE_LABEL = "fleettune.io/simulate"  # value: a chip bin as "M2_Ultra.76.192"
SCENARIO_LABEL = "fleettune.io/scenario"
TIME_SCALE_LABEL = "fleettune.io/time-scale"
SPEED_LABEL = "fleettune.io/speed"  # a simulated node's speed relative to its chip (a degraded Mac)
TRIAL_S_LABEL = "fleettune.io/trial-s"  # a simulated node whose every trial takes this many seconds

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
        fingerprint=sim.chip.fingerprint() if sim else fingerprint_live().to_dict(),
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
    result = sim.measure(spec) if sim else bench.measure(spec)
    result.node_id = node_id
    result.hostname = labels.get(HOSTNAME_LABEL) or socket.gethostname()
    return result


# ---------------------------------------------------------------- model push (head -> node)


def model_status(path: str, sha256: str) -> str:
    """"present" when this node has the file with that sha256, else "missing" or "different"."""
    from pathlib import Path

    from workers.models import sha256_file

    file = Path(path)
    if not file.is_file():
        return "missing"
    return "present" if sha256_file(file) == sha256 else "different"


def write_model_chunk(path: str, offset: int, data: bytes) -> int:
    """Write one chunk of a pushed model into ``path``.part (created on the first chunk)."""
    from pathlib import Path

    part = Path(path + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    with open(part, "r+b" if offset else "wb") as handle:
        handle.seek(offset)
        handle.write(data)
    return len(data)


def finish_model(path: str, sha256: str) -> bool:
    """Check the pushed file's sha256 and move it into place atomically; a bad copy is deleted."""
    from workers.models import sha256_file

    part = path + ".part"
    if sha256_file(part) != sha256:
        os.unlink(part)
        return False
    os.replace(part, path)
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


def probe_served(node_id: str, n_prompt: int, n_gen: int, n_requests: int, deadline_s: float = 300) -> dict:
    """On a node: send the workload's fixed prompt set to its own server (loopback) and summarise
    what came back; with the config version served before and after, so a switch is seen."""
    from workers import probe, serve

    _check_node(node_id)
    before = serve.read_status(node_id)
    if not before or not before.get("fresh") or not before.get("ready"):
        return {"served": False, "error": "no server running on this node"}
    summary = probe.probe(before["address"], before["model"], n_prompt, n_gen, n_requests, deadline_s)
    after = serve.read_status(node_id) or {}
    summary.pop("results", None)
    return {"served": True, **summary, "config_version": before["config_version"],
            "config_version_after": after.get("config_version")}
