"""The small typed records that cross between orchestrator and workers (through Ray).

They are plain dataclasses of builtins so they pickle cheaply and can be stored as JSON.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import asdict, dataclass, field, fields

from workers import knobs
from workers.errors import BadInput


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
    no_kv_offload: bool = False  # True: the KV cache stays in host memory (-nkvo), for a tight GPU budget
    # llama-server's own (issue 22.3); None: llama-server's default
    n_parallel: int | None = None  # slots (-np)
    n_ctx: int | None = None  # the whole KV cache in tokens (-c)
    kv_unified: bool | None = None  # one KV buffer for every slot (-kvu / -no-kvu)
    cache_ram: int | None = None  # host prompt cache, MiB (--cache-ram)
    cache_idle_slots: bool | None = None  # idle slots saved to the prompt cache (--cache-idle-slots)
    cache_reuse: int | None = None  # prompt-cache reuse by KV shifting, tokens (--cache-reuse)

    def __post_init__(self) -> None:
        fa = self.flash_attn
        if isinstance(fa, int):  # old records: a bool; llama-bench's JSON: -1 (auto), 0, 1
            fa = {1: "on", 0: "off", -1: "auto"}.get(int(fa), fa)
            object.__setattr__(self, "flash_attn", fa)
        knobs.knob("flash_attn").check(fa, "flash attention")
        for name in ("type_k", "type_v"):
            knobs.knob(name).check(getattr(self, name), name)

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
        out = knobs.stored_form(asdict(self))
        for f in fields(self):
            if f.name not in _STORED_ALWAYS and out[f.name] == f.default:
                del out[f.name]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> BenchParams:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def llama_cpp_flags(self, tool: str = "llama-server") -> str:
        """The same configuration as flags ``tool`` (llama-bench, llama-server, llama-cli) accepts as
        they are (workers/knobs.py: llama-bench has no ``-tb`` and takes ``-nopo 1``, llama-server a
        bare ``--no-op-offload``; knobs at their default are left out except -ngl -t -b -ub -fa)."""
        return knobs.flags(self, tool)

    def llama_cpp_python_kwargs(self) -> dict:
        """The same configuration as keyword arguments of ``llama_cpp.Llama`` (llama-cpp-python 0.3.36).

        Its ``flash_attn`` is a bool with no "auto"; llama.cpp's auto turns flash attention on for
        every layer whose device runs it (CPU, Metal and CUDA all do), so "auto" is given as True.
        ``n_cpu_moe`` has no keyword there, so a configuration with it is for llama.cpp's tools only.
        """
        return knobs.python_kwargs(self)

    @classmethod
    def from_llama_flags(cls, text: str, n_layer: int, base: BenchParams | None = None) -> BenchParams:
        """Read llama.cpp flags ("-ngl 99 -t 8 -fa on -ctk q8_0") the way llama.cpp reads them.

        ``-ngl`` of -1, ``all``, ``auto`` or anything above the model's layers means every layer
        (n_layer + 1, llama.cpp's own clamp), and that effective value is what is stored. Flags not
        given keep ``base``'s values (fleettune's defaults). Anything else is a BadInput, one line.
        """
        start = asdict(base or cls())
        return cls(**knobs.over(start, knobs.parse_flags(text, n_layer)))


_STORED_ALWAYS = {"n_gpu_layers", "n_threads", "n_batch", "n_ubatch", "flash_attn", "n_threads_batch"}


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


def validate_workload(workload: Workload, model: object | None) -> None:
    """BadInput, one line, for a workload no measurement can run (``model``: its ModelInfo, or None)."""
    if workload.n_prompt < 0 or workload.n_gen < 0 or workload.n_prompt + workload.n_gen == 0:
        raise BadInput("prompt and gen tokens must be >= 0 and not both 0")
    if workload.reps < 1:
        raise BadInput(f"repetitions {workload.reps}: must be >= 1")
    if workload.depth < 0:
        raise BadInput(f"depth {workload.depth}: must be >= 0")
    longest = workload.depth + max(workload.n_prompt, workload.n_gen)  # each test has its own context
    if model and model.context_length and longest > model.context_length:
        raise BadInput(
            f"depth {workload.depth} + {max(workload.n_prompt, workload.n_gen)} tokens exceed "
            f"{model.name}'s context ({model.context_length})"
        )


MAX_USERS = 4096  # a served load's users, requests per window and windows: at most this


@dataclass(frozen=True)
class ServedWorkload:
    """How a served trial loads its server (issue 22.1; workers/served.py measures it).

    The requests' lengths are the study's ``Workload`` (prompt tokens, give or take
    ``prompt_spread``, and generated tokens); this says how they arrive and how much is measured.
    """

    users: int = 4  # closed loop: concurrent users (goodput and throughput at a fixed load)
    rate: float | None = None  # open loop instead: Poisson arrivals, requests per second
    requests: int = 32  # measured requests per window (at least one per user)
    windows: int = 3  # windows a fixed-load trial measures: its repetitions
    prompt_spread: int = 0  # prompt lengths uniform in n_prompt -/+ this
    capacity: bool = False  # search the concurrency for the most users within the SLO
    max_users: int = 64  # the capacity search's ceiling
    slo: str = "ttft_p90=1s,tps_p10=20"  # workers/slo.py's text form
    window_s: float = 120.0  # bound on each window (and each capacity level)

    def validate(self, n_prompt: int) -> None:
        """BadInput, one line, for a load no served trial can run (``n_prompt``: the mean prompt)."""
        from workers.slo import parse_slo

        for name, value, low in (("--users", self.users, 1), ("--requests", self.requests, 1),
                                 ("--windows", self.windows, 1), ("--max-users", self.max_users, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_USERS:
                raise BadInput(f"{name} {value!r}: must be a whole number in {low}..{MAX_USERS}")
        if self.rate is not None and not (isinstance(self.rate, int | float) and 0 < self.rate < 1e6):
            raise BadInput(f"--rate {self.rate!r}: requests per second, more than 0")
        if not isinstance(self.prompt_spread, int) or not 0 <= self.prompt_spread < max(n_prompt, 1):
            raise BadInput(f"--prompt-spread {self.prompt_spread!r}: must be 0..{max(n_prompt - 1, 0)} "
                           f"(the prompts' length varies by at most this)")
        if not (isinstance(self.window_s, int | float) and 0 < self.window_s <= 86400):
            raise BadInput(f"window seconds {self.window_s!r}: must be in (0, 86400]")
        parse_slo(self.slo)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ServedWorkload:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


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
    served: ServedWorkload | None = None  # issue 22.1: measured on a real llama-server under this load


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
    OVER_BUDGET = "over budget"  # issue 23.1: llama.cpp allocated more GPU memory than the study's budget
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
    # issue 23.1: peak GPU memory of the trial: llama.cpp's own buffers on GPU devices (the model's,
    # plus the largest context's KV, compute and output buffers), from its log; 0 on a CPU build
    gpu_bytes: int | None = None
    # issue 23.1: the trial's process as NVIDIA's driver counts it at the peak (CUDA context
    # included, nvidia-smi), None where no counter names it (no NVIDIA GPU, a CPU build)
    gpu_device_bytes: int | None = None
    # issue 22.1: a served trial's levels (every request, each window's figures, the server's
    # /metrics), the server's build and command line (workers/served.py)
    served: dict | None = None

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
