#!/usr/bin/env bash
# A real fleettune study on an NVIDIA GPU machine with no package registry (the H200 device machine).
#
# What travels in .device/ (made here by bench/cuda/pack.sh, never committed): the pure-Python and
# manylinux wheels the machine lacks, a trimmed Ray wheel (tar.xz), a trimmed llama-cpp-python sdist
# (tar.xz) and a tiny GGUF that carries SmolLM2's tokenizer.
#
#   bash bench/cuda/study.sh start SECONDS   # start the steps detached (once), wait up to SECONDS
#   bash bench/cuda/study.sh wait SECONDS    # wait again (a later call on the same machine)
#
# Each step leaves a marker, so a restarted run skips what is done. Results land in $OUT.
set -u
W=/tmp/ft
ROOT=$(pwd)
TRIALS=${TRIALS:-24}
STUDY_ARGS=${STUDY_ARGS:---objective e2e --prompt-tokens 512 --gen-tokens 32 --reps 2 --timeout 90}
export PYTHONPATH=/tmp/site:$ROOT PYTHONUNBUFFERED=1 FLEETTUNE_HOME=$W/home
mkdir -p "$W" /tmp/site

ft() { python3 -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "fleettune"; main()' "$@"; }

step() {  # step NAME COMMAND...: run once; a marker records success
    local name=$1; shift
    [ -f "$W/$name.ok" ] && return 0
    echo "== $name $(date +%T)"
    "$@" && touch "$W/$name.ok"
}

deps() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .device/whl/*.whl && tar xJf .device/ray-trim.tar.xz -C /tmp/site
}

build() {
    rm -rf "$W/src" && mkdir -p "$W/src" && tar xJf .device/llama-src.tar.xz -C "$W/src" &&
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=16 \
    python3 -m pip install --no-index --no-build-isolation --no-deps --no-cache-dir --target /tmp/site \
        "$W"/src/llama_cpp_python-* > "$W/build.log" 2>&1 &&
    python3 -c 'import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), "no GPU offload"'
}

synth() {
    mkdir -p "$W/models" && ft model synth --shape llama3-8b --quant q4_0 --vocab-from .device/vocab.gguf \
        -o "$W/models/synthetic-llama3-8b-q4_0.gguf"
}

study() {
    ft tune "$W/models/synthetic-llama3-8b-q4_0.gguf" --trials "$TRIALS" $STUDY_ARGS --seed 1 --quiet \
        --db "sqlite:///$W/cuda-study.db" --json > "$W/outcome.json"
}

steps() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$W/nvidia-smi.csv"
    lscpu > "$W/lscpu.txt" 2>&1
    step deps deps && step build build && ft hw show --json > "$W/hw.json" && step synth synth &&
        step study study
    echo "== end $(date +%T) rc=$?"
    touch "$W/done"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    for f in log nvidia-smi.csv lscpu.txt hw.json outcome.json cuda-study.db; do
        [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"
    done
    [ -f "$W/build.log" ] && tail -c 200000 "$W/build.log" > "$OUT/build.log"
    return 0
}

wait_for() {  # wait_for SECONDS: until the steps end, then collect
    local deadline=$((SECONDS + $1))
    while [ ! -f "$W/done" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    collect
    tail -n 25 "$W/log"
    [ -f "$W/done" ] && echo "ALL DONE" || echo "STILL RUNNING"
}

case "${1:-}" in
    start)
        if [ ! -f "$W/started" ]; then
            touch "$W/started"
            setsid nohup bash "$0" steps > "$W/log" 2>&1 < /dev/null &
        fi
        wait_for "${2:-540}" ;;
    wait) wait_for "${2:-540}" ;;
    steps) steps ;;
    *) echo "usage: $0 start|wait [SECONDS]" >&2; exit 2 ;;
esac
