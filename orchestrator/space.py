"""The search space of a study, derived from the node's hardware, the model and the objective.

Each dimension is searched only where it can change the objective on this target:

- ngl (GPU layers): 0..n_layer+1 where llama.cpp can offload (n_layer+1 also puts the output layer
  on the GPU); fixed at 0 on a CPU-only node.
- threads: 1..performance cores where the chip says which cores those are (an Apple chip, a hybrid
  Intel): llama.cpp splits a step's work evenly, so a thread on an efficiency core (or a second
  thread on a core) makes every step wait for the slowest one; 1..logical cores elsewhere. On an
  M5 Pro/Max, whose second tier is performance cores, not efficiency cores (``m_cores``), up to
  its super and performance cores together: those threads pace the step too, but by far less, and
  all 18 can outrun the 6 super cores alone (docs/benchmarks.md, "The M5 generation"). Proposed
  on a log scale: speed changes by ratios of threads (1 -> 2 as much as 8 -> 16), and the few-thread
  end matters where CPU threads contend with the GPU (bench/search_efficiency.py, seed scenario).
- threads_batch (prompt threads apart from generation threads): only where the objective measures
  the prompt (pp, e2e); tg never runs the batch threads.
- batch, ubatch: powers of two from 32 up to the smallest of the prompt length rounded up, the
  model's context and 4096; ubatch never above batch. Searched only where the objective measures
  the prompt: a generated token is a batch of one whatever -b and -ub say, so for tg they stay at
  llama.cpp's defaults (-b 2048 -ub 512, clipped to the prompt).
- flash attention: off, on and llama.cpp's ``auto`` (which picks "on" where the backend has the
  kernel) on a GPU backend; on and off on a CPU-only node (the CPU kernel exists; ``auto`` means on
  there too, so it adds nothing).
- K and V cache types: f16, q8_0, q4_0, only where the user allows lossy knobs (``tune
  --allow-lossy``; a quantized cache changes the model's outputs); a quantized V cache needs flash
  attention on, so the V type is searched only in the trials that have flash attention "on".
- n_cpu_moe (layers whose expert tensors stay in host memory): only for a mixture-of-experts model
  whose weights exceed the GPU's working set, and only in trials that offload layers.
- op offload: only on a GPU backend (CUDA, Metal: both implement ggml's ``offload_op``), only
  where the objective measures the prompt (llama.cpp offloads the matmuls of host-resident weights
  only for batches of 32 or more tokens, which a generated token never is). A CPU-only node has
  nothing to offload to.

- switches (SWITCHES): further knobs searched over all their choices in every trial, where the knob
  table says they apply (gpu_only: a GPU backend; moe_only: a mixture-of-experts model). Today
  -nkvo (the KV cache kept in host memory: what a model needs that fits the GPU only without it).

Spaces stored by studies created before these dimensions existed have none of the new keys:
``from_dict`` gives them the defaults that search exactly what they searched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from workers.hardware import Fingerprint
from workers.knobs import BY_FIELD as _K
from workers.knobs import SERVER_FIELDS
from workers.models import ModelInfo
from workers.objective import PP, TG, Objective
from workers.objective import objective as objective_named
from workers.placement import FIT_MARGIN_BYTES, gpu_need, gpu_working_set
from workers.trial import BenchParams, ServedWorkload

_N = {name: knob.optuna_name for name, knob in _K.items()}  # each knob's Optuna parameter name
SWITCHES = ("no_kv_offload",)  # knobs searched over all their choices where the knob table says they apply
SERVER_SWITCHES = ("kv_unified", "cache_idle_slots")  # a served study's llama-server switches
CTX_PER_SLOT = "ctx_per_slot"  # the Optuna parameter of a served study's context per slot (-c = slots x it)
SERVER_DEFAULT_SLOTS = 4  # llama-server's -np auto (tools/server/server.cpp)
FITS_WHOLE = 0.5  # a served study keeps every layer on a GPU whose working set holds twice the weights
# what llama-server does with these switches unset once -np is given (common/common.h: kv_unified
# false, cache_idle_slots true; -np auto alone turns kv_unified on)
SERVER_SWITCH_DEFAULTS = {"kv_unified": False, "cache_idle_slots": True}
MIN_BATCH = 32
MAX_BATCH = 4096
CACHE_TYPES = ("f16", "q8_0", "q4_0")
FLASH_ATTN_MODES = ("off", "on", "auto")
LLAMA_CPP_BATCH, LLAMA_CPP_UBATCH = 2048, 512  # llama.cpp's own -b and -ub


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    values, value = [], low
    while value <= high:
        values.append(value)
        value *= 2
    return tuple(values) or (low,)


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class MoeLayout:
    """What the space needs to know about a mixture-of-experts model."""

    n_expert: int
    expert_bytes: int  # bytes of every layer's expert tensors together


def moe_layout(model: ModelInfo) -> MoeLayout | None:
    """The expert layout of a model (None for a dense one): named simulated shapes from their
    shape, GGUF files from ``{arch}.expert_count`` and their ``*_exps`` tensors."""
    from workers import simulated

    if simulated.is_sim_model(model.path):
        shape = simulated.parse_sim_model(model.path)
        if not shape.n_expert:
            return None
        return MoeLayout(shape.n_expert, int(shape.bytes_of(shape.n_layer * shape.expert_params)))
    try:
        from workers.models import open_gguf

        reader = open_gguf(model.path)
    except Exception:  # noqa: BLE001 - a model the head cannot read is treated as dense
        return None
    field = reader.fields.get(f"{model.architecture}.expert_count")
    n_expert = int(field.contents()) if field is not None else 0
    if n_expert <= 1:
        return None
    expert_bytes = sum(int(t.n_bytes) for t in reader.tensors if "_exps" in t.name)
    return MoeLayout(n_expert, expert_bytes)


@dataclass(frozen=True)
class SearchSpace:
    """The ranges of one study. Stored with the study so a resumed study searches the same space.

    Fields after ``batch_choices`` default to "not searched", which is what a space stored before
    they existed searched.
    """

    ngl_max: int
    threads_max: int
    batch_choices: tuple[int, ...]
    flash_attn: bool = False  # legacy: flash attention as a plain on/off (spaces stored before 0.x)
    fa_modes: tuple[str, ...] = ()  # flash attention values searched; (): off
    cache_types: tuple[str, ...] = ()  # K (and, with flash attention on, V) types; (): f16
    threads_batch: bool = False  # n_threads_batch searched apart from n_threads
    cpu_moe_max: int = 0  # n_cpu_moe searched 0..this (trials with layers on the GPU); 0: not
    op_offload: bool = False  # op offload searched on/off
    tune_batch: bool = True  # batch and ubatch searched (False: llama.cpp's defaults, clipped)
    threads_log: bool = False  # threads proposed on a log scale (1 -> 2 weighs as 8 -> 16)
    switches: tuple[str, ...] = ()  # further knobs searched over all their choices in every trial
    gpu_budget_bytes: int = 0  # issue 23.1: configurations estimated over it are refused; 0: no budget
    # a served study (issue 22.3): llama-server's own knobs; () / 0: left at llama-server's defaults
    ngl_min: int = 0  # GPU layers searched ngl_min..ngl_max (a served study on a GPU that holds the model: all)
    parallel_max: int = 0  # slots searched 1..this (log scale)
    ctx_per_slot: tuple[int, ...] = ()  # context per slot searched (-c is slots x this)
    server_switches: tuple[str, ...] = ()  # llama-server's switches searched over both values
    cache_ram_choices: tuple[int | None, ...] = ()  # host prompt cache sizes (None: llama-server's 8192 MiB)

    @classmethod
    def for_target(cls, fp: Fingerprint, model: ModelInfo, n_prompt: int, objective: Objective = TG,
                   moe: MoeLayout | None = None, depth: int = 0, lossy: bool = False,
                   gpu_budget: int | None = None) -> SearchSpace:
        prompt = objective_named(objective).needs_prompt and n_prompt > 0
        # Where the batch is not searched it stays at llama.cpp's default, clipped to the most
        # tokens one decode can get: the prompt's, or the depth's, which fill the KV cache with that
        # batch before tg is timed (clipped to the prompt alone, a tg study at a depth of 8k filled
        # it 32 tokens at a time: slow enough to time trials out, and on CUDA with -fa off an abort).
        fill = n_prompt if prompt else max(n_prompt, depth)
        top = min(MAX_BATCH, model.context_length or MAX_BATCH, next_power_of_two(max(fill, 1)))
        logical = max(fp.logical_cores or 1, 1)
        threads = logical
        if fp.p_cores and fp.p_cores < logical:
            # efficiency cores or SMT siblings pace every step (see above); a second tier of
            # performance cores (M5 Pro/Max) is searched as well
            threads = min(fp.p_cores + (fp.m_cores or 0), logical)
        working_set = gpu_budget or gpu_working_set(fp)
        # where llama.cpp's --fit would keep part of the model off the GPU (the weights and its 1 GiB
        # margin over the working set), the memory knobs are searched whatever the objective: the
        # experts' placement (issue 23, lease 4: the 30B-A3B's 15.8 GiB of weights under 16 GiB, the
        # driver's 0.6-0.9 GiB beside them, were searched without n_cpu_moe) and the micro-batch,
        # whose compute buffer buys a layer (the 14B under 8 GiB: every layer at -ub 256, 4.9x
        # --fit in tg, where -ub 512 fits one layer less, 3.0x; lease 3's grid)
        tight = working_set is not None and model.size_bytes + FIT_MARGIN_BYTES > working_set
        cpu_moe = model.n_layer if moe is not None and tight else 0
        return cls(
            ngl_max=model.n_layer + 1 if fp.gpu_offload else 0,
            threads_max=threads,
            batch_choices=powers_of_two(MIN_BATCH, max(top, MIN_BATCH)),
            fa_modes=FLASH_ATTN_MODES if fp.gpu_offload else ("off", "on"),
            cache_types=CACHE_TYPES if lossy else (),  # they change the outputs: opt-in (issue 20.4)
            threads_batch=prompt,
            cpu_moe_max=cpu_moe,
            op_offload=prompt and fp.gpu_offload,
            tune_batch=prompt or tight,
            threads_log=True,
            switches=tuple(name for name in SWITCHES if (fp.gpu_offload or not _K[name].gpu_only)
                           and (moe is not None or not _K[name].moe_only)),
            gpu_budget_bytes=gpu_budget or 0,
        )

    @classmethod
    def for_served(cls, fp: Fingerprint, model: ModelInfo, n_prompt: int, n_gen: int, served: ServedWorkload,
                   moe: MoeLayout | None = None, lossy: bool = False, gpu_budget: int | None = None) -> SearchSpace:
        """A served study's space (issue 22.3): the benchmark knobs of a study that measures the
        prompt (a server's batches mix prompt chunks with decode steps), and llama-server's own:
        slots up to the users that can be in flight, context per slot from what one request needs
        (its prompt, the spread and its tokens) to four times that, a unified KV cache, the idle
        slots' save to the host prompt cache, and that cache on (llama-server's 8 GiB) or off."""
        base = cls.for_target(fp, model, n_prompt + served.prompt_spread, PP, moe, lossy=lossy,
                              gpu_budget=gpu_budget)
        users = served.max_users if served.capacity else served.users
        need = next_power_of_two(n_prompt + served.prompt_spread + n_gen)
        limit = model.context_length or need * 4
        per_slot = tuple(c for c in (need, need * 2, need * 4) if c <= max(limit, need))
        # where the GPU holds the whole model, every layer stays on it: a served layer on the CPU
        # paces every slot's step (and on such a GPU full offload is as fast as it gets, issue 20)
        working_set = gpu_budget or gpu_working_set(fp)
        whole = bool(base.ngl_max and working_set and model.size_bytes < FITS_WHOLE * working_set)
        return replace(base, ngl_min=base.ngl_max if whole else 0,
                       parallel_max=max(min(users, _K["n_parallel"].high), 1), ctx_per_slot=per_slot,
                       server_switches=SERVER_SWITCHES, cache_ram_choices=(None, 0))

    def over_budget(self, params: BenchParams, model: ModelInfo, n_ctx: int, overhead: float = 0) -> str | None:
        """Why ``params`` must not be loaded (its estimated GPU memory, plus the ``overhead`` the GPU's
        driver was seen to hold beside llama.cpp's buffers, over the study's budget), or None (no
        budget, or it fits)."""
        if not self.gpu_budget_bytes or params.n_gpu_layers <= 0:
            return None
        need = gpu_need(model, params, n_ctx)
        if need.total + overhead <= self.gpu_budget_bytes:
            return None
        beside = f" + {overhead / 1024**3:.2f} GiB the driver holds beside them (measured)" if overhead else ""
        return (f"over the GPU budget: needs {need.describe()}{beside} > {self.gpu_budget_bytes / 1024**3:.2f} GiB "
                "(estimated)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SearchSpace:
        """A stored space; keys it lacks take the defaults (what older studies searched)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("batch_choices", "fa_modes", "cache_types", "switches", "ctx_per_slot", "server_switches",
                    "cache_ram_choices"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)

    # -- defaults where a dimension is not searched

    def default_batch(self) -> tuple[int, int]:
        """llama.cpp's -b 2048 -ub 512, clipped to the largest batch the prompt can fill."""
        top = max(self.batch_choices)
        batch = min(LLAMA_CPP_BATCH, top)
        return batch, min(LLAMA_CPP_UBATCH, batch)

    # -- Optuna side: names and distributions

    def suggest(self, trial) -> BenchParams:
        """Ask an Optuna trial for one configuration in this space (names and distributions: the
        knob table's; this space says only when each knob is searched and within what)."""
        ngl = _K["n_gpu_layers"].suggest(trial, self.ngl_min, self.ngl_max) if self.ngl_max > 0 else 0
        threads = _K["n_threads"].suggest(trial, 1, self.threads_max, log=self.threads_log)
        if self.tune_batch:
            batch = _K["n_batch"].suggest(trial, choices=self.batch_choices)
            ubatch = min(_K["n_ubatch"].suggest(trial, choices=self.batch_choices), batch)
        else:
            batch, ubatch = self.default_batch()
        values: dict = {}
        if self.flash_attn:
            values["flash_attn"] = "on" if trial.suggest_categorical("flash_attn", [False, True]) else "off"
        if self.fa_modes:
            values["flash_attn"] = _K["flash_attn"].suggest(trial, choices=self.fa_modes)
        if self.cache_types:
            values["type_k"] = _K["type_k"].suggest(trial, choices=self.cache_types)
            if values.get("flash_attn") == "on":  # a quantized V cache needs flash attention on
                values["type_v"] = _K["type_v"].suggest(trial, choices=self.cache_types)
        if self.threads_batch:
            tb = _K["n_threads_batch"].suggest(trial, 1, self.threads_max, log=self.threads_log)
            values["n_threads_batch"] = None if tb == threads else tb
        if self.cpu_moe_max > 0 and ngl > 0:
            values["n_cpu_moe"] = _K["n_cpu_moe"].suggest(trial, 0, self.cpu_moe_max)
        if self.op_offload:
            values["op_offload"] = _K["op_offload"].suggest(trial)
        for name in self.switches:
            values[name] = _K[name].suggest(trial)
        values |= self._suggest_server(trial)
        return BenchParams(n_gpu_layers=ngl, n_threads=threads, n_batch=batch, n_ubatch=ubatch, **values)

    def _suggest_server(self, trial) -> dict:
        """llama-server's knobs, where this is a served study's space."""
        values: dict = {}
        if self.parallel_max:
            slots = _K["n_parallel"].suggest(trial, 1, self.parallel_max)
            values["n_parallel"] = slots
            if self.ctx_per_slot:
                values["n_ctx"] = slots * trial.suggest_categorical(CTX_PER_SLOT, list(self.ctx_per_slot))
        for name in self.server_switches:
            values[name] = _K[name].suggest(trial)
        if self.cache_ram_choices:
            values["cache_ram"] = _K["cache_ram"].suggest(trial, choices=self.cache_ram_choices)
        return values

    def optuna_params(self, params: BenchParams) -> dict:
        """The Optuna parameter values that propose ``params`` (for enqueueing known configs)."""
        values: dict = {_N["n_threads"]: params.n_threads}
        if self.tune_batch:
            values[_N["n_batch"]], values[_N["n_ubatch"]] = params.n_batch, params.n_ubatch
        if self.ngl_max > 0:
            values[_N["n_gpu_layers"]] = params.n_gpu_layers
        if self.flash_attn:
            values["flash_attn"] = params.flash_attn == "on"
        if self.fa_modes:
            values[_N["flash_attn"]] = params.flash_attn
        if self.cache_types:
            values[_N["type_k"]] = params.type_k
            if params.flash_attn == "on":
                values[_N["type_v"]] = params.type_v
        if self.threads_batch:
            values[_N["n_threads_batch"]] = params.threads_batch
        if self.cpu_moe_max > 0 and params.n_gpu_layers > 0:
            values[_N["n_cpu_moe"]] = params.n_cpu_moe
        if self.op_offload:
            values[_N["op_offload"]] = params.op_offload
        for name in self.switches:
            values[_N[name]] = getattr(params, name)
        if self.parallel_max:
            slots = params.n_parallel or SERVER_DEFAULT_SLOTS
            values[_N["n_parallel"]] = min(max(slots, 1), self.parallel_max)
            if self.ctx_per_slot:
                per = (params.n_ctx or 0) // slots
                values[CTX_PER_SLOT] = min(self.ctx_per_slot, key=lambda c: (abs(c - per), c))
        for name in self.server_switches:
            value = getattr(params, name)
            values[_N[name]] = SERVER_SWITCH_DEFAULTS[name] if value is None else value
        if self.cache_ram_choices:
            values[_N["cache_ram"]] = params.cache_ram if params.cache_ram in self.cache_ram_choices else None
        return values

    def clip(self, params: BenchParams) -> BenchParams:
        """The nearest configuration inside this space (for configs learnt elsewhere)."""
        batches = self.batch_choices

        def nearest(value: int) -> int:
            return min(batches, key=lambda b: (abs(b - value), b))

        if self.tune_batch:
            batch = nearest(params.n_batch)
            ubatch = min(nearest(params.n_ubatch), batch)
        else:
            batch, ubatch = self.default_batch()
        threads = min(max(params.n_threads, 1), self.threads_max)
        flash = params.flash_attn
        if self.fa_modes:
            flash = flash if flash in self.fa_modes else "on"
        elif self.flash_attn:
            flash = "on" if flash == "on" else "off"
        else:
            flash = "off"
        types = self.cache_types or ("f16",)
        type_k = params.type_k if params.type_k in types else "f16"
        type_v = params.type_v if params.type_v in types and flash == "on" else "f16"
        tb = None
        if self.threads_batch and params.n_threads_batch:
            tb = min(max(params.n_threads_batch, 1), self.threads_max)
            tb = None if tb == threads else tb
        ngl = min(max(params.n_gpu_layers, self.ngl_min), self.ngl_max)
        return replace(
            params,
            n_gpu_layers=ngl,
            n_threads=threads,
            n_threads_batch=tb,
            n_batch=batch,
            n_ubatch=ubatch,
            flash_attn=flash,
            type_k=type_k,
            type_v=type_v,
            n_cpu_moe=min(max(params.n_cpu_moe, 0), self.cpu_moe_max) if ngl > 0 else 0,
            op_offload=params.op_offload if self.op_offload else True,
            **{name: getattr(params, name) if name in self.switches else _K[name].default for name in SWITCHES},
            **self._clip_server(params),
        )

    def _clip_server(self, params: BenchParams) -> dict:
        """llama-server's knobs inside this space: as the space's Optuna values say them."""
        if not self.parallel_max:
            return {name: None for name in SERVER_FIELDS}
        values = self.optuna_params(params)
        out = {name: None for name in SERVER_FIELDS}
        out["n_parallel"] = values[_N["n_parallel"]]
        if self.ctx_per_slot:
            out["n_ctx"] = out["n_parallel"] * values[CTX_PER_SLOT]
        for name in self.server_switches:
            out[name] = values[_N[name]]
        if self.cache_ram_choices:
            out["cache_ram"] = values[_N["cache_ram"]]
        return out

    def grid(self, max_axis: int = 8) -> dict[str, list]:
        """A coarse grid over this space for the grid sampler (each axis at most ``max_axis``).

        Conditional dimensions (the V type, n_cpu_moe) stay at their defaults: Optuna's grid has
        one set of values per parameter, asked or not.
        """

        def spread(low: int, high: int) -> list[int]:
            if high - low + 1 <= max_axis:
                return list(range(low, high + 1))
            step = (high - low) / (max_axis - 1)
            return sorted({round(low + i * step) for i in range(max_axis)})

        grid: dict[str, list] = {_N["n_threads"]: spread(1, self.threads_max)}
        if self.tune_batch:
            grid[_N["n_batch"]] = list(self.batch_choices)[-4:]
            grid[_N["n_ubatch"]] = ([min(512, max(self.batch_choices))]
                              if 512 in self.batch_choices or max(self.batch_choices) < 512
                              else [self.batch_choices[0]])
        if self.ngl_max > 0:
            grid[_N["n_gpu_layers"]] = spread(self.ngl_min, self.ngl_max)
        if self.flash_attn:
            grid["flash_attn"] = [False, True]
        if self.fa_modes:
            grid[_N["flash_attn"]] = [m for m in self.fa_modes if m != "auto"]
        if self.cache_types:
            grid[_N["type_k"]] = ["f16", "q8_0"] if "q8_0" in self.cache_types else list(self.cache_types)
            grid[_N["type_v"]] = ["f16"]  # asked only with flash attention on: one value, every trial can take
        if self.threads_batch:
            grid[_N["n_threads_batch"]] = spread(1, self.threads_max)[-max_axis // 2:]
        if self.cpu_moe_max:
            grid[_N["n_cpu_moe"]] = [0]
        if self.op_offload:
            grid[_N["op_offload"]] = list(_K["op_offload"].choices)
        for name in self.switches:
            grid[_N[name]] = list(_K[name].choices)
        if self.parallel_max:
            grid[_N["n_parallel"]] = list(powers_of_two(1, self.parallel_max))
            if self.ctx_per_slot:
                grid[CTX_PER_SLOT] = [self.ctx_per_slot[0]]
        for name in self.server_switches:
            grid[_N[name]] = list(_K[name].choices)
        if self.cache_ram_choices:
            grid[_N["cache_ram"]] = list(self.cache_ram_choices)
        return grid

    def size(self) -> int:
        """How many distinct configurations the space holds."""
        batches = len(self.batch_choices) ** 2 if self.tune_batch else 1
        n = (self.ngl_max - self.ngl_min + 1) * self.threads_max * batches
        if self.flash_attn:
            n *= 2
        if self.fa_modes:
            n_types = len(self.cache_types) or 1
            # V quantized only with flash attention on
            n *= (len(self.fa_modes) - 1) * n_types + n_types * n_types
        elif self.cache_types:
            n *= len(self.cache_types)
        if self.threads_batch:
            n *= self.threads_max
        if self.cpu_moe_max:
            n *= self.cpu_moe_max + 1
        if self.op_offload:
            n *= 2
        for name in self.switches:
            n *= len(_K[name].choices)
        if self.parallel_max:
            n *= self.parallel_max * max(len(self.ctx_per_slot), 1)
        for name in self.server_switches:
            n *= len(_K[name].choices)
        n *= max(len(self.cache_ram_choices), 1)
        return n


def llama_cpp_python_defaults(fp: Fingerprint) -> BenchParams:
    """The configuration ``llama_cpp.Llama(model_path)`` uses when given no settings."""
    cores = fp.logical_cores or 1
    return BenchParams(
        n_gpu_layers=0,
        n_threads=max(cores // 2, 1),
        n_threads_batch=cores,
        n_batch=512,
        n_ubatch=512,
        flash_attn="off",
    )


def llama_cpp_defaults(fp: Fingerprint, model: ModelInfo, n_prompt: int | None = None) -> BenchParams:
    """What llama.cpp's own tools (llama-bench, llama-server) run with when given no settings.

    Every layer offloaded where the backend can (``-ngl`` auto; llama-server's ``--fit`` shrinks
    the context, not the layers, for a model that fits), threads from the physical cores (the
    performance cores on Apple Silicon and hybrid Intel: llama.cpp's ``cpu_get_num_math``),
    ``-b 2048 -ub 512`` and flash attention ``auto``. The batch is clipped to the model's context
    and, where ``n_prompt`` is given, to the prompt (a larger batch processes it the same way).
    """
    # llama.cpp's default -t on macOS is hw.perflevel0.physicalcpu, the fastest tier only
    # (common/common.cpp, common_cpu_get_num_physical_cores, via common_cpu_get_num_math): on an
    # M5 Pro/Max its 6 super cores, not the 12 performance cores of hw.perflevel1 beside them
    # (checked in the llama.cpp vendored by llama-cpp-python 0.3.36). p_cores is that tier.
    threads = fp.p_cores or fp.logical_cores or 1
    batch = min(LLAMA_CPP_BATCH, model.context_length or LLAMA_CPP_BATCH)
    if n_prompt:
        batch = max(min(batch, next_power_of_two(n_prompt)), MIN_BATCH)
    return BenchParams(
        n_gpu_layers=model.n_layer + 1 if fp.gpu_offload else 0,
        n_threads=threads,
        n_batch=batch,
        n_ubatch=min(LLAMA_CPP_UBATCH, batch),
        flash_attn="auto",
    )


def predicted_optimum(fp: Fingerprint, model: ModelInfo, n_prompt: int, n_gen: int, depth: int = 0,
                      objective: Objective = TG) -> BenchParams | None:
    """The calibrated Apple Silicon model's best configuration for this chip and model (the
    simulator's exhaustive optimum, workers/simulated.py), as a first guess worth one trial.

    None where the model does not describe the target: not an Apple Silicon chip of the chip
    table, or a model whose shape the head cannot read.
    """
    from workers import simulated

    if fp.vendor != "Apple" or not (fp.family and fp.gpu_cores and fp.memory_bytes and fp.bandwidth_gbs):
        return None
    try:
        shape = simulated.shape_for_path(model.path)
        params, _, _ = simulated.optimum(fp, shape, str(objective), n_prompt, n_gen, depth=depth)
    except Exception:  # noqa: BLE001 - no prediction is a fine answer (unknown generation, no file...)
        return None
    return params


def obvious_slots(params: BenchParams, space: SearchSpace) -> BenchParams | None:
    """The first thing a user tries on llama-server (issue 22): one slot for every user the space
    can serve, each with the largest context per slot the space has. None outside a served space."""
    if not space.parallel_max:
        return None
    per_slot = max(space.ctx_per_slot) if space.ctx_per_slot else None
    return replace(params, n_parallel=space.parallel_max,
                   n_ctx=space.parallel_max * per_slot if per_slot else None)


def without_prompt_cache(params: BenchParams | None, space: SearchSpace) -> BenchParams | None:
    """``params`` with llama-server's host prompt cache off (``--cache-ram 0``), where the space
    searches it. A served study's load never repeats a prompt (workers/loadgen.py rule 1), so that
    cache never hits, while the server still saves every finished slot into it with no slot decoding
    meanwhile (about 120 ms for 51 MiB on the H200, issue 22). None outside a served space."""
    if params is None or 0 not in space.cache_ram_choices:
        return None
    return replace(params, cache_ram=0)


def compact_cache(params: BenchParams, space: SearchSpace) -> BenchParams | None:
    """``params`` with flash attention on and the most compact K and V cache the space has: at a
    depth every generated token reads the whole cache, so its bytes are the first thing to cut.
    None where the space searches neither (a stored older space)."""
    if "on" not in space.fa_modes or not space.cache_types:
        return None
    smallest = space.cache_types[-1]  # CACHE_TYPES runs from the largest to the smallest
    return replace(params, flash_attn="on", type_k=smallest, type_v=smallest)


def full_offload(fp: Fingerprint, model: ModelInfo, space: SearchSpace) -> BenchParams | None:
    """Every layer on the GPU with llama-cpp-python's other defaults: the usual hand-tuned choice.

    None where this machine cannot offload. Measured in every GPU study so the gain over it is known.
    """
    if space.ngl_max == 0:
        return None
    base = llama_cpp_python_defaults(fp)
    batch = min(base.n_batch, max(space.batch_choices))
    return replace(base, n_gpu_layers=space.ngl_max, n_batch=batch, n_ubatch=batch,
                   n_threads_batch=None)
