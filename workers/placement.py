"""Where a configuration puts a model, and whether it fits a GPU memory budget (issue 23.1).

One estimate of what a configuration asks of the GPU's memory, from the model's shape (a GGUF's
metadata or a named shape) and the context, used by the simulator (its out-of-memory rule) and by
a study (a configuration over the budget is refused before it is loaded):

- weights: the offloaded layers' tensors (less the experts kept on the CPU by ``n_cpu_moe``),
  and the output projection when ``n_gpu_layers`` exceeds the layer count (llama.cpp's rule);
- KV cache: K and V of every context position in the offloaded layers, in their cache types
  (none on the GPU with ``no_kv_offload``);
- compute buffers: ``COMPUTE_BYTES_PER_UBATCH_EMBD`` bytes per micro-batch token and embedding
  value (modelled, not calibrated).

The budget is the GPU's memory as the device reports it (a discrete GPU's total, or the wired
share of unified memory on a Mac: ``WORKING_SET_FRACTION``, Metal's default; ``iogpu.wired_limit_mb``
raises it), or what the user gives (``--gpu-budget 8GiB``), never more than the device has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from workers.errors import BadInput
from workers.hardware import GIB, Fingerprint, gpu_free_bytes
from workers.llamatools import (
    FitPlacement,
    ToolError,
    fit_params_argv,
    fit_target_mib,
    run_fit_params,
)
from workers.models import ModelInfo
from workers.trial import BenchParams

WORKING_SET_FRACTION = 0.75  # the share of unified memory Metal lets the GPU wire by default
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per cached value (ggml's blocks)
COMPUTE_BYTES_PER_UBATCH_EMBD = 64  # compute buffers per micro-batch token and embedding value (modelled)
FIT_MARGIN_BYTES = 1024**3  # llama.cpp's --fit-target default: 1024 MiB left free per device
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a configuration places in the GPU's memory, by kind."""

    weights: float
    kv_cache: float
    compute: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.compute

    def describe(self) -> str:
        return (f"{self.total / GIB:.2f} GiB (weights {self.weights / GIB:.2f}, KV cache {self.kv_cache / GIB:.2f}, "
                f"compute {self.compute / GIB:.2f})")


def gpu_layers(shape: ModelInfo, params: BenchParams) -> tuple[int, bool]:
    """The repeating layers offloaded, and whether the output projection is (ngl > layers)."""
    ngl = max(0, min(params.n_gpu_layers, shape.n_layer + 1))
    return min(ngl, shape.n_layer), ngl > shape.n_layer


def experts_on_cpu(shape: ModelInfo, params: BenchParams) -> int:
    """Offloaded layers whose experts stay in host memory: the first ``n_cpu_moe`` layers, less
    those the CPU holds whole anyway."""
    on_gpu, _ = gpu_layers(shape, params)
    if not shape.n_expert or not on_gpu:
        return 0
    return max(0, min(params.n_cpu_moe, shape.n_layer) - (shape.n_layer - on_gpu))


def gpu_need(shape: ModelInfo, params: BenchParams, n_ctx: int) -> MemoryNeed:
    """What ``params`` places in the GPU's memory for a context of ``n_ctx`` positions."""
    on_gpu, output = gpu_layers(shape, params)
    weights = shape.bytes_of(on_gpu * shape.layer_params - experts_on_cpu(shape, params) * shape.expert_params
                             + (shape.output_params if output else 0.0))
    per_position = shape.kv_elements * (KV_BYTES[params.type_k] + KV_BYTES[params.type_v])  # one layer
    kv = 0.0 if params.no_kv_offload else per_position * n_ctx * on_gpu
    compute = params.n_ubatch * shape.n_embd * COMPUTE_BYTES_PER_UBATCH_EMBD if on_gpu else 0.0
    return MemoryNeed(weights, kv, compute)


HOST_MEMORY_FRACTION = 0.9  # a server's weights and KV cache may take at most this share of the node's RAM


def served_context(shape: ModelInfo, params: BenchParams) -> int:
    """The KV cache a server allocates, in positions: ``-c``, else the model's training context
    (llama-server's default)."""
    return params.n_ctx or shape.context_length or 4096


def served_memory_problem(shape: ModelInfo, params: BenchParams, memory_bytes: int | None,
                          gpu_budget: int | None, discrete_gpu: bool = False) -> str | None:
    """Why a server with ``params`` cannot fit this node (issue 22.3: refused before it runs), or
    None. Its whole KV cache is allocated at start (every slot's context): the GPU's part must fit
    ``gpu_budget`` (the budget, or the GPU's working set), and the rest ``HOST_MEMORY_FRACTION`` of
    the node's memory: on unified memory (a Mac) or a CPU node that is weights plus every layer's KV
    cache; beside a discrete GPU (``discrete_gpu``), what the GPU does not hold."""
    n_ctx = served_context(shape, params)
    need = gpu_need(shape, params, n_ctx) if params.n_gpu_layers > 0 else MemoryNeed(0.0, 0.0, 0.0)
    if gpu_budget and params.n_gpu_layers > 0 and need.total > gpu_budget:
        return (f"does not fit the GPU: a {n_ctx}-token KV cache needs {need.describe()} > "
                f"{gpu_budget / GIB:.2f} GiB (estimated)")
    if memory_bytes:
        kv = shape.kv_elements * (KV_BYTES[params.type_k] + KV_BYTES[params.type_v]) * n_ctx * shape.n_layer
        total = shape.size_bytes + kv - (need.weights + need.kv_cache if discrete_gpu else 0.0)
        if total > memory_bytes * HOST_MEMORY_FRACTION:
            return (f"does not fit memory: weights {shape.size_bytes / GIB:.2f} GiB + a {n_ctx}-token KV cache "
                    f"{kv / GIB:.2f} GiB > {HOST_MEMORY_FRACTION:.0%} of {memory_bytes / GIB:.1f} GiB (estimated)")
    return None


def fit(shape: ModelInfo, params: BenchParams, n_ctx: int, budget: float,
        margin: float = FIT_MARGIN_BYTES) -> BenchParams | None:
    """llama.cpp's ``--fit`` for one device, on this module's estimate (common/fit.cpp, steps 3
    and 4; the context is the workload's, not reduced): full offload where it fits ``budget``
    less ``margin``; else, for a mixture of experts, every layer offloaded with the experts of as
    few leading layers as it takes kept on the CPU (``n_cpu_moe``); else as many whole layers as
    fit (with every expert on the CPU for a mixture). None: not even one layer fits. Only the GPU
    layers and ``n_cpu_moe`` are changed: --fit leaves every other knob as given.

    Where llama.cpp differs: its fit fills layers front to back, so the experts it moves to the
    CPU are the *last* layers' (``-ot blk.N.ffn_*_exps=CPU`` per layer, set_ngl_tensor_split_tbo),
    and one layer may overflow only in part (its up, gate or attention tensors); ``n_cpu_moe`` keeps
    the *first* layers' experts there. The count of expert bytes on each side is the same, which is
    all this module's estimate and the simulator see."""
    target = budget - margin
    n_layer = shape.n_layer

    def fits(ngl: int, cpu_moe: int) -> bool:
        return gpu_need(shape, replace(params, n_gpu_layers=ngl, n_cpu_moe=cpu_moe), n_ctx).total <= target

    if fits(n_layer + 1, 0):
        return replace(params, n_gpu_layers=n_layer + 1, n_cpu_moe=0)
    all_experts = n_layer if shape.n_expert else 0
    if shape.n_expert and fits(n_layer + 1, all_experts):
        cpu_moe = next(n for n in range(all_experts + 1) if fits(n_layer + 1, n))
        return replace(params, n_gpu_layers=n_layer + 1, n_cpu_moe=cpu_moe)
    ngl = next((n for n in range(n_layer, 0, -1) if fits(n, all_experts)), 0)
    return replace(params, n_gpu_layers=ngl, n_cpu_moe=all_experts) if ngl else None


def llama_fit(tool: str, model_path: str, n_ctx: int, budget: float | None,
              free_bytes: int | None = None, timeout_s: float = 600) -> FitPlacement:
    """llama.cpp's own ``--fit`` placement (``llama-fit-params`` of the node's build) at a context of
    ``n_ctx`` for ``budget`` bytes of the first GPU: told to leave free all but the budget less its
    1 GiB margin (``-fitt``), since ggml sees the whole device whatever budget is set. Its margin
    is counted from the device's free memory, the CUDA context included (about 530 MiB on the
    H200), where ``fit`` above counts llama.cpp's buffers only. Without a budget it plans for the
    device as llama.cpp sees it. ToolError: it failed, or a budget was given and the device's free
    memory is unknown (no nvidia-smi: -fitt cannot be set)."""
    target = None
    if budget:
        free = free_bytes if free_bytes is not None else gpu_free_bytes()
        if free is None:
            raise ToolError("the device's free memory is unknown (no nvidia-smi): llama-fit-params "
                            "cannot be told the budget")
        target = fit_target_mib(free, int(budget), FIT_MARGIN_BYTES)
    return run_fit_params(fit_params_argv(tool, model_path, n_ctx, target), timeout_s)


_EXPERT_LAYER = re.compile(r"blk\\?\.(\d+)\\?\.ffn_")


def from_llama_fit(fitted: FitPlacement, params: BenchParams, shape: ModelInfo) -> BenchParams:
    """``params`` placed as llama-fit-params placed them, in the knob table's terms: its GPU layers,
    and for a mixture of experts ``n_cpu_moe`` = the layers whose feed-forward tensors it keeps in
    CPU buffers (``-ot blk.N.ffn_…=CPU``; a layer it splits counts whole, so the result never needs
    more GPU memory than its own). A dense model's split layer stays on the CPU (one GPU layer
    fewer). Only the placement changes: --fit leaves every other knob as given."""
    # llama.cpp names one layer past the last (blk.48 of a 48-layer model): no tensor, not counted
    on_cpu = {layer for o in fitted.overrides if o.rpartition("=")[2].upper().startswith("CPU")
              for m in [_EXPERT_LAYER.search(o)] if m and (layer := int(m.group(1))) < shape.n_layer}
    if not on_cpu and fitted.n_gpu_layers > shape.n_layer:  # all of it on the GPU, as the defaults ask
        return replace(params, n_gpu_layers=shape.n_layer + 1, n_cpu_moe=0)  # as ``fit`` says it
    if shape.n_expert and fitted.n_gpu_layers <= shape.n_layer:
        # not every layer offloaded: -ncmoe counts from the first layer, which are the CPU's
        # already, so the offloaded layers' experts stay on the CPU by keeping all of them there
        # (``fit``'s placement of as many whole layers)
        return replace(params, n_gpu_layers=fitted.n_gpu_layers, n_cpu_moe=shape.n_layer if on_cpu else 0)
    if shape.n_expert:
        return replace(params, n_gpu_layers=fitted.n_gpu_layers, n_cpu_moe=len(on_cpu))
    ngl = fitted.n_gpu_layers - (1 if on_cpu else 0)
    return replace(params, n_gpu_layers=max(ngl, 0), n_cpu_moe=0)


def gpu_working_set(fp: Fingerprint) -> int | None:
    """Bytes the GPU can hold: a discrete GPU's memory, or the wired share of unified memory."""
    if not fp.gpu_offload:
        return None
    if fp.gpu_memory_bytes:
        return fp.gpu_memory_bytes
    return int(fp.memory_bytes * WORKING_SET_FRACTION) if fp.memory_bytes else None


def parse_size(text: str) -> int:
    """"8GiB", "16 GB", "8192MiB", "512M", a number of bytes: bytes (BadInput otherwise)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise BadInput(f"--gpu-budget {text!r}: not a size; e.g. 8GiB, 16GB, 8192MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_positive_size(text: str) -> int:
    """A budget's size in bytes, more than 0 (BadInput otherwise): checkable before any device is known."""
    budget = parse_size(text)
    if budget <= 0:
        raise BadInput(f"--gpu-budget {text!r}: must be more than 0 bytes")
    return budget


def parse_budget(text: str, fp: Fingerprint) -> int:
    """A GPU memory budget given by the user, checked against the device: positive, and no more
    than the GPU's memory (or wired share) that ``fp`` reports."""
    budget = parse_positive_size(text)
    device = gpu_working_set(fp)
    if device is None:
        raise BadInput(f"--gpu-budget {text!r}: this machine's llama.cpp has no GPU to budget")
    if budget > device:
        raise BadInput(f"--gpu-budget {text!r}: more than the GPU has ({device / GIB:.1f} GiB)")
    return budget
