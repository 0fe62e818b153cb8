#!/usr/bin/env bash
# End-to-end test of weft viz in headless chromium:
#  1. installs chromium + chromium-driver with apt if missing, builds the
#     page (build.sh), the pipeline example's real ZB-H1 trace and synthetic
#     metrics / expert-load files into a run folder;
#  2. serves it on 127.0.0.1 and checks lanes, slices, heatmap and bars are
#     drawn with the right counts, play moves the cursors, hover and zoom
#     work, health events and the torn last line are shown;
#  3. serves a truncated trace and checks the page names file and line;
#  4. with E2E_PERF=1, measures a 100k-event trace and 10k steps × 64
#     experts.
# Screenshots go to $E2E_OUT (default viz-web/e2e-out/).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
out="${E2E_OUT:-$here/e2e-out}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
mkdir -p "$out"
cd "$root"

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  apt-get install -y chromium chromium-driver >/dev/null
fi
"$here/build.sh"
cargo build -p weft-viz-web --examples
cargo build -p weft-pipeline --example schedules
ex="$CARGO_TARGET_DIR/debug/examples"

work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trace_exit() { cleanup; }
trap trace_exit EXIT

# A run folder: the real ZB-H1 trace (p = 4, m = 8) + synthetic logs.
run="$work/run"
mkdir -p "$run"
(cd "$work" && "$ex/schedules" --trace >/dev/null && mv zb-h1.trace.json "$run/trace.json")
steps=300 experts=16 layers=2
"$ex/synth_run" "$run" $steps $experts $layers
events=$(grep -c '"event"' "$run/metrics.jsonl")

port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
dport=$(port)
chromedriver --port="$dport" --allowed-ips=127.0.0.1 >"$out/chromedriver.log" 2>&1 &
pids+=($!)
serve() { # RUN_DIR -> prints URL
  local p; p=$(port)
  "$ex/serve" "$1" "$here/dist" "$p" >"$out/serve-$p.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 50); do curl -sf "http://127.0.0.1:$p/" >/dev/null && break; sleep 0.1; done
  echo "http://127.0.0.1:$p/"
}
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$dport/status" >/dev/null && break; sleep 0.1; done

url=$(serve "$run")
E2E_LANES=4 E2E_SLICES=96 E2E_STEPS=$steps E2E_EXPERTS=$experts E2E_EVENTS=$events \
  python3 "$here/e2e.py" "http://127.0.0.1:$dport" "$url" "$out" run

bad="$work/bad"
mkdir -p "$bad"
head -c 2000 "$run/trace.json" >"$bad/trace.json"
url=$(serve "$bad")
python3 "$here/e2e.py" "http://127.0.0.1:$dport" "$url" "$out" bad

if [ "${E2E_PERF:-0}" = 1 ]; then
  big="$work/big"
  "$ex/synth_run" "$big" 10000 64 1 100000
  url=$(serve "$big")
  python3 "$here/e2e.py" "http://127.0.0.1:$dport" "$url" "$out" perf
fi
echo "e2e.sh: all checks passed; screenshots in $out"
