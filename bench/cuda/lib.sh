# Shared by the device scripts (study.sh, issue15.sh): sourced, not run.
#
# The device machine has no package registry and starts bare; a call lasts at most ten minutes, so
# each script runs its steps detached (`start`), a later call waits again (`wait`), and every step
# leaves a marker so a restarted run skips what is done. What travels in .device/ (made here by
# bench/cuda/pack.sh, never committed): wheels, a trimmed Ray, the trimmed llama-cpp-python sdist and
# a tiny GGUF with SmolLM2's tokenizer.
#
# The sourcing script sets SRC (the sources to run: the checkout, or a copy of it in .device/src)
# and defines `steps` (what to run) and `collect` (what to copy to $OUT), then calls `main "$@"`.

W=${W:-/tmp/ft}
D=${D:-$(pwd)/.device}
# Each device call copies the working tree afresh, which replaces the directory a detached step
# started in (Ray then fails on os.getcwd()): the steps run from a copy of the sources of their own.
if [ "${1:-}" = steps ] && [ -d "${SRC:?}" ]; then
    rm -rf "$W/run" && mkdir -p "$W" && cp -r "$SRC" "$W/run" && SRC=$W/run
fi
LLAMA_SRC_VERSION=0.3.36
export PYTHONPATH=/tmp/site:${SRC:?SRC must be set before sourcing lib.sh} PYTHONUNBUFFERED=1 FLEETTUNE_HOME=$W/home
mkdir -p "$W" /tmp/site

ft() { python3 -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "fleettune"; main()' "$@"; }

step() {  # step NAME COMMAND...: run once; a marker records success
    local name=$1; shift
    [ -f "$W/$name.ok" ] && return 0
    echo "== $name $(date +%T)"
    if "$@"; then touch "$W/$name.ok"; echo "== $name ok $(date +%T)"; else echo "== $name FAILED $(date +%T)"; return 1; fi
}

deps() {  # the wheels and the trimmed Ray into /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$D"/whl/*.whl && tar xJf "$D/ray-trim.tar.xz" -C /tmp/site
}

build_shared() {  # TARGETS...: one CMake build of the vendored llama.cpp (CUDA sm_90, shared libs)
    # gives llama-bench and the libraries llama-cpp-python loads (its lib/ is linked to the build's
    # bin/), so both tools run the same compiled code.
    rm -rf "$W/src" && mkdir -p "$W/src" && tar xJf "$D/llama-src.tar.xz" -C "$W/src" || return 1
    local py=$W/src/llama_cpp_python-$LLAMA_SRC_VERSION
    # SERVER=1: llama-server too, offline (no web UI: the API works without it)
    local server="-DLLAMA_BUILD_SERVER=OFF"
    [ "${SERVER:-0}" = 1 ] && server="-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
    # shellcheck disable=SC2086
    cmake -S "$py/vendor/llama.cpp" -B "$W/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF $server -DLLAMA_CURL=OFF > "$W/build.log" 2>&1 &&
    cmake --build "$W/build" --target "$@" -j "$(nproc)" >> "$W/build.log" 2>&1 || return 1
    rm -rf /tmp/site/llama_cpp && cp -r "$py/llama_cpp" /tmp/site/llama_cpp && rm -rf /tmp/site/llama_cpp/lib &&
    ln -s "$W/build/bin" /tmp/site/llama_cpp/lib &&
    python3 -c 'import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), "no GPU offload"; print(llama_cpp.llama_print_system_info().decode())'
}

build_cpu() {  # TARGETS...: the same vendored llama.cpp built for the CPU only (no CUDA), shared
    # libraries that llama-cpp-python loads too: both tools run the same compiled code. $CPU_FLAGS
    # (e.g. "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16") go to the C and C++ compilers.
    rm -rf "$W/src" && mkdir -p "$W/src" && tar xJf "$D/llama-src.tar.xz" -C "$W/src" || return 1
    local py=$W/src/llama_cpp_python-$LLAMA_SRC_VERSION
    cmake -S "$py/vendor/llama.cpp" -B "$W/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF \
        -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS="${CPU_FLAGS:-}" -DCMAKE_CXX_FLAGS="${CPU_FLAGS:-}" > "$W/build.log" 2>&1 &&
    cmake --build "$W/build" --target "$@" -j "$(nproc)" >> "$W/build.log" 2>&1 || return 1
    rm -rf /tmp/site/llama_cpp && cp -r "$py/llama_cpp" /tmp/site/llama_cpp && rm -rf /tmp/site/llama_cpp/lib &&
    ln -s "$W/build/bin" /tmp/site/llama_cpp/lib &&
    python3 -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())'
}

synth_llama3_8b() {  # PATH: synthetic Llama-3-8B Q4_0 with SmolLM2's tokenizer
    mkdir -p "$(dirname "$1")" && { [ -f "$1" ] ||
        ft model synth --shape llama3-8b --quant q4_0 --vocab-from "$D/vocab.gguf" -o "$1"; }
}

machine_facts() {  # FILE: the GPU, its clocks and the CPU, for the report
    { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; lscpu; } > "$1" 2>&1
}

copy_db() {  # SRC DST: a consistent copy of a SQLite file a study may be writing (SQLite's backup API;
    # a plain cp during a write can be torn)
    [ -f "$1" ] && python3 -c 'import sqlite3, sys
src, dst = sqlite3.connect(sys.argv[1], timeout=30), sqlite3.connect(sys.argv[2])
src.backup(dst)' "$1" "$2"
}

collect_now() {  # collect() into a staging folder, then each file into $OUT by a rename, whole
    [ -n "${OUT:-}" ] || return 0
    local stage=$W/collect f name
    rm -rf "$stage" && mkdir -p "$stage" || return 0
    OUT=$stage collect
    cp "$W/log" "$stage/log.txt" 2>/dev/null
    for f in "$stage"/*; do
        [ -f "$f" ] || continue
        name=$(basename "$f")
        cp "$f" "$OUT/.$name.part" && mv -f "$OUT/.$name.part" "$OUT/$name"
    done
    return 0
}

# A call cut at its limit (the device budget's end included) returns what is under $OUT then: the
# wait collects every COLLECT_EVERY_S seconds, not only at its end (lease 6 lost a study that way)
COLLECT_EVERY_S=${COLLECT_EVERY_S:-60}

wait_for() {  # wait_for SECONDS: until the steps end, collecting as it goes, then collect
    local deadline=$((SECONDS + $1)) next=$((SECONDS + COLLECT_EVERY_S))
    while [ ! -f "$W/done" ] && [ $SECONDS -lt $deadline ]; do
        sleep 1
        if [ $SECONDS -ge $next ]; then collect_now; next=$((SECONDS + COLLECT_EVERY_S)); fi
    done
    collect_now
    tail -n 30 "$W/log"
    if [ -f "$W/done" ]; then echo "ALL DONE"; else echo "STILL RUNNING"; fi
}

main() {  # start|wait [SECONDS]
    case "${1:-}" in
        start)
            if [ ! -f "$W/started" ]; then
                touch "$W/started"
                setsid nohup bash "$0" steps > "$W/log" 2>&1 < /dev/null &
            fi
            wait_for "${2:-560}" ;;
        wait) wait_for "${2:-560}" ;;
        steps) steps; echo "== end $(date +%T)"; touch "$W/done" ;;
        *) echo "usage: $0 start|wait [SECONDS]" >&2; exit 2 ;;
    esac
}
