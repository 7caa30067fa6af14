"""Whether llama.cpp's AMX kernels and extra CPU buffer types (AMX tiles, repacked weights) work on
this machine.

A CPU may report AMX (``amx_tile`` in /proc/cpuinfo) whose tiles a process can run (a program that
asks the kernel for them and runs tile instructions works on this project's KVM machines) while
llama.cpp's AMX kernels still die: SIGILL at their first ``tileloadd`` (tinygemm_kernel_amx, under
llama-bench) or SIGSEGV (under llama-cpp-python) on the first batch of more than one token. So the
only probe that says whether they run is running them (issue 20.8):

- ``amx_kernels_run``: install.sh's probe, before it decides which build to keep. A child process
  loads a tiny synthetic Q4_0 model (written here, with a byte tokenizer: no download) with the
  extra buffer types on and decodes one batch. A build without AMX has nothing to probe.
- ``extra_buffers_usable``: at run time, once per machine and llama-cpp-python version, the same
  batch on the model being measured; where it dies the extra buffer types are turned off (kept in
  ``<data dir>/llama-extra-bufts.json``; FLEETTUNE_LLAMA_EXTRA_BUFTS=0 or 1 overrides).

``python -m workers.llamacompat amx`` prints the probe's answer in one line; exit 0 (the AMX kernels
run, or the library has none), 1 (they crash), 2 (undecided).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from workers.files import atomic_write
from workers.paths import data_dir

ENV = "FLEETTUNE_LLAMA_EXTRA_BUFTS"
PROBE = ("import sys, llama_cpp\n"
         "llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_batch=8, n_threads=1, verbose=False)\n"
         "llm.eval(llm.tokenize(b'the quick brown fox'))\n")


def library_has_amx() -> bool:
    """Whether the installed llama-cpp-python's llama.cpp was built with AMX kernels."""
    import llama_cpp

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")


def crashed(returncode: int) -> bool:
    """A child killed by a signal (SIGILL, SIGSEGV, SIGBUS...): the kernels crashed, not the probe."""
    return returncode < 0


def amx_kernels_run(timeout_s: float = 300) -> bool | None:
    """True where llama.cpp's AMX kernels (as the installed library has them) run a batch here, or the
    library has none; False where they crash; None where the probe could not say (a timeout)."""
    import tempfile

    from workers.models import synthesize

    if not library_has_amx():
        return True
    with tempfile.TemporaryDirectory(prefix="fleettune-amx-") as folder:
        model = Path(folder) / "tiny-q4_0.gguf"
        synthesize("tiny", "q4_0", None, model)  # Q4_0 has AMX kernels; a byte tokenizer, no download
        try:
            done = subprocess.run([sys.executable, "-c", PROBE, str(model)], capture_output=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return None
    return not crashed(done.returncode)


def _amx_reported() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def extra_buffers_usable(model_path: str) -> bool:
    """True unless llama.cpp's extra buffer types crash here (decided once per machine and version)."""
    if os.environ.get(ENV) in ("0", "1"):
        return os.environ[ENV] == "1"
    if not _amx_reported():
        return True
    import llama_cpp

    cache = data_dir() / "llama-extra-bufts.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if llama_cpp.__version__ in known:
        return bool(known[llama_cpp.__version__])
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, model_path], capture_output=True, timeout=300,
                              check=False)
        usable = not crashed(done.returncode)
    except subprocess.TimeoutExpired:
        return True  # undecided: leave llama.cpp's default
    known[llama_cpp.__version__] = usable
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(cache, json.dumps(known), fsync=False)
    return usable


def model_params(lib, model_path: str):
    """``llama_model_default_params()`` with the extra buffer types off where they crash."""
    params = lib.llama_model_default_params()
    if not extra_buffers_usable(model_path):
        params.use_extra_bufts = False
    return params


def main(argv: list[str]) -> int:
    if argv != ["amx"]:
        print("usage: python -m workers.llamacompat amx", file=sys.stderr)
        return 2
    if not library_has_amx():
        print("llama.cpp here has no AMX kernels: nothing to probe")
        return 0
    runs = amx_kernels_run()
    if runs is None:
        print("llama.cpp's AMX kernels: undecided (the probe timed out)")
        return 2
    print("llama.cpp's AMX kernels run here" if runs else
          "llama.cpp's AMX kernels crash here (a batch of a Q4_0 model died by a signal)")
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
