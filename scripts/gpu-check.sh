#!/usr/bin/env bash
# The whole GPU check of weft, in one go, for a machine with an NVIDIA GPU.
#
#   bash scripts/gpu-check.sh               # on the GPU machine
#   bash scripts/gpu-check.sh --build-only  # on a CPU machine: build the
#                                           # binaries into target/gpu-check/
#                                           # to carry to a GPU machine that
#                                           # has no cargo or no crates
#
# What it runs (each step under its own time limit; the whole check stays
# under 8 minutes on an H200 with 16 cores):
#   1. what is on the machine: the GPU and driver (nvidia-smi), and where
#      libcuda, libnvrtc.so.13 and libcublas.so.13 are (the script puts
#      their folders on LD_LIBRARY_PATH; it installs nothing);
#   2. kernels: every CUDA kernel against its CPU reference
#      (kernels/tests/cuda.rs with WEFT_REQUIRE_GPU=1: a missing GPU or
#      library fails instead of skipping), NVRTC compiling every source;
#   3. model: the dense GPT trained on the GPU (weft_model::cuda::CudaGpt)
#      against the CPU model: every gradient after the first step and the
#      losses of six steps, in f32 and bf16; the trainer's step (two
#      micro-batches accumulated, clipping), evaluation of short batches
#      and the AdamW state (model/tests/cuda.rs);
#   4. train: `weft train --device cuda` against `--device cpu`, 20 steps
#      of the default job (f32): every step's training loss and both
#      evaluations side by side with the largest relative |Δ| (at most
#      1e-3: the model check's f32 bound of 1e-4 over six steps, with
#      room for twenty and the clipping); then each run's checkpoint of
#      step 10 continued to step 20 on the other device, against that
#      device's own run (the same bound); the GPU run's tokens/s and MFU;
#      a fault drill (`--inject nan:step=3 --inject slow:...`): step 3
#      skipped and reported, training going on;
#   5. nccl: the NCCL backend's check (collectives/gpu-check.sh: every
#      collective through NCCL on GPU 0, world size 1);
#   6. bench: the kernels at GPT-2 small's shapes (time, GB/s, TFLOP/s) and
#      the projected training step's tokens/s and MFU
#      (kernels/benches/cuda.rs);
# then a summary: one line per step, PASS / FAIL / MISSING, with the
# tests' counts. Logs go to $OUT/gpu-check/ when OUT is set (the device
# tool's output folder), else to a temporary folder that is printed.
#
# The binaries always come from this checkout's sources: taken prebuilt
# from target/gpu-check/ when the fingerprint of the sources they were
# built from (target/gpu-check/kernels.source, written by --build-only)
# equals this checkout's, else built here with cargo (release, only the
# packages needed; offline when the registry cannot be reached) — a stale
# binary is never run.
#
# Exit status: 0 when every step ran and passed; 1 when a step failed; 2
# when something needed is missing (each missing piece is reported).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
BIN_DIR=target/gpu-check
TESTS="$BIN_DIR/kernels-cuda-tests"
MODEL="$BIN_DIR/model-cuda-tests"
BENCH="$BIN_DIR/kernels-cuda-bench"
WEFT="$BIN_DIR/weft"
STAMP="$BIN_DIR/kernels.source"
say() { echo "gpu-check: $*"; }
start=$SECONDS

# Step 4, on its own: `bash scripts/gpu-check.sh --train-check WEFT DIR`
# trains the default job for 20 steps with the `weft` binary WEFT on the
# CPU and on GPU 0 into DIR, and compares them (exit 1 when they differ).
if [ "${1:-}" = "--train-check" ]; then
    weft=$2 dir=$3 tol=1e-3 rc=0
    rm -rf "$dir" && mkdir -p "$dir" || exit 2
    # "kind step loss" of every training step and evaluation
    losses() {
        awk '{
            if (!match($0, /"step":[0-9]+/)) next
            step = substr($0, RSTART + 7, RLENGTH - 7)
            if ($0 ~ /"event":"eval"/) {
                if (match($0, /"val_loss":[^,}]+/)) print "eval", step, substr($0, RSTART + 11, RLENGTH - 11)
            } else if ($0 !~ /"event"/ && match($0, /"loss":[^,}]+/)) {
                print "train", step, substr($0, RSTART + 7, RLENGTH - 7)
            }
        }' "$1/metrics.jsonl"
    }
    # compare WHAT BASE OTHER FIRST_STEP: the losses of OTHER against BASE
    # from step FIRST_STEP on, side by side, and the largest relative |Δ|
    compare() {
        echo "--- $1 (steps from $4; tolerance $tol relative)"
        losses "$2" > "$dir/base.txt" && losses "$3" > "$dir/other.txt"
        awk -v tol="$tol" -v from="$4" -v what="$1" '
            NR == FNR { base[$1 " " $2] = $3; next }
            $2 + 0 < from + 0 { next }
            {
                key = $1 " " $2
                if (!(key in base)) { printf "  %-5s %4d: missing in the base run\n", $1, $2; bad = 1; next }
                b = base[key] + 0; o = $3 + 0; d = o - b; if (d < 0) d = -d
                r = (b != 0) ? d / (b < 0 ? -b : b) : d
                if (r > worst || r != r) worst = r
                if (r != r || r > tol) bad = 1
                printf "  %-5s %4d: base %.6f other %.6f |d| %.2e rel %.2e\n", $1, $2, b, o, d, r
                n++
            }
            END {
                if (n == 0) { print "  no steps to compare"; bad = 1 }
                printf "%s: max |d| relative %.2e over %d losses (tolerance %s): %s\n", what, worst, n, tol, bad ? "FAIL" : "ok"
                exit bad
            }' "$dir/base.txt" "$dir/other.txt"
    }
    common=(--set "run.dir=\"$dir\"" --set train.steps=20 --set checkpoint.every=10)
    for dev in cpu cuda; do
        echo "--- weft train --device $dev ${common[*]} --set run.name=$dev"
        "$weft" train --device "$dev" --set "run.name=$dev" "${common[@]}" 2>&1 | tee "$dir/$dev.out" \
            || { echo "weft train --device $dev failed"; exit 1; }
    done
    grep -E '^(matmul peak|throughput)' "$dir/cuda.out" | sed 's/^/GPU run: /'
    compare "GPU vs CPU" "$dir/cpu" "$dir/cuda" 0 || rc=1
    # each device's checkpoint of step 10 continued to 20 on the other
    for pair in "cuda cpu" "cpu cuda"; do
        read -r from to <<< "$pair"
        run="$dir/$from-then-$to"
        mkdir -p "$run/checkpoints" && cp "$dir/$from/config.toml" "$dir/$from/metrics.jsonl" "$run/" \
            && cp -r "$dir/$from/checkpoints/step-00000010" "$run/checkpoints/" || { rc=1; continue; }
        echo "--- weft train --resume $run --device $to"
        "$weft" train --resume "$run" --device "$to" || { echo "resuming on $to failed"; rc=1; continue; }
        compare "$from checkpoint continued on $to vs $to" "$dir/$to" "$run" 11 || rc=1
    done
    # fault drills on the GPU loop: a non-finite step 3 (skipped and
    # reported, the parameter put back, training goes on) and a slow rank
    echo "--- weft train --device cuda --inject nan:step=3 --inject slow:step=5,factor=2"
    if "$weft" train --device cuda --set "run.name=drill" "${common[@]}" --set train.steps=8 \
        --inject nan:step=3 --inject slow:step=5,factor=2 > "$dir/drill.out" 2>&1; then
        if grep -q '"skip"' "$dir/drill/metrics.jsonl" && grep -q '"fault"' "$dir/drill/events.jsonl" \
            && grep -q '"step":8,"loss":[0-9]' "$dir/drill/metrics.jsonl"; then
            echo "fault drill: step 3 skipped and reported, training went on: ok"
        else
            echo "fault drill: no skip event, no fault event or a non-finite loss after it: FAIL"
            tail -n 5 "$dir/drill.out"; rc=1
        fi
    else
        echo "fault drill: the run failed: FAIL"; tail -n 20 "$dir/drill.out"; rc=1
    fi
    exit $rc
fi

# A fingerprint of every source file the binaries are built from.
fingerprint() {
    find kernels/src kernels/cuda kernels/tests/cuda.rs kernels/benches/cuda.rs model/tests/cuda.rs \
        numerics collectives/src kernels/Cargo.toml parallel moe/src pipeline/src fsdp/src model/src \
        trace/src trainer/src checkpoint/src data/src plan/src supervise/src compare/src viz/src viz/page \
        */Cargo.toml Cargo.toml Cargo.lock -type f -not -path '*/target/*' 2>/dev/null \
        | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
}

# Builds the kernels' and the model's GPU test binaries, the bench and
# `weft` with CUDA (release) and copies them to $BIN_DIR, stripped of
# debug info (they travel).
build() {
    local out out2 out3 out4 tests model bench weft offline
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
    for offline in "" "--offline"; do
        out=$(cargo test --release -p weft-kernels --features cuda --test cuda --no-run $offline 2>&1)
        tests=$(printf '%s\n' "$out" | sed -n 's/.*Executable tests\/cuda.rs (\(.*\))$/\1/p' | tail -n 1)
        out3=$(cargo test --release -p weft-model --features cuda --test cuda --no-run $offline 2>&1)
        model=$(printf '%s\n' "$out3" | sed -n 's/.*Executable tests\/cuda.rs (\(.*\))$/\1/p' | tail -n 1)
        out2=$(cargo bench -p weft-kernels --features cuda --bench cuda --no-run $offline 2>&1)
        bench=$(printf '%s\n' "$out2" | sed -n 's/.*Executable benches\/cuda.rs (\(.*\))$/\1/p' | tail -n 1)
        out4=$(cargo build --release -p weft-trainer --features cuda --bin weft $offline 2>&1)
        weft="$CARGO_TARGET_DIR/release/weft"
        if [ -n "$tests" ] && [ -x "$tests" ] && [ -n "$model" ] && [ -x "$model" ] \
            && [ -n "$bench" ] && [ -x "$bench" ] && [ -x "$weft" ]; then
            mkdir -p "$BIN_DIR" && cp "$tests" "$TESTS" && cp "$model" "$MODEL" && cp "$bench" "$BENCH" \
                && cp "$weft" "$WEFT" \
                && { strip --strip-debug "$TESTS" "$MODEL" "$BENCH" "$WEFT" 2>/dev/null || true; } \
                && fingerprint > "$STAMP" \
                && say "built $TESTS, $MODEL, $BENCH and $WEFT from sources $(cat "$STAMP")" && return 0
        fi
    done
    printf '%s\n%s\n%s\n%s\n' "$out" "${out3:-}" "${out2:-}" "${out4:-}" | tail -n 30
    say "MISSING: could not build the GPU binaries (cargo and the crates of Cargo.lock are needed; or build them elsewhere with --build-only and bring target/gpu-check/)"
    return 2
}

if [ "${1:-}" = "--build-only" ]; then
    build || exit $?
    # The NCCL check's binary too, for the same trip.
    bash collectives/gpu-check.sh --build-only
    exit $?
fi

log_dir="${OUT:+$OUT/gpu-check}"
log_dir="${log_dir:-$(mktemp -d)}"
mkdir -p "$log_dir"
say "logs in $log_dir"
missing=0

# ------------------------------------------------------- 1. the machine
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>&1 | sed 's/^/gpu-check: /'
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null \
        | sed 's/^/gpu-check: name, driver, memory, max SM clock: /'
else
    say "nvidia-smi not found (looking for the driver library anyway)"
fi
nproc_n=$(nproc 2>/dev/null || echo '?')
say "CPU cores: $nproc_n"

# Every folder that may hold CUDA libraries: the loader's cache, CUDA
# installs, and the nvidia-* wheels of any Python (PyTorch brings them).
lib_dirs() {
    ldconfig -p 2>/dev/null | awk '/=>/ {print $NF}' | xargs -r -n1 dirname 2>/dev/null | sort -u
    ls -d /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/local/nvidia/lib64 \
        /usr/lib/x86_64-linux-gnu /opt/conda/lib 2>/dev/null
    for py in python3 python /opt/torch/.venv/bin/python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        "$py" - 2>/dev/null <<'EOF'
import glob, os, site, sys
dirs = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
for d in dirs:
    for f in glob.glob(os.path.join(d, "nvidia", "*", "lib")):
        print(f)
EOF
    done
}
find_lib() { # name pattern -> first path
    local pat=$1 d f
    for d in $(lib_dirs | awk '!seen[$0]++'); do
        for f in "$d"/$pat; do
            [ -e "$f" ] && { echo "$f"; return 0; }
        done
    done
    timeout 60 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$pat" -print 2>/dev/null | head -n 1
}
add_path() { case ":${LD_LIBRARY_PATH:-}:" in *":$1:"*) ;; *) export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}";; esac; }
for want in "libcuda.so.1:the NVIDIA driver library" "libnvrtc.so.13:NVRTC 13 (the runtime compiler; CUDA 13 toolkit or the nvidia-cuda-nvrtc wheel)" \
            "libcublas.so.13:cuBLAS 13 (CUDA 13 toolkit or the nvidia-cublas wheel)" "libcublasLt.so.13:cuBLASLt 13 (beside cuBLAS)"; do
    name=${want%%:*}
    what=${want#*:}
    path=$(find_lib "$name")
    if [ -n "$path" ]; then
        say "$name: $path"
        add_path "$(dirname "$path")"
    else
        say "MISSING: $name — $what"
        missing=1
    fi
done
# NVRTC's builtins library sits beside it; report its version.
nvrtc_builtins=$(ls "$(dirname "$(find_lib libnvrtc.so.13)")"/libnvrtc-builtins.so.13.* 2>/dev/null | head -n 1)
[ -n "$nvrtc_builtins" ] && say "NVRTC builtins: $nvrtc_builtins"

# ---------------------------------------------------- the binaries
# Prebuilt ones built from exactly these sources are used as they are
# (no build on the GPU machine's time); otherwise cargo builds them here.
want=$(fingerprint)
have=$(cat "$STAMP" 2>/dev/null || echo none)
if [ -x "$TESTS" ] && [ -x "$MODEL" ] && [ -x "$BENCH" ] && [ -x "$WEFT" ] && [ "$have" = "$want" ]; then
    say "using the prebuilt $TESTS, $MODEL, $BENCH and $WEFT (built from these sources, $want)"
elif command -v cargo >/dev/null 2>&1; then
    [ "$have" != none ] && say "the prebuilt binaries in $BIN_DIR were built from other sources ($have; this checkout is $want): rebuilding"
    say "building with cargo ($(cargo --version))"
    t0=$SECONDS
    build || missing=1
    say "build took $((SECONDS - t0)) s"
elif [ "$have" != none ]; then
    say "MISSING: the prebuilt binaries in $BIN_DIR were built from other sources ($have; this checkout is $want) and there is no cargo: rebuild them with --build-only"
    missing=1
else
    say "MISSING: no cargo and no prebuilt binaries in $BIN_DIR (run scripts/gpu-check.sh --build-only on a machine with cargo and carry target/gpu-check)"
    missing=1
fi

if [ "$missing" != 0 ]; then
    say "not run: see MISSING above"
    exit 2
fi

# ------------------------------------------------------------ the steps
declare -a summary=()
failed=0
run_step() { # name limit-seconds command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS rc
    say "=== $name: $*"
    timeout "$limit" "$@" > "$log_dir/$name.log" 2>&1
    rc=$?
    cat "$log_dir/$name.log"
    local counts
    counts=$(sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed.*/\1 passed, \2 failed/p' "$log_dir/$name.log" | tail -n 1)
    local verdict=PASS
    if [ "$rc" = 124 ]; then
        verdict="FAIL (over its ${limit} s limit)"
        failed=1
    elif [ "$rc" != 0 ]; then
        verdict="FAIL (exit $rc)"
        failed=1
    fi
    summary+=("$(printf '%-8s %-28s %4d s  %s' "$name" "$verdict" $((SECONDS - t0)) "$counts")")
}

# 2. Every kernel against the CPU; a skip is a failure here.
run_step kernels 150 env WEFT_REQUIRE_GPU=1 WEFT_REQUIRE_ALL=1 "$TESTS" --test-threads=1
# 3. The dense GPT trained on the GPU against the CPU model: every
# gradient after one step, the losses of six steps (f32, bf16, and bf16
# with the batch-invariant products).
run_step model 120 env WEFT_REQUIRE_GPU=1 "$MODEL" --test-threads=1
# 4. weft train on the GPU against the CPU, and checkpoints across them.
run_step train 240 bash scripts/gpu-check.sh --train-check "$WEFT" "$log_dir/train-runs"
# 5. NCCL (its own script finds NCCL and runs its check).
run_step nccl 90 bash collectives/gpu-check.sh
# 6. The bench.
run_step bench 120 env WEFT_BENCH_REPS="${WEFT_BENCH_REPS:-10}" "$BENCH"

# ------------------------------------------------------------ summary
echo
say "summary ($((SECONDS - start)) s in all):"
for line in "${summary[@]}"; do echo "  $line"; done
for step in kernels model; do
    grep -E "^(test .* FAILED|.*panicked at)" "$log_dir/$step.log" 2>/dev/null | head -n 20 | sed "s/^/  $step: /"
done
grep -E "step [0-9]+: loss" "$log_dir/model.log" 2>/dev/null | tail -n 3 | sed 's/^/  model: /'
grep -E "max \|d\| relative|^GPU run: " "$log_dir/train.log" 2>/dev/null | sed 's/^/  train: /'
grep -E "^projected|invariant kernel vs cuBLAS" "$log_dir/bench.log" 2>/dev/null | sed 's/^/  bench: /'
if [ "$failed" = 0 ]; then
    say "PASS"
    exit 0
fi
say "FAIL (logs in $log_dir)"
exit 1
