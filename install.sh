#!/bin/sh
# Create .venv and install fleettune with everything its tests and tools use.
#
#   sh install.sh                    # CPU build of llama.cpp on Linux, Metal on a Mac (pip does it)
#   FLEETTUNE_CUDA=1 sh install.sh   # NVIDIA GPUs: llama-cpp-python built with CMAKE_ARGS=-DGGML_CUDA=on
#                                    # (needs the CUDA toolkit's nvcc); `fleettune tools build` then
#                                    # builds llama-server/llama-bench for CUDA too
#
# llama-cpp-python is built from source (about 8 minutes on 2 cores). On Linux the wheel is kept
# under ~/.cache/fleettune (wheels, wheels-cuda), so a second install takes seconds; on a Mac pip
# builds it with Metal and keeps it in its own cache.
#
# AMX (issue 20.8): on a Linux host whose CPU reports AMX (Intel Xeon 4th generation and later) the
# build keeps llama.cpp's AMX kernels where they run; `python -m workers.llamacompat amx` runs them
# on a tiny synthetic model in a child process, and only where that child dies (SIGILL or SIGSEGV,
# seen on KVM guests whose tiles a plain program can use) is llama-cpp-python built again without
# them (-mno-amx-*, kept in wheels-no-amx or wheels-cuda-no-amx).
set -eu
cd "$(dirname "$0")"
python3 -m venv .venv
LLAMA_VERSION=0.3.36
cache="${XDG_CACHE_HOME:-$HOME/.cache}/fleettune"
variant=""
case "${FLEETTUNE_CUDA:-0}" in
    1|on|yes|true)
        export CMAKE_ARGS="-DGGML_CUDA=on${CMAKE_ARGS:+ $CMAKE_ARGS}"
        variant="-cuda" ;;
esac

# build_wheel DIR [C FLAGS]: llama-cpp-python's wheel into DIR, unless one is there already
build_wheel() {
    if ! ls "$1"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
        if [ -n "${2:-}" ]; then
            CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='$2' -DCMAKE_CXX_FLAGS='$2'" \
                .venv/bin/pip wheel -q --no-deps --no-cache-dir -w "$1" "llama-cpp-python==$LLAMA_VERSION"
        else
            .venv/bin/pip wheel -q --no-deps --no-cache-dir -w "$1" "llama-cpp-python==$LLAMA_VERSION"
        fi
    fi
    .venv/bin/pip install -q --no-deps --force-reinstall "$1"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
}

if [ "$(uname -s)" = Linux ]; then
    build_wheel "$cache/wheels$variant"
fi
.venv/bin/pip install -q -e '.[dev,postgres]'
if [ "$(uname -s)" = Linux ] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    status=0
    .venv/bin/python -m workers.llamacompat amx || status=$?
    if [ "$status" = 1 ]; then
        echo "install.sh: building llama-cpp-python again without llama.cpp's AMX kernels"
        build_wheel "$cache/wheels$variant-no-amx" "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
fi
