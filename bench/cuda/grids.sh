#!/usr/bin/env bash
# Issue 23 on an NVIDIA GPU machine with no package registry (the H200 device machine): measured
# placement landscapes under GPU memory budgets (bench/placement_grid.py), the truths of
# bench/search_efficiency.py --landscape (issue 23.6b), and each grid's best point within the
# budget refereed against llama.cpp's own --fit by llama-bench in interleaved rounds
# (bench/fit_referee.py): where it is not 1.2x --fit, the done-when asks that no configuration
# beat --fit by more than 3 %. What travels in .device/ is made here by bench/cuda/pack.sh.
#
#   bash bench/cuda/grids.sh start SECONDS   # start the steps detached (once), wait up to SECONDS
#   bash bench/cuda/grids.sh wait SECONDS    # wait again (a later call on the same machine)
#
# GRIDS chooses the grids (default: the MoE at 16 GiB, then the dense 14B at 8 and 16 GiB, one grid
# for both: every placement of it fits 8 GiB, only --fit's differs; moe-8: the MoE at 8 GiB; moe-16-ub:
# the MoE's tg at 16 GiB across generation micro-batches, whose smaller compute buffers buy experts
# on the GPU: lease 5's study measured -ncmoe 2 at -ub 64 at about 1.3x --fit, 3 rounds). Each
# step leaves a marker, so a restarted run skips what is done. Results land in $OUT.
set -u
SRC=$(pwd)
# shellcheck source=bench/cuda/lib.sh
. "$SRC/bench/cuda/lib.sh"
GRIDS=${GRIDS:-moe-16 dense-8-16}
ROUNDS=${ROUNDS:-5}
AXES=${AXES:---threads 4,8,16 --fa off,on --ubatch 256,512 -r 2}

synth() {  # SHAPE: a synthetic Q4_0 model of that shape with SmolLM2's tokenizer
    local path=$W/models/synthetic-$1-q4_0.gguf
    mkdir -p "$W/models" && { [ -f "$path" ] ||
        ft model synth --shape "$1" --quant q4_0 --vocab-from "$D/vocab.gguf" -o "$path" > /dev/null; }
}

grid() {  # NAME SHAPE TESTS BUDGETS PLACEMENT-FLAGS...: one landscape
    local name=$1 model=$W/models/synthetic-$2-q4_0.gguf tests=$3 budgets=$4; shift 4
    local b args=()
    for b in $budgets; do args+=(--budget "$b"); done
    # shellcheck disable=SC2086
    python3 "$SRC/bench/placement_grid.py" --model "$model" "${args[@]}" "$@" $AXES --tests "$tests" \
        --llama-bench "$W/build/bin/llama-bench" --fit-params "$W/build/bin/llama-fit-params" \
        --json "$W/grid-$name.json" > "$W/grid-$name.txt" 2>&1
    local rc=$?
    tail -n 6 "$W/grid-$name.txt"
    return $rc
}

referee() {  # NAME SHAPE BUDGET TEST=GRID-TEST...: the grid's best point of each test against --fit
    local name=$1 model=$W/models/synthetic-$2-q4_0.gguf budget=$3 configs=() tests="" pair flags; shift 3
    for pair in "$@"; do  # the referee's test (tg128), and the grid's test whose best point it times
        flags=$(python3 "$SRC/bench/placement_grid.py" --best "$W/grid-$name.json:${pair#*=}:$budget") || return 1
        configs+=(--config "best-${pair#*=}=$flags") && tests=${tests:+$tests,}${pair%%=*}
    done
    python3 "$SRC/bench/fit_referee.py" --model "$model" --budget "$budget" "${configs[@]}" --tests "$tests" \
        --rounds "$ROUNDS" -r 2 --llama-bench "$W/build/bin/llama-bench" \
        --fit-params "$W/build/bin/llama-fit-params" --json "$W/referee-$name-$budget.json" \
        > "$W/referee-$name-$budget.txt" 2>&1
    local rc=$?
    tail -n 8 "$W/referee-$name-$budget.txt"
    return $rc
}

steps() {
    machine_facts "$W/env.txt"
    step deps deps && step build build_shared llama-bench llama-fit-params && ft hw show --json > "$W/hw.json" || return
    for g in $GRIDS; do
        case $g in
            moe-16)
                step synth-qwen3-30b-a3b synth qwen3-30b-a3b &&
                step grid-moe-16 grid moe-16 qwen3-30b-a3b tg128,pp512 16GiB --ncmoe 1,2,3,4,5,6,8,10 &&
                step referee-moe-16 referee moe-16 qwen3-30b-a3b 16GiB tg128=tg128 pp512=pp512 ;;
            moe-8)
                step synth-qwen3-30b-a3b synth qwen3-30b-a3b &&
                step grid-moe-8 grid moe-8 qwen3-30b-a3b tg128,pp512 8GiB --ncmoe 27,28,29,30,31,32,34,36 &&
                step referee-moe-8 referee moe-8 qwen3-30b-a3b 8GiB tg128=tg128 pp512=pp512 ;;
            moe-16-ub)
                step synth-qwen3-30b-a3b synth qwen3-30b-a3b &&
                AXES="--threads 8,16 --fa on --gen-ubatch 32,64,128,256,512 -r 2" \
                    step grid-moe-16-ub grid moe-16-ub qwen3-30b-a3b tg128 16GiB --ncmoe 1,2,3,4,5 &&
                step referee-moe-16-ub referee moe-16-ub qwen3-30b-a3b 16GiB tg128=tg128 ;;
            dense-8-16)
                # tg32: a 14B's CPU layers on 4 threads run at ~8 tok/s; the referee times tg128
                step synth-qwen3-14b synth qwen3-14b &&
                step grid-dense-8-16 grid dense-8-16 qwen3-14b tg32,pp512 "8GiB 16GiB" --ngl 28,32,34,36,38,40,41 &&
                step referee-dense-16 referee dense-8-16 qwen3-14b 16GiB tg128=tg32 pp512=pp512 &&
                step referee-dense-8 referee dense-8-16 qwen3-14b 8GiB pp512=pp512 ;;
        esac
    done
}

collect() {  # at most 8 files come back
    for f in env.txt hw.json; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"; done
    python3 - "$W" > "$OUT/grids.json" 2>/dev/null <<'PY'
import json, pathlib, sys
w = pathlib.Path(sys.argv[1])
out = {}
for f in sorted(w.glob("grid-*.json")) + sorted(w.glob("referee-*.json")):
    try:
        out[f.name] = json.loads(f.read_text())
    except ValueError as exc:
        out[f.name] = {"unreadable": str(exc)}
print(json.dumps(out, indent=1))
PY
    for f in "$W"/grid-*.txt "$W"/referee-*.txt; do
        [ -f "$f" ] && { echo "===== $(basename "$f")"; cat "$f"; }
    done > "$OUT/printed.txt" 2>/dev/null
    [ -f "$W/build.ok" ] || { [ -f "$W/build.log" ] && tail -c 20000 "$W/build.log" >> "$OUT/printed.txt"; }
    return 0
}

main "$@"
