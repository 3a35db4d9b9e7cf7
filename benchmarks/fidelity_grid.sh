#!/usr/bin/env bash
# Issue 5's fidelity grids of several models at once, on a machine of several GPUs, in one 10-minute device command.
#
#   bash benchmarks/h200_session.sh sh 'bash benchmarks/fidelity_grid.sh h200_fidelity_2b:0 h200_fidelity_9b:2,3'
#   bash benchmarks/h200_session.sh sh 'bash benchmarks/fidelity_grid.sh h200_fidelity_9b:2,3+flide,pipeline/race'
#
# Each NAME:GPUS[+PARTS] runs configs/bench/NAME.yaml: first the float32 reference and `final_norm_scale: auto`'s pick, with
# the delimiter engine, in one process on the first GPU (kept in shared/fidelity/NAME.reference.json); then, once
# that is done, one process per engine and workload at once (flide, flide:batch-invariant, pipeline and prefix-cache
# per workload), spread over the GPUs given, all reading that reference and scale. The GPU is far from full with one
# engine answering one question at a time, so the parts overlap well; answers do not depend on the timing.
# A part that runs out of time loses only its unfinished cells (the runner writes its JSON after every cell).
# PARTS (comma-separated ENGINE or ENGINE/WORKLOAD, e.g. `+flide,pipeline/race`) runs only those parts, without the
# reference part unless `delimiter` is among them: for a grid whose reference is already in shared/fidelity.
# Processes per GPU x the model's size must fit its memory (9B: ~17 GB each, plus a transient ~8 GB while
# `weights_fingerprint` sums the embedding in float64): give a large model several GPUs.
# Results: $OUT/NAME/<part>/NAME.json (+ .md, logs); merge them with flide.bench.runner.merge_rows, then --report.
set -u
OUT=${OUT:-/tmp/out}
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
REF_S=${REF_S:-330}  # the reference part's own limit
REF_ARGS=${REF_ARGS:-}  # more arguments of the reference part, e.g. `--workloads race` with parts of that workload only
ENGINES=${ENGINES:-"flide flide:batch-invariant"}
BASELINES=${BASELINES:-"pipeline prefix-cache"}
WORKLOADS=${WORKLOADS:-"race multirc quality"}
mkdir -p shared/fidelity

part() {  # part GPU NAME LABEL LIMIT ARGS...: one flide.bench process on one GPU
    local gpu=$1 name=$2 label=$3 limit=$4; shift 4
    mkdir -p "$OUT/$name/$label"
    CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python3 -m flide.bench "configs/bench/$name.yaml" "$@" \
        --reference-dir shared/fidelity --out "$OUT/$name/$label" > "$OUT/$name/$label/bench.log" 2>&1
    echo "$name $label rc=$? $(date +%s)" >> "$OUT/fidelity_summary.txt"
}

grid() {  # grid NAME GPUS (comma-separated) [PARTS (comma-separated)]
    local name=$1 gpus=(${2//,/ }) parts=${3:-} i=0
    if [ -z "$parts" ]; then
        parts="delimiter"
        for engine in $ENGINES; do parts="$parts,$engine"; done
        for engine in $BASELINES; do for workload in $WORKLOADS; do parts="$parts,$engine/$workload"; done; done
    fi
    if [[ ",$parts," == *,delimiter,* ]]; then
        part "${gpus[0]}" "$name" reference "$REF_S" --engines delimiter $REF_ARGS
    fi
    local left=$(( DEADLINE - $(date +%s) ))
    [ "$left" -gt 30 ] || { echo "$name: no time left after the reference" >> "$OUT/fidelity_summary.txt"; return; }
    for p in ${parts//,/ }; do
        [ "$p" = delimiter ] && continue
        local engine=${p%%/*} args=()
        [[ "$p" == */* ]] && args=(--workloads "${p#*/}")
        local gpu=${gpus[$(( i % ${#gpus[@]} ))]}  # here: `cmd &` expands its words in the background subshell
        i=$(( i + 1 ))
        part "$gpu" "$name" "${p//[:\/]/_}" "$left" --engines "$engine" "${args[@]}" &
    done
    wait
}

for spec in "$@"; do
    name=${spec%%:*}; rest=${spec#*:}
    gpus=${rest%%+*}; parts=""
    [[ "$rest" == *+* ]] && parts=${rest#*+}
    grid "$name" "$gpus" "$parts" &
done
wait
cp shared/fidelity/*.reference.json "$OUT/" 2>/dev/null
sort "$OUT/fidelity_summary.txt"
# the log lines with each cell's figures
grep -h -E "Agr|reference done|final_norm_scale|FAILED" "$OUT"/*/*/bench.log | grep -v DEBUG | cut -c1-160
