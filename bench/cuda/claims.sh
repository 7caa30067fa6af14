#!/usr/bin/env bash
# Issue 20 on an NVIDIA GPU machine with no package registry (the H200 device machine): the GPU study
# (synthetic Llama-3-8B Q4_0, tg, 8 trials, timeout 45, sampler auto) under the claims protocol
# (baselines, search, interleaved confirmation with an A/A arm, gains with intervals), a check that
# no configuration was proposed twice, and `fleettune verify` (llama-bench from the same build) as
# the referee. What travels in .device/ is made here by bench/cuda/pack.sh (never committed).
#
#   bash bench/cuda/claims.sh start SECONDS   # start the steps detached (once), wait up to SECONDS
#   bash bench/cuda/claims.sh wait SECONDS    # wait again (a later call on the same machine)
#
# Each step leaves a marker, so a restarted run skips what is done. Results land in $OUT.
set -u
SRC=$(pwd)
# shellcheck source=bench/cuda/lib.sh
. "$SRC/bench/cuda/lib.sh"
TRIALS=${TRIALS:-8}
STUDY=${STUDY:-h200-claims-tg}
STUDY_ARGS=${STUDY_ARGS:---objective tg --reps 2 --timeout 45}
VERIFY_ROUNDS=${VERIFY_ROUNDS:-5}
MODEL=${MODEL:-$W/models/synthetic-llama3-8b-q4_0.gguf}
DB=sqlite:///$W/claims.db

study() {  # the study as a user runs it (sampler auto); what tune printed: outcome.json, tune.log
    # shellcheck disable=SC2086
    ft tune "$MODEL" --trials "$TRIALS" $STUDY_ARGS --seed 1 --study "$STUDY" --quiet --db "$DB" \
        --json > "$W/outcome.json" 2> "$W/tune.log"
    local rc=$?
    tail -n 40 "$W/tune.log"
    return $rc
}

report() {  # results (every state), best (its table with the claims), and the repeat check
    ft results --study "$STUDY" --state all --json --db "$DB" > "$W/results.json" &&
        ft results --study "$STUDY" --state all --db "$DB" > "$W/results.txt" 2>&1
    ft best --model "$MODEL" --db "$DB" > "$W/best.txt" 2>&1
    repeats "$W/results.json" > "$W/repeats.txt" 2>&1
    local rc=$?
    grep -i -E "random|warn" "$W/tune.log" >> "$W/repeats.txt"
    cat "$W/results.txt" "$W/best.txt" "$W/repeats.txt"
    return $rc
}

repeats() {  # RESULTS_JSON: was a configuration proposed twice? exit 1 if so
    python3 - "$1" <<'PY'
import json, sys
from orchestrator.learn import identity, config_key
from workers.trial import BenchParams
rows = sorted(json.load(open(sys.argv[1])), key=lambda r: r["id"])
def ident(r):
    return identity(BenchParams.from_dict(r["params"]), r["effective"])
def asked(r):
    return config_key(BenchParams.from_dict(r["params"]))
print("trials:", len(rows), {k: sum(r["phase"] == k for r in rows) for k in sorted({r["phase"] for r in rows})},
      "states:", {k: sum(r["state"] == k for r in rows) for k in sorted({r["state"] for r in rows})})
for r in rows:
    print(f'{r["id"]:>4} {r["phase"]:<9} {r["state"]:<9} {r["flags"]:<60} eff: {r["effective_flags"]} '
          f'tg {r["tg_tps"]} err {(r["error"] or "")[:80]}')
bad = 0
search = [r for r in rows if r["phase"] == "search"]
for name, key in (("as asked", asked), ("effective", ident)):
    seen = {}
    for r in search:
        if key(r) in seen:
            bad += 1
            print(f"REPEAT ({name}): search trial {r['id']} = trial {seen[key(r)]}: {r['flags']}")
        seen.setdefault(key(r), r["id"])
failed = {}
for r in rows:
    if r["phase"] == "confirm":
        continue
    for key in (asked(r), ident(r)):
        if key in failed:
            bad += 1
            print(f"FAILED AGAIN: trial {r['id']} ({r['phase']}) repeats failed trial {failed[key]}: {r['flags']}")
            break
    if r["state"] == "failed":
        failed.setdefault(asked(r), r["id"])
        failed.setdefault(ident(r), r["id"])
print(f"search trials: {len(search)}, distinct as asked: {len({asked(r) for r in search})}, "
      f"distinct effective: {len({ident(r) for r in search})}; failed: {sum(r['state'] == 'failed' for r in rows)}")
print("NO CONFIGURATION PROPOSED TWICE" if bad == 0 else f"{bad} REPEATS")
sys.exit(1 if bad else 0)
PY
}

referee() {  # fleettune verify: llama-bench from the same build, interleaved rounds
    FLEETTUNE_LLAMA_BENCH=$W/build/bin/llama-bench ft verify "$STUDY" --rounds "$VERIFY_ROUNDS" --db "$DB" \
        --json > "$W/verify.json" 2> "$W/verify.log"
    local rc=$?
    cat "$W/verify.log" "$W/verify.json"
    return $rc
}

steps() {
    machine_facts "$W/env.txt"
    step deps deps && step build build_shared llama-bench && ft hw show --json > "$W/hw.json" &&
        step synth synth_llama3_8b "$MODEL" && { step study study; step report report; step verify referee; }
}

collect() {  # at most 8 files come back
    for f in env.txt outcome.json results.json verify.json repeats.txt; do
        [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"
    done
    # the human-readable outputs in one file
    for f in hw.json tune.log results.txt best.txt verify.log; do
        [ -f "$W/$f" ] && { echo "===== $f"; cat "$W/$f"; }
    done > "$OUT/printed.txt" 2>/dev/null
    [ -f "$W/build.ok" ] || { [ -f "$W/build.log" ] && tail -c 20000 "$W/build.log" >> "$OUT/printed.txt"; }
    copy_db "$W/claims.db" "$OUT/claims.db"
    return 0
}

main "$@"
