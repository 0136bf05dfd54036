#!/usr/bin/env bash
# The GPU check (issue 18; docs/gpu.md): build the patched llama.cpp from the kit and measure parity, decoding speed
# and memory on it, within one time budget. What runs is the STEPS list at the bottom, in order.
#
#   on the device (CUDA, sm_90, 16 jobs, 540 s):  bash bench/device/run.sh out/device-kit
#   here, as a test of the scripts (CPU):         bash bench/device/run.sh out/device-kit --backend cpu --reuse-build
#
# options: --backend cuda|cpu (cuda)  --cuda-arch A (90)  --jobs N (all cores)  --budget SECONDS (540; cpu: 1500;
#          0: no budget and no caps, every planned step runs to its end: a test of the scripts on a slow or busy
#          machine, whose work the profile fixes, must not fail on a clock)
#          --reuse-build: use the cached `make llama` build of the backend instead of compiling the kit's sources
#          --work DIR (/tmp/clover-device-BACKEND)  --out DIR ($OUT, else out/device-run-BACKEND)
#          --steps a,b,c: only these measuring steps (a second try on a warm machine: the build and the slice are
#          reused, so unpack, env, build and slice_make take seconds; slice_make runs only for the slice steps)
# env: PYTHON (python3): an interpreter with torch, numpy, safetensors, typer, tqdm, transformers, jinja2, pytest.
#
# The kit (bench/device/pack.sh) brings the llama.cpp sources with our patches, the binding, the wheels the image
# lacks and the project itself: every step runs the kit's copy of the project. A step starts only when its expected
# time still fits in the budget (else it is recorded as skipped, with the reason), and is stopped at its cap.
# $OUT/results.json and $OUT/results.md are rewritten after every step, so a run cut short keeps what it measured;
# $OUT/run.log holds the whole output, $OUT/build.log the build's.
set -euo pipefail

KIT=${1:?usage: run.sh KIT [--backend cuda|cpu] [--reuse-build] [--budget S] [--jobs N] [--cuda-arch A]}
shift
BACKEND=cuda CUDA_ARCH=90 JOBS=$(nproc) BUDGET= REUSE=0 WORK= OUTDIR=${OUT:-} ONLY=
while (($#)); do
    case $1 in
        --backend) BACKEND=$2; shift ;;
        --cuda-arch) CUDA_ARCH=$2; shift ;;
        --jobs) JOBS=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        --reuse-build) REUSE=1 ;;
        --steps) ONLY=$2; shift ;;
        --work) WORK=$2; shift ;;
        --out) OUTDIR=$2; shift ;;
        *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[[ $BACKEND == cuda || $BACKEND == cpu ]] || { echo "run.sh: --backend cuda or cpu" >&2; exit 2; }
if [[ -z $BUDGET ]]; then
    if [[ $BACKEND == cuda ]]; then BUDGET=540; else BUDGET=1500; fi  # the H200 run: 9 minutes, build included
fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
KIT=$(cd "$KIT" && pwd)
[[ -f $KIT/kit.json ]] || { echo "run.sh: $KIT has no kit.json: make a kit with bench/device/pack.sh" >&2; exit 2; }
PY=${PYTHON:-python3}
export WORK=${WORK:-${TMPDIR:-/tmp}/clover-device-$BACKEND}
export OUT=${OUTDIR:-$REPO/out/device-run-$BACKEND}
BUILD_DIR=$REPO/out/device-build-$BACKEND  # kept between calls on a warm device (not carried, so not replaced)
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/kit" "$WORK/sections" "$WORK/logs" "$WORK/steps.jsonl" "$WORK/parity"
# the models made from this kit (bundled GGUF, slice) are kept for a second try with the same kit; another kit's go
KIT_KEY=$(sha256sum "$KIT/project.tar.xz" | cut -c1-16)
export MODELS=$WORK/models/$KIT_KEY
find "$WORK/models" -mindepth 1 -maxdepth 1 ! -name "$KIT_KEY" -exec rm -rf {} + 2>/dev/null || true
rm -f "$OUT/results.json" "$OUT/results.md" "$OUT/run.log" "$OUT/build.log"
mkdir -p "$WORK/logs"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$(date +%s)
PROJ=$WORK/kit/project
export PYTHONPATH=$WORK/kit/site:$WORK/kit/binding:$PROJ
export PYTHONUNBUFFERED=1
STEPS_PY=$PROJ/bench/device/steps.py
PLANNED="" SETUP_STEPS=""

elapsed() { echo $(($(date +%s) - T0)); }

report() {
    "$PY" "$STEPS_PY" report --backend "$BACKEND" --budget "$BUDGET" --elapsed "$(elapsed)" --planned "$PLANNED" \
        || echo "run.sh: could not write results (see above)"
}

# step NAME EXPECTED_S CAP_S COMMAND...: run COMMAND when EXPECTED_S still fits the budget, stop it at CAP_S (or at
# the end of the budget), record how it ended (ok / failed / timed out / skipped, with the reason) and rewrite the
# results. A failing step never stops the run.
not_run() {  # not_run NAME REASON: a planned step this profile does not make, recorded as skipped
    [[ ,$PLANNED, == *,$1,* ]] || return 0
    echo "== $1: skipped, $2"
    "$PY" "$STEPS_PY" record "$1" skipped 0 0 0 "$2"
    report
}

step() {
    local name=$1 expected=$(($2 * SCALE)) cap=$(($3 * SCALE)) rc=0 status reason t
    shift 3
    if [[ ,$PLANNED, != *,$name,* && ,$SETUP_STEPS, != *,$name,* ]]; then
        return 0  # not among --steps
    fi
    local left=$((BUDGET - $(elapsed)))
    if ((BUDGET == 0)); then
        left=$((expected + cap + 1))  # no budget: every step starts, none is stopped
    fi
    if ((expected > left)); then
        echo "== $name: skipped, expected ${expected} s, ${left} s of the ${BUDGET} s budget left"
        "$PY" "$STEPS_PY" record "$name" skipped 0 "$expected" "$cap" "expected ${expected} s, only ${left} s left"
        report
        return 0
    fi
    ((cap > left)) && cap=$left
    if ((BUDGET == 0)); then
        echo "== $name (expected ${expected} s, no cap; $(elapsed) s used)"
    else
        echo "== $name (expected ${expected} s, stopped at ${cap} s; $(elapsed) s of ${BUDGET} s used)"
    fi
    t=$(date +%s)
    if declare -F "$1" >/dev/null || ((BUDGET == 0)); then  # a function of this script (unpack): bounded by itself
        ("$@") 2>&1 | tee "$WORK/logs/$name.log" || rc=${PIPESTATUS[0]}
    else
        timeout --kill-after=15 "$cap" "$@" 2>&1 | tee "$WORK/logs/$name.log" || rc=${PIPESTATUS[0]}
    fi
    t=$(($(date +%s) - t))
    reason=$(grep -v '^\s*$' "$WORK/logs/$name.log" | tail -n 1 | cut -c1-300 || true)
    case $rc in
        0) status=ok reason="" ;;
        3) status=skipped ;;
        124 | 137) status=timed-out reason="stopped at its cap of ${cap} s; last line: $reason" ;;
        *) status=failed reason="exit $rc: $reason" ;;
    esac
    echo "== $name: $status in ${t} s${reason:+ ($reason)}"
    "$PY" "$STEPS_PY" record "$name" "$status" "$t" "$expected" "$cap" "$reason"
    report
}

# unpack: the kit's project, binding, llama.cpp sources (read by the build step) and wheels, into $WORK/kit
unpack() {
    mkdir -p "$WORK/kit/binding" "$WORK/kit/site"
    local untar='import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")'
    "$PY" -c "$untar" "$KIT/project.tar.xz" "$WORK/kit"  # Python's tarfile: no xz binary needed
    "$PY" -c "$untar" "$KIT/binding.tar.xz" "$WORK/kit/binding"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$WORK/kit/site" \
        "$KIT"/wheels/*.whl
    cmp -s "$HERE/run.sh" "$PROJ/bench/device/run.sh" || echo "warning: this run.sh differs from the kit's: repack"
}

# ---------------------------------------------------------------------------------------------------------------------
# The profile: what each step works on. On CUDA the 35B's real layer shape and every reference comparison; on the CPU
# (a test of these scripts on a 2-core machine: CI runs the comparisons themselves) a few of each on smaller inputs.
NOT_PARITY="not tokenizes and not patches_apply and not llama_cli and not llama_server"  # tools, tokenizer, sdist
if [[ $BACKEND == cuda ]]; then
    SCALE=1                                        # expected times and caps as written in STEPS
    GPU_LAYERS=-1                                  # every layer on the GPU
    SLICE=(--num-experts 256 --vocab-size 248320)  # make_tiny --preset slice35b at full width: 8.6 GB BF16
    DECODE_PROMPTS=8 SLICE_PROMPTS=3 MAX_NEW=64 MEM_CTX=32768 HOST_HISTORY=100 BLOCK_PASSES=16
    SLICE_DECODE=()                                # the model's threshold: random weights, ~1 token per block pass
    THREADS=()                                     # the runtime's default (up to 8)
    PARITY_K=$NOT_PARITY
    RUNTIME_K="rejection or exact_equals_ar or matches_the_reference or graph_selection or graph_choice or sampling"
    REAL_SHAPE_K="parity"
else
    SCALE=3                                        # 2 shared cores: three times the H200's times
    GPU_LAYERS=0
    SLICE=(--num-experts 8 --vocab-size 4096)      # the slice's layers with 8 experts, a 4k vocabulary: 0.5 GB
    DECODE_PROMPTS=2 SLICE_PROMPTS=1 MAX_NEW=8 MEM_CTX=4096 HOST_HISTORY=32 BLOCK_PASSES=4
    SLICE_DECODE=(--threshold 0)                   # a whole block per pass: few passes on a slow machine
    THREADS=(--threads 1)                          # a test of the scripts: one thread, the same work everywhere
    PARITY_K="test_causal_parity or block_parity_and_prefix_untouched"
    RUNTIME_K="rejection"
    REAL_SHAPE_K=""                                # tests/test_slice35b.py takes minutes here: CI runs it
fi

SETUP_STEPS=unpack,env,build  # always made (the build is reused when it is already there)
ALL_STEPS=$SETUP_STEPS,slice_make,parity_exact,decode_bundled,slice_quantize,decode_slice,host_slice,block_checks,memory
ALL_STEPS+=,parity_defaults
ALL_STEPS+=,decode_slice_cpu_moe,parity_runtime,parity_real_shape,llama_archs
PLANNED=${ONLY:+$SETUP_STEPS,$ONLY}
if [[ ,$PLANNED, =~ ,(slice_quantize|decode_slice|host_slice|block_checks|decode_slice_cpu_moe|memory), ]]; then
    PLANNED+=,slice_make  # the slice steps need it (it reuses what a previous run made)
fi
PLANNED=${PLANNED:-$ALL_STEPS}
for s in ${ONLY//,/ }; do [[ ,$ALL_STEPS, == *,$s,* ]] || { echo "run.sh: unknown step $s" >&2; exit 2; }; done
echo "GPU check: backend $BACKEND, budget ${BUDGET} s, kit $KIT, work $WORK, results in $OUT; steps $PLANNED"

# ---------------------------------------------------------------------------------------------------------------------
# STEPS, in order: step NAME EXPECTED_S CAP_S COMMAND. EXPECTED_S is the time expected on the H200 (16 cores); a step
# starts only if it still fits the budget, and is stopped at CAP_S. The order is the order of importance after the
# build: parity in the exact settings, then decoding and memory, then the further checks.
step unpack 10 60 unpack
step env 10 30 "$PY" "$STEPS_PY" env --kit "$KIT" --backend "$BACKEND"
# the slice's checkpoint and BF16 GGUF (numpy and our converter, no llama.cpp), in the background while the build runs:
# about 100 s alone on one core (make_tiny streams 8.6 GB of random BF16 weights; convert copies them).
(step slice_make 150 300 "$PY" "$STEPS_PY" slice slice_make "${SLICE[@]}") > "$WORK/logs/slice_make.bg" 2>&1 &
SLICE_PID=$!  # (step returns at once when slice_make is not planned)
# the build: libllama and libggml (CUDA for sm_90 only), llama-fit-params, test-llama-archs, with clover-gguf's own
# cmake options (clover_gguf.build.cmake_options) and ccache off. 3-5 min. Reused on a rerun with the same kit.
BUILD_OPTS=(--kit "$KIT" --build-dir "$BUILD_DIR" --backend "$BACKEND" --jobs "$JOBS")
[[ $BACKEND == cuda ]] && BUILD_OPTS+=(--cuda-arch "$CUDA_ARCH")
((REUSE)) && BUILD_OPTS+=(--reuse-build)
step build 270 390 "$PY" "$STEPS_PY" build "${BUILD_OPTS[@]}"
[[ -f $BUILD_DIR/build.log ]] && cp "$BUILD_DIR/build.log" "$OUT/build.log"
LIB=$(tail -n 1 "$WORK/logs/build.log" 2>/dev/null || true)
if [[ -f $LIB/libllama.so ]]; then
    export LLAMA_CPP_LIB_PATH=$LIB
else
    echo "no library was built: the steps that need it will fail"
fi
# 1. parity, exact settings (flash attention off, F32 K/V), every layer offloaded, against the float64 reference
#    (tests/test_llama_parity.py): causal (prompt, then token by token), blocks of 1/5/32 (and with rs snapshots) with
#    the causal continuation after them, masked blocks with the coreset on and off, coreset top_p overrides, two
#    blocks in one call, a causal commit and a block in one call, long prompts over several ubatches, a saved model,
#    no compute allocation by block passes, a plain Qwen3.5-MoE against transformers. 45 s.
step parity_exact 45 150 "$PY" "$STEPS_PY" parity parity_exact --settings exact --gpu-layers "$GPU_LAYERS" -- \
    tests/test_llama_parity.py -k "$PARITY_K"
# 2. decoding on the bundled trained model (F32 GGUF): ar, diffusion, draft-self interleaved per prompt; tok/s,
#    passes/token, ms per AR step / block pass / commit or verification pass / rollback. 25 s.
step decode_bundled 25 90 "$PY" "$STEPS_PY" decode decode_bundled --bundled --prompts "$DECODE_PROMPTS" \
    --max-new-tokens 96 --gpu-layers "$GPU_LAYERS" "${THREADS[@]}"
# 3. the slice (waited for), quantized to Q4_K_M by llama.cpp with every core. 30 s.
wait "$SLICE_PID" || true
cat "$WORK/logs/slice_make.bg" 2>/dev/null || true
step slice_quantize 30 120 "$PY" "$STEPS_PY" slice slice_quantize "${SLICE[@]}" --quantize Q4_K_M
# 4. decoding on the Q4_K_M slice, every layer on the GPU: the same figures, and tok/s projected from the bundled
#    model's pass mix (random weights resolve little per block pass). 40 s.
step decode_slice 40 100 "$PY" "$STEPS_PY" decode decode_slice --gguf-from slice_quantize --prompts "$SLICE_PROMPTS" \
    --max-new-tokens "$MAX_NEW" --gpu-layers "$GPU_LAYERS" --project-from decode_bundled "${SLICE_DECODE[@]}" \
    "${THREADS[@]}"
# 4b. the host's share at the 35B's vocabulary: ms per AR step and per 32-token block pass spent outside llama_decode,
#     selection in numpy (before patches/0004) and in the graph, interleaved (bench/host.py). 20 s.
step host_slice 20 90 "$PY" "$STEPS_PY" host host_slice --gguf-from slice_quantize --history "$HOST_HISTORY" \
    --gpu-layers "$GPU_LAYERS" "${THREADS[@]}"
# 4c. the patch's GPU questions on the slice: graph reuse when block and causal passes alternate (llama.cpp's reuse
#     count, ms per pass), and the coreset's experts on the device against the CPU's for the same blocks. 25 s.
step block_checks 25 90 "$PY" "$STEPS_PY" block-checks block_checks --gguf-from slice_quantize --passes "$BLOCK_PASSES" \
    --gpu-layers "$GPU_LAYERS" "${THREADS[@]}"
# 5. memory of the slice at one context size: llama-fit-params (its estimate and its fitted arguments) and
#    clover-gguf fit's prediction, against llama.cpp's own breakdown after decoding, and nvidia-smi. 30 s.
step memory 30 90 "$PY" "$STEPS_PY" memory memory --gguf-from slice_quantize --ctx "$MEM_CTX" \
    --gpu-layers "$GPU_LAYERS" "${THREADS[@]}"
# 6. parity in llama.cpp's default settings (flash attention on, F16 K/V): the errors stated, not held to 1e-4. 30 s.
step parity_defaults 30 90 "$PY" "$STEPS_PY" parity parity_defaults --settings defaults --gpu-layers "$GPU_LAYERS" \
    -- tests/test_llama_parity.py -k "$PARITY_K"
# 7. decoding on the slice, every layer's routed experts in host memory (--n-cpu-moe 4): expert offload's cost. 30 s.
step decode_slice_cpu_moe 30 100 "$PY" "$STEPS_PY" decode decode_slice_cpu_moe --gguf-from slice_quantize \
    --prompts "$SLICE_PROMPTS" --max-new-tokens "$MAX_NEW" --gpu-layers "$GPU_LAYERS" --n-cpu-moe 4 \
    --project-from decode_bundled "${SLICE_DECODE[@]}" "${THREADS[@]}"
# 8. the runtime on this build: rollback leaves no trace (redecode, snapshot), draft-self (exact) = ar, the
#    bundled model's diffusion decode = the reference's, token for token and pass for pass, and the selection in the
#    graph = the selection in numpy (every mode, the controls on) with sampling's distribution kept. 45 s.
step parity_runtime 45 120 "$PY" "$STEPS_PY" parity parity_runtime --settings exact --gpu-layers "$GPU_LAYERS" -- \
    tests/test_runtime.py tests/test_runtime_tiny.py tests/test_runtime_select.py -k "$RUNTIME_K"
# 9. the 35B's per-layer dimensions (16 experts, 1k vocabulary) against the reference, routing included. 45 s.
if [[ -n $REAL_SHAPE_K ]]; then
    step parity_real_shape 45 120 "$PY" "$STEPS_PY" parity parity_real_shape --settings exact \
        --gpu-layers "$GPU_LAYERS" -- tests/test_slice35b.py -k "$REAL_SHAPE_K"
else
    not_run parity_real_shape "the CPU profile leaves tests/test_slice35b.py to CI (minutes on 2 cores)"
fi
# 10. llama.cpp's own test of the clover architecture on every device it finds (CPU and CUDA0). 15 s.
step llama_archs 15 60 "$PY" "$STEPS_PY" llama-archs

echo "GPU check done in $(elapsed) s: $OUT/results.md"
