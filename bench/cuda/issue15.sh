#!/usr/bin/env bash
# Issue 15's runs on the H200 device machine, one build and three runs in one lease:
#   (a) fleettune's measurement against llama-bench (bench/compare_llama_bench.py),
#   (b) a fleettune study of synthetic Llama-3-8B Q4_0 at a depth of 8192,
#   (c) llama-optimus (its defaults) against fleettune, the same wall-clock time each.
#
# The device tool sends the lead's checkout; everything this needs travels in .device/ (carried,
# ignored by git): pack.sh's outputs (wheels, trimmed Ray, the trimmed llama-cpp-python 0.3.36
# sdist, vocab.gguf) and the sources to run in .device/src (git archive of the branch).
#
#   bash .device/src/bench/cuda/issue15.sh start SECONDS   # start the steps detached, wait
#   bash .device/src/bench/cuda/issue15.sh wait SECONDS    # a later call: wait again
#
# One cmake build of the vendored llama.cpp (CUDA, sm_90, shared libraries) gives both llama-bench
# and the libraries llama-cpp-python's Python package loads (its lib/ is linked to the build's
# bin/), so both tools run the same compiled code. Each step leaves a marker; results land in $OUT.
set -u
W=/tmp/ft
ROOT=$(pwd)
D=$ROOT/.device
SRC=$D/src
export PYTHONPATH=/tmp/site:$SRC PYTHONUNBUFFERED=1 FLEETTUNE_HOME=$W/home
COMPARE_S=${COMPARE_S:-380}
STUDY_S=${STUDY_S:-240}
VS_S=${VS_S:-200}
STUDY_ARGS=${STUDY_ARGS:---objective e2e --prompt-tokens 512 --gen-tokens 32 --depth 8192 --reps 2 --timeout 45}
LB=$W/build/bin/llama-bench
M8B=$W/models/synthetic-llama3-8b-q4_0.gguf
MSMALL=$W/models/synthetic-smollm2-135m-q8_0.gguf
mkdir -p "$W" /tmp/site

ft() { python3 -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "fleettune"; main()' "$@"; }

step() {  # step NAME COMMAND...: run once; a marker records success
    local name=$1; shift
    [ -f "$W/$name.ok" ] && return 0
    echo "== $name $(date +%T)"
    if "$@"; then touch "$W/$name.ok"; echo "== $name ok $(date +%T)"; else echo "== $name FAILED $(date +%T)"; return 1; fi
}

deps() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$D"/whl/*.whl && tar xJf "$D/ray-trim.tar.xz" -C /tmp/site
}

build() {
    rm -rf "$W/src" && mkdir -p "$W/src" && tar xJf "$D/llama-src.tar.xz" -C "$W/src" || return 1
    local py=$W/src/llama_cpp_python-0.3.36
    cmake -S "$py/vendor/llama.cpp" -B "$W/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF > "$W/build.log" 2>&1 &&
    cmake --build "$W/build" --target llama-bench -j 16 >> "$W/build.log" 2>&1 || return 1
    rm -rf /tmp/site/llama_cpp && cp -r "$py/llama_cpp" /tmp/site/llama_cpp && rm -rf /tmp/site/llama_cpp/lib &&
    ln -s "$W/build/bin" /tmp/site/llama_cpp/lib &&
    python3 -c 'import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), "no GPU offload"; print(llama_cpp.llama_print_system_info().decode())'
}

synth() {
    mkdir -p "$W/models" && { [ -f "$M8B" ] ||
    ft model synth --shape llama3-8b --quant q4_0 --vocab-from "$D/vocab.gguf" -o "$M8B"; } &&
    python3 - "$D/vocab.gguf" "$MSMALL" <<'EOF'
import sys
from workers import models
# SmolLM2-135M's shape (30 layers, 576 wide, 9 heads, 3 KV heads): the model of the 2-core runs
models.ARCH_SHAPES["smollm2-135m"] = models.arch_shape(30, 576, 1536, 9, 3, 49152, 8192, 100000.0)
models.synthesize("smollm2-135m", "q8_0", sys.argv[1], sys.argv[2])
EOF
}

compare() {  # (a)
    timeout -s KILL "$COMPARE_S" python3 "$SRC/bench/compare_llama_bench.py" --llama-bench "$LB" --model "$MSMALL" \
        --config "-ngl 99 -t 16" --config "-ngl 99 -t 16 -fa on -d 4096" --config "-ngl 0 -t 16" \
        --config "-ngl 0 -t 8" --config "-ngl 0 -t 4" --config "-ngl 0 -t 1" --rounds 5 -r 2 --json "$W/compare.json" \
        > "$W/compare.md"
    echo "compare rc=$?"  # cut short at COMPARE_S: the table of the rounds it finished
    python3 "$SRC/bench/compare_llama_bench.py" --from-json "$W/compare.json" > "$W/compare-table.md"
}

study() {  # (b)
    # shellcheck disable=SC2086
    python3 "$SRC/bench/cuda/side_by_side.py" run-fleettune "$STUDY_S" "$W/study.log" -- \
        python3 -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "fleettune"; main()' \
        tune "$M8B" --trials 10 $STUDY_ARGS --seed 1 --quiet --db "sqlite:///$W/study.db" --json &&
    ft results --db "sqlite:///$W/study.db" --state all --json > "$W/study-results.json" 2>&1
    ft best --model "$M8B" --db "sqlite:///$W/study.db" --json > "$W/study-best.json" 2>&1
    return 0
}

versus() {  # (c)
    local vs="--objective tg --prompt-tokens 0 --gen-tokens 192 --reps 3 --timeout 120"
    { [ -s "$W/optimus.log" ] || python3 "$SRC/bench/cuda/side_by_side.py" run-optimus "$VS_S" "$W/optimus.log" -- \
        python3 -c 'import sys; from llama_optimus.cli import main; sys.argv[0] = "llama-optimus"; main()' \
        --llama-bin "$W/build/bin" --model "$M8B"; } &&  # kept from an earlier start
    python3 "$SRC/bench/cuda/side_by_side.py" run-fleettune "$VS_S" "$W/vs-fleettune.log" -- \
        python3 -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "fleettune"; main()' \
        tune "$M8B" --trials 200 $vs --seed 1 --quiet --db "sqlite:///$W/vs.db" &&
    timeout -s KILL 150 python3 "$SRC/bench/cuda/side_by_side.py" compare --optimus-log "$W/optimus.log" \
        --fleettune-log "$W/vs-fleettune.log" --db "sqlite:///$W/vs.db" --llama-bench "$LB" --model "$M8B" \
        -n 192 -r 3 --rounds 5 --json "$W/versus.json" > "$W/versus.md"
}

steps() {
    cd "$SRC" || return  # python3 -c and stdin scripts put the working directory first on sys.path
    { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; lscpu; } > "$W/env.txt" 2>&1
    step deps deps || { touch "$W/done"; return; }
    ( step synth synth > "$W/synth.log" 2>&1 ) &
    local synth_pid=$!
    step build build
    wait "$synth_pid"; cat "$W/synth.log"
    if [ -f "$W/build.ok" ] && [ -f "$W/synth.ok" ]; then
        ft hw show --json > "$W/hw.json" 2>&1
        step compare compare
        step study study
        step versus versus
    fi
    echo "== end $(date +%T)"
    touch "$W/done"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    cp "$W/log" "$OUT/log.txt" 2>/dev/null
    [ -f "$W/build.log" ] && tail -c 100000 "$W/build.log" > "$OUT/build-tail.log"
    (cd "$W" && tar czf "$OUT/results.tar.gz" --ignore-failed-read env.txt hw.json compare.md compare-table.md compare.json \
        study.log study.db study-results.json study-best.json optimus.log vs-fleettune.log vs.db versus.json \
        versus.md 2>/dev/null)
    return 0
}

wait_for() {  # wait_for SECONDS: until the steps end, then collect
    local deadline=$((SECONDS + $1))
    while [ ! -f "$W/done" ] && [ $SECONDS -lt $deadline ]; do sleep 3; done
    collect
    tail -n 30 "$W/log"
    if [ -f "$W/done" ]; then echo "ALL DONE"; else echo "STILL RUNNING"; fi
}

case "${1:-}" in
    start)
        if [ ! -f "$W/started" ]; then
            touch "$W/started"
            setsid nohup bash "$0" steps > "$W/log" 2>&1 < /dev/null &
        fi
        wait_for "${2:-560}" ;;
    wait) wait_for "${2:-560}" ;;
    steps) steps ;;
    *) echo "usage: $0 start|wait [SECONDS]" >&2; exit 2 ;;
esac
