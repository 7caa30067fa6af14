"""The small typed records that cross between orchestrator and workers (through Ray).

They are plain dataclasses of builtins so they pickle cheaply and can be stored as JSON.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class BenchParams:
    """One llama.cpp configuration: what llama-bench calls -ngl, -t, -b, -ub, -fa."""

    n_gpu_layers: int = 0
    n_threads: int = 1
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: bool = False
    n_threads_batch: int | None = None  # None: same as n_threads (llama-bench's way)

    @property
    def threads_batch(self) -> int:
        return self.n_threads_batch or self.n_threads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> BenchParams:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def llama_cpp_flags(self) -> str:
        """The same configuration as llama.cpp command-line flags."""
        flags = f"-ngl {self.n_gpu_layers} -t {self.n_threads}"
        if self.n_threads_batch and self.n_threads_batch != self.n_threads:
            flags += f" -tb {self.n_threads_batch}"
        flags += f" -b {self.n_batch} -ub {self.n_ubatch}"
        return flags + (" -fa on" if self.flash_attn else "")

    def llama_cpp_python_kwargs(self) -> dict:
        """The same configuration as keyword arguments of ``llama_cpp.Llama``."""
        return {
            "n_gpu_layers": self.n_gpu_layers,
            "n_threads": self.n_threads,
            "n_threads_batch": self.threads_batch,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn,
        }


def llama_cpp_python_code(kwargs: dict) -> str:
    """The Python line that loads a model with these ``llama_cpp.Llama`` keyword arguments."""
    return "llama_cpp.Llama(model_path, " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


@dataclass(frozen=True)
class Workload:
    """How a trial is measured: pp of ``n_prompt`` tokens, tg of ``n_gen`` tokens, ``reps`` times."""

    n_prompt: int = 512
    n_gen: int = 128
    reps: int = 3
    warmup: bool = True
    seed: int = 1234

    def to_dict(self) -> dict:
        return asdict(self)


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
