#!/bin/sh
# Create .venv and install fleettune with everything its tests and tools use.
#
#   sh install.sh                    # CPU build of llama.cpp on Linux, Metal on a Mac (pip does it)
#   FLEETTUNE_CUDA=1 sh install.sh   # NVIDIA GPUs: llama-cpp-python built with CMAKE_ARGS=-DGGML_CUDA=on
#                                    # (needs the CUDA toolkit's nvcc); `fleettune tools build` then
#                                    # builds llama-server/llama-bench for CUDA too
#
# llama-cpp-python is built from source by pip (about 8 minutes on 2 cores, cached afterwards).
# On Linux x86 hosts with AMX (Intel Xeon 4th generation and later), the AMX kernels of the
# llama.cpp that llama-cpp-python 0.3.36 vendors crash prompt processing with SIGILL, so there it is
# built once without them (-mno-amx-*), into a wheel kept under ~/.cache/fleettune; Macs and other
# hosts get pip's ordinary build. A CUDA build is kept there too (wheels-cuda, or wheels-cuda-no-amx).
set -eu
cd "$(dirname "$0")"
python3 -m venv .venv
LLAMA_VERSION=0.3.36
cache="${XDG_CACHE_HOME:-$HOME/.cache}/fleettune"
flags=""
wheels=""
if [ "$(uname -s)" = Linux ] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    wheels="$cache/wheels-no-amx"
fi
case "${FLEETTUNE_CUDA:-0}" in
    1|on|yes|true)
        export CMAKE_ARGS="-DGGML_CUDA=on${CMAKE_ARGS:+ $CMAKE_ARGS}"
        wheels="$cache/wheels-cuda${flags:+-no-amx}" ;;
esac
if [ -n "$wheels" ]; then
    if ! ls "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
        if [ -n "$flags" ]; then
            CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='$flags' -DCMAKE_CXX_FLAGS='$flags'" \
                .venv/bin/pip wheel -q --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==$LLAMA_VERSION"
        else
            .venv/bin/pip wheel -q --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==$LLAMA_VERSION"
        fi
    fi
    .venv/bin/pip install -q --no-deps --force-reinstall "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
fi
.venv/bin/pip install -q -e '.[dev,postgres]'
