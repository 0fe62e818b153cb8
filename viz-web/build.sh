#!/usr/bin/env bash
# Build the weft viz page into viz-web/dist/ (or $WEFT_VIZ_DIST):
#   cargo build --target wasm32-unknown-unknown --release, then wasm-bindgen.
# Idempotent: installs the wasm32 target and the wasm-bindgen-cli whose
# version equals the lock file's wasm-bindgen only when missing. Respects
# CARGO_TARGET_DIR. No tool here downloads binaries of its own.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
dist="${WEFT_VIZ_DIST:-$here/dist}"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
cd "$root"

if ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
  rustup target add wasm32-unknown-unknown
fi

# Make sure the lock file has the app's dependencies, then read the version.
cargo metadata --format-version 1 --filter-platform wasm32-unknown-unknown >/dev/null
want="$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)"
if [ -z "$want" ]; then
  echo "build.sh: no wasm-bindgen in Cargo.lock" >&2
  exit 1
fi
have="$(wasm-bindgen --version 2>/dev/null | awk '{print $2}' || true)"
if [ "$have" != "$want" ]; then
  echo "build.sh: installing wasm-bindgen-cli $want (found: ${have:-none})" >&2
  cargo install wasm-bindgen-cli --version "=$want"
fi

cargo build -p weft-viz-web --target wasm32-unknown-unknown --release
mkdir -p "$dist"
wasm-bindgen --target web --no-typescript --out-dir "$dist" \
  "$target_dir/wasm32-unknown-unknown/release/weft_viz_web.wasm"
cp "$here/static/index.html" "$here/static/style.css" "$dist/"
echo "build.sh: wrote $dist ($(du -sh "$dist" | cut -f1))" >&2
