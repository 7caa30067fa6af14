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
    """chip key -> {model sha256 -> payload} (the newest promoted rollout's).

    A rollout publishes its own model's configs only (``models``), so a driver of another model,
    publishing what it read a moment earlier, never puts back a config that was just rolled back
    (rule 24.4: the hub never hands out a rolled-back config)."""

    def __init__(self) -> None:
        self._configs: dict[str, dict[str, dict]] = {}

    def publish(self, configs: dict[str, dict[str, dict]], models: list[str] | None = None) -> int:
        """Replace every model's configs (``models`` None) or those of ``models`` only."""
        if models is None:
            self._configs = configs
        else:
            kept = {chip: {m: p for m, p in by_model.items() if m not in models}
                    for chip, by_model in self._configs.items()}
            for chip, by_model in configs.items():
                kept.setdefault(chip, {}).update({m: p for m, p in by_model.items() if m in models})
            self._configs = {chip: by_model for chip, by_model in kept.items() if by_model}
        return sum(len(v) for v in self._configs.values())

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
