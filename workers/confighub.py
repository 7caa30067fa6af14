"""The head's answer to "what config should my chip run?", held in a named Ray actor.

The head (a rollout, `rollout sync`) publishes each chip's current configuration here after every
change; a node that joins later, or lost its file, asks for its chip's config through Ray when its
`fleettune serve` starts with none. Workers never touch the database: this actor holds plain
payloads and nothing else.
"""

from __future__ import annotations

NAME = "fleettune-config-hub"
NAMESPACE = "fleettune"


class ConfigHub:
    """chip key -> {model sha256 -> payload} (the newest promoted rollout's)."""

    def __init__(self) -> None:
        self._configs: dict[str, dict[str, dict]] = {}

    def publish(self, configs: dict[str, dict[str, dict]]) -> int:
        self._configs = configs
        return sum(len(v) for v in configs.values())

    def config_for(self, chip_key: str, model_sha256: str) -> dict | None:
        return self._configs.get(chip_key, {}).get(model_sha256)


def ask(chip_key: str, model_sha256: str, timeout_s: float = 10) -> dict | None:
    """From a node: the chip's current config for the model (None: none, or no head to answer)."""
    import ray

    try:
        hub = ray.get_actor(NAME, namespace=NAMESPACE)
        return ray.get(hub.config_for.remote(chip_key, model_sha256), timeout=timeout_s)
    except (ValueError, ray.exceptions.RayError):
        return None
