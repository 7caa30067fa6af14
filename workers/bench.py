"""Measure one configuration the way llama.cpp's llama-bench does.

The measurement runs in a fresh subprocess with a timeout (``measure``), so a crash, an OOM kill,
a hang or a corrupt model becomes a failed trial with its reason and the calling worker lives on.

Method (llama-bench's ``test_prompt``/``test_gen``): the model is loaded once with the trial's
parameters; each test gets its own context of depth + its token count and a polling threadpool (as
llama-bench builds them, freed with the context); one warm-up of each test at depth 0; then ``reps``
repetitions of pp (n_prompt random tokens decoded in n_batch chunks) and tg (n_gen single-token
decodes), the memory cleared before each and, with a depth, ``depth`` tokens put in the KV cache
first (decoded once per test, then restored from a saved state, untimed, as ``llama-bench -d``),
``llama_synchronize`` before the clock stops. No sampling, no EOS, no logits beyond the last token
of a batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import platform
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from workers import knobs
from workers.hardware import Fingerprint, process_gpu_bytes
from workers.knobs import GGML_TYPES, check_on_node
from workers.models import ModelInfo
from workers.trial import (
    BenchParams,
    FailureKind,
    Sample,
    TrialResult,
    TrialSpec,
    Workload,
    validate_workload,
)

MAX_BATCH = 1 << 16
MODEL_CHANGED = "model changed"  # the failure reason when the file is not the spec's model


def cpu_only(params: BenchParams, fp: Fingerprint, keep_op_offload: bool = False) -> BenchParams:
    """``params`` for a measurement of the CPU alone: op offload off where a GPU backend has one.

    With every layer on the CPU (-ngl 0), llama.cpp's op offload still copies the weights of a
    large prompt batch (32 tokens and more) to the GPU and runs it there, so a pp figure at -ngl 0
    would measure the GPU, not the threads.
    """
    if params.n_gpu_layers == 0 and fp.gpu_offload and not keep_op_offload:
        return dataclasses.replace(params, op_offload=False)
    return params


# ---------------------------------------------------------------- thermal state


def thermal_state() -> str | None:
    """The OS's own word on heat: macOS NSProcessInfo.thermalState, Linux thermal zones."""
    if platform.system() == "Darwin":
        return _macos_thermal_state()
    temps = []
    for zone in Path("/sys/class/thermal").glob("thermal_zone*/temp"):
        try:
            temps.append(int(zone.read_text()) / 1000)
        except (OSError, ValueError):
            continue
    return f"{max(temps):.0f}C" if temps else None


def _macos_thermal_state() -> str | None:
    try:
        objc = ctypes.cdll.LoadLibrary("/usr/lib/libobjc.A.dylib")
        ctypes.cdll.LoadLibrary("/System/Library/Frameworks/Foundation.framework/Foundation")
        objc.objc_getClass.restype = ctypes.c_void_p
        objc.sel_registerName.restype = ctypes.c_void_p
        objc.objc_msgSend.restype = ctypes.c_void_p
        objc.objc_msgSend.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        info = objc.objc_msgSend(
            objc.objc_getClass(b"NSProcessInfo"), objc.sel_registerName(b"processInfo")
        )
        state = objc.objc_msgSend(info, objc.sel_registerName(b"thermalState"))
    except (OSError, AttributeError):
        return None
    return ("nominal", "fair", "serious", "critical")[int(state or 0) % 4]


# ---------------------------------------------------------------- the measuring subprocess


GGML_MAX_N_THREADS = 512
POLL_LEVEL = 50  # llama-bench's default --poll


class _ThreadpoolParams(ctypes.Structure):
    """ggml.h's ``struct ggml_threadpool_params`` (not bound by llama-cpp-python)."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class _Llama:
    """The handful of llama.cpp calls a measurement needs (llama-cpp-python's low-level API)."""

    def __init__(self) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self._pools: list[int] = []  # the current context's threadpools
        self.log: list[str] = []  # llama.cpp's log lines: what it resolved (issue 20.1) is read here
        echo = bool(os.environ.get("FLEETTUNE_LLAMA_LOG"))

        def keep(level, text, data) -> None:
            line = text.decode(errors="replace") if text else ""
            self.log.append(line)
            if echo:
                sys.stderr.write(line)

        self._capture = llama_cpp.llama_log_callback(keep)
        llama_cpp.llama_log_set(self._capture, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()

    def effective(self, ctx, params: BenchParams, load_log: str, context_log: str) -> dict:
        """What llama.cpp ran (issue 20.1): threads and batch sizes from its getters (the batch
        clipped to the context, the ubatch to the batch); flash attention ``auto`` as llama.cpp
        resolved it, the GPU layers after clipping and the K/V types from its own log lines (no
        getter exists in llama.h). Op offload is llama.cpp's default where no GPU device exists
        (there is nothing to offload to). A value llama.cpp did not state stays as requested."""
        lib = self.lib
        gpu = bool(lib.llama_supports_gpu_offload())
        flash = params.flash_attn
        if flash == "auto":
            if re.search(r"Flash Attention enabled|enabling flash_attn", context_log):
                flash = "on"
            elif re.search(r"Flash Attention not supported|forcing off", context_log):
                flash = "off"
        offloaded = re.search(r"offloaded (\d+)/(\d+) layers to GPU", load_log)
        ngl = int(offloaded.group(1)) if offloaded else (params.n_gpu_layers if gpu else 0)
        types = re.search(r"K \((\w+)\):.*V \((\w+)\):", context_log)
        type_k, type_v = (types.group(1), types.group(2)) if types else (params.type_k, params.type_v)
        threads, threads_batch = int(lib.llama_n_threads(ctx)), int(lib.llama_n_threads_batch(ctx))
        return BenchParams(
            n_gpu_layers=ngl, n_threads=threads,
            n_threads_batch=None if threads_batch == threads else threads_batch,
            n_batch=int(lib.llama_n_batch(ctx)), n_ubatch=int(lib.llama_n_ubatch(ctx)), flash_attn=flash,
            type_k=type_k if type_k in GGML_TYPES else params.type_k,
            type_v=type_v if type_v in GGML_TYPES else params.type_v,
            n_cpu_moe=params.n_cpu_moe if ngl > 0 else 0,
            op_offload=params.op_offload if gpu else True,
        ).to_dict()

    def load(self, path: str, params: BenchParams):
        lib = self.lib
        from workers.llamacompat import model_params

        mparams = model_params(lib, path)  # extra CPU buffer types off where they crash
        for name, value in knobs.library_params(params, "model").items():
            setattr(mparams, name, value)
        if params.n_cpu_moe:
            mparams.tensor_buft_overrides = self._cpu_moe_overrides(params.n_cpu_moe)
        model = lib.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            raise RuntimeError("llama.cpp could not load the model")
        return model

    def _cpu_moe_overrides(self, n_layers: int) -> int:
        """llama.cpp's ``--n-cpu-moe N`` (common.h, llm_add_n_cpu_ffn_overrides): the expert
        tensors of layers 0..N-1 in CPU buffers. llama-cpp-python leaves
        ``tensor_buft_overrides`` unbound, so the NULL-terminated array is built here (kept alive
        on self until the process ends)."""

        class Override(ctypes.Structure):
            _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

        cpu = self._ggml_cpu()
        cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
        buft = cpu.ggml_backend_cpu_buffer_type()
        patterns = [f"blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps".encode() for i in range(n_layers)]
        array = (Override * (n_layers + 1))(*[Override(p, buft) for p in patterns], Override(None, None))
        self._keep = (patterns, array)
        return ctypes.addressof(array)

    def _ggml_cpu(self) -> ctypes.CDLL | None:
        lib_dir = Path(self.lib.__file__).parent / "lib"
        candidates = sorted(lib_dir.glob("libggml-cpu.*")) + sorted(lib_dir.glob("ggml-cpu.*"))
        return ctypes.CDLL(str(candidates[0])) if candidates else None

    def context(self, model, params: BenchParams, n_ctx: int):
        lib = self.lib
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        for name, value in knobs.library_params(params, "context").items():
            setattr(cparams, name, value)
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context (batch too large for memory?)")
        self._attach_threadpools(ctx, params.n_threads, params.threads_batch)
        return ctx

    def free(self, ctx) -> None:
        """Free a test's context and then its threadpools.

        A pool left alive keeps its threads: those of the pp test would still be there, polling,
        while the tg test's pool runs (llama-bench frees each test's pool after its context).
        """
        self.lib.llama_free(ctx)
        pools, self._pools = self._pools, []
        if pools:
            cpu = self._ggml_cpu()
            cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
            cpu.ggml_threadpool_free.restype = None
            for pool in pools:
                cpu.ggml_threadpool_free(pool)

    def _attach_threadpools(self, ctx, n_threads: int, n_threads_batch: int) -> None:
        """Run CPU work on a polling threadpool, as llama-bench (and llama-cli) do.

        Without one, ggml starts its threads per graph, which costs a small model up to ~15 %
        at 2 threads. llama-cpp-python does not bind these calls, so they go through ctypes.
        """
        if os.environ.get("FLEETTUNE_THREADPOOL") == "0":
            return
        ggml_cpu = self._ggml_cpu()
        if ggml_cpu is None:
            return
        llama = self.lib.llama_cpp._lib
        ggml_cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        ggml_cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
        llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        llama.llama_attach_threadpool.restype = None

        def new_pool(threads: int):
            tpp = _ThreadpoolParams()
            tpp.n_threads, tpp.prio, tpp.poll = threads, 0, POLL_LEVEL
            return ggml_cpu.ggml_threadpool_new(ctypes.byref(tpp))

        pools = [new_pool(n_threads)]
        if n_threads_batch != n_threads:
            pools.append(new_pool(n_threads_batch))
        self._pools = [p for p in pools if p]
        if all(pools):
            llama.llama_attach_threadpool(ctx, pools[0], pools[-1])


# llama.cpp's buffer lines: "load_tensors: CUDA0 model buffer size = 4155.99 MiB",
# "llama_kv_cache: Metal KV buffer size = 256.00 MiB", "sched_reserve: CUDA0 compute buffer size = ..."
_BUFFER = re.compile(r"(\S+)\s+(?:model|KV|compute|output|RS)\s+buffer size\s*=\s*([\d.]+) MiB")
# buffers in a GPU device's memory (Apple's Metal buffers are the GPU's working set); host-side
# buffers (CPU, CPU_Mapped, CPU_REPACK, CUDA_Host) are not
_GPU_BUFFER = re.compile(r"(CUDA\d+|ROCm\d+|Vulkan\d+|SYCL\d+|Metal|MTL\d+)(_Mapped)?")


def gpu_buffer_bytes(log: str) -> int:
    """Bytes of GPU buffers llama.cpp reports in ``log`` (0 where it reports none)."""
    return int(sum(float(mib) * 1024**2 for name, mib in _BUFFER.findall(log) if _GPU_BUFFER.fullmatch(name)))


def _run_child(spec: TrialSpec) -> TrialResult:
    """Inside the subprocess: load, warm up, time every repetition."""
    started = time.time()
    params, workload = spec.params, spec.workload
    thermal_before = thermal_state()
    llama = _Llama()
    lib = llama.lib
    t0 = time.perf_counter()  # from here on: llama.cpp load + decode (measure_s)
    model = llama.load(spec.model_path, params)
    load_s = time.perf_counter() - t0
    load_log = "".join(llama.log)
    effective: dict | None = None
    context_gpu_bytes = 0  # the largest of the tests' contexts (one at a time, as llama-bench)
    device_bytes: int | None = None  # the driver's count for this process, at each test's end
    vocab = lib.llama_model_get_vocab(model)
    n_vocab = lib.llama_vocab_n_tokens(vocab)
    bos = lib.llama_vocab_bos(vocab)
    add_bos = bool(lib.llama_vocab_get_add_bos(vocab))
    rng = random.Random(workload.seed)
    tokens = (lib.llama_token * max(params.n_batch, 1))()

    def decode(ctx, n_tokens: int) -> None:
        status = lib.llama_decode(ctx, lib.llama_batch_get_one(tokens, n_tokens))
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def test_prompt(ctx, n_prompt: int) -> None:
        done = 0
        while done < n_prompt:
            n_tokens = min(n_prompt - done, params.n_batch)
            for i in range(n_tokens):
                tokens[i] = rng.randrange(n_vocab)
            if done == 0 and add_bos:
                tokens[0] = bos
            decode(ctx, n_tokens)
            done += n_tokens
        lib.llama_synchronize(ctx)

    def test_gen(ctx, n_gen: int) -> None:
        tokens[0] = bos if add_bos else rng.randrange(n_vocab)
        for _ in range(n_gen):
            decode(ctx, 1)
            lib.llama_synchronize(ctx)
            tokens[0] = rng.randrange(n_vocab)

    depth = workload.depth

    def fill_depth(ctx, saved: list) -> None:
        """Put ``depth`` tokens in the KV cache: decoded the first time, then restored (untimed)."""
        if saved and lib.llama_state_seq_set_data(ctx, saved[0], len(saved[0]), 0):
            return
        test_prompt(ctx, depth)
        size = lib.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        lib.llama_state_seq_get_data(ctx, buf, size, 0)
        saved[:] = [buf]

    tests = [("pp", workload.n_prompt, test_prompt), ("tg", workload.n_gen, test_gen)]
    samples: list[Sample] = []
    for kind, n_tokens, run in tests:
        if n_tokens <= 0:
            continue
        t_ctx = time.perf_counter()
        log_from = len(llama.log)
        ctx = llama.context(model, params, depth + n_tokens)  # as llama-bench: one context per test
        load_s += time.perf_counter() - t_ctx
        context_log = "".join(llama.log[log_from:])
        context_gpu_bytes = max(context_gpu_bytes, gpu_buffer_bytes(context_log))
        if effective is None:  # the first test's context: the prompt's, where batch sizes matter
            effective = llama.effective(ctx, params, load_log, context_log)
        memory = lib.llama_get_memory(ctx)
        if workload.warmup:
            lib.llama_memory_clear(memory, True)
            run(ctx, n_tokens if kind == "pp" else 1)
        saved: list = []
        for rep in range(workload.reps):
            lib.llama_memory_clear(memory, True)
            if depth:
                fill_depth(ctx, saved)
            start = time.perf_counter_ns()
            run(ctx, n_tokens)
            samples.append(Sample(kind, rep, n_tokens, (time.perf_counter_ns() - start) / 1e9))
            held = lib.llama_memory_seq_pos_max(memory, 0) + 1
            if held != depth + n_tokens:  # the depth was not where it was meant to be
                raise RuntimeError(f"the KV cache holds {held} tokens after {kind}, not {depth}+{n_tokens}")
        # every buffer of this test is held now, the context's included (at -ngl 0 too: a CUDA
        # build's context and op offload's copies take device memory all the same)
        now = process_gpu_bytes(os.getpid())
        if now is not None:
            device_bytes = max(device_bytes or 0, now)
        llama.free(ctx)
    measure_s = time.perf_counter() - t0
    kl = kl_divergence(llama, model, params) if spec.measure_kl and lossy(params) else None
    lib.llama_model_free(model)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if platform.system() == "Darwin" else rss * 1024
    return TrialResult(
        trial_key=spec.trial_key,
        ok=True,
        samples=samples,
        load_s=load_s,
        peak_rss_bytes=rss_bytes,
        thermal_before=thermal_before,
        thermal_after=thermal_state(),
        started_at=started,
        finished_at=time.time(),
        measure_s=measure_s,
        backend_info=llama_build_info(),
        effective=effective,
        kl_divergence=kl,
        gpu_bytes=gpu_buffer_bytes(load_log) + context_gpu_bytes,
        gpu_device_bytes=device_bytes,
    )


def lossy(params: BenchParams) -> bool:
    """Whether a configuration changes the model's outputs (issue 20.4): a quantized K or V cache."""
    return params.type_k != "f16" or params.type_v != "f16"


# A fixed text for the KL divergence (issue 20.4), the same in every measurement.
KL_TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "The farmers moved their animals to the hill behind the church, where the ground was dry and the "
    "grass was still green. Nobody in the village could remember a flood like it: the old miller said "
    "his father had spoken of one, sixty years before, when the bridge was carried away and the road "
    "to the town was closed for a month. By noon the rain had stopped, the sky cleared from the west, "
    "and the children went down to the edge of the water to watch the branches and the broken fences "
    "drift past. In the evening the first boats came up from the town with bread, lamp oil and news."
)


def kl_divergence(llama: _Llama, model, params: BenchParams) -> float:
    """Mean KL divergence of the next-token distributions of ``params``' KV cache against the f16
    cache on ``KL_TEXT``, as ``llama-perplexity --kl-divergence`` computes it: every token's logits
    from one decode of the whole text, KL(f16 || tested) over the second half of the tokens (the
    first half is context). Both contexts share every other setting of ``params``."""
    import numpy as np

    lib = llama.lib
    vocab = lib.llama_model_get_vocab(model)
    text = KL_TEXT.encode()
    buf = (lib.llama_token * (len(text) + 8))()
    n = lib.llama_tokenize(vocab, text, len(text), buf, len(buf), True, False)
    if n < 8:
        raise RuntimeError(f"the KL text tokenized to {n} tokens")
    n_vocab = lib.llama_vocab_n_tokens(vocab)

    def log_probs(config: BenchParams):
        ctx = llama.context(model, dataclasses.replace(config, n_batch=n, n_ubatch=min(config.n_ubatch, n)), n)
        try:
            batch = lib.llama_batch_init(n, 0, 1)
            try:
                for i in range(n):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = buf[i], i, 1
                    batch.seq_id[i][0], batch.logits[i] = 0, True
                batch.n_tokens = n
                status = lib.llama_decode(ctx, batch)
                if status != 0:
                    raise RuntimeError(f"llama_decode returned {status} (KL divergence)")
                rows = np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                                 for i in range(n // 2, n)]).astype(np.float64)
            finally:
                lib.llama_batch_free(batch)
        finally:
            llama.free(ctx)
        rows -= rows.max(axis=1, keepdims=True)
        return rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))

    base = log_probs(dataclasses.replace(params, type_k="f16", type_v="f16"))
    tested = log_probs(params)
    return float(np.mean(np.sum(np.exp(base) * (base - tested), axis=1)))


def llama_build_info() -> str:
    """llama-cpp-python version and the compiled llama.cpp features, e.g. "0.3.36 CPU: AVX2=1..."."""
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python not installed"
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return f"llama-cpp-python {llama_cpp.__version__}; {info}"


def _spec_from_json(text: str) -> TrialSpec:
    data = json.loads(text)
    return TrialSpec(
        model_path=data["model_path"],
        model_sha256=data["model_sha256"],
        params=BenchParams.from_dict(data["params"]),
        workload=Workload(**data["workload"]),
        timeout_s=data["timeout_s"],
        cooldown_s=data["cooldown_s"],
        trial_key=data["trial_key"],
        measure_kl=data.get("measure_kl", False),
    )


def model_changed(spec: TrialSpec) -> str | None:
    """Why the file at the spec's path is not the spec's model (None: it is).

    A study measures one model, known by its sha256; a file replaced under the same path would
    otherwise be measured and stored as that model. The digest is cached per file (workers.digests).
    """
    from workers import digests

    actual = digests.sha256_cached(spec.model_path)
    if actual.lower() == spec.model_sha256.lower():
        return None
    return (f"{MODEL_CHANGED}: {spec.model_path} has sha256 {actual[:12]}, "
            f"the study's model is {spec.model_sha256[:12]}")


# ---------------------------------------------------------------- the child's link to its parent

PARENT_GONE_EXIT = 75
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int):
    """A ``preexec_fn``: on Linux the child gets SIGKILL when its parent dies (PR_SET_PDEATHSIG,
    kept across exec), and exits at once if the parent died before this ran. Elsewhere it does
    nothing: the lifeline pipe covers it (rule 2 of issue 24)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(PARENT_GONE_EXIT)

    return preexec


def _watch_parent(pipe_fd: int) -> None:
    """Exit at once when the process that started this measurement dies, however it dies.

    The parent's SIGKILL, a killed Ray worker, raylet or driver run no clean-up of their own, and
    this process sits in its own session (out of reach of the terminal's Ctrl-C), so it must notice
    by itself: on Linux the kernel sends SIGKILL when the parent dies (PR_SET_PDEATHSIG); everywhere
    (macOS has no such signal) a thread waits on a pipe whose only writer is the parent, which the
    kernel closes when the parent dies (also when it died before this process got here).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the pipe below still covers it
    threading.Thread(target=_exit_on_eof, args=(pipe_fd,), daemon=True,
                     name="fleettune-parent-watch").start()


def _exit_on_eof(pipe_fd: int, before_exit: Callable[[], object] | None = None) -> None:
    """Wait for the lifeline's end (the parent gone), then ``before_exit`` and exit at once."""
    while True:
        try:
            data = os.read(pipe_fd, 64)
        except OSError:
            data = b""
        if not data:
            if before_exit is not None:
                before_exit()
            os._exit(PARENT_GONE_EXIT)  # now, even in the middle of a llama.cpp call


def child_main(argv: list[str]) -> int:
    """The measuring process: ``SPEC RESULT [--parent-pipe FD] [--trial KEY]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="workers.bench")
    parser.add_argument("spec_path")
    parser.add_argument("result_path")
    parser.add_argument("--parent-pipe", type=int)
    parser.add_argument("--trial", default="")  # only a label, so `ps` shows which trial this is
    args = parser.parse_args(argv)
    if args.parent_pipe is not None:
        _watch_parent(args.parent_pipe)
    spec = _spec_from_json(Path(args.spec_path).read_text())
    try:
        reason = model_changed(spec)
        if reason:
            result = TrialResult.failure(spec.trial_key, reason, FailureKind.MODEL_CHANGED)
        elif spec.params.kv_problem:  # llama.cpp would refuse the context; say why, as a bad config
            result = TrialResult.failure(spec.trial_key, spec.params.kv_problem, FailureKind.BAD_CONFIG)
        else:
            result = _run_child(spec)
    except Exception as exc:  # reported to the parent as the trial's reason
        result = TrialResult.failure(spec.trial_key, str(exc))
    Path(args.result_path).write_text(json.dumps(result.to_dict()))
    return 0


# ---------------------------------------------------------------- the parent side


def _describe_exit(returncode: int, stderr: str) -> tuple[str, FailureKind]:
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        if sig == "SIGKILL":
            return "killed by SIGKILL (out of memory?)", FailureKind.OUT_OF_MEMORY
        if sig == "SIGILL":  # a build for another CPU, or llama.cpp's AMX kernels (see install.sh)
            return "llama.cpp crashed (SIGILL: an instruction this CPU refuses; rebuild llama-cpp-python, " \
                   "see install.sh)", FailureKind.CRASH
        return f"llama.cpp crashed ({sig})", FailureKind.CRASH
    tail = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"measuring process exited with {returncode}" + (f": {tail[-1]}" if tail else ""), FailureKind.CRASH


# Run isolated (-I: no working directory, PYTHONPATH or user site on sys.path, so a local
# `workers/` folder cannot stand in for the package), with the parent's own package put first.
# -I also drops PYTHONPATH, where a machine without an installer may keep llama_cpp and the rest,
# so the parent's own sys.path comes along in FLEETTUNE_CHILD_PATH, after the child's: the interpreter's packages first,
# ``workers`` from the parent's package root before anything else, no working directory.
CHILD_PATH_ENV = "FLEETTUNE_CHILD_PATH"
CHILD_PATH_BOOT = ("import os, sys; sys.path.insert(0, sys.argv[1]); "
                   f"sys.path += [p for p in os.environ.get({CHILD_PATH_ENV!r}, '').split(os.pathsep) "
                   "if p and p not in sys.path]; ")
CHILD_BOOT = CHILD_PATH_BOOT + "from workers.bench import child_main; sys.exit(child_main(sys.argv[2:]))"


def child_env() -> dict[str, str]:
    """The measuring process's environment: this one's, and the directories of this sys.path."""
    paths = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != Path.cwd().resolve()]
    return {**os.environ, CHILD_PATH_ENV: os.pathsep.join(paths)}


def child_argv(spec_path: Path, result_path: Path, pipe_fd: int, trial_key: str) -> list[str]:
    """The measuring process's command line (its cmdline names workers.bench and the trial)."""
    package_root = str(Path(__file__).resolve().parent.parent)
    label = re.sub(r"[^A-Za-z0-9._:-]", "_", trial_key)[:64]
    return [sys.executable, "-I", "-c", CHILD_BOOT, package_root, str(spec_path), str(result_path),
            f"--parent-pipe={pipe_fd}", f"--trial={label}"]


def _signal_group(proc: subprocess.Popen) -> None:
    """SIGKILL the measuring process's group, unless it has already been reaped (its id reused)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen) -> None:
    _signal_group(proc)
    proc.wait()


KILLING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _killed_on_signals(proc: subprocess.Popen) -> Iterator[None]:
    """While measuring in the main thread: Ctrl-C (SIGINT) or SIGTERM kills the measurement first,
    then, once the wait for it is over, does what it did before (SIGINT: KeyboardInterrupt; SIGTERM's
    default: terminate; a handler of the program's: run it).

    The handler itself never raises: an exception raised at an arbitrary instant of
    ``Popen.wait(timeout)`` can fall between its non-blocking acquire of the wait lock and the
    ``try`` that releases it, and the lock stays held: the clean-up's ``proc.wait()`` then blocks
    for ever (issue 24: `fleettune bench` once ignored Ctrl-C for 30 s). So the handler only kills
    the measurement and notes the signal; the wait returns as the child dies, and the signal's
    own action runs here, outside Popen's lock."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in KILLING_SIGNALS}
    caught: list[int] = []

    def on_signal(signum, frame) -> None:
        _signal_group(proc)  # no wait() here: the interrupted code may hold Popen's wait lock
        caught.append(signum)

    ours = [sig for sig in KILLING_SIGNALS if previous[sig] != signal.SIG_IGN]
    for sig in ours:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig in ours:
            if signal.getsignal(sig) is on_signal:
                signal.signal(sig, previous[sig] if previous[sig] is not None else signal.SIG_DFL)
        if caught:
            _replay(caught[0], previous[caught[0]])


def _replay(signum: int, previous) -> None:
    """Do what ``signum`` did before the measurement took it over."""
    if callable(previous):
        previous(signum, None)  # signal.default_int_handler raises KeyboardInterrupt
        return
    os.kill(os.getpid(), signum)  # its default action (the handler is restored by now)


STOP_POLL_S = 0.5  # how often a running measurement asks whether it should stop


class Abandoned(Exception):
    """The measurement is no longer wanted (``stop_when`` gave this reason)."""


def _wait(proc: subprocess.Popen, timeout_s: float, stop_when: Callable[[], str | None] | None) -> int:
    """The measuring process's exit status; TimeoutExpired past ``timeout_s``, Abandoned as soon as
    ``stop_when()`` gives a reason."""
    if stop_when is None:
        return proc.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        try:
            return proc.wait(timeout=min(left, STOP_POLL_S))
        except subprocess.TimeoutExpired:
            reason = stop_when()
            if reason:
                raise Abandoned(reason) from None


def measure(spec: TrialSpec, stop_when: Callable[[], str | None] | None = None) -> TrialResult:
    """Run one trial in a fresh subprocess; any failure comes back as ``ok=False`` with a reason.

    The subprocess never outlives this call: it is killed (with its process group) on a timeout,
    when ``stop_when()`` gives a reason (a Ray worker whose raylet died), on an exception, Ctrl-C
    or SIGTERM here (signals taken over while it runs: ``_killed_on_signals``), and it exits by itself when this process dies.
    """
    if not Path(spec.model_path).is_file():
        return TrialResult.failure(
            spec.trial_key, f"model not on node ({spec.model_path}); run `fleettune model push`",
            FailureKind.MODEL_MISSING,
        )
    with tempfile.TemporaryDirectory(prefix="fleettune-trial-") as tmp:
        spec_path, result_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps({**asdict(spec)}))
        started = time.time()
        with tempfile.TemporaryFile(mode="w+") as err:
            read_end, write_end = os.pipe()  # the child's lifeline: closed when this process dies
            try:
                proc = subprocess.Popen(
                    child_argv(spec_path, result_path, read_end, spec.trial_key),
                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                    pass_fds=(read_end,), env=child_env(),
                )
            except BaseException:
                os.close(write_end)
                raise
            finally:
                os.close(read_end)
            try:
                with _killed_on_signals(proc):
                    returncode = _wait(proc, spec.timeout_s, stop_when)
            except subprocess.TimeoutExpired:
                return TrialResult.failure(
                    spec.trial_key, f"timed out after {spec.timeout_s:g}s", FailureKind.TIMEOUT,
                    started_at=started, finished_at=time.time(),
                )
            except Abandoned as stopped:  # its reason is a FailureKind's value (e.g. "node lost")
                reason = str(stopped)
                kind = next((k for k in FailureKind if k.value == reason), FailureKind.INTERRUPTED)
                return TrialResult.failure(spec.trial_key, reason, kind, started_at=started,
                                           finished_at=time.time())
            finally:
                _kill_group(proc)
                os.close(write_end)
            err.seek(0)
            stderr = err.read()
        if returncode != 0 or not result_path.is_file():
            reason, kind = _describe_exit(returncode, stderr)
            return TrialResult.failure(spec.trial_key, reason, kind, started_at=started,
                                       finished_at=time.time())
        return TrialResult.from_dict(json.loads(result_path.read_text()))


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))


def bench_local(
    model: ModelInfo, params: BenchParams, workload: Workload, timeout_s: float
) -> tuple[Fingerprint, TrialResult]:
    """Validate against this machine and measure here (what ``fleettune bench`` does)."""
    from workers.hardware import fingerprint_live

    fp = fingerprint_live()
    check_on_node(params, fp, model)
    validate_workload(workload, model)
    spec = TrialSpec(model.path, model.sha256, params, workload, timeout_s=timeout_s, trial_key="bench")
    return fp, measure(spec)


def default_threads(fp: Fingerprint) -> int:
    """llama-bench's default thread count: the physical cores of the fastest tier (macOS's
    hw.perflevel0: an M5 Pro/Max's super cores, not its performance cores; space.llama_cpp_defaults)."""
    return fp.p_cores or fp.logical_cores or os.cpu_count() or 1
