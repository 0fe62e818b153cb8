#!/usr/bin/env bash
# The whole GPU check of weft-collectives' NCCL backend, in one go.
#
#   collectives/gpu-check.sh               # on the GPU machine: find the
#                                          # libraries, build the check from
#                                          # this checkout's source, run it
#   collectives/gpu-check.sh --build-only  # on a CPU machine: build the check
#                                          # into target/gpu-check/ to carry
#                                          # to a GPU machine that cannot build
#
# The check always runs the current source: with cargo present it is
# rebuilt (cargo rebuilds only what changed); a prebuilt binary is used only
# where there is no cargo, and only if the fingerprint of the sources it was
# built from (target/gpu-check/nccl-check.source, written by --build-only)
# equals this checkout's — a stale binary is refused, not run.
#
# The check (collectives/tests/nccl.rs) runs every collective through NCCL
# on GPU 0 with world size 1 (NCCL refuses two ranks on one GPU) and
# compares with a CPU reference bit for bit. It needs at run time only the
# NVIDIA driver (libcuda.so.1) and NCCL (libnccl.so[.2]); no CUDA toolkit.
# cudarc looks for "libnccl.so", so a libnccl.so.2 found elsewhere (e.g. in
# the nvidia-nccl-cu12 wheel that PyTorch installs) is linked under that
# name in a temporary folder put first on LD_LIBRARY_PATH.
#
# What one GPU can and cannot verify. NCCL refuses two ranks on one device,
# so this is world size 1: it checks that the bindings load, that every
# dtype maps to the right NCCL type, that host buffers are staged through the
# device and back intact, that the device-buffer methods work, and that bad
# calls give typed errors. It cannot check the reduction across ranks (with
# one rank NCCL copies), the order of a multi-rank sum, rendezvous between
# processes, or bandwidth: those need two or more GPUs (run the trainer's
# mpirun tests with parallel.backend = "nccl" there).
#
# Exit status: 0 when the check ran on a GPU and passed; 1 when it failed;
# 2 when something it needs is missing (each missing piece is reported).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
BIN_DIR=target/gpu-check
BIN="$BIN_DIR/nccl-check"
STAMP="$BIN.source"
say() { echo "gpu-check: $*"; }

# A fingerprint of every source file the check is built from.
fingerprint() {
    find collectives/src collectives/tests/nccl.rs collectives/Cargo.toml \
        numerics/src numerics/Cargo.toml Cargo.toml Cargo.lock -type f 2>/dev/null \
        | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
}

build() {
    # Builds the test binary; copies it to $BIN. Offline when the registry
    # cannot be reached but the dependencies are cached.
    local out exe
    for offline in "" "--offline"; do
        out=$(cargo test -p weft-collectives --features nccl --test nccl --no-run $offline 2>&1)
        exe=$(printf '%s\n' "$out" | sed -n 's/.*Executable tests\/nccl.rs (\(.*\))$/\1/p' | tail -n 1)
        if [ -n "$exe" ] && [ -x "$exe" ]; then
            mkdir -p "$BIN_DIR" && cp "$exe" "$BIN" && fingerprint > "$STAMP" \
                && say "built $BIN from sources $(cat "$STAMP")" && return 0
        fi
    done
    printf '%s\n' "$out" | tail -n 20
    say "MISSING: could not build the check (cargo and the crates of Cargo.lock are needed; or build it elsewhere with --build-only and bring target/gpu-check/)"
    return 2
}

if [ "${1:-}" = "--build-only" ]; then
    build
    exit $?
fi

missing=0

# 1. The GPU and its driver.
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>&1 | sed 's/^/gpu-check: /'
    nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu-check: driver, memory: /'
else
    say "nvidia-smi not found (looking for the driver library anyway)"
fi
libcuda=$( { ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF}'; \
    ls /usr/lib/x86_64-linux-gnu/libcuda.so* /usr/lib64/libcuda.so* /usr/local/nvidia/lib64/libcuda.so* 2>/dev/null; } | head -n 1)
if [ -n "$libcuda" ]; then
    say "CUDA driver library: $libcuda"
else
    say "MISSING: the NVIDIA driver library libcuda.so(.1) was not found"
    missing=1
fi

# 2. NCCL: the system's, a CUDA install's, or a Python wheel's.
find_nccl() {
    ldconfig -p 2>/dev/null | awk '/libnccl\.so/ {print $NF}'
    ls /usr/lib/x86_64-linux-gnu/libnccl.so* /usr/local/cuda*/lib64/libnccl.so* \
        /usr/local/lib/libnccl.so* /opt/conda/lib/libnccl.so* 2>/dev/null
    if [ -n "${NCCL_HOME:-}" ]; then ls "$NCCL_HOME"/lib/libnccl.so* 2>/dev/null; fi
    for py in python3 python; do
        command -v "$py" >/dev/null 2>&1 || continue
        "$py" - 2>/dev/null <<'EOF'
import glob, os, site, sys
dirs = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
for d in dirs:
    for f in glob.glob(os.path.join(d, "nvidia", "nccl", "lib", "libnccl.so*")):
        print(f)
EOF
    done
    timeout 60 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name 'libnccl.so*' -print 2>/dev/null
}
libnccl=$(find_nccl | awk 'NF' | head -n 1)
if [ -n "$libnccl" ]; then
    say "NCCL library: $libnccl"
    shim=$(mktemp -d)
    ln -s "$(readlink -f "$libnccl")" "$shim/libnccl.so"
    export LD_LIBRARY_PATH="$shim:$(dirname "$libnccl")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    say "MISSING: NCCL (libnccl.so.2) was not found: install the libnccl2 package, or the nvidia-nccl-cu12 wheel (pip install nvidia-nccl-cu12), or set NCCL_HOME"
    missing=1
fi

# 3. The check binary, from this checkout's source: built here, or (without
# cargo) prebuilt by --build-only from the same sources.
if command -v cargo >/dev/null 2>&1; then
    build || missing=1
elif [ -x "$BIN" ]; then
    want=$(fingerprint)
    have=$(cat "$STAMP" 2>/dev/null || echo none)
    if [ "$have" = "$want" ]; then
        say "no cargo: using the prebuilt $BIN (built from these sources, $want)"
    else
        say "MISSING: the prebuilt $BIN was built from other sources ($have, this checkout is $want): rebuild it with --build-only"
        missing=1
    fi
else
    say "MISSING: no cargo and no prebuilt $BIN"
    missing=1
fi

if [ "$missing" != 0 ]; then
    say "not run: see MISSING above"
    exit 2
fi

say "running $BIN (world size 1: bindings, dtypes, staging, device buffers and errors; not multi-rank sums, rendezvous or bandwidth)"
WEFT_REQUIRE_GPU=1 "$BIN"
rc=$?
if [ "$rc" = 0 ]; then say "PASS"; else say "FAIL (exit $rc)"; fi
exit $((rc == 0 ? 0 : 1))
