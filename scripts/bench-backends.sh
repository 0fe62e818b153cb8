#!/usr/bin/env bash
# Step time of the same layouts on thread ranks and on MPI processes, side by
# side in one run: each layout runs as `weft train` (threads) and as `mpirun
# -np N weft train`, alternately, REPEATS times; the table gives the median
# tokens/s of each and their ratio.
#
#   bash scripts/bench-backends.sh [STEPS] [REPEATS]
#
# Builds the release binary with the `mpi` feature first. Extra settings for
# every run go in $WEFT_BENCH_SETS (e.g. "--set model.n_layer=4").
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
repeats=${2:-3}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/weft-target}"
cargo build --release --locked -p weft-trainer --features mpi >&2
weft="$CARGO_TARGET_DIR/release/weft"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# name, ranks, settings
layouts=(
    "dp=2|2|--set parallel.dp=2"
    "dp=2 fsdp=full|2|--set parallel.dp=2 --set parallel.fsdp=\"full\""
    "tp=2|2|--set parallel.tp=2"
    "pp=2 (1f1b, m=8)|2|--set parallel.pp=2"
    "dp=4|4|--set parallel.dp=4"
    "dp=2 tp=2|4|--set parallel.dp=2 --set parallel.tp=2"
    "pp=2 dp=2|4|--set parallel.pp=2 --set parallel.dp=2"
)

tps() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['tokens_per_s'])" "$1/summary.json"; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "$(mpirun --version | head -1); $steps steps per run, median of $repeats"
echo
printf '| %-18s | %5s | %14s | %14s | %13s |\n' layout ranks "threads tok/s" "mpi tok/s" "mpi / threads"
printf '|%s|%s|%s|%s|%s|\n' -------------------- ------- ---------------- ---------------- ---------------
for l in "${layouts[@]}"; do
    IFS='|' read -r name np sets <<<"$l"
    t=() m=()
    for r in $(seq "$repeats"); do
        # shellcheck disable=SC2086
        eval "$weft" train --set train.steps="$steps" --set checkpoint.every=0 \
            --set run.dir="'\"$out\"'" --set run.name="t$r$np${name//[^a-z0-9]/}" $sets ${WEFT_BENCH_SETS:-} >/dev/null 2>&1
        t+=("$(tps "$out/t$r$np${name//[^a-z0-9]/}")")
        eval mpirun --oversubscribe -np "$np" "$weft" train --set train.steps="$steps" --set checkpoint.every=0 \
            --set run.dir="'\"$out\"'" --set run.name="m$r$np${name//[^a-z0-9]/}" $sets ${WEFT_BENCH_SETS:-} >/dev/null 2>&1
        m+=("$(tps "$out/m$r$np${name//[^a-z0-9]/}")")
    done
    tm=$(printf '%s\n' "${t[@]}" | median)
    mm=$(printf '%s\n' "${m[@]}" | median)
    printf '| %-18s | %5s | %14.0f | %14.0f | %12.2f× |\n' "$name" "$np" "$tm" "$mm" \
        "$(python3 -c "print($mm / $tm)")"
done
