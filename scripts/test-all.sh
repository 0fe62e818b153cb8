#!/usr/bin/env bash
# Runs every check of the weft workspace, after installing what they need.
#
#   bash scripts/test-all.sh
#
# Safe to run on a fresh machine of the project's kind and to run again: each
# install step checks first. Uses a shared cargo target dir outside the clone
# (override with CARGO_TARGET_DIR) so repeated runs and fresh clones reuse
# earlier builds. Exits non-zero if any step fails; the last line is
# "summary: N passed, M failed", where N and M count the tests run by cargo
# and M also counts each failed step (a failed fmt, clippy or doc check
# counts as one failure).
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
step doc env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
step test cargo test --workspace --locked
# The same numerics tests on the baseline (non-AVX) code paths the run-time
# dispatch would pick on an older CPU; the binaries are already built.
step test-simd-baseline env WEFT_SIMD=baseline cargo test -p weft-numerics --locked

# ----------------------------------------------------------------- summary
passed=0
failed=0
while read -r p f; do
    passed=$((passed + p))
    failed=$((failed + f))
done < <(cat "$log_dir"/*.log | sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/p')
failed=$((failed + ${#failed_steps[@]}))

say "done"
if [ ${#failed_steps[@]} -gt 0 ]; then
    echo "failed steps: ${failed_steps[*]}"
fi
echo "summary: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
