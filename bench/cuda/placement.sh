#!/usr/bin/env bash
# Issue 23 on an NVIDIA GPU machine with no package registry (the H200 device machine): models that
# do not fit a GPU memory budget. For each model x budget x objective: a study with `tune
# --gpu-budget` (llama.cpp's defaults refused over the budget, --fit's placement a baseline, the
# claims over it), then bench/fit_referee.py: the study's recommendation against llama.cpp's own
# --fit (llama-fit-params from the same build, planned for the same budget) by llama-bench in
# interleaved rounds, each run's peak GPU memory from nvidia-smi. What travels in .device/ is made
# here by bench/cuda/pack.sh (never committed).
#
#   bash bench/cuda/placement.sh start SECONDS   # start the steps detached (once), wait up to SECONDS
#   bash bench/cuda/placement.sh wait SECONDS    # wait again (a later call on the same machine)
#
# MODELS, BUDGETS and OBJECTIVES choose the cases (default: the dense 14B and the MoE, 8 and 16 GiB,
# tg and pp: eight studies, more than one 30-minute lease holds; run a part per lease, e.g.
# MODELS=qwen3-30b-a3b BUDGETS=8GiB). Each case leaves a marker, so a restarted run skips what is
# done. CASES (SHAPE:BUDGET:OBJECTIVE[:TRIALS] ..., e.g. "qwen3-30b-a3b:16GiB:tg:12 qwen3-14b:8GiB:pp")
# names cases one by one instead, run in that order. Results land in $OUT.
set -u
SRC=$(pwd)
# shellcheck source=bench/cuda/lib.sh
. "$SRC/bench/cuda/lib.sh"
MODELS=${MODELS:-qwen3-14b qwen3-30b-a3b}
BUDGETS=${BUDGETS:-8GiB 16GiB}
OBJECTIVES=${OBJECTIVES:-tg pp}
TRIALS=${TRIALS:-12}
ROUNDS=${ROUNDS:-5}
STUDY_ARGS=${STUDY_ARGS:---reps 2 --timeout 180}

synth() {  # SHAPE: a synthetic Q4_0 model of that shape with SmolLM2's tokenizer
    local path=$W/models/synthetic-$1-q4_0.gguf
    mkdir -p "$W/models" && { [ -f "$path" ] ||
        ft model synth --shape "$1" --quant q4_0 --vocab-from "$D/vocab.gguf" -o "$path" > /dev/null; }
}

study() {  # SHAPE BUDGET OBJECTIVE [TRIALS]: the study, then the referee on its recommendation
    local model=$W/models/synthetic-$1-q4_0.gguf name=$1-$2-$3 db=sqlite:///$W/placement-$2.db
    # the study's --fit baseline from the node's llama-fit-params of this build (without it the study
    # falls back to fleettune's own estimate of --fit, as the first lease's did)
    # shellcheck disable=SC2086
    FLEETTUNE_LLAMA_FIT_PARAMS=$W/build/bin/llama-fit-params ft tune "$model" --trials "${4:-$TRIALS}" --objective "$3" --gpu-budget "$2" $STUDY_ARGS --seed 1 \
        --study "$name" --quiet --db "$db" --json > "$W/$name.outcome.json" 2> "$W/$name.tune.log" || {
        tail -n 30 "$W/$name.tune.log"; return 1; }
    local flags test
    flags=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["llama_bench_flags"])' \
        "$W/$name.outcome.json") || return 1
    case $3 in pp) test=pp512 ;; *) test=tg128 ;; esac
    python3 "$SRC/bench/fit_referee.py" --model "$model" --budget "$2" --config "fleettune=$flags" \
        --tests "$test" --rounds "$ROUNDS" -r 2 --llama-bench "$W/build/bin/llama-bench" \
        --fit-params "$W/build/bin/llama-fit-params" --json "$W/$name.referee.json" > "$W/$name.referee.txt" 2>&1
    local rc=$?
    tail -n 12 "$W/$name.referee.txt"
    return $rc
}

steps() {
    machine_facts "$W/env.txt"
    step deps deps && step build build_shared llama-bench llama-fit-params && ft hw show --json > "$W/hw.json" || return
    local case shape budget objective trials cases=${CASES:-}
    if [ -z "$cases" ]; then
        for shape in $MODELS; do for budget in $BUDGETS; do for objective in $OBJECTIVES; do
            cases="$cases $shape:$budget:$objective"
        done; done; done
    fi
    for case in $cases; do
        IFS=: read -r shape budget objective trials <<< "$case"
        step "synth-$shape" synth "$shape" &&
            step "study-$shape-$budget-$objective" study "$shape" "$budget" "$objective" "${trials:-$TRIALS}"
    done
}

collect() {  # at most 8 files come back: the referees' and outcomes' JSON in one file, the text in another
    python3 - "$W" > "$OUT/placement.json" 2>/dev/null <<'PY'
import json, pathlib, sys
w = pathlib.Path(sys.argv[1])
out = {}
for f in sorted(w.glob("*.referee.json")) + sorted(w.glob("*.outcome.json")):
    try:  # a study that failed leaves an empty outcome: say so, keep the others
        out[f.name] = json.loads(f.read_text())
    except ValueError as exc:
        out[f.name] = {"unreadable": str(exc)}
print(json.dumps(out, indent=1))
PY
    for f in env.txt hw.json; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"; done
    for f in "$W"/*.referee.txt "$W"/*.tune.log; do
        [ -f "$f" ] && { echo "===== $(basename "$f")"; tail -n 60 "$f"; }
    done > "$OUT/printed.txt" 2>/dev/null
    [ -f "$W/build.ok" ] || { [ -f "$W/build.log" ] && tail -c 20000 "$W/build.log" >> "$OUT/printed.txt"; }
    for db in "$W"/placement-*.db; do copy_db "$db" "$OUT/$(basename "$db")"; done
    return 0
}

main "$@"
