"""A node's active configuration: the file a rollout writes and `fleettune config show` reads.

The payload is validated data (known keys, bounded values), never a shell string; it is written to
a temporary file, flushed to disk and renamed over the old one, so a reader sees the old config or
the new one, never half of either. One file per node, named by the node's Ray id, under
``<data dir>/node-config`` (several simulated nodes may share one machine).

Writers (a rollout's apply, a rollback, the join hand-out) take the node's lock file, and a write
may be conditional (``only_if``: the configs the node may hold now), so a rollback never replaces a
config that some later change put there, and a failed apply never ends in a deleted config.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from workers import knobs
from workers.errors import BadInput
from workers.paths import data_dir
from workers.trial import BenchParams, llama_cpp_python_code

KEYS = {"version", "rollout_id", "model_sha256", "model_name", "objective", "params", "expected_tps"}
OPTIONAL_KEYS = {"workload", "source"}  # the recommendation's n_prompt/n_gen; "recommendation" or "pin"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[\w.\-+ ]{1,200}$")
FORMATS = ("json", "flags", "ollama", "python")


def config_dir() -> Path:
    return data_dir() / "node-config"


def validate(payload: dict) -> dict:
    """The payload, checked; BadInput names the first thing wrong with it."""
    if not isinstance(payload, dict) or not KEYS <= set(payload) <= KEYS | OPTIONAL_KEYS:
        raise BadInput(f"config payload must have the keys {sorted(KEYS)} (and only {sorted(OPTIONAL_KEYS)} besides)")
    workload = payload.get("workload", {"n_prompt": 0, "n_gen": 1})
    if not isinstance(workload, dict) or set(workload) != {"n_prompt", "n_gen"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1_000_000 for v in workload.values()) \
            or workload["n_prompt"] + workload["n_gen"] < 1:
        raise BadInput("config workload must be {n_prompt, n_gen}: integers in 0..1000000, not both 0")
    if payload.get("source", "recommendation") not in ("recommendation", "pin"):
        raise BadInput("config source must be recommendation or pin")
    if not isinstance(payload["version"], int) or not isinstance(payload["rollout_id"], int) \
            or payload["version"] < 1:
        raise BadInput("config version and rollout_id must be positive integers")
    if not SHA256.match(str(payload["model_sha256"])) or not NAME.match(str(payload["model_name"])):
        raise BadInput("config model_sha256 must be 64 hex digits and model_name a plain name")
    if payload["objective"] not in ("tg", "pp", "e2e"):
        raise BadInput(f"config objective {payload['objective']!r} unknown")
    expected = payload["expected_tps"]
    if not isinstance(expected, int | float) or not 0 < expected < 1e7:
        raise BadInput("config expected_tps must be a positive number")
    knobs.validate_params(payload["params"])
    return payload


def path_for(node_id: str) -> Path:
    if not re.match(r"^[0-9a-f]{8,64}$", node_id):
        raise BadInput(f"bad node id {node_id!r}")
    return config_dir() / f"{node_id}.json"


def read(node_id: str) -> dict | None:
    path = path_for(node_id)
    return json.loads(path.read_text()) if path.is_file() else None


@contextlib.contextmanager
def locked(node_id: str) -> Iterator[None]:
    """Hold the node's config lock (one writer at a time; readers need none: writes are renames)."""
    path = path_for(node_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{node_id}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _replace(path: Path, node_id: str, payload: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{node_id}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write(node_id: str, payload: dict | None, only_if: list[dict | None] | None = None) -> dict:
    """Make ``payload`` the node's active config (None: no config), under the node's lock.

    ``only_if``: the configs the node may hold now for the write to happen; holding any other, the
    node keeps it. Returns ``{"previous": the config it held, "applied": whether it was written}``.
    """
    if payload is not None:
        validate(payload)
    path = path_for(node_id)
    with locked(node_id):
        previous = read(node_id)
        if only_if is not None and previous not in only_if:
            return {"previous": previous, "applied": False}
        if payload is None:
            path.unlink(missing_ok=True)
        elif previous != payload:
            _replace(path, node_id, payload)
    return {"previous": previous, "applied": True}


def all_configs() -> dict[str, dict]:
    """Every node config on this machine: node id -> payload."""
    folder = config_dir()
    if not folder.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def render(payload: dict, fmt: str) -> str:
    """The config as JSON, llama.cpp flags, Ollama Modelfile PARAMETER lines or Python."""
    params = BenchParams.from_dict(payload["params"])
    if fmt == "json":
        return json.dumps(payload, indent=2, sort_keys=True)
    if fmt == "flags":
        return params.llama_cpp_flags()
    if fmt == "ollama":
        return "\n".join([f"PARAMETER num_gpu {params.n_gpu_layers}",
                          f"PARAMETER num_thread {params.n_threads}",
                          f"PARAMETER num_batch {params.n_batch}"])
    if fmt == "python":
        return llama_cpp_python_code(params.llama_cpp_python_kwargs())
    raise BadInput(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
