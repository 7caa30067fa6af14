"""The head's view of serving: what each node serves (asked through Ray), and the config hub
that joining nodes ask for their chip's config (workers.confighub)."""

from __future__ import annotations

from orchestrator import dispatch, fleet
from orchestrator.db import Database, repo
from workers import confighub

STATUS_TIMEOUT_S = 5.0


def node_serving(node_ids: list[str], timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, dict | None]:
    """Per node: its `fleettune serve` status (None: not serving); unanswered ones: {"health": ...}."""
    from workers import agent

    answers = dispatch.ask_nodes(agent.serve_status, node_ids, timeout_s)
    return {node_id: ({"health": "no answer" if isinstance(answer, TimeoutError) else "error"}
                      if isinstance(answer, Exception) else answer)
            for node_id, answer in answers.items()}


def _health(status: dict | None) -> str:
    if status is None:
        return "-"
    if "health" in status:
        return status["health"]
    if not status.get("fresh"):
        return "stale"
    if status.get("switching_to"):
        return f"switching to v{status['switching_to']}"
    return "healthy" if status.get("healthy") else "unhealthy"


def fleet_rows(db: Database) -> list[dict]:
    """`fleet status`: every node's state and history (last seen to the minute, its flag), with what
    it serves (model, config version, health, address)."""
    nodes = fleet.fleet_status(db)
    serving = node_serving([n.ray_node_id for n in nodes if n.state in ("idle", "busy")])
    rows = []
    for n in nodes:
        status = serving.get(n.ray_node_id)
        served = status if status and "health" not in status else {}
        last_seen = n.last_seen.strftime("%Y-%m-%d %H:%M") if n.last_seen else None
        rows.append({**n.__dict__, "last_seen": last_seen, "served_model": served.get("model"),
                     "config_version": served.get("config_version"), "health": _health(status),
                     "address": served.get("address"), "flag": n.flag})
    return rows


def publish_configs(db: Database, model_sha256: str | None = None) -> int:
    """Put every chip's current config (per model; of ``model_sha256`` only, when given) in the
    config hub, creating it on the head."""
    import ray

    with db.session() as s:
        configs: dict[str, dict[str, dict]] = {}
        for model in [model_sha256] if model_sha256 else repo.rolled_out_models(s):
            for chip, payload in repo.current_chip_configs(s, model).items():
                configs.setdefault(chip, {})[model] = payload
    hub = ray.remote(confighub.ConfigHub).options(
        name=confighub.NAME, namespace=confighub.NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, resources={"node:__internal_head__": 0.001},  # on the head: it outlives workers
    ).remote()
    return ray.get(hub.publish.remote(configs, [model_sha256] if model_sha256 else None), timeout=30)
