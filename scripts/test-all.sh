#!/usr/bin/env bash
# Runs every check of the weft workspace, after installing what they need.
#
#   bash scripts/test-all.sh
#
# Safe to run on a fresh machine of the project's kind and to run again: each
# install step checks first. Uses a shared cargo target dir outside the clone
# (override with CARGO_TARGET_DIR) so repeated runs and fresh clones reuse
# earlier builds. Exits non-zero if any step fails; the last line is
# "summary: N passed, M failed, K skipped", where N and M count the
# distinct tests run by cargo (one run by several steps counts once; the
# line before gives the runs) and M also counts each failed step (a failed
# fmt, clippy or doc check counts as one failure); a test that prints a
# line starting `SKIPPED:` counts as skipped, not passed.
set -uo pipefail

cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/weft-target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
export CARGO_INCREMENTAL=0
mkdir -p "$CARGO_TARGET_DIR"
log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT

say() { printf '\n=== %s\n' "$*"; }

# ---------------------------------------------------------------- installs
say "prerequisites"
if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo is not on PATH: this machine needs a Rust toolchain (rustup)." >&2
    exit 1
fi
for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$component"; then
        rustup component add "$component" || { echo "cannot install $component" >&2; exit 1; }
    fi
done
# Debian packages: OpenMPI (the collectives' mpi feature; libclang for its
# bindings) and Chromium (the visualizer's browser test).
apt_needed=()
for pkg in libopenmpi-dev openmpi-bin libclang-dev chromium chromium-driver; do
    dpkg -s "$pkg" >/dev/null 2>&1 || apt_needed+=("$pkg")
done
if [ ${#apt_needed[@]} -gt 0 ]; then
    echo "installing: ${apt_needed[*]}"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${apt_needed[@]}" >/dev/null \
        || { echo "cannot install ${apt_needed[*]}" >&2; exit 1; }
fi
# Python with safetensors, numpy, torch and transformers: an independent
# reader of our checkpoint files (bf16 included) and the check that
# transformers loads our Hugging Face export (checkpoint's interop tests,
# through WEFT_PYTHON); and tensorboard, whose reader checks the event
# files that weft-trace writes. torch from the package index is its CUDA
# build (about 5.6 GiB with its libraries, two minutes once; cached after).
venv="${WEFT_VENV:-$HOME/.cache/weft-venv}"
if ! "$venv/bin/python" -c "import safetensors, numpy, torch, transformers, tensorboard" >/dev/null 2>&1; then
    { [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"; } \
        && "$venv/bin/pip" install -q safetensors numpy torch transformers tensorboard \
        || { echo "cannot set up $venv" >&2; exit 1; }
fi
export WEFT_PYTHON="$venv/bin/python"
# NVRTC (libnvrtc.so.13, CUDA 13's runtime compiler) for the test that
# compiles every CUDA kernel source without a GPU (kernels/tests/cuda.rs).
# torch's CUDA wheels bring it (nvidia-cuda-nvrtc, in nvidia/cu13/lib);
# where they do not, it is installed on its own.
nvrtc_so=$(ls "$venv"/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 2>/dev/null | head -n 1)
if [ -z "$nvrtc_so" ]; then
    "$venv/bin/pip" install -q "nvidia-cuda-nvrtc==13.*" \
        || { echo "cannot install nvidia-cuda-nvrtc into $venv" >&2; exit 1; }
    nvrtc_so=$(ls "$venv"/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 2>/dev/null | head -n 1)
    [ -n "$nvrtc_so" ] || { echo "nvidia-cuda-nvrtc installed no libnvrtc.so.13" >&2; exit 1; }
fi
export WEFT_NVRTC_LIB_DIR="$(dirname "$nvrtc_so")"
# Everything the tests need is installed above: a test that would skip for
# want of it fails instead (the GPU checks, which need hardware CI does not
# have, still skip, and are counted as skipped).
export WEFT_REQUIRE_ALL=1
cargo --version
echo "target dir: $CARGO_TARGET_DIR"

# ------------------------------------------------------------------- steps
failed_steps=()
step() {
    local name=$1
    shift
    say "$name: $*"
    local start=$SECONDS
    if "$@" 2>&1 | tee "$log_dir/$name.log"; then
        echo "--- $name ok ($((SECONDS - start)) s)"
    else
        echo "--- $name FAILED ($((SECONDS - start)) s)"
        failed_steps+=("$name")
    fi
}

step fmt cargo fmt --all --check
step clippy cargo clippy --workspace --all-targets --locked -- -D warnings
# Optional hardware backends must compile (and lint) without the hardware.
step clippy-features cargo clippy --locked -p weft-collectives -p weft-kernels -p weft-model -p weft-trainer \
    --all-targets --features weft-trainer/nccl,weft-trainer/cuda -- -D warnings
step doc env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
# the internals' docs too: their links are checked only when documented
step doc-private env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --document-private-items
# Every test, with the trainer's MPI support built in: its tests/mpi.rs runs
# `weft train` under `mpirun -np 2` and `-np 4` against the thread ranks,
# and kills and stops ranks of running jobs. Every test binary runs even
# after one fails, so that the summary counts every failure.
step test cargo test --workspace --locked --no-fail-fast --features weft-trainer/mpi
# The CUDA backend without a GPU: NVRTC compiles every kernel source for
# sm_80 and sm_90 (a missing libnvrtc fails, under WEFT_REQUIRE_ALL), the
# no-GPU path gives typed errors, and the GPU-vs-CPU tests print SKIPPED.
# Only the targets the feature changes: the lib's tests and tests/cuda.rs.
step test-cuda env LD_LIBRARY_PATH="$WEFT_NVRTC_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -p weft-kernels --features cuda --lib --test cuda
# `weft train` with `train.device = "cuda"` and no GPU: refused before it
# starts with what is missing; its GPU test prints SKIPPED.
step test-cuda-train env LD_LIBRARY_PATH="$WEFT_NVRTC_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -p weft-trainer --features cuda --lib --test gpu
# The collectives suite over 4 MPI processes (the test relaunches itself
# under mpirun), and the NCCL backend's typed "not available" path.
step test-mpi env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    cargo test --locked -p weft-collectives --features mpi,nccl
# The browser visualizer: build the WebAssembly page from source into
# viz-web/dist/ (installing the wasm32 target and the wasm-bindgen-cli
# matching Cargo.lock when missing), then drive it in headless Chromium
# against served run folders; screenshots go to viz-web/e2e-out/. Its
# examples and weft binary are the test step's (the same features). (The
# committed page that `weft viz` embeds is checked against its sources by
# viz-web's unit tests in the test step.)
step viz-e2e env WEFT_E2E_FEATURES=weft-trainer/mpi bash viz-web/e2e.sh
# The test step's binaries ("package target folder executable" lines),
# which the steps below run again with nothing compiled: a `cargo test -p`
# resolves other features than the test step's and builds them all again.
binaries="$log_dir/binaries"
cargo test --workspace --locked --features weft-trainer/mpi --no-run --message-format=json 2>/dev/null \
    | "$WEFT_PYTHON" -c '
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        source, _, fragment = m["package_id"].rpartition("#")
        # "...#name@version", or "...#version" where the folder is the name
        package = fragment.split("@")[0] if "@" in fragment else source.rstrip("/").rsplit("/", 1)[-1]
        print(package, m["target"]["name"], os.path.dirname(m["manifest_path"]), m["executable"])
' >"$binaries"
# run_built PACKAGE [TARGET...] [-- ARGS...]: the test step's binaries of
# PACKAGE (every one, or the TARGETs), each in its package's folder as
# cargo runs them, with ARGS.
run_built() {
    local package=$1 targets=() status=0 found=0
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do targets+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    while read -r p t dir exe; do
        [ "$p" = "$package" ] || continue
        [ ${#targets[@]} -eq 0 ] || [[ " ${targets[*]} " == *" $t "* ]] || continue
        found=$((found + 1))
        printf '     Running %s (%s)\n' "$t" "$exe"
        (cd "$dir" && "$exe" "$@" </dev/null) || status=1
    done <"$binaries"
    if [ "$found" -eq 0 ]; then
        echo "no test binary of $package ${targets[*]} was built" >&2
        return 1
    fi
    return $status
}
# The numerics, kernels and collectives tests, and the model's bitwise
# ones, on the baseline (non-AVX) code paths the run-time dispatch would
# pick on an older CPU (every AVX-512 path obeys WEFT_SIMD) ...
simd_baseline() {
    local status=0
    for package in weft-numerics weft-kernels weft-collectives; do
        WEFT_SIMD=baseline run_built "$package" || status=1
    done
    return $status
}
simd_baseline_model() { WEFT_SIMD=baseline run_built weft-model -- bitwise; }
# ... and the layout matrix, the pipeline schedules and the documentation's
# examples on them (their test names do not say "bitwise"): the dense,
# Llama-family, mixed-precision, masked and Muon matrices (the MoE ones,
# recomputation's and the chunked loss's run the same kernels again).
simd_baseline_layouts() {
    WEFT_SIMD=baseline run_built weft-model compose pipeline docs -- \
        --skip every_moe_layout --skip every_fine_grained_moe_layout \
        --skip recomputation_changes_no_bit --skip a_chunked_loss_changes_no_bit
}
step test-simd-baseline simd_baseline
step test-simd-baseline-model simd_baseline_model
step test-simd-baseline-layouts simd_baseline_layouts

# ------------------------------------------------- nothing left running
# Every process the steps started (weft, the examples, test binaries: all
# run from the target dir) must have ended with its step.
sleep 1
left=$(pgrep -af -- "$CARGO_TARGET_DIR/" | grep -v -e "^$$ " -e "pgrep" || true)
if [ -n "$left" ]; then
    say "processes left running"
    echo "$left"
    failed_steps+=("leftover-processes")
fi

# ----------------------------------------------------------------- summary
# Distinct tests (scripts/count-tests.awk): a crate the steps test again
# (the SIMD baseline, other features) counts once; a test that fails in
# any run is a failure. The runs are counted beside them.
read -r passed failed runs < <(cat "$log_dir"/*.log | awk -f scripts/count-tests.awk)
failed=$((failed + ${#failed_steps[@]}))
# a test that printed SKIPPED ran nothing it names: a skip, not a pass
# (each distinct message once, as its test)
skipped=$(cat "$log_dir"/*.log | grep '^SKIPPED:' | sort -u | wc -l)
passed=$((passed - skipped))

say "done"
if [ ${#failed_steps[@]} -gt 0 ]; then
    echo "failed steps: ${failed_steps[*]}"
fi
if [ "$skipped" -gt 0 ]; then
    echo "skipped:"
    cat "$log_dir"/*.log | grep '^SKIPPED:' | sort -u | sed 's/^/  /'
fi
# code paths this machine could not test (a CPU feature it lacks)
if grep -q '^UNTESTED:' "$log_dir"/*.log; then
    echo "not tested on this machine:"
    cat "$log_dir"/*.log | grep '^UNTESTED:' | sort -u | sed 's/^UNTESTED: /  /'
fi
echo "test runs: $runs over every step (tests run in more than one step count once below)"
echo "summary: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
