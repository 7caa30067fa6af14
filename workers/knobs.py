"""One description per knob: every llama.cpp setting fleettune searches, prints, serves and imports.

A knob is added here, in one entry of ``KNOBS`` (llama-bench's one-file shape: tools/llama-bench
keeps a parameter's flag, default, printing and translation into the library together), and each
dimension is described once (Optuna's ``distributions.py``). Everything else is derived from the
table: the flags of llama-bench, llama-server and llama-cli (parsed and printed), the keyword
arguments of llama-cpp-python's ``Llama(...)`` and the fields of its server's ``ModelSettings``, the
fields of llama-bench's JSON/CSV rows, the bounds a node config and a pin are checked against, the
Optuna parameter names and distributions, the click options of the CLI.

This is a leaf module (pure data and pure functions): the head imports it to validate parameters
without importing the measuring module ``workers/bench.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from workers.errors import BadInput

TOOLS = ("llama-bench", "llama-server", "llama-cli")
BENCHMARK, SERVER = "benchmark", "server"
BOTH = frozenset({BENCHMARK, SERVER})
SERVED = frozenset({SERVER})  # a knob only a server has: slots, its KV cache, its prompt cache
FLASH_ATTN = ("on", "off", "auto")  # llama.cpp's values for -fa
KV_TYPES = ("f16", "q8_0", "q4_0")  # the KV cache types searched (-ctk/-ctv)
GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml.h's enum ggml_type, as llama_cpp.Llama takes them
ALL_LAYERS = 999  # -ngl for "every layer" where the model's layer count is not known (llama.cpp clamps it)
_ALL_WORDS = ("all", "auto", "-1")  # llama.cpp's spellings of "every layer" for -ngl
_WHOLE = "a whole number"


@dataclass(frozen=True)
class Knob:
    """One llama.cpp setting, described once.

    ``senses`` (bool knobs): every flag spelling with the value it sets given bare or with ``1``
    (``-nopo 1`` and ``--no-op-offload`` set op_offload False; ``0`` sets the opposite).
    ``same_as``: a knob that is unset (None) where it equals that field (``-tb`` and ``-t``).
    ``*_values``: (field value, that side's value) pairs; the first pair for a side's value wins
    when read back (llama-cpp-python's ``flash_attn=True`` reads back as ``on``).
    ``effective``: how the value llama.cpp actually used is read back (the read-back lives in
    workers/bench.py).
    """

    field: str
    type: type
    default: object
    help: str
    low: int | None = None
    high: int | None = None
    choices: tuple = ()
    aliases: Mapping[str, str] = field(default_factory=dict)  # other words llama.cpp reads as a choice
    bench_flags: tuple[str, ...] = ()  # llama-bench's spellings, the first one printed; (): it has none
    server_flags: tuple[str, ...] = ()  # llama-server's and llama-cli's (common/arg.cpp), first printed
    senses: Mapping[str, bool] = field(default_factory=dict)
    all_layers: bool = False  # -ngl: all, auto, -1 and anything above the model's layers mean every layer
    same_as: str | None = None
    python_kwarg: str | None = None  # llama_cpp.Llama(...) keyword; None: llama-cpp-python cannot say it
    python_values: tuple[tuple[object, object], ...] = ()
    server_field: str | None = None  # llama_cpp.server.settings.ModelSettings field
    bench_field: str | None = None  # llama-bench's JSON/CSV field
    library_field: str | None = None  # llama.h: "model.<llama_model_params field>" or "context.<...>"
    library_values: tuple[tuple[object, object], ...] = ()
    bench_values: tuple[tuple[object, object], ...] = ()
    effective: str = ""
    lossy: bool = False  # changes the model's outputs (issue 20 item 4: searched only when allowed)
    optuna_name: str | None = None
    log: bool = False  # Optuna proposes it on a log scale
    applies: frozenset[str] = BOTH
    gpu_only: bool = False  # changes nothing without a GPU backend
    moe_only: bool = False  # changes nothing on a dense model
    always_printed: bool = False  # printed even at its default (llama.cpp's defaults differ from ours)

    @property
    def cli_names(self) -> tuple[str, ...]:
        """fleettune's option names: llama.cpp's spellings (a switch: llama-bench's, with 0|1)."""
        if self.type is bool:
            return self.bench_flags
        return tuple(dict.fromkeys((*self.bench_flags, *self.server_flags)))

    # -- reading one flag

    def parse(self, flag: str, word: str | None, n_layer: int | None) -> object:
        """The value of ``flag word`` as llama.cpp reads it; ``word`` None: a bare switch."""
        if self.type is bool:
            sense = self.senses[flag]
            if word is None or word == "1":
                return sense
            if word == "0":
                return not sense
            raise BadInput(f"{flag} takes 0 or 1, not {word!r}")
        if word is None:
            raise BadInput(f"{flag} needs a value")
        if self.choices and self.type is str:
            value = self.aliases.get(word, word)
            if value not in self.choices:
                raise BadInput(f"{flag} takes {_one_of(self.choices)}, not {word!r}")
            return value
        if self.all_layers and word in _ALL_WORDS:
            return ALL_LAYERS if n_layer is None else n_layer + 1
        try:
            number = int(word)
        except ValueError:
            raise BadInput(f"{flag} takes {_WHOLE}, not {word!r}") from None
        self.check(number, flag)
        if self.all_layers and n_layer is not None and number > n_layer + 1:
            return n_layer + 1  # llama.cpp's own clamp: the effective value is what is stored
        return number

    def check(self, value: object, name: str | None = None) -> None:
        """BadInput, one line, where ``value`` is not one this knob takes."""
        name = name or self.field
        if value is None and self.default is None:
            return
        if self.type is bool:
            if not isinstance(value, bool):
                raise BadInput(f"{name} {value!r}: must be true or false")
            return
        if self.type is str:
            if value not in self.choices:
                raise BadInput(f"{name} {value!r}: must be {_one_of(self.choices)}")
            return
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadInput(f"{name} {value!r}: must be {_WHOLE}")
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise BadInput(f"{name} {value}: must be in {self.low}..{self.high}")

    # -- printing

    def flag_words(self, value: object, tool: str) -> list[str]:
        """This knob's words for ``tool`` ([] where the tool has no spelling for it)."""
        if tool == "llama-bench":
            if not self.bench_flags:
                return []
            flag = self.bench_flags[0]
            if self.type is bool:
                return [flag, "1" if value == self.senses[flag] else "0"]
            return [flag, str(value)]
        if not self.server_flags:
            return []
        if self.type is bool:
            return [next(f for f in self.server_flags if self.senses[f] == value)]
        return [self.server_flags[0], str(value)]

    def omitted(self, value: object, params: object) -> bool:
        """Left out of printed flags and of stored new fields: at its default, or equal to ``same_as``."""
        if value is None:
            return True
        if self.same_as and value == getattr(params, self.same_as):
            return True
        return not self.always_printed and value == self.default

    # -- the library's and the bench file's forms

    def to_python(self, value: object) -> object:
        return _translate(self.python_values, value)

    def from_python(self, value: object) -> object:
        return _translate([(b, a) for a, b in self.python_values], value)

    def to_bench(self, value: object) -> object:
        return _translate(self.bench_values, value)

    def from_bench(self, raw: object) -> object:
        """A llama-bench JSON or CSV cell as this knob's value; ValueError says why not."""
        if self.type is bool or self.bench_values:
            text = str(raw).strip().lower()
            raw = {"true": 1, "false": 0}.get(text, raw)
        if self.type in (int, bool) or self.bench_values and isinstance(self.bench_values[0][1], int):
            try:
                raw = int(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{self.bench_field} {str(raw)[:20]!r} is not {_WHOLE}") from None
        if self.type is bool and not self.bench_values:
            raw = bool(raw)
        value = _translate([(b, a) for a, b in self.bench_values], raw)
        if self.type is str and value not in self.choices:
            raise ValueError(f"{self.bench_field} {str(raw)[:20]!r}: fleettune knows {_one_of(self.choices)}")
        return value

    # -- Optuna

    def suggest(self, trial, low: int | None = None, high: int | None = None, *, choices: Iterable = (),
                log: bool | None = None):
        """Ask an Optuna trial for this knob: an int within low..high (on a log scale where ``log``,
        default the table's), else one of ``choices`` (default: all of the table's)."""
        if self.type is int and not choices:
            return trial.suggest_int(self.optuna_name, low, high, log=self.log if log is None else log)
        return trial.suggest_categorical(self.optuna_name, list(choices or self.choices))


def _translate(pairs, value):
    for a, b in pairs:
        if a == value and type(a) is type(value):
            return b
    for a, b in pairs:  # bool/int of the other kind (llama-bench's 0/1 for a false/true)
        if a == value:
            return b
    return value


def _one_of(choices: Iterable) -> str:
    words = [str(c) for c in choices]
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


_FA_WORDS = {"enabled": "on", "true": "on", "1": "on", "disabled": "off", "false": "off", "0": "off",
             "-1": "auto"}
_FA_NUMBERS = (("off", 0), ("on", 1), ("auto", -1))
_KV = tuple((name, GGML_TYPES[name]) for name in KV_TYPES)

KNOBS: tuple[Knob, ...] = (
    Knob("n_gpu_layers", int, 0, "Layers offloaded to the GPU; 99, -1 or all: every layer (read as llama.cpp "
         "reads it; what is printed is the effective count).", low=0, high=1000,
         bench_flags=("-ngl", "--n-gpu-layers"), server_flags=("-ngl", "--n-gpu-layers", "--gpu-layers"),
         all_layers=True, python_kwarg="n_gpu_layers", server_field="n_gpu_layers", bench_field="n_gpu_layers",
         library_field="model.n_gpu_layers",
         effective="llama_model_n_layer: min(ngl, n_layer + 1) layers offloaded", optuna_name="ngl",
         gpu_only=True, always_printed=True),
    Knob("n_threads", int, 1, "CPU threads (generation).", low=1, high=1024,
         bench_flags=("-t", "--threads"), server_flags=("-t", "--threads"), python_kwarg="n_threads",
         server_field="n_threads", bench_field="n_threads", library_field="context.n_threads", effective="llama_n_threads(ctx)",
         optuna_name="threads", log=True, always_printed=True),
    Knob("n_threads_batch", int, None, "Prompt threads (default: -t).", low=1, high=1024,
         server_flags=("-tb", "--threads-batch"), same_as="n_threads", python_kwarg="n_threads_batch",
         server_field="n_threads_batch", library_field="context.n_threads_batch", effective="llama_n_threads_batch(ctx)", optuna_name="threads_batch",
         log=True),
    Knob("n_batch", int, 2048, "Logical batch size.", low=1, high=65536,
         bench_flags=("-b", "--batch-size"), server_flags=("-b", "--batch-size"), python_kwarg="n_batch",
         server_field="n_batch", bench_field="n_batch", library_field="context.n_batch", effective="llama_n_batch(ctx)", optuna_name="batch",
         always_printed=True),
    Knob("n_ubatch", int, 512, "Physical batch size (default: min(512, batch)).", low=1, high=65536,
         bench_flags=("-ub", "--ubatch-size"), server_flags=("-ub", "--ubatch-size"), python_kwarg="n_ubatch",
         server_field="n_ubatch", bench_field="n_ubatch", library_field="context.n_ubatch", effective="llama_n_ubatch(ctx): min(ubatch, batch)",
         optuna_name="ubatch", always_printed=True),
    Knob("flash_attn", str, "off", "Flash attention (llama.cpp's -fa).", choices=FLASH_ATTN, aliases=_FA_WORDS,
         bench_flags=("-fa", "--flash-attn"), server_flags=("-fa", "--flash-attn"), python_kwarg="flash_attn",
         python_values=(("off", False), ("on", True), ("auto", True)),  # llama-cpp-python has no auto
         server_field="flash_attn", bench_field="flash_attn", bench_values=_FA_NUMBERS,
         library_field="context.flash_attn_type", library_values=_FA_NUMBERS,  # llama.h llama_flash_attn_type
         effective="llama_context's resolved flash_attn_type (auto: on where every layer's device has it)",
         optuna_name="fa", always_printed=True),
    Knob("type_k", str, "f16", "K cache type.", choices=KV_TYPES,
         bench_flags=("-ctk", "--cache-type-k"), server_flags=("-ctk", "--cache-type-k"), python_kwarg="type_k",
         python_values=_KV, server_field="type_k", bench_field="type_k",
         library_field="context.type_k", library_values=_KV,
         effective="the K tensors' type in the context's KV cache", lossy=True, optuna_name="type_k"),
    Knob("type_v", str, "f16", "V cache type (quantized only with -fa on).", choices=KV_TYPES,
         bench_flags=("-ctv", "--cache-type-v"), server_flags=("-ctv", "--cache-type-v"), python_kwarg="type_v",
         python_values=_KV, server_field="type_v", bench_field="type_v",
         library_field="context.type_v", library_values=_KV,
         effective="the V tensors' type in the context's KV cache", lossy=True, optuna_name="type_v"),
    Knob("n_cpu_moe", int, 0, "Layers whose experts stay on the CPU (MoE models).", low=0, high=1000,
         bench_flags=("-ncmoe", "--n-cpu-moe"), server_flags=("-ncmoe", "--n-cpu-moe"), bench_field="n_cpu_moe",
         effective="the expert tensors' buffer types (tensor_buft_overrides)", optuna_name="cpu_moe",
         gpu_only=True, moe_only=True),
    Knob("op_offload", bool, True, "Op offload off (-nopo 1): large prompt batches of CPU-resident weights stay on the CPU.",
         choices=(True, False), bench_flags=("-nopo", "--no-op-offload"),
         server_flags=("--no-op-offload", "--op-offload"),
         senses={"-nopo": False, "--no-op-offload": False, "--op-offload": True}, python_kwarg="op_offload",
         bench_field="no_op_offload", bench_values=((True, 0), (False, 1)), library_field="context.op_offload",
         effective="llama_context_params.op_offload as the context holds it", optuna_name="op_offload",
         gpu_only=True),
    Knob("no_kv_offload", bool, False, "KV cache in host memory (-nkvo 1), not on the GPU.", choices=(False, True),
         bench_flags=("-nkvo", "--no-kv-offload"), server_flags=("-nkvo", "--no-kv-offload"),
         senses={"-nkvo": True, "--no-kv-offload": True}, python_kwarg="offload_kqv",
         python_values=((False, True), (True, False)), server_field="offload_kqv", bench_field="no_kv_offload",
         library_field="context.offload_kqv", library_values=((False, True), (True, False)),
         effective="llama_context_params.offload_kqv as the context holds it", optuna_name="no_kv_offload",
         gpu_only=True),
    # llama-server's own knobs (issue 22.3): served trials and serving nodes only; None leaves each
    # to llama-server's default, which the served trial reads back from the server (rule 20.1)
    Knob("n_parallel", int, None, "Server slots: requests decoded together (default: llama-server's auto, 4).",
         low=1, high=256, server_flags=("-np", "--parallel"),
         effective="llama_context: n_seq_max in the server's log; /props total_slots", optuna_name="parallel",
         log=True, applies=SERVED),
    Knob("n_ctx", int, None, "The server's whole KV cache in tokens, split among the slots unless unified "
         "(default: the model's training context).", low=256, high=1 << 22, server_flags=("-c", "--ctx-size"),
         effective="llama_context: n_ctx in the server's log (rounded to the slots)", optuna_name="ctx",
         log=True, applies=SERVED),
    Knob("kv_unified", bool, None, "One KV buffer shared by every slot (default: on when the slots are auto).",
         choices=(False, True), server_flags=("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"),
         senses={"-kvu": True, "--kv-unified": True, "-no-kvu": False, "--no-kv-unified": False},
         effective="llama_context: kv_unified in the server's log", optuna_name="kv_unified", applies=SERVED),
    Knob("cache_ram", int, None, "Host prompt cache in MiB (0: off, -1: no limit; default 8192).", low=-1,
         high=1 << 24, server_flags=("-cram", "--cache-ram"), effective="as given (the server prints no read-back)",
         optuna_name="cache_ram", applies=SERVED),
    Knob("cache_idle_slots", bool, None, "Save an idle slot to the host prompt cache when a new task takes it "
         "(default: on, needs --cache-ram).", choices=(True, False),
         server_flags=("--cache-idle-slots", "--no-cache-idle-slots"),
         senses={"--cache-idle-slots": True, "--no-cache-idle-slots": False},
         effective="as given", optuna_name="cache_idle_slots", applies=SERVED),
    Knob("cache_reuse", int, None, "Smallest chunk reused from the prompt cache by KV shifting (0: off).", low=0,
         high=1 << 20, server_flags=("--cache-reuse",), effective="as given", optuna_name="cache_reuse",
         applies=SERVED),
)

BY_FIELD: dict[str, Knob] = {k.field: k for k in KNOBS}
BENCH_FIELDS = tuple(k.field for k in KNOBS if BENCHMARK in k.applies)  # what one llama-bench stream can say
SERVER_FIELDS = tuple(k.field for k in KNOBS if k.applies == SERVED)  # llama-server's own
FLAGS: dict[str, Knob] = {f: k for k in KNOBS for f in (*k.bench_flags, *k.server_flags)}
PLOT_AXES = {k.optuna_name: k.field for k in KNOBS if k.type is int and k.always_printed}  # ngl threads batch ubatch


def knob(field_name: str) -> Knob:
    return BY_FIELD[field_name]


def optuna_name(field_name: str) -> str:
    return BY_FIELD[field_name].optuna_name


# ---------------------------------------------------------------- flags


def parse_flags(text: str, n_layer: int | None = None) -> dict:
    """llama.cpp flags of any of its tools ("-ngl 99 -t 8 -fa on -nopo 1") as {field: value}, only the
    fields given. ``n_layer``: the model's layers, for -ngl's "every layer" (None: ``ALL_LAYERS``).
    A batch given without a micro-batch clips the default micro-batch to it (llama.cpp's clamp)."""
    words = text.split()
    values: dict = {}
    i = 0
    while i < len(words):
        flag = words[i]
        knob_ = FLAGS.get(flag)
        if knob_ is None:
            raise BadInput(f"unknown flag {flag!r}; known: {' '.join(sorted(FLAGS))}")
        word = words[i + 1] if i + 1 < len(words) else None
        if knob_.type is bool and word is not None and word.startswith("-"):
            word = None  # a bare switch (llama-server's), followed by the next flag
        values[knob_.field] = knob_.parse(flag, word, n_layer)
        i += 1 if word is None else 2
    return values


def over(base: Mapping, given: Mapping) -> dict:
    """``given`` fields over ``base`` (a pin over the recommendation, flags over the defaults): a
    batch given alone clips the base's micro-batch to it, as llama.cpp clamps it."""
    out = {**base, **given}
    if "n_batch" in given and "n_ubatch" not in given and out.get("n_ubatch") is not None:
        out["n_ubatch"] = min(out["n_ubatch"], out["n_batch"])
    return out


def flags(params: object, tool: str = "llama-server") -> str:
    """``params`` as flags ``tool`` accepts as they are; knobs at their default are left out except
    those ``always_printed``; a knob the tool cannot say (llama-bench has no -tb) is left out."""
    if tool not in TOOLS:
        raise BadInput(f"tool {tool!r}: must be one of {', '.join(TOOLS)}")
    words: list[str] = []
    for k in KNOBS:
        value = getattr(params, k.field)
        if not k.omitted(value, params):
            words += k.flag_words(value, tool)
    return " ".join(words)


# ---------------------------------------------------------------- llama-cpp-python


def python_kwargs(params: object) -> dict:
    """``params`` as ``llama_cpp.Llama(...)`` keyword arguments. A knob is given where it leaves its
    default or is ``always_printed``; ``n_threads_batch`` always (llama-cpp-python's own default is
    every core, not -t). Knobs it cannot say (``python_kwarg`` None) are left out: see ``unservable``."""
    out: dict = {}
    for k in KNOBS:
        if not k.python_kwarg:
            continue
        value = getattr(params, k.field)
        if k.same_as:
            value = getattr(params, k.same_as) if value is None else value
        elif not k.always_printed and value == k.default:
            continue
        out[k.python_kwarg] = k.to_python(value)
    return out


def from_python_kwargs(kwargs: Mapping, names: str = "python_kwarg") -> dict:
    """``llama_cpp.Llama`` keyword arguments (``names`` "server_field": a server's ModelSettings
    fields) read back as {field: value}."""
    out: dict = {}
    for k in KNOBS:
        name = getattr(k, names)
        if name and name in kwargs:
            out[k.field] = k.from_python(kwargs[name])
    for k in KNOBS:
        if k.same_as and out.get(k.field) == out.get(k.same_as):
            out[k.field] = None
    return out


def server_settings(params: object) -> dict:
    """``params`` as fields of llama-cpp-python's server ``ModelSettings``: every knob it has a field
    for, so what is served equals the node's config field for field. BadInput where a knob away from
    its default has no field (``unservable``)."""
    problem = unservable(params, "llama-cpp-python")
    if problem:
        raise BadInput(problem)
    out: dict = {}
    for k in KNOBS:
        if not k.server_field:
            continue
        value = getattr(params, k.field)
        if k.same_as and value is None:
            value = getattr(params, k.same_as)
        out[k.server_field] = k.to_python(value)
    return out


def unservable(params: object, server_kind: str) -> str | None:
    """Why the server kind cannot apply ``params`` (one line), or None where it can."""
    if server_kind == "llama-cpp-python":
        missing = [k for k in KNOBS if not k.server_field and not k.omitted(getattr(params, k.field), params)]
    elif server_kind == "llama-server":
        missing = [k for k in KNOBS if not k.server_flags and not k.omitted(getattr(params, k.field), params)]
    else:
        return None
    if not missing:
        return None
    spelled = ", ".join(" ".join(k.flag_words(getattr(params, k.field), "llama-server")
                                 or k.flag_words(getattr(params, k.field), "llama-bench")) for k in missing)
    return f"the {server_kind} server cannot apply {spelled}: use --server llama-server or leave it out"


def library_params(params: object, struct: str) -> dict:
    """``params`` as fields of llama.h's ``llama_model_params`` (``struct`` "model") or
    ``llama_context_params`` ("context"): the one translation into the library a measurement uses
    (n_cpu_moe, a list of tensor buffer overrides, is built by the measuring code)."""
    out = {}
    for k in KNOBS:
        if not k.library_field or not k.library_field.startswith(struct + "."):
            continue
        value = getattr(params, k.field)
        if k.same_as and value is None:
            value = getattr(params, k.same_as)
        out[k.library_field.split(".", 1)[1]] = _translate(k.library_values, value)
    return out


# ---------------------------------------------------------------- llama-bench files


def bench_fields(params: object) -> dict:
    """``params`` as llama-bench JSON fields (those of the knobs it has a field for)."""
    return {k.bench_field: k.to_bench(getattr(params, k.field)) for k in KNOBS if k.bench_field}


def from_bench_fields(record: Mapping) -> dict:
    """A llama-bench row's knob fields as {field: value}; a missing field is left out (its
    default). ValueError says what cannot be read."""
    return {k.field: k.from_bench(record[k.bench_field]) for k in KNOBS
            if k.bench_field and record.get(k.bench_field) not in (None, "")}


# ---------------------------------------------------------------- validation


def stored_form(values: Mapping) -> dict:
    """{field: value} as studies and node configs store it: flash attention on/off as the bool it
    always was (studies compare configurations by this form), auto as "auto"."""
    out = dict(values)
    if out.get("flash_attn") in ("on", "off"):
        out["flash_attn"] = out["flash_attn"] == "on"
    return out


def validate_params(params: Mapping) -> dict:
    """A stored params dict (a node config's, a pin's) checked against every knob's type and bounds;
    returns it as {field: value} with llama.cpp's words (flash attention stored as a bool reads as
    on/off). BadInput, one line, names the first thing wrong."""
    if not isinstance(params, Mapping):
        raise BadInput("params must be a mapping of knob names to values")
    unknown = sorted(set(params) - set(BY_FIELD))
    if unknown:
        raise BadInput(f"params has unknown keys: {', '.join(map(str, unknown))}")
    out = {}
    for name, value in params.items():
        if name == "flash_attn" and isinstance(value, bool):
            value = "on" if value else "off"  # the stored form of older records
        BY_FIELD[name].check(value, f"params.{name}")
        out[name] = value
    problem = combination_problem({**{k.field: k.default for k in KNOBS}, **out})
    if problem:
        raise BadInput(problem)
    return out


def combination_problem(values: Mapping) -> str | None:
    """What llama.cpp refuses in this combination of values, or None."""
    if values["type_v"] != "f16" and values["flash_attn"] != "on":
        return f"a {values['type_v']} V cache needs flash attention on (-fa on), not {values['flash_attn']}"
    if values["n_ubatch"] > values["n_batch"]:
        return f"ubatch {values['n_ubatch']}: must be 1..batch ({values['n_batch']})"
    return None


def check_on_node(params: object, fp: object, model: object | None) -> None:
    """Reject what this node's llama.cpp cannot do, instead of letting it silently ignore it
    (``fp``: the node's Fingerprint; ``model``: its ModelInfo, or None)."""
    import os

    for k in KNOBS:
        k.check(getattr(params, k.field), k.optuna_name or k.field)
    ngl = params.n_gpu_layers
    if ngl > 0 and not fp.gpu_offload:
        raise BadInput(f"ngl {ngl}: this node's llama.cpp has no GPU offload ({fp.backend}); use --ngl 0")
    if model is not None and ngl > model.n_layer + 1:
        raise BadInput(f"ngl {ngl}: {model.name} has {model.n_layer} layers; "
                       f"use 0..{model.n_layer + 1} ({model.n_layer + 1} offloads everything)")
    cores = fp.logical_cores or os.cpu_count() or 1
    for name, value in (("threads", params.n_threads), ("threads-batch", params.threads_batch)):
        if not 1 <= value <= cores:
            raise BadInput(f"{name} {value}: must be 1..{cores} (logical cores of this node)")
    problem = combination_problem({k.field: getattr(params, k.field) for k in KNOBS})
    if problem:
        raise BadInput(problem)
    if model is not None and params.n_cpu_moe > model.n_layer:
        raise BadInput(f"n-cpu-moe {params.n_cpu_moe}: must be 0..{model.n_layer}")
