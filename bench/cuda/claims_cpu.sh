#!/usr/bin/env bash
# Issue 20's referee protocol on the H200 machine's CPU (16 cores; the CUDA build, GPU hidden):
# five studies (tg, pp, tg, pp, tg; seeds 1-5) of a synthetic Llama-3.2-1B-shaped Q4_0, each
# refereed by `fleettune verify` (llama-bench from the same build, five interleaved rounds), and a
# table of every claimed ratio against llama-bench's. What travels in .device/ is made here by
# bench/cuda/pack.sh (never committed).
#
#   bash bench/cuda/claims_cpu.sh start SECONDS   # start the steps detached (once), wait up to SECONDS
#   bash bench/cuda/claims_cpu.sh wait SECONDS    # wait again (a later call on the same machine)
set -u
SRC=$(pwd)
# shellcheck source=bench/cuda/lib.sh
. "$SRC/bench/cuda/lib.sh"
TRIALS=${TRIALS:-6}
MODEL=${MODEL:-$W/models/synthetic-llama3.2-1b-q4_0.gguf}
DB=sqlite:///$W/claims-cpu.db

synth_1b() {
    mkdir -p "$(dirname "$MODEL")" && { [ -f "$MODEL" ] ||
        ft model synth --shape llama3.2-1b --quant q4_0 --vocab-from "$D/vocab.gguf" -o "$MODEL"; }
}

study_n() {  # N OBJECTIVE: one study and its referee, the GPU hidden from both (the CPU's study)
    local n=$1 objective=$2 workload
    export CUDA_VISIBLE_DEVICES=""
    if [ "$objective" = tg ]; then workload="-p 0 -n 32"; else workload="-p 256 -n 0"; fi
    # shellcheck disable=SC2086
    ft tune "$MODEL" --trials "$TRIALS" --objective "$objective" $workload --reps 2 --timeout 120 --seed "$n" \
        --study "cpu-$n-$objective" --quiet --db "$DB" --json > "$W/outcome-$n.json" 2> "$W/tune-$n.log" || return 1
    FLEETTUNE_LLAMA_BENCH=$W/build/bin/llama-bench ft verify "cpu-$n-$objective" --rounds 5 --db "$DB" \
        --json > "$W/verify-$n.json" 2> "$W/verify-$n.log"
}

table() {  # every claim beside llama-bench's ratio
    python3 - "$W" <<'PY'
import glob, json, os, sys
w = sys.argv[1]
print("| study | outcome | recommendation (llama-bench) | baseline | fleettune claimed | llama-bench measured | llama-bench inside the claim |")
print("|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(w, "verify-*.json"))):
    n = path.rsplit("-", 1)[1].split(".")[0]
    rows = json.load(open(path))
    outcome = json.load(open(os.path.join(w, f"outcome-{n}.json")))
    rec = next(r for r in rows if r["config"] == "recommendation")
    for r in rows:
        if r["config"] == "recommendation":
            continue
        print(f"| {n} | {outcome.get('outcome', '?')} | {rec['llama_bench_flags']} "
              f"| {r['config']} | {r.get('claimed')} | {r.get('measured')} | {r.get('inside_claim')} |")
PY
}

sanity() {  # does llama-bench itself run the model, and does llama-cpp-python? (exit codes in the log)
    "$W/build/bin/llama-bench" -m "$MODEL" -p 64 -n 8 -r 1 -o md > "$W/sanity.log" 2>&1
    echo "llama-bench rc $?" >> "$W/sanity.log"
    python3 -c "import llama_cpp; m = llama_cpp.Llama('$MODEL', n_ctx=256, verbose=False); m('10001, 10002,', max_tokens=4)" \
        >> "$W/sanity.log" 2>&1
    echo "llama-cpp-python rc $?" >> "$W/sanity.log"
    tail -n 4 "$W/sanity.log"
}

steps() {
    machine_facts "$W/env.txt"
    # the CUDA build with the GPU hidden: a CPU-only shared build (build_cpu) ran llama-bench but
    # crashed llama-cpp-python 0.3.36 (SIGSEGV in its first Llama(), docs/cuda-h200/issue20/README.md)
    # llama-fit-params too: bench/cuda/placement.sh can follow on the same machine (same build marker)
    step deps deps && step build build_shared llama-bench llama-fit-params && ft hw show --json > "$W/hw.json" &&
        step synth synth_1b || return 1
    CUDA_VISIBLE_DEVICES="" sanity
    local n=1
    for objective in tg pp tg pp tg; do
        step "study-$n" study_n "$n" "$objective"
        n=$((n + 1))
    done
    table > "$W/table.md" 2>&1
}

collect() {  # at most 8 files come back
    [ -f "$W/table.md" ] && cp "$W/table.md" "$OUT/"
    [ -f "$W/env.txt" ] && cp "$W/env.txt" "$OUT/"
    cat "$W"/outcome-*.json > "$OUT/outcomes.json" 2>/dev/null
    cat "$W"/verify-*.json > "$OUT/verify.json" 2>/dev/null
    for f in sanity.log hw.json tune-1.log tune-2.log tune-3.log tune-4.log tune-5.log verify-1.log verify-2.log verify-3.log \
             verify-4.log verify-5.log; do
        [ -f "$W/$f" ] && { echo "===== $f"; cat "$W/$f"; }
    done > "$OUT/printed.txt" 2>/dev/null
    [ -f "$W/build.ok" ] || { [ -f "$W/build.log" ] && tail -c 20000 "$W/build.log" >> "$OUT/printed.txt"; }
    copy_db "$W/claims-cpu.db" "$OUT/claims-cpu.db"
    return 0
}

main "$@"
