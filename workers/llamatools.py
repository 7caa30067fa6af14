"""llama.cpp's own tools (llama-server, llama-bench, llama-perplexity, llama-fit-params): where they
are, how they are built, which build they are, llama-bench run as a measurement, and
llama-fit-params's placement (llama.cpp's ``--fit``) for a memory budget.

Where a tool is found (``find_tool``), first hit wins:

1. the file its variable names (``FLEETTUNE_LLAMA_SERVER``, ``FLEETTUNE_LLAMA_BENCH``,
   ``FLEETTUNE_LLAMA_PERPLEXITY``, ``FLEETTUNE_LLAMA_FIT_PARAMS``);
2. fleettune's own build, ``<cache>/fleettune/llama.cpp-<version>-<backend>/bin`` (``<cache>`` is
   ``$XDG_CACHE_HOME`` or ``~/.cache``), made by ``fleettune tools build`` (``build``);
3. ``PATH`` (Homebrew's ``brew install llama.cpp`` on a Mac).

The build compiles the llama.cpp that llama-cpp-python vendors (its sdist from PyPI, the version
fleettune measures with), so llama-bench and fleettune's own measurements run the same code. Only
these targets, static, without the web UI (the API works without it); without llama.cpp's AMX
kernels where install.sh built the library without them (its probe saw them crash), so both run
the same kernels. The build's identity (version, commit, backend, flags) is written beside the binaries in
``build.json`` and recorded with results (``identity``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from workers.errors import BadInput, FleettuneError
from workers.trial import BenchParams, Workload

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the version pyproject.toml and install.sh pin
TOOLS = ("llama-server", "llama-bench", "llama-perplexity", "llama-fit-params")
ENV_VARS = {name: "FLEETTUNE_" + name.upper().replace("-", "_") for name in TOOLS}
BACKENDS = ("cpu", "cuda", "metal")
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
IDENTITY_FILE = "build.json"
BUILD_TIMEOUT_S = 3 * 3600


class ToolError(FleettuneError):
    """A tool ran and failed (its exit status and last line of stderr)."""


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fleettune"


def default_backend() -> str:
    """The backend a build gets unless told: Metal on a Mac (llama.cpp enables it there); CUDA where
    the installed llama-cpp-python offloads to a GPU (install.sh's CUDA build) or ``CMAKE_ARGS`` asks
    for it; else CPU. The tools then run the same backend as the library fleettune measures with."""
    if platform.system() == "Darwin":
        return "metal"
    if re.search(r"-DGGML_CUDA=(on|1|true)\b", os.environ.get("CMAKE_ARGS", ""), re.I):
        return "cuda"
    try:
        import llama_cpp
    except ImportError:
        return "cpu"
    return "cuda" if llama_cpp.llama_supports_gpu_offload() else "cpu"


def build_dir(backend: str | None = None, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where ``build`` puts a backend's binaries and their identity (``bin/``, ``build.json``)."""
    return cache_root() / f"llama.cpp-{version}-{backend or default_backend()}"


def _cached_builds() -> list[Path]:
    """This version's builds in the cache, GPU backends before the CPU one."""
    rank = {"cuda": 0, "metal": 0, "cpu": 1}
    found = cache_root().glob(f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-*")
    return sorted((p for p in found if p.is_dir()), key=lambda p: (rank.get(p.name.rsplit("-", 1)[-1], 2), p.name))


def _executable(path: str | Path) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_tool(name: str) -> str | None:
    """The path of llama.cpp's tool ``name``: its variable, then fleettune's build, then PATH.

    A variable that names no executable file is not skipped: it is the user's choice, and the caller
    says the file is missing (None is returned only when nothing names the tool at all).
    """
    if name not in TOOLS:
        raise BadInput(f"unknown tool {name!r}; known: {', '.join(TOOLS)}")
    named = os.environ.get(ENV_VARS[name])
    if named:
        return named if _executable(named) else None
    for build in _cached_builds():
        candidate = build / "bin" / name
        if _executable(candidate):
            return str(candidate)
    return shutil.which(name)


def identity(binary: str) -> dict:
    """Which llama.cpp a tool is: ``{"version", "commit", "backend", "source"}``.

    fleettune's build says it in its ``build.json``; any other binary (Homebrew's, a user's) is
    asked with ``--version`` ("version: 6100 (0c1e5709)"); what cannot be told is None.
    """
    path = Path(binary).resolve()
    written = path.parent.parent / IDENTITY_FILE
    if written.is_file():
        try:
            data = json.loads(written.read_text())
            return {"version": data.get("llama_cpp_python"), "commit": data.get("commit"),
                    "backend": data.get("backend"), "source": "fleettune build " + str(path.parent.parent)}
        except ValueError:
            pass
    try:
        done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30, check=False)
        text = done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    # "version: 6100 (0c1e5709)" (llama.cpp's tools until 2026), "version: 0.5.0-dev (build 1, commit
    # 0c1e57098)" (since), the commit "unknown" where the build had none
    found = (re.search(r"version:\s*(\S+)\s*\((?:build\s*\d+,\s*)?commit\s+([0-9a-f]+|unknown)\)", text)
             or re.search(r"version:\s*(\d+)\s*\(([0-9a-f]+|unknown)\)", text))
    return {"version": found.group(1) if found else None,
            "commit": found.group(2) if found and found.group(2) != "unknown" else None,
            "backend": None, "source": str(path)}


def tool_rows() -> list[dict]:
    """Each tool: where it is found (or None) and which llama.cpp it is."""
    rows = []
    for name in TOOLS:
        path = find_tool(name)
        found = identity(path) if path else {}
        rows.append({"tool": name, "path": path, "commit": found.get("commit"), "backend": found.get("backend"),
                     "version": found.get("version")})
    return rows


# ---------------------------------------------------------------- the build


def amx_reported() -> bool:
    """Whether this Linux CPU lists AMX tiles (where install.sh probes llama.cpp's AMX kernels)."""
    if platform.system() != "Linux":
        return False
    try:
        return re.search(r"\bamx_tile\b", Path("/proc/cpuinfo").read_text()) is not None
    except OSError:
        return False


def drop_amx() -> bool:
    """Whether the tools are built without llama.cpp's AMX kernels: where the CPU reports AMX and the
    installed llama-cpp-python has none (install.sh dropped them: they crash here), so both run the
    same kernels; where the library kept them, they run, and the tools keep them too."""
    if not amx_reported():
        return False
    try:
        from workers.llamacompat import library_has_amx

        return not library_has_amx()
    except ImportError:  # no llama-cpp-python: as install.sh's probe would most often decide on a VM
        return True


def cmake_args(backend: str, commit: str | None) -> list[str]:
    """The configuration of the tools' build: static, three tools, no web UI, no downloads."""
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF"]
    if backend == "cuda":
        args.append("-DGGML_CUDA=ON")
    elif backend == "metal":
        args.append("-DGGML_METAL=ON")
    else:
        args += ["-DGGML_METAL=OFF", "-DGGML_CUDA=OFF"]
    if commit:  # the sdist has no .git: llama.cpp's build info would say "unknown"
        args.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    if drop_amx():
        args += [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
    return args


def vendored_commit(sdist_root: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> str | None:
    """The llama.cpp commit a llama-cpp-python release vendors, from its CHANGELOG's section."""
    try:
        text = (sdist_root / "CHANGELOG.md").read_text()
    except OSError:
        return None
    section = text.split(f"## [{version}]", 1)[-1].split("\n## [", 1)[0] if f"## [{version}]" in text else ""
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return found.group(1) if found else None


def _run_logged(argv: list[str], log, cwd: Path | None = None) -> None:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, timeout=BUILD_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        raise ToolError(f"{Path(argv[0]).name} failed (exit {done.returncode}); see {log.name}")


def _sdist(version: str, into: Path, log) -> Path:
    """llama-cpp-python's sdist from PyPI (kept in the cache: 75 MB, downloaded once)."""
    found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    into.mkdir(parents=True, exist_ok=True)
    _run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                 "-d", str(into), f"llama-cpp-python=={version}"], log)
    found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        raise ToolError(f"pip download left no llama_cpp_python-{version}.tar.gz in {into}")
    return found[0]


def build(backend: str | None = None, *, jobs: int | None = None, force: bool = False,
          version: str = LLAMA_CPP_PYTHON_VERSION, echo=print) -> dict:
    """Build llama-server, llama-bench and llama-perplexity once into ``build_dir(backend)``.

    Reused when its ``build.json`` and every binary are there (``force`` builds again). Returns the
    build's identity (``build.json``'s content), with ``reused`` and ``seconds``.
    """
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise BadInput(f"backend {backend!r}: must be one of {', '.join(BACKENDS)}")
    for program in ("cmake", "c++"):
        if not shutil.which(program):
            raise BadInput(f"{program} is not on PATH; the tools' build needs CMake and a C++ compiler")
    target = build_dir(backend, version)
    done = target / IDENTITY_FILE
    if not force and done.is_file() and all(_executable(target / "bin" / name) for name in TOOLS):
        return {**json.loads(done.read_text()), "reused": True, "seconds": 0.0}
    cache_root().mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".llama.cpp-{version}-{backend}.", dir=cache_root()))
    log_path = cache_root() / f"llama.cpp-{version}-{backend}.build.log"
    echo(f"building {', '.join(TOOLS)} from llama-cpp-python {version}'s llama.cpp ({backend}); log: {log_path}")
    try:
        with log_path.open("w") as log:
            sdist = _sdist(version, cache_root() / "sdist", log)
            with tarfile.open(sdist) as tar:
                tar.extractall(work / "src", filter="data")
            root = work / "src" / f"llama_cpp_python-{version}"
            commit = vendored_commit(root, version)
            args = cmake_args(backend, commit)
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run_logged(["cmake", "-S", str(root / "vendor" / "llama.cpp"), "-B", str(work / "build"),
                         *generator, *args], log)
            _run_logged(["cmake", "--build", str(work / "build"), "--target", *TOOLS,
                         "-j", str(jobs or os.cpu_count() or 1)], log)
            staged = work / "out"
            (staged / "bin").mkdir(parents=True)
            for name in TOOLS:
                shutil.copy2(work / "build" / "bin" / name, staged / "bin" / name)
            info = {"llama_cpp_python": version, "commit": commit, "backend": backend, "cmake_args": args,
                    "no_amx": drop_amx(), "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build_seconds": round(time.monotonic() - started, 1), "jobs": jobs or os.cpu_count()}
            (staged / IDENTITY_FILE).write_text(json.dumps(info, indent=1) + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(staged, target)  # all or nothing: a build cut short leaves no half cache
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**info, "reused": False, "seconds": info["build_seconds"]}


# ---------------------------------------------------------------- llama-bench as a measurement


def llama_bench_argv(binary: str, model_path: str, params: BenchParams, *, n_prompt: int, n_gen: int,
                     reps: int, depth: int = 0, repack: bool | None = None) -> list[str]:
    """One llama-bench run of ``params`` (its ``-o json``). llama-bench has no ``-tb``: it runs the
    prompt on ``-t`` threads, so a run with a prompt and no generation is given the prompt threads."""
    if n_prompt and not n_gen:
        params = dataclasses.replace(params, n_threads=params.threads_batch, n_threads_batch=None)
    argv = [binary, "-m", model_path, "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps), "-d", str(depth),
            *params.llama_cpp_flags("llama-bench").split()]
    if repack is not None:
        argv += ["--repack", str(int(repack))]
    return [*argv, "-o", "json"]


def bench_runs(binary: str, model_path: str, params: BenchParams, workload: Workload,
               repack: bool | None = None) -> list[list[str]]:
    """The llama-bench runs that measure ``params`` on ``workload``: one, or, where the prompt and
    the generation have different thread counts, one per test, each with its own ``-t``."""
    common = {"reps": workload.reps, "depth": workload.depth, "repack": repack}
    p, n = workload.n_prompt, workload.n_gen
    if p and n and params.threads_batch != params.n_threads:
        return [llama_bench_argv(binary, model_path, params, n_prompt=p, n_gen=0, **common),
                llama_bench_argv(binary, model_path, params, n_prompt=0, n_gen=n, **common)]
    return [llama_bench_argv(binary, model_path, params, n_prompt=p, n_gen=n, **common)]


def parse_llama_bench_json(text: str) -> dict[str, float]:
    """``{"pp512": avg tok/s, "tg128": ...}`` from llama-bench's ``-o json``."""
    rows = json.loads(text)
    return {("pp" if row["n_prompt"] else "tg") + str(row["n_prompt"] or row["n_gen"]): float(row["avg_ts"])
            for row in rows}


def run_tool(name: str, argv: list[str], timeout_s: float) -> str:
    """Run one of llama.cpp's tools and return its stdout; a failure (an exit status, a timeout) is a
    ToolError with the tool's last line of stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ToolError(f"{name} did not finish within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ToolError(f"{name} exited with {done.returncode}: {tail[0]}")
    return done.stdout


def run_llama_bench(argv: list[str], timeout_s: float = 1800) -> dict[str, float]:
    """Run one llama-bench command and read its JSON; a failure is a ToolError with its last line."""
    stdout = run_tool("llama-bench", argv, timeout_s)
    try:
        return parse_llama_bench_json(stdout)
    except (ValueError, KeyError, TypeError) as exc:
        raise ToolError(f"llama-bench's output is not its JSON: {exc}") from None


@dataclass(frozen=True)
class BenchFigures:
    """One configuration measured by llama-bench: prompt and generation rates (tok/s, the mean of
    the repetitions, llama-bench's ``avg_ts``), None where the workload has none."""

    pp_tps: float | None
    tg_tps: float | None


def measure_with_llama_bench(binary: str, model_path: str, params: BenchParams, workload: Workload,
                             repack: bool | None = None) -> BenchFigures:
    """The worker-side measurement ``fleettune verify`` uses: llama-bench on this node."""
    figures: dict[str, float] = {}
    for argv in bench_runs(binary, model_path, params, workload, repack):
        figures.update(run_llama_bench(argv))
    p, n = workload.n_prompt, workload.n_gen
    return BenchFigures(figures.get(f"pp{p}") if p else None, figures.get(f"tg{n}") if n else None)


# ---------------------------------------------------------------- llama.cpp's --fit placement


MIB = 1024**2


@dataclass(frozen=True)
class FitPlacement:
    """What llama-fit-params printed: llama.cpp's ``--fit`` placement (common/fit.cpp) as CLI
    arguments: the context, the GPU layers and the tensor overrides (``pattern=BUFFER``, e.g. the
    experts of the last layers kept in ``CPU`` buffers)."""

    n_ctx: int
    n_gpu_layers: int
    overrides: tuple[str, ...] = ()

    def llama_bench_args(self) -> list[str]:
        """The placement as llama-bench takes it (its ``-ot`` separates overrides with ';': a ','
        would start another test)."""
        args = ["-ngl", str(self.n_gpu_layers)]
        return [*args, "-ot", ";".join(self.overrides)] if self.overrides else args

    def llama_server_args(self) -> list[str]:
        args = ["-c", str(self.n_ctx), "-ngl", str(self.n_gpu_layers)]
        return [*args, "-ot", ",".join(self.overrides)] if self.overrides else args


def fit_target_mib(free_bytes: int, budget_bytes: int, margin_bytes: int = 1024 * MIB) -> int:
    """``-fitt`` (MiB llama.cpp leaves free on the device) that makes its fit plan for the budget as
    fleettune's ``placement.fit`` does: ``budget - margin`` usable, out of ``free``. ggml reports the
    device's whole free memory whatever cap is in force, so the budget has to come from here."""
    return max((free_bytes - budget_bytes + margin_bytes) // MIB, 0)


def fit_params_argv(binary: str, model_path: str, n_ctx: int, target_mib: int | None = None) -> list[str]:
    """llama-fit-params for ``model_path`` at a context of ``n_ctx``, which --fit may not shrink
    (``-fitc``): the placement moves layers and experts, as the study's configurations do."""
    argv = [binary, "-m", model_path, "-c", str(n_ctx), "-fitc", str(n_ctx)]
    return [*argv, "-fitt", str(target_mib)] if target_mib is not None else argv


def parse_fit_params(stdout: str) -> FitPlacement:
    """The last line llama-fit-params printed to stdout (``-c N -ngl N [-ts ...] [-ot "P=B,..."]``,
    tools/fit-params/fit-params.cpp); ToolError when there is none."""
    import shlex

    lines = [line for line in stdout.splitlines() if line.strip().startswith("-c ")]
    if not lines:
        raise ToolError("llama-fit-params printed no placement")
    tokens = shlex.split(lines[-1])
    values: dict[str, str] = {}
    for flag, value in zip(tokens[::2], tokens[1::2], strict=False):
        values[flag] = value
    try:
        n_ctx, ngl = int(values["-c"]), int(values["-ngl"])
    except (KeyError, ValueError):
        raise ToolError(f"llama-fit-params printed {lines[-1]!r}, not -c N -ngl N") from None
    overrides = tuple(o for o in values.get("-ot", "").split(",") if o)
    return FitPlacement(n_ctx, ngl, overrides)


def run_fit_params(argv: list[str], timeout_s: float = 600) -> FitPlacement:
    """Run llama-fit-params; a failure (it could not fit even the CPU share) is a ToolError."""
    return parse_fit_params(run_tool("llama-fit-params", argv, timeout_s))
