#!/usr/bin/env bash
# Build the weft viz page from its sources:
#   cargo build --target wasm32-unknown-unknown --profile viz-page, then
#   wasm-bindgen, then the static files.
#
#   bash viz-web/build.sh            writes viz-web/dist/ (or $WEFT_VIZ_DIST),
#                                    e.g. for `weft viz RUN --assets viz-web/dist`
#                                    and the e2e test;
#   bash viz-web/build.sh --commit   rewrites the committed page viz/page/
#                                    (which weft-viz compiles in) and its
#                                    stamp viz/page/SOURCES (the sources it
#                                    was built from, which a test checks);
#                                    commit viz/page/ afterwards.
#
# Idempotent: installs the wasm32 target and the wasm-bindgen-cli whose
# version equals the lock file's wasm-bindgen only when missing. Respects
# CARGO_TARGET_DIR. No tool here downloads binaries of its own. Paths are
# remapped (cargo home -> /cargo, and with --commit the source tree ->
# /weft) so the committed wasm does not depend on where the tree or the
# cargo home is. (Other builds leave the tree's path alone: remapping it
# changes the flags of every crate with the tree's place, and a build from
# a fresh clone would compile every dependency again.)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
commit=0
case "${1:-}" in
  "") ;;
  --commit) commit=1 ;;
  *)
    echo "usage: bash viz-web/build.sh [--commit]" >&2
    exit 2
    ;;
esac
dist="${WEFT_VIZ_DIST:-$here/dist}"
if [ "$commit" = 1 ]; then
  dist="$root/viz/page"
fi
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

remap="--remap-path-prefix=${CARGO_HOME:-$HOME/.cargo}=/cargo"
if [ "$commit" = 1 ]; then
  remap="--remap-path-prefix=$root=/weft $remap"
fi
export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="$remap"
cargo build -p weft-viz-web --target wasm32-unknown-unknown --profile viz-page
# Built whole in a fresh folder, then moved into place: a failed build
# leaves the old page as it was.
tmp="$(mktemp -d "$(dirname "$dist")/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
# Without the name section (a third of the module; function names in
# browser stack traces) and the producers section: a smaller page.
wasm-bindgen --target web --no-typescript --remove-name-section --remove-producers-section --out-dir "$tmp" \
  "$target_dir/wasm32-unknown-unknown/viz-page/weft_viz_web.wasm"
cp "$here/static/index.html" "$here/static/style.css" "$tmp/"
if [ "$commit" = 1 ]; then
  # The stamp: the format and the file list of viz/src/page.rs (its
  # STAMPED; dot files and editor backups left out), which its test
  # recomputes and compares.
  if command -v sha256sum >/dev/null; then sha=(sha256sum); else sha=(shasum -a 256); fi
  {
    echo "# The sources viz/page/ was built from (see viz/src/page.rs):"
    echo "# wasm-bindgen's version in Cargo.lock, then \`sha256sum\` lines of the"
    echo "# files, paths from the repository root. Written by \`bash viz-web/build.sh --commit\`."
    echo "wasm-bindgen $want"
    find trace/Cargo.toml trace/src compare/Cargo.toml compare/src \
        viz-web/Cargo.toml viz-web/build.sh viz-web/src viz-web/static \
        -name '.*' -prune -o -type f ! -name '*~' ! -name '*.swp' -print |
      LC_ALL=C sort | while IFS= read -r f; do "${sha[@]}" "$f"; done
  } >"$tmp/SOURCES"
fi
mkdir -p "$dist"
for f in "$tmp"/*; do
  mv -f "$f" "$dist/"
done
echo "build.sh: wrote $dist ($(du -sh "$dist" | cut -f1))" >&2
if [ "$commit" = 1 ]; then
  echo "build.sh: commit it: git add viz/page && git commit" >&2
fi
