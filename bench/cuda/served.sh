#!/usr/bin/env bash
# Issue 22 on the H200: a served study of a synthetic Llama-3-8B Q4_0 on llama-server (CUDA), then
# the capacity at the SLO of llama-server's defaults, the obvious `-np 32 -c 65536` and the study's
# recommendation, side by side in the same lease (bench/served_capacity.py). What travels in
# .device/ is made here by bench/cuda/pack.sh (never committed).
#
#   bash bench/cuda/served.sh start SECONDS   # start the steps detached (once), wait up to SECONDS
#   bash bench/cuda/served.sh wait SECONDS    # wait again (a later call on the same machine)
set -u
SRC=$(pwd)
# shellcheck source=bench/cuda/lib.sh
. "$SRC/bench/cuda/lib.sh"
MODEL=$W/models/synthetic-llama3-8b-q4_0.gguf
DB=sqlite:///$W/served.db
SLO=${SLO:-ttft_p90=1s,tps_p10=20}
USERS=${USERS:-64}
TRIALS=${TRIALS:-4}
LOAD="-p 280 -n 128 --slo $SLO"

study() {  # goodput at USERS closed-loop users under the SLO: the served kind, the served knobs
    FLEETTUNE_LLAMA_SERVER=$W/build/bin/llama-server ft tune "$MODEL" --objective goodput --users "$USERS" \
        --requests "$USERS" --windows 1 $LOAD --trials "$TRIALS" --confirm-top 1 --confirm-rounds 3 --timeout 300 \
        --seed 1 --quiet --no-warm-start --db "$DB" --json > "$W/outcome.json" 2> "$W/tune.log"
}

capacity() {  # the three configurations' capacity, side by side
    local flags
    flags=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["llama_cpp_flags"])' "$W/outcome.json") || return 1
    FLEETTUNE_LLAMA_SERVER=$W/build/bin/llama-server python3 "$SRC/bench/served_capacity.py" "$MODEL" \
        --config "defaults=" --config "obvious=-np 32 -c 65536" --config "study=$flags" \
        -p 280 -n 128 --slo "$SLO" --max-users 128 --requests 64 --rounds 1 --timeout 600 \
        -o "$W/capacity.json" > "$W/capacity.log" 2>&1
}

steps() {
    machine_facts "$W/env.txt"
    SERVER=1 step deps deps && SERVER=1 step build build_shared llama-server && ft hw show --json > "$W/hw.json" &&
        step synth synth_llama3_8b "$MODEL" && step study study && step capacity capacity
}

collect() {  # at most 8 files come back
    for f in env.txt outcome.json capacity.json capacity.log tune.log; do
        [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"
    done
    copy_db "$W/served.db" "$OUT/served.db"
    [ -f "$W/build.log" ] && tail -c 100000 "$W/build.log" > "$OUT/build.log"
    return 0
}

main "$@"
