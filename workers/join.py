"""Joining a node to the fleet: fingerprint it, then start a Ray worker with its labels.

The node advertises one ``fleettune_bench`` slot and labels for its chip, GPU cores and memory, so
the head can route a chip's trials to it and never run two benchmarks on it at once. A simulated
node (``--simulate "M2 Ultra/76"``) carries its chip bin in a label and measures through the model.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from workers.errors import BadInput, FleettuneError
from workers.hardware import Fingerprint, fingerprint_live
from workers.labels import (
    BENCH_RESOURCE,
    CHIP_LABEL,
    GPU_CORES_LABEL,
    HOSTNAME_LABEL,
    MEMORY_LABEL,
    SCENARIO_LABEL,
    SIMULATE_LABEL,
    SPEED_LABEL,
    TIME_SCALE_LABEL,
    TRIAL_S_LABEL,
)

AUTH_ENV = {"RAY_AUTH_MODE": "token"}
# Ray's metrics export (the dashboard agent's Prometheus endpoint, with `ray[default]` installed)
# answers anyone, token or not, and listens on every interface of a node that is not on loopback;
# fleettune reads nothing from it, so no fleet node runs it (docs/security.md).
# The dashboard's own Prometheus endpoint (`head start --dashboard`) has no switch and binds every
# interface off loopback: a port no socket can bind makes Ray's guarded start of it fail, logged,
# and the dashboard runs without it (tests/test_netns_token.py checks Ray's code still guards it).
NO_METRICS_ENV = {"RAY_enable_metrics_collection": "0", "DASHBOARD_METRIC_PORT": "65536"}
NODE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")  # a valid Ray label value


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); anything else is BadInput (one parser for every command)."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if (not host or not port.isdigit() or not 1 <= int(port) <= 65535
            or not re.fullmatch(r"[A-Za-z0-9._:-]+", host)):
        raise BadInput(f"bad Ray address {address!r}: expected HOST:PORT")
    return host, int(port)


@dataclass(frozen=True)
class JoinPlan:
    """What `worker start` will ask Ray for."""

    fingerprint: Fingerprint
    labels: dict
    resources: dict
    simulated: bool


def plan_join(
    simulate: str | None = None, scenario: str = "calibrated", time_scale: float = 0.0, speed: float = 1.0,
    name: str | None = None, trial_s: float | None = None,
) -> JoinPlan:
    """What to ask Ray for; ``name`` is shown for this node instead of its OS hostname.
    ``trial_s``: a simulated node whose every trial takes exactly this long (a test that must
    catch a trial in flight, whatever the machine's load)."""
    if name is not None and not NODE_NAME.fullmatch(name):
        raise BadInput(f"--name {name!r}: 1-63 letters, digits, '.', '-' or '_', starting and ending "
                       "with a letter or digit")
    if simulate:
        from workers import simulated

        fp = simulated.parse_chip(simulate)
        extra = {SIMULATE_LABEL: simulated.ray_label(fp), SCENARIO_LABEL: scenario,
                 TIME_SCALE_LABEL: f"{time_scale:g}", SPEED_LABEL: f"{speed:g}"}
        if trial_s:
            extra[TRIAL_S_LABEL] = f"{trial_s:g}"
    else:
        if trial_s:
            raise BadInput("--trial-seconds is for simulated nodes (--simulate) only")
        fp = fingerprint_live()
        extra = {}
    if not fp.chip_key:
        raise BadInput("this machine's chip is unknown; it cannot be routed to")
    labels = {CHIP_LABEL: fp.chip_key, **extra}
    if name:
        labels[HOSTNAME_LABEL] = name
    if fp.gpu_cores:
        labels[GPU_CORES_LABEL] = str(fp.gpu_cores)
    if fp.memory_bytes:
        labels[MEMORY_LABEL] = str(round(fp.memory_bytes / 1024**3))
    return JoinPlan(fp, labels, {BENCH_RESOURCE: 1}, simulate is not None)


def ray_env(token: str | None) -> dict:
    """Environment for every Ray process of the fleet: token auth, no unauthenticated metrics
    endpoint, and the macOS cluster switch."""
    env = {**os.environ, **NO_METRICS_ENV}
    if token:
        env.update(AUTH_ENV, RAY_AUTH_TOKEN=token)
    if platform.system() == "Darwin":
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"  # multi-node Ray on Macs needs it everywhere
    return env


def ray_cli() -> str:
    exe = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if not exe:
        raise FleettuneError("the `ray` command is not installed beside this Python")
    return exe


def run_ray(args: list[str], token: str | None, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    """Run the ray CLI (``env``: settings over the fleet's own); a failure is one line naming Ray's own reason."""
    try:
        done = subprocess.run([ray_cli(), *args], capture_output=True, text=True, timeout=timeout,
                              env={**ray_env(token), **(env or {})}, check=False)
    except subprocess.TimeoutExpired:
        raise FleettuneError(f"`ray {args[0]}` did not finish in {timeout:g}s") from None
    if done.returncode != 0:
        text = (done.stderr + done.stdout).strip().splitlines()
        telling = ("mismatch", "already in use", "failed to start", "error:", "exception:")
        reason = next((line for word in telling for line in text if word in line.lower()), None)
        last = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = reason or (last[-1] if last else "no output")
        if "dashboard with missing packages" in reason:
            reason += " (pip install 'ray[default]' for --dashboard)"
        raise FleettuneError(f"`ray {args[0]}` failed: {reason.strip()}")
    return done.stdout


def worker_start(address: str, token: str | None, plan: JoinPlan, num_cpus: int | None = None) -> str:
    """Start this node's Ray worker joined to the head at ``address``."""
    args = [
        "start", "--address", address,
        "--resources", json.dumps(plan.resources),
        "--labels", ",".join(f"{k}={v}" for k, v in plan.labels.items()),
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    if os.environ.get("RAY_TMPDIR"):  # this node's own temp dir, not the head's path (Ray's default)
        args += ["--temp-dir", os.path.join(os.environ["RAY_TMPDIR"], "ray")]
    host = address.rpartition(":")[0]
    if host in ("127.0.0.1", "localhost"):  # a head on loopback: this node is on the same machine
        args += ["--node-ip-address", "127.0.0.1"]
    return run_ray(args, token)


def worker_stop() -> str:
    return run_ray(["stop"], None)
