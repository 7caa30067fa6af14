"""The small typed records that cross between orchestrator and workers (through Ray).

They are plain dataclasses of builtins so they pickle cheaply and can be stored as JSON.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import asdict, dataclass, field, fields

from workers.errors import BadInput

FLASH_ATTN = ("off", "on", "auto")  # llama.cpp's values for -fa
KV_TYPES = ("f16", "q8_0", "q4_0")  # the KV cache types searched (-ctk/-ctv)
GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml.h's enum ggml_type, as llama_cpp.Llama takes them
TOOLS = ("llama-bench", "llama-server")


@dataclass(frozen=True)
class BenchParams:
    """One llama.cpp configuration: what llama-bench calls -ngl -t -b -ub -fa -ctk -ctv -ncmoe -nopo.

    ``flash_attn`` is llama.cpp's own "off" | "on" | "auto" (a bool, as older records stored it,
    reads as "on"/"off"). A quantized V cache needs flash attention "on" (``kv_problem``).
    """

    n_gpu_layers: int = 0
    n_threads: int = 1
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: str = "off"
    n_threads_batch: int | None = None  # None: same as n_threads (llama-bench's way)
    type_k: str = "f16"
    type_v: str = "f16"
    n_cpu_moe: int = 0  # layers whose expert tensors stay on the CPU (MoE models only)
    op_offload: bool = True  # llama.cpp's default; False keeps big prompt batches off the GPU at -ngl 0

    def __post_init__(self) -> None:
        fa = self.flash_attn
        if isinstance(fa, int):  # old records: a bool; llama-bench's JSON: -1 (auto), 0, 1
            fa = {1: "on", 0: "off", -1: "auto"}.get(int(fa), fa)
            object.__setattr__(self, "flash_attn", fa)
        if fa not in FLASH_ATTN:
            raise BadInput(f"flash attention {fa!r}: must be one of {', '.join(FLASH_ATTN)}")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_TYPES:
                raise BadInput(f"{name} {getattr(self, name)!r}: must be one of {', '.join(KV_TYPES)}")

    @property
    def threads_batch(self) -> int:
        return self.n_threads_batch or self.n_threads

    @property
    def kv_problem(self) -> str | None:
        """Why llama.cpp refuses this KV cache (a quantized V without flash attention on), else None."""
        if self.type_v != "f16" and self.flash_attn != "on":
            return f"a {self.type_v} V cache needs flash attention on (-fa on), not {self.flash_attn}"
        return None

    def to_dict(self) -> dict:
        """The stored form: exactly the old one for configurations the old fields can say.

        Studies compare and deduplicate configurations by this dict, so flash attention on/off is
        stored as the bool it always was and the newer fields only where they leave their default.
        """
        out = asdict(self)
        if self.flash_attn != "auto":
            out["flash_attn"] = self.flash_attn == "on"
        for f in fields(self):
            if f.name in _NEW_FIELDS and out[f.name] == f.default:
                del out[f.name]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> BenchParams:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def llama_cpp_flags(self, tool: str = "llama-server") -> str:
        """The same configuration as flags ``llama-bench`` or ``llama-server`` accept as they are.

        llama-server takes ``-tb`` and a bare ``--no-op-offload``; llama-bench has no ``-tb`` (it runs
        prompt and generation on ``-t`` threads) and takes ``-nopo 1``. Defaults are left out except
        -ngl -t -b -ub -fa, which always print (llama.cpp's own defaults for them differ from ours).
        """
        if tool not in TOOLS:
            raise BadInput(f"tool {tool!r}: must be one of {', '.join(TOOLS)}")
        flags = [f"-ngl {self.n_gpu_layers}", f"-t {self.n_threads}"]
        if tool == "llama-server" and self.n_threads_batch and self.n_threads_batch != self.n_threads:
            flags.append(f"-tb {self.n_threads_batch}")
        flags += [f"-b {self.n_batch}", f"-ub {self.n_ubatch}", f"-fa {self.flash_attn}"]
        if self.type_k != "f16":
            flags.append(f"-ctk {self.type_k}")
        if self.type_v != "f16":
            flags.append(f"-ctv {self.type_v}")
        if self.n_cpu_moe:
            flags.append(f"-ncmoe {self.n_cpu_moe}")
        if not self.op_offload:
            flags.append("-nopo 1" if tool == "llama-bench" else "--no-op-offload")
        return " ".join(flags)

    def llama_cpp_python_kwargs(self) -> dict:
        """The same configuration as keyword arguments of ``llama_cpp.Llama`` (llama-cpp-python 0.3.36).

        Its ``flash_attn`` is a bool with no "auto"; llama.cpp's auto turns flash attention on for
        every layer whose device runs it (CPU, Metal and CUDA all do), so "auto" is given as True.
        ``n_cpu_moe`` has no keyword there (llama.cpp implements it as tensor buffer overrides, which
        ``Llama`` does not bind), so a configuration with it is for llama.cpp's tools only.
        """
        kwargs: dict = {
            "n_gpu_layers": self.n_gpu_layers,
            "n_threads": self.n_threads,
            "n_threads_batch": self.threads_batch,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn != "off",
        }
        if self.type_k != "f16":
            kwargs["type_k"] = GGML_TYPES[self.type_k]
        if self.type_v != "f16":
            kwargs["type_v"] = GGML_TYPES[self.type_v]
        if not self.op_offload:
            kwargs["op_offload"] = False
        return kwargs

    @classmethod
    def from_llama_flags(cls, text: str, n_layer: int, base: BenchParams | None = None) -> BenchParams:
        """Read llama.cpp flags ("-ngl 99 -t 8 -fa on -ctk q8_0") the way llama.cpp reads them.

        ``-ngl`` of -1, ``all``, ``auto`` or anything above the model's layers means every layer
        (n_layer + 1, llama.cpp's own clamp), and that effective value is what is stored. Flags not
        given keep ``base``'s values (fleettune's defaults). Anything else is a BadInput, one line.
        """
        words = text.split()
        start = base or cls()
        values = {f.name: getattr(start, f.name) for f in fields(cls)}
        i = 0
        while i < len(words):
            flag = words[i]
            key = _FLAGS.get(flag)
            if key is None:
                raise BadInput(f"unknown flag {flag!r}; known: {' '.join(sorted(_FLAGS))}")
            bare = flag in ("--no-op-offload", "--op-offload")  # llama-server's; llama-bench's takes 0|1
            if bare and (i + 1 >= len(words) or words[i + 1].startswith("-")):
                values["op_offload"] = flag == "--op-offload"
                i += 1
                continue
            if i + 1 >= len(words):
                raise BadInput(f"{flag} needs a value")
            value = words[i + 1]
            i += 2
            values[key] = _flag_value(flag, key, value, n_layer)
        try:
            return cls(**values)
        except TypeError as exc:  # pragma: no cover - every key above is a field
            raise BadInput(str(exc)) from None


_NEW_FIELDS = {"type_k", "type_v", "n_cpu_moe", "op_offload"}  # left out of to_dict at their default
_FLAGS = {
    "-ngl": "n_gpu_layers", "--n-gpu-layers": "n_gpu_layers", "--gpu-layers": "n_gpu_layers",
    "-t": "n_threads", "--threads": "n_threads", "-tb": "n_threads_batch", "--threads-batch": "n_threads_batch",
    "-b": "n_batch", "--batch-size": "n_batch", "-ub": "n_ubatch", "--ubatch-size": "n_ubatch",
    "-fa": "flash_attn", "--flash-attn": "flash_attn",
    "-ctk": "type_k", "--cache-type-k": "type_k", "-ctv": "type_v", "--cache-type-v": "type_v",
    "-ncmoe": "n_cpu_moe", "--n-cpu-moe": "n_cpu_moe",
    "-nopo": "op_offload", "--no-op-offload": "op_offload", "--op-offload": "op_offload",
}
_TRUTHY, _FALSEY, _AUTOY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0"), ("auto", "-1")


def _flag_value(flag: str, key: str, value: str, n_layer: int):
    """One flag's value as llama.cpp parses it (common/arg.cpp, tools/llama-bench)."""
    if key == "flash_attn":
        for word, words in (("on", _TRUTHY), ("off", _FALSEY), ("auto", _AUTOY)):
            if value in words:
                return word
        raise BadInput(f"{flag} takes on, off or auto, not {value!r}")
    if key in ("type_k", "type_v"):
        if value not in KV_TYPES:
            raise BadInput(f"{flag} takes one of {', '.join(KV_TYPES)}, not {value!r}")
        return value
    if key == "op_offload":  # llama-bench's -nopo 0|1 (1: op offload off)
        if value in ("1", "0"):
            return (value == "1") == (flag == "--op-offload")
        raise BadInput(f"{flag} takes 0 or 1, not {value!r}")
    if key == "n_gpu_layers" and value in ("all", "auto"):
        return n_layer + 1
    try:
        number = int(value)
    except ValueError:
        raise BadInput(f"{flag} takes a whole number, not {value!r}") from None
    if key == "n_gpu_layers":
        if number < -1:
            raise BadInput(f"{flag} {number}: must be -1 (every layer) or more")
        return n_layer + 1 if number == -1 or number > n_layer + 1 else number
    lowest = 0 if key == "n_cpu_moe" else 1
    if number < lowest:
        raise BadInput(f"{flag} {number}: must be >= {lowest}")
    return number


def llama_cpp_python_code(kwargs: dict) -> str:
    """The Python line that loads a model with these ``llama_cpp.Llama`` keyword arguments."""
    return "llama_cpp.Llama(model_path, " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


@dataclass(frozen=True)
class Workload:
    """How a trial is measured: pp of ``n_prompt`` tokens, tg of ``n_gen`` tokens, ``reps`` times,
    each after ``depth`` tokens already in the KV cache (their prefill is not timed)."""

    n_prompt: int = 512
    n_gen: int = 128
    reps: int = 3
    warmup: bool = True
    seed: int = 1234
    depth: int = 0  # tokens already in the KV cache before pp and tg are timed (llama-bench -d)

    def to_dict(self) -> dict:
        """Depth 0 is left out, so the stored workloads of existing studies keep their identity."""
        out = asdict(self)
        if not self.depth:
            del out["depth"]
        return out


@dataclass(frozen=True)
class TrialSpec:
    """Everything a worker needs to run one trial; no database ids, no orchestrator state."""

    model_path: str
    model_sha256: str
    params: BenchParams
    workload: Workload
    timeout_s: float = 600.0
    cooldown_s: float = 0.0
    trial_key: str = ""  # opaque id the orchestrator uses to match the result
    measure_kl: bool = False  # issue 20.4: also measure the KL divergence of a quantized KV cache


@dataclass(frozen=True)
class Sample:
    """One timed repetition: ``n_tokens`` of kind pp or tg took ``seconds``."""

    kind: str
    rep: int
    n_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Stats:
    """Summary of one kind's samples in tokens per second, as llama-bench reports them."""

    mean: float
    median: float
    stddev: float
    cv: float
    n: int

    @classmethod
    def of(cls, samples: list[Sample]) -> Stats | None:
        rates = [s.tokens_per_s for s in samples]
        if not rates:
            return None
        mean = statistics.fmean(rates)
        stddev = statistics.stdev(rates) if len(rates) > 1 else 0.0
        return cls(mean, statistics.median(rates), stddev, stddev / mean if mean else 0.0, len(rates))


class FailureKind(enum.Enum):
    """Why a trial failed, as the study loop decides on it (the message is for people).

    ``NODE_LOST`` and ``INTERRUPTED`` say nothing about the configuration: the study measures it
    again (a node lost, a bounded number of times). The others are the configuration's own
    outcome and count as a failed trial.
    """

    NODE_LOST = "node lost"
    INTERRUPTED = "interrupted"
    TIMEOUT = "timeout"
    CRASH = "crash"
    OUT_OF_MEMORY = "out of memory"
    MODEL_CHANGED = "model changed"
    MODEL_MISSING = "model missing"
    BAD_CONFIG = "bad config"
    NO_SAMPLES = "no samples"
    WORKER_ERROR = "worker error"


@dataclass
class TrialResult:
    """What a worker sends back: samples and summaries, or an error with its reason and kind."""

    trial_key: str
    ok: bool
    error: str | None = None
    samples: list[Sample] = field(default_factory=list)
    load_s: float | None = None
    peak_rss_bytes: int | None = None
    thermal_before: str | None = None
    thermal_after: str | None = None
    node_id: str | None = None
    hostname: str | None = None
    started_at: float | None = None  # unix time, as the node's clock saw it
    finished_at: float | None = None
    measure_s: float | None = None  # load + decode time inside the measuring subprocess
    simulated: bool = False
    backend_info: str | None = None
    failure_kind: str | None = None  # a FailureKind value (a plain string: it crosses as JSON)
    # issue 20.1: the configuration llama.cpp actually ran (flash attention resolved, batch sizes and
    # GPU layers after clipping), read back from llama.cpp, in BenchParams.to_dict form
    effective: dict | None = None
    # issue 20.4: mean KL divergence of the next-token distributions against the f16 KV cache
    kl_divergence: float | None = None

    @property
    def kind(self) -> FailureKind | None:
        """The failure's kind; None for a result that is ok."""
        if self.ok:
            return None
        try:
            return FailureKind(self.failure_kind)
        except ValueError:
            return FailureKind.WORKER_ERROR

    def stats(self, kind: str) -> Stats | None:
        return Stats.of([s for s in self.samples if s.kind == kind])

    @property
    def pp(self) -> Stats | None:
        return self.stats("pp")

    @property
    def tg(self) -> Stats | None:
        return self.stats("tg")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrialResult:
        data = dict(data)
        data["samples"] = [Sample(**s) for s in data.get("samples", [])]
        return cls(**data)

    @classmethod
    def failure(cls, trial_key: str, reason: str, kind: FailureKind = FailureKind.WORKER_ERROR,
                **extra) -> TrialResult:
        return cls(trial_key=trial_key, ok=False, error=reason, failure_kind=kind.value, **extra)
