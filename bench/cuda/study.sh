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
SRC=$(pwd)
# shellcheck source=bench/cuda/lib.sh
. "$SRC/bench/cuda/lib.sh"
TRIALS=${TRIALS:-24}
STUDY_ARGS=${STUDY_ARGS:---objective e2e --prompt-tokens 512 --gen-tokens 32 --reps 2 --timeout 90}
MODEL=$W/models/synthetic-llama3-8b-q4_0.gguf

study() {
    # shellcheck disable=SC2086
    ft tune "$MODEL" --trials "$TRIALS" $STUDY_ARGS --seed 1 --quiet --db "sqlite:///$W/cuda-study.db" \
        --json > "$W/outcome.json"
}

steps() {
    machine_facts "$W/env.txt"
    step deps deps && step build build_shared llama-bench && ft hw show --json > "$W/hw.json" &&
        step synth synth_llama3_8b "$MODEL" && step study study
}

collect() {
    for f in env.txt hw.json outcome.json; do
        [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"
    done
    copy_db "$W/cuda-study.db" "$OUT/cuda-study.db"
    [ -f "$W/build.log" ] && tail -c 200000 "$W/build.log" > "$OUT/build.log"
    return 0
}

main "$@"
