"""A node's active configuration: the file a rollout writes and `fleettune config show` reads.

The config is a typed ``NodeConfig``, checked in ``from_dict`` (known keys, bounded values, never a
shell string) both where it is written and where it is read (rule 24.3): a file that is truncated,
empty, of the wrong shape or hand-edited out of bounds is a ``BadConfigFile`` naming what is wrong in
one line; the supervisor keeps serving its last good config and says why in its status, `config
show` prints that line, and the next write (a rollout's apply or restore) replaces the file.

A write goes to a temp file, flushed to disk and renamed over the old one, so a reader sees the old
config or the new one, never half of either. One file per node, named by the node's Ray id, under
``<data dir>/node-config``, which holds nothing else (several simulated nodes may share one machine).

Writers (a rollout's apply, a rollback, the join hand-out) take the node's lock file, and a write
may be conditional (``only_if``: the configs the node may hold now), so a rollback never replaces a
config that some later change put there, and a failed apply never ends in a deleted config.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from workers import knobs
from workers.errors import BadInput
from workers.files import atomic_write
from workers.objective import Objective, objective
from workers.paths import data_dir
from workers.trial import BenchParams, llama_cpp_python_code

KEYS = ("version", "rollout_id", "model_sha256", "model_name", "objective", "params", "expected_tps")
OPTIONAL_KEYS = ("workload", "source", "server")
SOURCES = ("recommendation", "pin")
REQUIRED_PARAMS = ("n_gpu_layers", "n_threads", "n_batch", "n_ubatch")
SERVER_PARAM_BOUNDS = {"n_ctx": (1, 1 << 20), "n_parallel": (1, 256)}  # server-only: context, slots
SHA256 = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[\w.\-+ ]{1,200}$")
NODE_ID = re.compile(r"^[0-9a-f]{8,64}$")
FORMATS = ("json", "flags", "ollama", "python")
MAX_FILE_BYTES = 1 << 20  # a node config is a few hundred bytes


class BadConfigFile(BadInput):
    """A node's config file that is not a valid config (one line: the file and what is wrong)."""


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def validate_params(params: object) -> dict:
    """The bench params of a node config, checked against the knob table (rule 21.2: the one place the
    bounds are checked); the four a server always needs must be there."""
    if not isinstance(params, dict):
        raise BadInput("config params must be an object")
    knobs.validate_params(params)
    missing = [key for key in REQUIRED_PARAMS if key not in params]
    if missing:
        raise BadInput(f"config params lacks {', '.join(missing)}")
    BenchParams.from_dict(params)
    return dict(params)


@dataclass(frozen=True)
class ServedWorkload:
    """The requests a config was recommended for: prompt and generated tokens."""

    n_prompt: int
    n_gen: int

    @classmethod
    def from_dict(cls, data: object) -> ServedWorkload:
        if not isinstance(data, dict) or set(data) != {"n_prompt", "n_gen"} \
                or not all(_is_int(v, 0, 1_000_000) for v in data.values()) or data["n_prompt"] + data["n_gen"] < 1:
            raise BadInput("config workload must be {n_prompt, n_gen}: integers in 0..1000000, not both 0")
        return cls(data["n_prompt"], data["n_gen"])

    def to_dict(self) -> dict:
        return {"n_prompt": self.n_prompt, "n_gen": self.n_gen}


@dataclass(frozen=True)
class NodeConfig:
    """One node's active config: which rollout put it there, for which model and objective, the bench
    params (validated by ``validate_params``), server-only params, and the figure a canary must reach.

    ``to_dict(from_dict(d)) == d`` for every valid ``d``: the dict is what crosses Ray and what the
    rollout's records hold, and conditional writes compare it.
    """

    version: int
    rollout_id: int
    model_sha256: str
    model_name: str
    objective: Objective
    params: dict
    expected_tps: float
    workload: ServedWorkload | None = None  # absent in configs written before workloads were recorded
    source: str | None = None  # "recommendation" (the default when absent) or "pin"
    server: dict = field(default_factory=dict)  # server-only params (SERVER_PARAM_BOUNDS)

    @classmethod
    def from_dict(cls, data: object) -> NodeConfig:
        """The config, checked; BadInput names the first thing wrong with it."""
        if not isinstance(data, dict):
            raise BadInput(f"config must be a JSON object, not {type(data).__name__}")
        missing, unknown = set(KEYS) - set(data), set(data) - set(KEYS) - set(OPTIONAL_KEYS)
        if missing or unknown:
            raise BadInput(f"config must have the keys {sorted(KEYS)} (and only {sorted(OPTIONAL_KEYS)} besides): "
                           + ", ".join([*(f"{k} missing" for k in sorted(missing)),
                                        *(f"{k} unknown" for k in sorted(unknown))]))
        if not _is_int(data["version"], 1, 1 << 62) or not _is_int(data["rollout_id"], 0, 1 << 62):
            raise BadInput("config version must be a positive integer and rollout_id a whole number")
        if not isinstance(data["model_sha256"], str) or not SHA256.match(data["model_sha256"]) \
                or not isinstance(data["model_name"], str) or not NAME.match(data["model_name"]):
            raise BadInput("config model_sha256 must be 64 hex digits and model_name a plain name")
        if not isinstance(data["objective"], str):
            raise BadInput("config objective must be a name")
        expected = data["expected_tps"]
        if isinstance(expected, bool) or not isinstance(expected, int | float) or not 0 < expected < 1e7:
            raise BadInput("config expected_tps must be a positive number")
        source = data.get("source")
        if source is not None and source not in SOURCES:
            raise BadInput(f"config source must be {' or '.join(SOURCES)}")
        server = data.get("server", {})
        if not isinstance(server, dict) or not set(server) <= set(SERVER_PARAM_BOUNDS) or not all(
                _is_int(v, *SERVER_PARAM_BOUNDS[k]) for k, v in server.items()):
            raise BadInput(f"config server must hold only bounded integers {sorted(SERVER_PARAM_BOUNDS)}")
        return cls(version=data["version"], rollout_id=data["rollout_id"], model_sha256=data["model_sha256"],
                   model_name=data["model_name"], objective=objective(data["objective"]),
                   params=validate_params(data["params"]), expected_tps=expected,
                   workload=ServedWorkload.from_dict(data["workload"]) if "workload" in data else None,
                   source=source, server=dict(server))

    def to_dict(self) -> dict:
        out = {"version": self.version, "rollout_id": self.rollout_id, "model_sha256": self.model_sha256,
               "model_name": self.model_name, "objective": self.objective.name, "params": dict(self.params),
               "expected_tps": self.expected_tps}
        if self.workload is not None:
            out["workload"] = self.workload.to_dict()
        if self.source is not None:
            out["source"] = self.source
        if self.server:
            out["server"] = dict(self.server)
        return out

    @property
    def bench_params(self) -> BenchParams:
        return BenchParams.from_dict(self.params)

    @property
    def origin(self) -> str:
        """Where the config came from: "recommendation" or "pin"."""
        return self.source or "recommendation"


def config_dir() -> Path:
    return data_dir() / "node-config"


def validate(payload: dict) -> dict:
    """The payload, checked (``NodeConfig.from_dict``); BadInput names the first thing wrong with it."""
    return NodeConfig.from_dict(payload).to_dict()


def path_for(node_id: str) -> Path:
    if not isinstance(node_id, str) or not NODE_ID.match(node_id):
        raise BadInput(f"bad node id {node_id!r}")
    return config_dir() / f"{node_id}.json"


def _parse(path: Path, node_id: str) -> NodeConfig | None:
    """The config in ``path`` (None: no file); BadConfigFile for a file that holds no valid config."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadConfigFile(f"node {node_id[:12]}: config file {path}: cannot be read ({exc.strerror})") from None
    try:
        if len(raw) > MAX_FILE_BYTES:
            raise BadInput(f"config is over {MAX_FILE_BYTES} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise BadInput("not JSON (empty or truncated?)" if raw.strip() else "empty") from None
        return NodeConfig.from_dict(data)
    except BadInput as exc:
        raise BadConfigFile(f"node {node_id[:12]}: bad config file {path}: {exc}") from None


def load(node_id: str) -> NodeConfig | None:
    """The node's active config (None: none); ``BadConfigFile`` when its file holds no valid config."""
    return _parse(path_for(node_id), node_id)


def read(node_id: str) -> dict | None:
    """The node's active config as its dict; None when there is none or its file is not a valid config
    (what the head sees: a node without a usable config, which the next write repairs)."""
    try:
        config = load(node_id)
    except BadConfigFile:
        return None
    return config.to_dict() if config else None


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


def write(node_id: str, config: NodeConfig | dict | None, only_if: list[dict | None] | None = None) -> dict:
    """Make ``config`` the node's active config (None: no config), under the node's lock.

    ``only_if``: the configs the node may hold now for the write to happen; holding any other, the
    node keeps it. A file that is not a valid config counts as no config and is always replaced
    (rule 24.3). Returns ``{"previous": the config it held, "applied": whether it was written}``.
    """
    if config is not None and not isinstance(config, NodeConfig):
        config = NodeConfig.from_dict(config)
    path = path_for(node_id)
    with locked(node_id):
        try:
            held = _parse(path, node_id)
            bad = False
        except BadConfigFile:
            held, bad = None, True
        previous = held.to_dict() if held else None
        if only_if is not None and not bad and previous not in only_if:
            return {"previous": previous, "applied": False}
        if config is None:
            path.unlink(missing_ok=True)
        elif bad or held != config:
            atomic_write(path, json.dumps(config.to_dict(), indent=2, sort_keys=True))
    return {"previous": previous, "applied": True}


def all_configs() -> dict[str, NodeConfig | BadConfigFile]:
    """Every node config on this machine: node id -> its config, or why its file holds none."""
    folder = config_dir()
    if not folder.is_dir():
        return {}
    out: dict[str, NodeConfig | BadConfigFile] = {}
    for path in sorted(folder.glob("*.json")):
        if not NODE_ID.match(path.stem):
            continue
        try:
            config = _parse(path, path.stem)
        except BadConfigFile as exc:
            out[path.stem] = exc
            continue
        if config is not None:
            out[path.stem] = config
    return out


def render(config: NodeConfig, fmt: str) -> str:
    """The config as JSON, llama.cpp flags, Ollama Modelfile PARAMETER lines or Python."""
    params = config.bench_params
    if fmt == "json":
        return json.dumps(config.to_dict(), indent=2, sort_keys=True)
    if fmt == "flags":
        return params.llama_cpp_flags()
    if fmt == "ollama":
        return "\n".join([f"PARAMETER num_gpu {params.n_gpu_layers}",
                          f"PARAMETER num_thread {params.n_threads}",
                          f"PARAMETER num_batch {params.n_batch}"])
    if fmt == "python":
        return llama_cpp_python_code(params.llama_cpp_python_kwargs())
    raise BadInput(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
