"""Whether llama.cpp's extra CPU buffer types (AMX tiles, repacked weights) work on this machine.

A CPU may report AMX (``amx_tile`` in /proc/cpuinfo) that its kernel or sandbox does not let a
process use: llama.cpp then picks its AMX buffer type and the process dies with SIGILL on the
first batch of more than one token (seen on this project's Linux build machines; Macs have no
AMX). Where AMX is reported, a child process tries one two-token batch once; the answer is kept
in ``<data dir>/llama-extra-bufts.json`` per llama-cpp-python version. Override with
FLEETTUNE_LLAMA_EXTRA_BUFTS=0 or 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from workers.files import atomic_write
from workers.paths import data_dir

ENV = "FLEETTUNE_LLAMA_EXTRA_BUFTS"
PROBE = ("import sys, llama_cpp\n"
         "llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_batch=8, n_threads=1, verbose=False)\n"
         "llm.eval(llm.tokenize(b'the quick brown fox'))\n")


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
        usable = done.returncode != -signal.SIGILL
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
