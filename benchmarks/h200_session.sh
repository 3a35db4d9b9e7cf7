#!/usr/bin/env bash
# The H200 checks and timings of a session, in parts that each fit one 10-minute device command.
#
# Here (CPU side), once:   bash benchmarks/h200_session.sh stage
#     copies the Qwen3.5 tokenizer/configs and the workload data into ./shared (git-ignored via .git/info/exclude;
#     the data must not be committed) and fetches the wheels into .whl (../shared/gpu/wheels.sh).
# There (device `run`, carry [".whl"]; shared/ travels by itself):
#     bash benchmarks/h200_session.sh alltests   every GPU test file at once (FILES=... to pick), one process each, then latency alone of 0.8B in the time left (BUDGET_S); AB_CONFIG=X.yaml: and the profile with X for an A/B
#     bash benchmarks/h200_session.sh kernels    GPU tests of the op variants against the references       ~8 min
#     bash benchmarks/h200_session.sh models     GPU tests of whole engines: fast kernels, graph capture   ~8 min
#     bash benchmarks/h200_session.sh invariant  batch-invariant mode (issue 7): invariant GEMM + attention, engine ~9 min
#     bash benchmarks/h200_session.sh profile    latency alone + kernel profile of one replay, 0.8B     ~5 min
#     bash benchmarks/h200_session.sh ops        op benchmarks (attention, gated delta, conv) vs floors     ~5 min
#     bash benchmarks/h200_session.sh rounds     pytest-benchmark of engine rounds (benchmarks/test_gpu_rounds.py) ~5 min
#     bash benchmarks/h200_session.sh agents     SWE-agent replay (issue 6): slope and steps/s (MODEL=4b: 4B)   ~4 min
#     bash benchmarks/h200_session.sh tiles      invariant GEMM tiles vs cuBLAS per fused projection (issue 7)  ~2.5 min
#     bash benchmarks/h200_session.sh resume     GPU tests of the checkpoint-round kernels, then the 0.8B replay  ~8 min
#     bash benchmarks/h200_session.sh bench ARGS  python -m flide.bench ARGS (e.g. a config and --engines flide)
#     bash benchmarks/h200_session.sh fidelity NAME ARGS  configs/bench/NAME.yaml in fidelity parts (issue 5): the float32
#                                                reference and auto final-norm scale kept in shared/fidelity between calls
#     bash benchmarks/h200_session.sh verify     GPU tests of the question kernel + its forms/tiles at 0.8B's shapes ~6 min
#     bash benchmarks/h200_session.sh wy         GPU tests + op bench + latency of the questions' chunked (WY) form ~8 min
#     bash benchmarks/h200_session.sh attn_split the value-column split of the invariant attention: bits test, op bench, replay A/B ~8 min
#     bash benchmarks/h200_session.sh chunked    chunked questions' GPU tests at HEAD (nested, invariant, engine) + nested rows-in-turns A/B ~7 min
#     bash benchmarks/h200_session.sh nested     where a nested fork's rows go: replay A/B of long leaves chunked (re-run / stored) and 1 stage ~7 min
#     bash benchmarks/h200_session.sh mlp        the SiLU-mul in the gate/up GEMM (kernels.gated_mlp): GPU tests, op bench, replay A/B ~7 min
#     bash benchmarks/h200_session.sh serve      issue 4: the http bench twice (req/s 1/8/32/64, one-client gap) + serve A/B ~9 min
#     bash benchmarks/h200_session.sh widen      the question launches' tiles: GPU tests of both sets, then the replay A/B ~9 min
#     bash benchmarks/h200_session.sh ab NAME=ARGS...  replay A/B arms of the 0.8B profile (ARGS: --set / --config), then $THEN
#     bash benchmarks/h200_session.sh sh 'CMDS'  any commands, after the same set-up (a session's own mix of parts)
# Logs and results go to $OUT.
set -u
part=${1:?usage: h200_session.sh stage|kernels|models|invariant|profile|ops|rounds|agents|bench ...}
shift
if [ "$part" = stage ]; then
    mkdir -p .git/info  # a fresh checkout may lack it
    for p in /shared/ /.cache/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
    mkdir -p shared/models shared/data
    cp -r ../shared/models/qwen3_5 shared/models/
    for d in race quality multirc swe_agent_trajs; do cp -r ../shared/data/$d shared/data/; done
    [ -d .whl ] && ls .whl | grep -q uvloop || EXTRA="uvloop==0.23.0 httptools==0.9.0" bash ../shared/gpu/wheels.sh
    du -sh shared .whl
    exit 0
fi
OUT=${OUT:-/tmp/out}; export OUT
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/transformers-*.whl .whl/fla_core-*.whl .whl/fastapi-*.whl .whl/starlette-*.whl .whl/uvicorn-*.whl \
    .whl/prometheus_client-*.whl .whl/pydantic-*.whl .whl/pydantic_core-*.whl .whl/annotated_types-*.whl \
    .whl/typing_inspection-*.whl .whl/uvloop-*.whl .whl/httptools-*.whl .whl/opentelemetry_api-*.whl \
    .whl/importlib_metadata-*.whl > /tmp/pip.log 2>&1 || cat /tmp/pip.log
export PYTHONPATH=$PWD:/tmp/site
# fastapi 0.165 imports opentelemetry at import time (session 7's first http bench failed on it): check it here
python3 -c "import fastapi" 2>> /tmp/pip.log || { echo "fastapi does not import:"; tail -3 /tmp/pip.log; }
# The device's copy of .git can report a stale HEAD: before a call, `git rev-parse --short HEAD > shared/COMMIT`
# here (shared/ travels, git-excluded) and the results record that commit
[ -f shared/COMMIT ] && export FLIDE_COMMIT=$(cat shared/COMMIT)
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
# Triton's own cache (our kernels and fla's) inside it, so one archive holds every compiled kernel
export TRITON_CACHE_DIR=/tmp/inductor-cache/triton-jit
# Compile caches travel between calls: a machine starts bare, and capturing 0.8B's 10 buckets took ~100 s of
# compiling on each. With SAVE_CACHE=1 a call leaves $OUT/inductor.txz (if under 15 MiB: files come back up to 16);
# copy it to .cache/inductor.txz here (git-excluded) and carry ".cache" with ".whl": later calls unpack it first.
# Valid while the device's torch / triton / GPU stay the same (their versions are in the cache keys).
# A cache over 15 MiB comes back in 15 MiB parts (inductor.txz.part-aa, -ab, ...): join them here with
# `cat inductor.txz.part-* > .cache/inductor.txz` (session 9's: 17 MB in xz, 39 MB in gzip).
# A call's carry is at most 64 MiB with .whl's ~22 MB: a cache that grew past ~40 MB (each SAVE_CACHE archive holds
# the unpacked old one too) is pruned here to the files of the call that saved it (find -newermt the call's start,
# then `tar | xz -9e`; session 18: 54 -> 19 MB).
for c in .cache/inductor.txz .cache/inductor.tgz; do
    if [ -f "$c" ]; then tar xf "$c" -C /tmp && echo "compile cache: $(du -sh /tmp/inductor-cache | cut -f1) unpacked from $c"; break; fi
done
save_cache() {
    [ -n "${SAVE_CACHE:-}" ] || return 0
    tar cf - -C /tmp inductor-cache | xz -T0 -6 > "$OUT/inductor.txz"
    size=$(stat -c %s "$OUT/inductor.txz")
    if [ "$size" -gt $((60 * 1024 * 1024)) ]; then echo "compile cache $size bytes: too large to come back"; rm -f "$OUT/inductor.txz"
    elif [ "$size" -gt $((15 * 1024 * 1024)) ]; then
        split -b $((15 * 1024 * 1024)) "$OUT/inductor.txz" "$OUT/inductor.txz.part-" && rm -f "$OUT/inductor.txz"
        echo "compile cache saved: $size bytes in $(ls "$OUT"/inductor.txz.part-* | wc -l) parts"
    else echo "compile cache saved: $size bytes"; fi
}
# At most 8 files come back from $OUT: with BUNDLE=1 everything a call wrote (logs, JSON, markdown, plots) goes back
# as one $OUT/results.tgz instead (the compile cache stays beside it); unpack it here with tar xzf.
bundle() {
    [ -n "${BUNDLE:-}" ] || return 0
    (cd "$OUT" && find . -type f ! -name 'inductor.t?z*' ! -name results.tgz | tar czf results.tgz -T - && \
        find . -type f ! -name 'inductor.t?z*' ! -name results.tgz -delete && echo "bundled: $(du -h results.tgz | cut -f1)")
}
finish() { bundle; save_cache; }
trap finish EXIT
started=$(date +%s)
# profile_rows PREFIX NAME...: each $OUT/PREFIX_NAME.json of profile_round.py, a line a workload: stream tokens, latency,
# replay GPU ms and the ms of the kernels named in $KERNELS
profile_rows() {
    PREFIX=$1 python3 - "${@:2}" <<'PY'
import json, os, sys
kernels = os.environ.get("KERNELS", "").split()
for name in sys.argv[1:]:
    try:
        r = json.load(open(f"{os.environ['OUT']}/{os.environ['PREFIX']}_{name}.json"))
    except Exception as error:
        print(name, error)
        continue
    for row in r["rows"]:
        p = row.get("profile") or {}
        top = dict(p.get("top_kernels_ms") or [])
        print(name, row["workload"], row["stream_tokens"], row["latency_ms"], p.get("gpu_ms_total"),
              {k: round(top[k], 3) for k in kernels if k in top})
PY
}
# ab_arms NAME=ARGS...: a replay A/B of the 0.8B profile, one profile_round.py run per arm (ARGS: its --set / --config
# arguments, empty for the baseline), WORKLOADS="..." (default: race multirc quality sweep64), each arm's
# $OUT/PREFIX_NAME.json (AB_PREFIX, default ab), then the replay GPU ms and the kernels of $KERNELS per workload and arm
ab_arms() {
    local names=() arm name prefix=${AB_PREFIX:-ab}
    for arm in "$@"; do
        name=${arm%%=*}; names+=("$name")
        timeout ${PROFILE_S:-110} python3 benchmarks/profile_round.py \
            --config-json shared/models/qwen3_5/configs/qwen3.5-0.8b.json --tokenizer shared/models/qwen3_5 \
            --data shared/data --repeats ${REPEATS:-15} --profile-runs 2 \
            --workloads ${WORKLOADS:-race multirc quality sweep64 multirc@6} ${arm#*=} --out "$OUT/${prefix}_$name.json" \
            > "$OUT/${prefix}_$name.log" 2>&1
        echo "profile $name rc=$? at $(( $(date +%s) - started )) s"
    done
    profile_rows "$prefix" "${names[@]}"
}
# named_tests PREFIX TIMEOUT "NAME FILE [-k EXPR]"...: one pytest process per spec, all at once, EXPR's `_or_` /
# `_and_` read as ` or ` / ` and ` (one word for the spec's split); each log in $OUT/PREFIX_NAME.log, a line per
# spec, then the failures
named_tests() {
    local prefix=$1 timeout=$2 t name file expr; shift 2
    for t in "$@"; do
        set -- $t; name=$1; file=$2; expr=${4:-}; expr=${expr//_or_/ or }; expr=${expr//_and_/ and }
        (timeout "$timeout" python3 -m pytest -q -rA -p no:logging --tb=short "$file" ${expr:+-k "$expr"} \
            > "$OUT/${prefix}_$name.log" 2>&1; echo "$name rc=$? $(tail -1 "$OUT/${prefix}_$name.log")") &
    done
    wait
    grep -h -E "^FAILED|^E  " "$OUT"/${prefix}_*.log | head -20
}
# parallel_tests TIMEOUT LOG_LINES FILE...: one pytest process per GPU test file, all at once (small next to the H200,
# compiling on 16 cores in parallel), waiting for every background job; a line per file in $OUT/summary.txt, the
# logs' tails in $OUT/tests.log
parallel_tests() {
    local timeout=$1 lines=$2; shift 2
    mkdir -p /tmp/logs
    for f in "$@"; do
        local name=$(basename "$f" .py)
        ( timeout "$timeout" python3 -m pytest -q -p no:logging --tb=short "$f" > "/tmp/logs/$name.log" 2>&1
          echo "$name rc=$? $(date +%s) $(tail -1 "/tmp/logs/$name.log")" >> "$OUT/summary.txt" ) &
    done
    wait
    for f in /tmp/logs/*.log; do echo "=================== $f"; grep -v DEBUG "$f" | tail -"$lines"; done > "$OUT/tests.log"
    sort "$OUT/summary.txt"
}
case "$part" in
alltests)
    # One process per file, all at once: the tests are small next to the H200 and compile on 16 cores in parallel.
    mkdir -p /tmp/logs
    [ -n "${CAPTURE_CHECK:-}" ] && (timeout 200 python3 benchmarks/capture_check.py > /tmp/logs/capture_check.log 2>&1; echo "capture_check rc=$?" >> "$OUT/summary.txt") &
    parallel_tests "${TEST_TIMEOUT:-450}" "${LOG_LINES:-150}" ${FILES:-tests/gpu/test_*_gpu.py}
    echo "elapsed $(( $(date +%s) - started )) s"
    # time left in a 10-minute command: latency alone of 0.8B with graphs (the profile part, no eager rounds)
    left=$(( ${BUDGET_S:-555} - ($(date +%s) - started) ))
    if [ "$left" -gt 150 ]; then
        timeout "$left" python3 benchmarks/profile_round.py --config-json shared/models/qwen3_5/configs/qwen3.5-0.8b.json \
            --tokenizer shared/models/qwen3_5 --data shared/data --repeats 20 --profile-runs 3 ${PROFILE_ARGS:-} \
            --out "$OUT/profile_0_8b.json" 2>&1 | grep -v DEBUG | tr '\r' '\n' | grep -v '^\s*$' > "$OUT/profile.log"
        tail -25 "$OUT/profile.log"
    fi
    # AB_CONFIG=configs/h200/X.yaml: then the same profile (RACE, QuALITY, sweep 64) with that config, for an A/B in
    # one call (e.g. configs/h200/conv_layout_separate.yaml)
    left=$(( ${BUDGET_S:-555} - ($(date +%s) - started) ))
    if [ -n "${AB_CONFIG:-}" ] && [ "$left" -gt 100 ]; then
        timeout "$left" python3 benchmarks/profile_round.py --config-json shared/models/qwen3_5/configs/qwen3.5-0.8b.json \
            --tokenizer shared/models/qwen3_5 --data shared/data --repeats 20 --profile-runs 3 --config "$AB_CONFIG" \
            --workloads race quality sweep64 --out "$OUT/profile_ab.json" 2>&1 | grep -v DEBUG | tr '\r' '\n' \
            | grep -v '^\s*$' > "$OUT/profile_ab.log"
        tail -5 "$OUT/profile_ab.log"
    fi ;;
kernels|models|invariant)
    if [ "$part" = kernels ]; then
        files="test_fork_conv_gpu test_gated_delta_gpu test_fork_attention_triton_gpu test_fork_attention_gpu"
    elif [ "$part" = invariant ]; then
        files="test_linear_gpu test_fork_attention_invariant_gpu test_batch_invariant_gpu"
    else
        files="test_engine_gpu test_graphs_gpu test_checkpoints_gpu"
    fi
    for name in $files; do
        timeout 280 python3 -m pytest -q -x -p no:logging "tests/gpu/$name.py" > "$OUT/$name.log" 2>&1
        echo "$name rc=$? $(tail -1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
    done ;;
profile)
    timeout ${BUDGET_S:-540} python3 benchmarks/profile_round.py --config-json shared/models/qwen3_5/configs/qwen3.5-0.8b.json \
        --tokenizer shared/models/qwen3_5 --data shared/data ${PROFILE_ARGS:---eager} --repeats 20 --profile-runs 3 \
        --out "$OUT/profile_0_8b.json" 2>&1 | grep -v DEBUG | tr '\r' '\n' | grep -v '^\s*$' > "$OUT/profile.log"
    tail -20 "$OUT/profile.log" ;;
ops)
    for op in ${OPS:-fork_attention gated_delta fork_conv linear}; do
        extra=""; limit=${OP_LIMIT:-120}
        [ "$op" = fork_attention ] && extra="${ATTN_ARGS---sweep --flex-sweep}" && limit=${ATTN_LIMIT:-200}
        [ "$op" = gated_delta ] && extra="${GDN_ARGS---sweep}"
        timeout $limit python3 benchmarks/ops/bench_$op.py --out "$OUT/ops_$op.json" $extra > "$OUT/ops_$op.log" 2>&1
        echo "$op rc=$?" | tee -a "$OUT/summary.txt"; tail -12 "$OUT/ops_$op.log"
    done ;;
rounds)
    timeout 560 python3 -m pytest -q -p no:logging benchmarks/test_gpu_rounds.py \
        --benchmark-json "$OUT/gpu_rounds.json" > "$OUT/gpu_rounds.log" 2>&1
    echo "rounds rc=$?"; tail -15 "$OUT/gpu_rounds.log" ;;
agents)
    # MODEL=4b for Qwen3.5-4B; ENGINES to pick (default: with checkpoints, prefix-cache, pipeline); the ALONE (3) longest of
    # the 25 trajectories replayed alone (slope), steps/s runs bounded to 20 s each (slow baselines)
    model=${MODEL:-0.8b}
    timeout ${BUDGET_S:-300} python3 benchmarks/agent_steps.py --model shared/models/qwen3_5/configs/qwen3.5-$model.json \
        --tokenizer shared/models/qwen3_5 --data shared/data --dtype bfloat16 --device cuda \
        --engines ${ENGINES:-flide+checkpoints prefix-cache pipeline} --trajectories 25 --alone-trajectories ${ALONE:-3} \
        --seconds 20 --agents 1 32 --out "$OUT/agent_steps_${model/./_}.json" > "$OUT/agent_steps.log" 2>&1
    echo "agents rc=$?"; cat "$OUT/agent_steps_${model/./_}.md" ;;
resume)
    # Session 10's checkpoint-round kernels (attention prefix phase, conv windows, one-launch short states) on the
    # device: their GPU tests in parallel, then the 0.8B replay with checkpoints only (ALONE=6 for the slope)
    parallel_tests "${TEST_TIMEOUT:-240}" 60 tests/gpu/test_checkpoints_gpu.py tests/gpu/test_fork_attention_invariant_gpu.py \
        tests/gpu/test_fork_conv_gpu.py tests/gpu/test_gated_delta_gpu.py
    timeout ${BUDGET_S:-240} python3 benchmarks/agent_steps.py --model shared/models/qwen3_5/configs/qwen3.5-0.8b.json \
        --tokenizer shared/models/qwen3_5 --data shared/data --dtype bfloat16 --device cuda \
        --engines flide+checkpoints --trajectories 25 --alone-trajectories ${ALONE:-6} --seconds 20 --agents 1 32 \
        --out "$OUT/agent_steps_0_8b.json" > "$OUT/agent_steps.log" 2>&1
    echo "agents rc=$?"; cat "$OUT/agent_steps_0_8b.md" ;;
tiles)
    # the batch-invariant GEMM's tiles per fused projection shape against cuBLAS (issue 7), 0.8B and 4B, 16,384 rows
    timeout ${BUDGET_S:-200} python3 benchmarks/ops/bench_linear.py --sweep --rows ${ROWS:-16384} \
        --out "$OUT/ops_linear_sweep.json" > "$OUT/ops_linear_sweep.log" 2>&1
    echo "tiles rc=$?"; grep " ms " "$OUT/ops_linear_sweep.log" | tr -s " " | sed "s/qwen3.5-//; s/ TFLOP\/s//" | cut -c1-110 ;;
verify)
    # A session's first call, after kernel changes: the question kernel's GPU tests (both forms, Qwen shapes), then
    # its forms and tiles (incl. 32-token chunks) at 0.8B's shapes, to pick the defaults. Run with SAVE_CACHE=1.
    timeout 150 python3 -m pytest -q -p no:logging --tb=short tests/gpu/test_gated_delta_gpu.py \
        -k "branch_kernel or unfilled" > "$OUT/gdn_tests.log" 2>&1
    echo "gdn tests rc=$? $(tail -1 "$OUT/gdn_tests.log")" | tee -a "$OUT/summary.txt"
    timeout ${VERIFY_BENCH_S:-240} python3 benchmarks/ops/bench_gated_delta.py --models 0.8B \
        --streams ${VERIFY_STREAMS:-RACE@bucket 2000+64x40 sweep1@bucket sweep8@bucket} \
        --no-ceilings --sweep --out "$OUT/ops_gated_delta.json" > "$OUT/ops_gated_delta.log" 2>&1
    echo "gated delta bench rc=$?" | tee -a "$OUT/summary.txt"; grep -o '"impl": "[^"]*".*"ms": [0-9.]*' "$OUT/ops_gated_delta.log" ;;
chunked)
    # Session 38 left (NOTES, Session 38 item 5): the GPU tests not yet run at HEAD with the chunked questions on by
    # default (the mended nested chunked test + NESTED_ROW_PROGRAMS' bits, batch-invariant mode with
    # `gated_delta_questions: chunked`, the engine against the pipeline, the graphs' 1,000 rounds without recompiles),
    # in four processes, then the replay A/B of
    # the split call's nested launch with programs taking rows in turns (questions_chunked.NESTED_ROW_PROGRAMS 16 vs
    # 0: the launch of empty rows costs QuALITY / 16 RACE 0.73 ms), ~7 min with compiles
    named_tests chunked ${TEST_S:-250} "engine tests/gpu/test_engine_gpu.py -k chunked_or_nested" \
        "split tests/gpu/test_questions_chunked_gpu.py -k nested_or_opcheck" \
        "invariant tests/gpu/test_batch_invariant_gpu.py -k chunked" \
        "graphs tests/gpu/test_graphs_gpu.py -k replay_or_rounds_or_graphs_or_oversized" \
        "solve tests/gpu/test_gated_delta_gpu.py -k own_w_u_or_own_kkt_or_chunked_or_unfilled"
    # the nested rows in turns at 128 programs (16 took QuALITY's / 16 RACE's all-empty nested launch from 0.73 to
    # 0.07 ms but cost sweep 64, whose 96 nested rows it ran 6 to a program, +1.8 ms: H100, session 40)
    AB_PREFIX=profile PROFILE_S=${PROFILE_S:-120} WORKLOADS="race multirc quality sweep8 sweep64 race@16" \
        KERNELS="_questions_chunked_kernel _branch_kernel chunk_gated_delta_rule_fwd_kkt_solve_kernel
                 _kkt_solve_kernel _w_u_kernel _state_chain_kernel" \
        ab_arms main= "rows128=--set flide.ops.gated_delta.questions_chunked.NESTED_ROW_PROGRAMS=128"
    ;;
nested)
    # where a nested fork's rows go (session 40: the bench's 64-question request is 32 sub-trunks of 24-83 tokens with
    # 2 leaves of 38-105 each, all 96 rows in the recurrent nested launch: 7.8 of its 28.8 ms replay on an H100).
    # Replay A/B: main (leaves + their sub-trunks recurrent), leaves32 (split: a sub-trunk whose leaves all have > 32
    # tokens chunked with them, NESTED_CHUNKED_LEAF_TOKENS; every nested row chunked lost on MultiRC in session 37),
    # stored32 (those leaves from their sub-trunk's stored state: a re-run doubles sweep 64's chunked work), stages1
    # (the chunked question kernel at one pipeline stage: on the device's Triton 3.6 it spills 92 bytes a thread
    # there vs 276 at two), rows128 (the nested launch's rows taken in turns by 128 programs a head: its all-empty
    # launch cost QuALITY 0.73 ms at 0, 0.07 at 16, which cost sweep 64 +1.8 ms), then the engine tests of chunked /
    # nested questions in the time left, ~8 min
    Q=flide.ops.gated_delta
    AB_PREFIX=nested WORKLOADS="multirc sweep64 quality race" \
        KERNELS="_questions_chunked_kernel _branch_kernel _kkt_solve_kernel chunk_local_cumsum_scalar_kernel" \
        ab_arms main= "leaves32=--set $Q.NESTED_CHUNKED_LEAF_TOKENS=32" \
        "stored32=--set $Q.NESTED_CHUNKED_LEAF_TOKENS=32 $Q.questions_chunked.STORED_SUB_STATES=True" \
        "stages1=--set $Q.questions_chunked.NUM_STAGES=1" \
        "rows128=--set $Q.questions_chunked.NESTED_ROW_PROGRAMS=128"
    # the engine against the pipeline with chunked / nested questions (the long-leaves cases) in the time left
    left=$(( ${BUDGET_S:-570} - ($(date +%s) - started) ))
    if [ "$left" -gt 90 ]; then
        timeout "$left" python3 -m pytest -q -rA -p no:logging --tb=short tests/gpu/test_engine_gpu.py \
            -k "chunked or nested" > "$OUT/nested_engine_tests.log" 2>&1
        echo "engine tests rc=$? $(tail -1 "$OUT/nested_engine_tests.log")"
    fi
    ;;
attn_split)
    # Session 33's opt-in value-column split of the invariant attention (triton_invariant.V_SPLIT_DIM; NOTES,
    # Session 33 item 3): its GPU bits test, the op bench (a "2 value parts" row per stream), then the replay A/B of
    # 0.8B with it on and off (and the question call's row programs, a no-code A/B), in one call (~8 min)
    timeout ${TEST_S:-120} python3 -m pytest -q -p no:logging --tb=short tests/gpu/test_fork_attention_invariant_gpu.py \
        -k value_parts > "$OUT/attn_split_test.log" 2>&1; echo "value parts test rc=$? $(tail -1 "$OUT/attn_split_test.log")"
    timeout ${OPS_S:-150} python3 benchmarks/ops/bench_fork_attention_invariant.py --out "$OUT/ops_attention_vparts.json" \
        > "$OUT/ops_attention_vparts.log" 2>&1; echo "attention bench rc=$?"; grep -E "triton-invariant" "$OUT/ops_attention_vparts.log"
    P="python3 benchmarks/profile_round.py --config-json shared/models/qwen3_5/configs/qwen3.5-0.8b.json \
        --tokenizer shared/models/qwen3_5 --data shared/data --repeats 15 --profile-runs 2 \
        --workloads quality sweep1 sweep8 race multirc race@16"
    for ab in "main" "split flide.ops.fork_attention.triton_invariant.V_SPLIT_DIM=256" \
              "rows flide.ops.gated_delta.branches.ROW_PROGRAMS=256"; do
        name=${ab%% *}; set_arg=""; [ "$name" != main ] && set_arg="--set ${ab#* }"
        timeout ${PROFILE_S:-110} $P $set_arg --out "$OUT/profile_$name.json" > "$OUT/profile_$name.log" 2>&1
        echo "profile $name rc=$?"
    done
    python3 - <<'PY'
import json, os
for name in ("main", "split", "rows"):
    try:
        r = json.load(open(os.environ["OUT"] + f"/profile_{name}.json"))
    except Exception as error:
        print(name, error); continue
    print(name, {k: r.get(k) for k in ("capture_s", "graph_memory_gib", "start_peak_reserved_gib")})
    for row in r["rows"]:
        p = row.get("profile") or {}
        print(" ", row["workload"], row["stream_tokens"], row["latency_ms"], p.get("gpu_ms_total"),
              (p.get("gpu_ms_by_family") or {}).get("attention"))
PY
    ;;
wy)
    # Session 12's CPU-only work, first on the device: the GPU tests of the questions' chunked (WY) form, the conv's
    # rounding (bitwise the reference conv) and the engine with fla_wy, in parallel; then the op bench (fork vs
    # fork:wy vs questions alone, tiles) and latency alone of 0.8B with fla_wy (compare with profile_0_8b.json)
    parallel_tests "${TEST_TIMEOUT:-300}" 60 tests/gpu/test_gated_delta_gpu.py tests/gpu/test_fork_conv_gpu.py \
        tests/gpu/test_engine_gpu.py
    timeout ${OPS_S:-150} python3 benchmarks/ops/bench_gated_delta.py --models 0.8B 9B --no-ceilings --sweep \
        --out "$OUT/ops_gated_delta_wy.json" > "$OUT/ops_gated_delta_wy.log" 2>&1
    echo "gated delta bench rc=$?"; grep -o '"impl": "[^"]*".*"stream": "[^"]*".*"ms": [0-9.]*' "$OUT/ops_gated_delta_wy.log"
    timeout ${PROFILE_S:-200} python3 benchmarks/profile_round.py --config-json shared/models/qwen3_5/configs/qwen3.5-0.8b.json \
        --tokenizer shared/models/qwen3_5 --data shared/data --config configs/h200/questions_wy.yaml --repeats 20 \
        --profile-runs 3 --cprofile-enqueue --out "$OUT/profile_0_8b_wy.json" 2>&1 | grep -v DEBUG | tr '\r' '\n' | grep -v '^\s*$' > "$OUT/profile_wy.log"
    grep -o '"workload": "[a-z0-9]*".*"prepare_ms": [0-9.]*' "$OUT/profile_wy.log" ;;
serve)
    # issue 4's figures, twice, and the serve A/B: each `flide bench` http run ~130 s (its server and its in-process
    # twin built and captured; the compile cache carried), the A/B ~150 s; the servers' request logs kept
    for run in $(seq 1 ${HTTP_RUNS:-2}); do
        rm -rf /tmp/flide_bench_http_*
        timeout ${HTTP_S:-170} python3 -m flide.bench configs/bench/h200_http_launch_ahead.yaml --out "$OUT/http_$run" \
            > "$OUT/http_$run.log" 2>&1
        echo "http run $run rc=$?"
        for log in /tmp/flide_bench_http_*/server_*.log; do [ -f "$log" ] && cp "$log" "$OUT/http_$run.server.log"; done
        grep -E "^\| race \| (1|8|32|64) \|" "$OUT/http_$run/h200_http_launch_ahead.md"
        grep -A3 "HTTP minus" "$OUT/http_$run/h200_http_launch_ahead.md" | tail -1
    done
    # AB_VARIANTS: the variants, one per line (default: launch-ahead on / off); HTTP_RUNS: how many bench runs first
    variants=()
    while IFS= read -r v; do [ -n "$v" ] && variants+=(--variant "$v"); done <<< "${AB_VARIANTS:-default=
no-launch-ahead=serve.launch_ahead=false}"
    timeout ${AB_S:-190} python3 benchmarks/serve_ab.py --model shared/models/qwen3_5/configs/qwen3.5-0.8b.json \
        --tokenizer shared/models/qwen3_5 --data shared/data --clients ${AB_CLIENTS:-8 32} --seconds 8 \
        --rounds ${AB_ROUNDS:-3} "${variants[@]}" --out "$OUT/ab" > "$OUT/ab.log" 2>&1
    echo "serve A/B rc=$?"; grep -v DEBUG "$OUT/ab.log" | tail -12 ;;
mlp)
    # `kernels.gated_mlp: triton` (the SiLU-mul in the gate/up GEMM's epilogue; session 41): its GPU tests, the op
    # bench against cuBLAS + Inductor's pointwise kernel (0.8B / 4B shapes), then the replay A/B of the 0.8B profile
    # (default vs configs/h200/gated_mlp_triton.yaml), ~7 min
    timeout ${TEST_S:-200} python3 -m pytest -q -rA -p no:logging --tb=short tests/gpu/test_gated_mlp_gpu.py \
        > "$OUT/mlp_tests.log" 2>&1
    echo "tests rc=$? $(tail -1 "$OUT/mlp_tests.log")"; grep -E "^FAILED|^E  " "$OUT/mlp_tests.log" | head -10
    timeout ${BENCH_S:-120} python3 benchmarks/ops/bench_gated_mlp.py ${SWEEP:+--sweep} --out "$OUT/ops_gated_mlp.json" \
        > "$OUT/ops_gated_mlp.log" 2>&1
    echo "op bench rc=$?"; grep -v DEBUG "$OUT/ops_gated_mlp.log" | tail -40
    WORKLOADS="race multirc quality sweep8 sweep64 race@16" KERNELS="_gated_mlp_tma_kernel" \
        ab_arms main= "triton=--config configs/h200/gated_mlp_triton.yaml"
    ;;
widen)
    # The question launches' tiles (session 44's defaults: the chunked launch's 64 columns / 8 warps / 1 stage, the
    # nested launch's 32 columns in streams of 4,608+ tokens since session 45): their GPU tests first, in parallel
    # (both tile sets against the reference; 32 nested columns on both sides of the threshold; the engine with chunked
    # / nested questions), then the replay A/B: the defaults vs the tiles before (NARROW_TILES, 16 nested columns) vs
    # the defaults with long leaves chunked from stored sub-trunk states (H100, the 64-question sweep vs every other
    # workload: session 44, sharing the plain rows' launch, 26.62 vs 27.97 ms, others 0.06-0.39 ms slower; session 45,
    # in a launch of their own since c63bdb9, 26.85 vs 28.04, others 0.10-0.33 slower). ~9 min with the compile cache (TEST_S per test file; 250 s
    # left the chunked-question file 21 tests short on a bare H100 in session 44; AB=0: the tests only)
    Q=flide.ops.gated_delta.questions_chunked
    # one process per slice (session 44: the chunked-question file in one process ran 28 of its 49 tests in 250 s,
    # most of it the CPU-side reference's token loop); TESTS=0: the A/B only
    F=tests/gpu/test_questions_chunked_gpu.py E=tests/gpu/test_engine_gpu.py
    [ "${TESTS:-1}" = 1 ] && named_tests widen ${TEST_S:-300} "match $F -k match_the_reference" \
        "fork0 $F -k nested_fork_and_[0-" "fork1 $F -k nested_fork_and_[1-" "fork2 $F -k nested_fork_and_[2-" \
        "opcheck $F -k opcheck" "engine_chunked $E -k chunked_questions_equal" "engine_nested $E -k nested_forks" \
        "nested tests/gpu/test_gated_delta_nested_gpu.py -k row_programs_or_stored"
    [ "${AB:-1}" = 0 ] && exit 0  # AB=0: the tests only (give them TEST_S up to ~540 s)
    # the tiles before read from NARROW_TILES, so the A/B measures what the tests checked
    read -r bv warps stages < <(python3 -c "from $Q import NARROW_TILES; print(*NARROW_TILES)")
    AB_PREFIX=widen PROFILE_S=${PROFILE_S:-100} WORKLOADS="race multirc multirc@3 quality sweep8 sweep64" \
        KERNELS="_questions_chunked_kernel _branch_kernel" ab_arms main= \
        "narrow=--set $Q.BLOCK_V=$bv $Q.NUM_WARPS=$warps $Q.NUM_STAGES=$stages $Q.NESTED_BLOCK_V=None" \
        "stored=--set flide.ops.gated_delta.NESTED_CHUNKED_LEAF_TOKENS=32 $Q.STORED_SUB_STATES=True"
    ;;
ab)
    # A replay A/B of the 0.8B profile (`ab_arms`), then THEN='CMDS' in the time left
    ab_arms "$@"
    [ -n "${THEN:-}" ] && bash -c "$THEN"
    ;;
sh)
    # any commands after the set-up above (wheels on PYTHONPATH, Inductor cache): `h200_session.sh sh 'CMD; CMD'`
    bash -c "$*" ;;
fidelity)
    # A model's fidelity grid in parts (--engines / --workloads in ARGS), each within one call. The reference answers
    # and `final_norm_scale: auto`'s pick go to shared/fidelity/NAME.reference.json and come back in $OUT: copy that
    # file into shared/fidelity/ here before the next part, which then reuses both (same scale in every part).
    name=${1:?usage: h200_session.sh fidelity NAME [flide.bench args]}; shift
    mkdir -p shared/fidelity
    timeout ${BUDGET_S:-540} python3 -m flide.bench "configs/bench/$name.yaml" "$@" --reference-dir shared/fidelity \
        --out "$OUT" > "$OUT/bench.log" 2>&1
    echo "fidelity rc=$?"; cp shared/fidelity/"$name".reference.json "$OUT/" 2>/dev/null
    grep -v DEBUG "$OUT/bench.log" | grep -E "final_norm_scale|Agr|reference" | cut -c1-200 ;;
bench)
    timeout ${BUDGET_S:-540} python3 -m flide.bench "$@" --out "$OUT" > "$OUT/bench.log" 2>&1
    echo "bench rc=$?"; tail -20 "$OUT/bench.log" ;;
*) echo "unknown part $part"; exit 2 ;;
esac
