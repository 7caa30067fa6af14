"""The fleet as the head sees it: start the head, list nodes, flag slow ones, simulate a fleet.

The head runs Ray with token authentication. `head start` generates the token (or takes
$FLEETTUNE_RAY_TOKEN) and keeps it in a 0600 file once the head is up; every worker and client
must present it (workers/fleet_token.py).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from orchestrator.db import Database, repo
from orchestrator.db.session import data_dir
from workers import fleet_token
from workers.errors import BadInput
from workers.join import run_ray
from workers.labels import BENCH_RESOURCE, CHIP_LABEL, HOSTNAME_LABEL, SIMULATE_LABEL

SLOW_NODE_THRESHOLD = 0.10  # a node this much slower than its peers' median is flagged


def token_path() -> Path:
    """Where `head start` keeps the fleet's token unless told otherwise (mode 0600)."""
    return data_dir() / "ray_token"


def saved_token(path: Path | None = None) -> str | None:
    """The token kept at ``path`` (default: this machine's data dir), or None if there is none."""
    path = Path(path) if path else token_path()
    return fleet_token.read_token_file(path) if os.path.lexists(path) else None


@dataclass(frozen=True)
class HeadStarted:
    """A running head: the address workers join and the file that holds its token."""

    address: str
    token_file: Path

    def join_line(self) -> str:
        """What to run on every Mac, the token handed over as a file (never on the command line)."""
        return f"fleettune worker start --address {self.address} --token-file {self.token_file}"


def head_start(port: int = 6379, host: str = "127.0.0.1", dashboard: bool = False,
               token_file: Path | None = None) -> HeadStarted:
    """Start the Ray head bound to ``host`` (loopback by default) with token authentication.

    The token is $FLEETTUNE_RAY_TOKEN when set, else a fresh one. It is written to ``token_file``
    only once Ray is up: a head that fails to start leaves the previous token (and the workers
    that hold it) as they were.
    """
    if not 1 <= port <= 65535:
        raise BadInput(f"port {port}: must be 1..65535")
    _check_bindable(host)
    if _listening(host, port):
        raise BadInput(f"{host}:{port} is already in use (another Ray head, or Redis?); pass --port")
    path = Path(token_file) if token_file else token_path()
    token = os.environ.get(fleet_token.TOKEN_ENV, "").strip() or fleet_token.generate()
    args = [
        "start", "--head", "--port", str(port), "--node-ip-address", host,
        "--include-dashboard", "true" if dashboard else "false",
        "--resources", f'{{"{BENCH_RESOURCE}": 0}}', "--disable-usage-stats",
        # no autoscaler (a fleet is the Macs that join): its Prometheus endpoint, started when
        # `ray[default]` is installed, answers without the token on every interface
        "--no-monitor",
    ]
    if dashboard:
        args += ["--dashboard-host", host]
    run_ray(args, token, env=LOOPBACK_ENV if _is_loopback(host) else None)
    fleet_token.write_token_file(path, token)
    return HeadStarted(f"{host}:{port}", path)


# `ray start --node-ip-address 127.0.0.1` replaces a loopback address with the machine's own
# (ray._private.services.resolve_ip_for_localhost) unless Ray thinks clusters are off; its
# servers (GCS, raylet, agents, Ray client) bind every interface unless the node's own address is
# 127.0.0.1. So a loopback head starts with clusters off: its node address stays 127.0.0.1 and
# every server binds loopback (issue 24, case 10). Only this machine can join such a head anyway.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _is_loopback(host: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(host).is_loopback


def _check_bindable(host: str) -> None:
    """``host`` must be an address of this machine: Ray would otherwise fail late, or bind elsewhere."""
    import ipaddress
    import socket

    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise BadInput(f"--host {host!r}: name an IP address of this machine, e.g. 127.0.0.1") from None
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
    except OSError as exc:
        raise BadInput(f"--host {host}: not an address of this machine ({exc.strerror or exc})") from None


def _listening(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class NodeStatus:
    hostname: str
    ray_node_id: str
    chip: str | None
    state: str  # idle | busy | dead
    simulated: bool
    trials_done: int
    last_seen: object
    slow_by: float | None  # how much slower than its peers, when flagged

    @property
    def flag(self) -> str:
        """`fleet status`'s flag: "slow 23%" for a node slower than its peers, else "sim" for a
        simulated one."""
        if self.slow_by:
            return f"slow {self.slow_by:.0%}"
        return "sim" if self.simulated else ""


def node_states() -> dict[str, tuple[str, str | None, dict]]:
    """Ray's view of the bench nodes: node id -> (idle | busy | dead, chip label, labels)."""
    import ray

    available = _available_bench()
    out = {}
    for node in ray.nodes():
        if node.get("Resources", {}).get(BENCH_RESOURCE, 0) < 1:
            continue
        labels = dict(node.get("Labels") or {})
        if not node.get("Alive"):
            state = "dead"
        else:
            state = "idle" if available.get(node["NodeID"], 0) >= 1 else "busy"
        out[node["NodeID"]] = (state, labels.get(CHIP_LABEL), labels)
    return out


def _available_bench() -> dict[str, float]:
    """Free bench slots per live node, from the GCS's resource view (a slot in use is absent)."""
    from ray._private.state import available_resources_per_node

    return {node_id: res.get(BENCH_RESOURCE, 0) for node_id, res in available_resources_per_node().items()}


def slow_nodes(db: Database, threshold: float = SLOW_NODE_THRESHOLD) -> dict[int, float]:
    """Nodes consistently slower than peers of their chip on the same configurations.

    For every (study, configuration) measured on two or more nodes, each node's objective is
    compared with the median of the others; a node whose median ratio is below 1 - threshold
    over at least two such comparisons is flagged, with how much slower it is.
    """
    with db.session() as s:
        rows = repo.comparable_results(s)
    by_config: dict[tuple, dict[int, list[float]]] = {}
    for study_id, params_key, node_id, value, maximize in rows:
        by_config.setdefault((study_id, params_key, maximize), {}).setdefault(node_id, []).append(value)
    ratios: dict[int, list[float]] = {}
    for (_, _, maximize), per_node in by_config.items():
        if len(per_node) < 2:
            continue
        medians = {n: statistics.median(v) for n, v in per_node.items()}
        for node_id, value in medians.items():
            peers = statistics.median(v for n, v in medians.items() if n != node_id)
            ratio = value / peers if maximize else peers / value
            ratios.setdefault(node_id, []).append(ratio)
    return {
        node_id: 1 - statistics.median(r)
        for node_id, r in ratios.items()
        if len(r) >= 2 and statistics.median(r) < 1 - threshold
    }


def fleet_status(db: Database) -> list[NodeStatus]:
    """Every known node: Ray's live state joined with the database's history."""
    states = node_states()
    slow = slow_nodes(db)
    with db.session() as s:
        known = {n.ray_node_id: n for n in repo.list_nodes(s)}
        done = repo.trials_per_node(s)
        out = []
        for node_id, (state, chip, labels) in sorted(states.items(), key=lambda kv: (kv[1][1] or "", kv[0])):
            row = known.get(node_id)
            out.append(NodeStatus(
                hostname=row.hostname if row else labels.get(HOSTNAME_LABEL, "?"),
                ray_node_id=node_id,
                chip=chip,
                state=state,
                simulated=bool(row.simulated) if row else SIMULATE_LABEL in labels,
                trials_done=done.get(row.id, 0) if row else 0,
                last_seen=row.last_seen if row else None,
                slow_by=slow.get(row.id) if row else None,
            ))
        for node_id, row in known.items():
            if node_id not in states:
                out.append(NodeStatus(row.hostname, node_id, row.chip.key, "gone", row.simulated,
                                      done.get(row.id, 0), row.last_seen, slow.get(row.id)))
    return out


def parse_mix(mix: str) -> list[tuple[str, int]]:
    """"M1 Pro/16:4,M2 Ultra/76:8" -> [("M1 Pro/16", 4), ("M2 Ultra/76", 8)]."""
    from workers.simulated import parse_chip

    out = []
    for part in (p.strip() for p in mix.split(",") if p.strip()):
        chip, _, count = part.rpartition(":")
        if not chip or not count.isdigit() or int(count) < 1:
            raise BadInput(f"bad --mix entry {part!r}: expected CHIP:COUNT, e.g. \"M2 Ultra/76:8\"")
        parse_chip(chip)  # unknown chips are bad input before anything starts
        out.append((chip, int(count)))
    if not out:
        raise BadInput("--mix names no nodes")
    return out


def simulate(mix: str, address: str | None, port: int, scenario: str, time_scale: float):
    """Start (or join) a head and one simulated Ray worker per node of the mix."""
    from workers import join

    entries = parse_mix(mix)
    token_file = None
    if address is None:
        started = head_start(port)
        address, token_file = started.address, started.token_file
    token = fleet_token.resolve(None, token_path())
    for chip, count in entries:
        plan = join.plan_join(chip, scenario, time_scale)
        for _ in range(count):
            join.worker_start(address, token, plan, num_cpus=0)
    return address, token_file, [{"chip": chip, "count": count} for chip, count in entries]
