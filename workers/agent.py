"""What a node does when the head asks: describe itself, run one trial.

These functions run inside Ray tasks on the worker node. They take and return plain dataclasses and
never import the orchestrator or the database.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from dataclasses import asdict, dataclass

from workers import bench
from workers.hardware import fingerprint_live
from workers.trial import TrialResult, TrialSpec


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


def node_info() -> NodeInfo:
    """Fingerprint the node this runs on."""
    import ray

    node_id, labels = _ray_context()
    return NodeInfo(
        ray_node_id=node_id,
        hostname=labels.get("fleettune.io/hostname") or socket.gethostname(),
        fingerprint=fingerprint_live().to_dict(),
        llama_build=bench.llama_build_info(),
        simulated=False,
        python_version=".".join(map(str, sys.version_info[:3])),
        ray_version=ray.__version__,
        labels=labels,
    )


def run_trial(spec: TrialSpec) -> TrialResult:
    """Measure one configuration on this node (after the cool-down the study asked for)."""
    node_id, labels = _ray_context()
    if spec.cooldown_s > 0:
        time.sleep(spec.cooldown_s)  # let the machine cool between trials; not synchronisation
    result = bench.measure(spec)
    result.node_id = node_id
    result.hostname = labels.get("fleettune.io/hostname") or socket.gethostname()
    return result


def local_identity() -> dict:
    """Facts for a fleet-wide version check (Ray and Python must match across nodes)."""
    import ray

    return {
        "python": ".".join(map(str, sys.version_info[:2])),
        "ray": ray.__version__,
        "platform": platform.system(),
        "pid": os.getpid(),
    }
