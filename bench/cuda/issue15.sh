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
SRC=$(pwd)/.device/src
# shellcheck source=bench/cuda/lib.sh
. "$SRC/bench/cuda/lib.sh"
COMPARE_S=${COMPARE_S:-380}
STUDY_S=${STUDY_S:-240}
VS_S=${VS_S:-200}
STUDY_ARGS=${STUDY_ARGS:---objective e2e --prompt-tokens 512 --gen-tokens 32 --depth 8192 --reps 2 --timeout 45}
# Which steps run after the build, in order (the second lease: STEPS="diagnose study pinned").
STEPS=${STEPS:-compare study versus}
LB=$W/build/bin/llama-bench
M8B=$W/models/synthetic-llama3-8b-q4_0.gguf
MSMALL=$W/models/synthetic-smollm2-135m-q8_0.gguf

synth() {
    synth_llama3_8b "$M8B" &&
    python3 - "$D/vocab.gguf" "$MSMALL" <<'PY'
import sys
from workers import models
# SmolLM2-135M's shape (30 layers, 576 wide, 9 heads, 3 KV heads): the model of the 2-core runs
models.ARCH_SHAPES["smollm2-135m"] = models.arch_shape(30, 576, 1536, 9, 3, 49152, 8192, 100000.0)
models.synthesize("smollm2-135m", "q8_0", sys.argv[1], sys.argv[2])
PY
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
        tune "$M8B" --trials "${STUDY_TRIALS:-10}" $STUDY_ARGS --seed 1 --quiet --db "sqlite:///$W/study.db" --json &&
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

diagnose() {  # flash attention off at a depth of 8k on the GPU: does llama-bench abort too?
    local cfg="-ngl 99 -fa 0 -p 0 -n 32 -r 1 ${DIAG_FLAGS:-}"
    for d in ${DIAG_DEPTHS:-4096 8160}; do
        echo "-- llama-bench $cfg -d $d"
        timeout -s KILL 120 "$LB" -m "$M8B" $cfg -d "$d" 2>&1 | tail -n 25
        echo "rc=${PIPESTATUS[0]}"
        echo "-- fleettune bench --ngl 99 -fa off -d $d"
        timeout -s KILL 120 python3 -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "fleettune"; main()' \
            bench "$M8B" --ngl 99 -fa off -p 0 -n 32 -r 1 ${DIAG_FLAGS:-} -d "$d" 2>&1 | tail -n 25
        echo "rc=${PIPESTATUS[0]}"
    done >> "$W/diagnose.log" 2>&1
    return 0
}

pinned() {  # (a) again, CPU only, each thread count on as many cores of its own (taskset)
    local t
    for t in 1 4 8 16; do
        [ -f "$W/pinned-$t.json" ] && continue
        timeout -s KILL "${PINNED_S:-150}" taskset -c "0-$((t - 1))" python3 "$SRC/bench/compare_llama_bench.py" \
            --llama-bench "$LB" --model "$MSMALL" --config "-ngl 0 -t $t" --rounds 5 -r 2 \
            --json "$W/pinned-$t.part.json" > /dev/null && mv "$W/pinned-$t.part.json" "$W/pinned-$t.json"
        echo "pinned t=$t rc=$?"
    done
}

steps() {
    cd "$SRC" || return  # python3 -c and stdin scripts put the working directory first on sys.path
    machine_facts "$W/env.txt"
    step deps deps || return
    ( step synth synth > "$W/synth.log" 2>&1 ) &
    local synth_pid=$! s
    step build build_shared llama-bench
    wait "$synth_pid"; cat "$W/synth.log"
    [ -f "$W/build.ok" ] && [ -f "$W/synth.ok" ] || return
    ft hw show --json > "$W/hw.json" 2>&1
    for s in $STEPS; do step "$s" "$s"; done
}

collect() {
    [ -f "$W/build.log" ] && tail -c 100000 "$W/build.log" > "$OUT/build-tail.log"
    (cd "$W" && tar czf "$OUT/results.tar.gz" --ignore-failed-read env.txt hw.json compare.md compare-table.md \
        compare.json study.log study.db study-results.json study-best.json optimus.log vs-fleettune.log vs.db \
        versus.json versus.md diagnose.log pinned-*.json 2>/dev/null)
    return 0
}

main "$@"
