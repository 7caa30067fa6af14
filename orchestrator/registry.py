"""Models known to the results database: register a GGUF file, resolve what the user typed.

MODEL on the command line is a path, a sha256 prefix (6+ hex digits) or a registered name.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.db import Database, repo
from orchestrator.db.session import data_dir
from workers.errors import BadInput
from workers.models import KNOWN_MODELS, ModelInfo, fetch_known_model, read_model_info
from workers.simulated import is_sim_model, sim_model_info


def models_dir() -> Path:
    return data_dir() / "models"


def register(db: Database, path: str | os.PathLike, *, write: bool = True) -> ModelInfo:
    """Read a GGUF file (hashing it only when it changed since last time) and record it.

    With ``write=False`` nothing is stored (the study that uses the model records it later).
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise BadInput(f"{path}: no such model file")
    mtime = file.stat().st_mtime
    with db.session() as s:
        known = repo.model_by_path(s, str(file))
        if known and known.path_mtime == mtime and known.size_bytes == file.stat().st_size:
            # a row keeps no shape (heads, experts): the file's metadata gives it, its hash is kept
            return read_model_info(file, sha256=known.sha256)
    info = read_model_info(file)  # raises BadInput before anything is written
    if write:
        with db.session() as s:
            repo.upsert_model(s, info, mtime)
    return info


def looks_like_path(ref: str) -> bool:
    if is_sim_model(ref):
        return False
    return Path(ref).expanduser().exists() or ref.endswith(".gguf") or os.sep in ref


def model_key(db: Database, ref: str) -> str:
    """What a stored row's model is matched by for ``ref``: a path's or a sim:// reference's
    sha256 (neither is a stored name), else ``ref`` itself (a name or a sha256 prefix)."""
    return resolve(db, ref).sha256 if is_sim_model(ref) or looks_like_path(ref) else ref


def resolve(db: Database, ref: str, *, write: bool = False) -> ModelInfo:
    """The model ``ref`` names: a path, a simulated shape (sim://NAME/QUANT), a name or a prefix.

    Nothing is written unless ``write``: a command that fails later leaves the database as it was.
    """
    if is_sim_model(ref):
        return sim_model_info(ref)
    if looks_like_path(ref):
        return register(db, ref, write=write)
    if ref in KNOWN_MODELS:
        path = models_dir() / Path(KNOWN_MODELS[ref].member).name
        if not path.is_file():
            raise BadInput(f"model {ref} is not here yet: run `fleettune model fetch {ref}`")
        return register(db, path, write=write)
    with db.session() as s:
        matches = repo.find_models(s, ref)
        infos = [repo.model_info_of(m) for m in matches]
    if not infos:
        raise BadInput(f"unknown model {ref!r}: not a file, a registered name or a sha256 prefix")
    if len(infos) > 1:
        names = ", ".join(f"{i.name} ({i.sha256[:12]})" for i in infos)
        raise BadInput(f"model {ref!r} is ambiguous: {names}")
    info = infos[0]
    if info.path and is_sim_model(info.path):
        return sim_model_info(info.path)
    if not info.path or not Path(info.path).is_file():
        raise BadInput(f"model {info.name} ({info.sha256[:12]}) is registered but its file is gone: {info.path}")
    return register(db, info.path, write=write)  # a file changed since is hashed again


def fetch(db: Database, name: str, dest: str | os.PathLike | None = None) -> ModelInfo:
    try:
        path = fetch_known_model(name, dest or models_dir())
    except OSError as exc:  # a --dest that cannot be made or written
        raise BadInput(f"cannot fetch {name} into {exc.filename or dest}: {exc.strerror or exc}") from None
    return register(db, path)


def list_all(db: Database) -> list[ModelInfo]:
    with db.session() as s:
        return [repo.model_info_of(m) for m in repo.list_models(s)]


def synth(db: Database, shape: str, quant: str, out: str | os.PathLike, vocab_from: str | None = None,
          seed: int = 0) -> ModelInfo:
    """Write a shape-faithful synthetic GGUF and register it.

    The tokenizer is borrowed from ``vocab_from`` (a path or a model reference); by default from
    the known real model smollm2-135m, which must have been fetched.
    """
    from workers.models import synthesize

    source = resolve(db, vocab_from or "smollm2-135m")
    out_path = Path(out).expanduser()
    if out_path.is_dir():
        out_path = out_path / f"synthetic-{shape}-{quant.lower()}.gguf"
    info = synthesize(shape, quant, source.path, out_path, seed=seed)
    return register(db, info.path)
