#!/usr/bin/env bash
# End-to-end test of weft viz in headless chromium:
#  1. installs chromium + chromium-driver with apt if missing, builds the
#     page from source (build.sh, into $E2E_DIST, default viz-web/dist/;
#     the committed page viz/page/ is left alone) and the weft binary,
#     and checks that `weft viz` without --assets serves the committed
#     page built into it;
#  2. trains a real run with `weft train` (pipeline parallel, ZB-H1 over 2
#     stages, and a mixture of experts), serves it with `weft viz`, and
#     checks against the run's own files that the pipeline lanes, their
#     slices, the expert heatmap, the bars and the metrics are drawn with
#     the right counts, that the bubble shown is the trainer's per-step
#     figure (summary.json) and each traced step's bubble the one in
#     trace.json, that play moves the cursors, hover and zoom work;
#  3. serves a run folder with the pipeline example's trace and synthetic
#     logs holding what a short real run does not (skips, spikes, a NaN
#     loss, a torn last line) and checks they are shown;
#  4. serves the real run and a shorter one with another seed together and
#     checks the legend names both, every metrics chart draws both, and
#     the loss difference against the first run is drawn at the steps both
#     have, with the largest difference their files give;
#  5. serves a truncated trace and checks the page names file and line;
#  6. with E2E_PERF=1, measures a 100k-event trace and 10k steps × 64
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
dist="${E2E_DIST:-$here/dist}"
WEFT_VIZ_DIST="$dist" "$here/build.sh"
# the examples and the binary, in one build of the whole workspace (with
# $WEFT_E2E_FEATURES, e.g. the features the test run before it built with:
# then nothing is compiled again)
cargo build --workspace --examples --bins ${WEFT_E2E_FEATURES:+--features "$WEFT_E2E_FEATURES"}
ex="$CARGO_TARGET_DIR/debug/examples"
weft="$CARGO_TARGET_DIR/debug/weft"

work="$(mktemp -d)"
pids=()
# Stops every server this script started and checks that none is left
# (a server started in a subshell would escape `pids`: `serve` runs in
# this shell).
cleanup() {
  local status=$? left=()
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left+=("$p"); done
  rm -rf "$work"
  if [ ${#left[@]} -gt 0 ]; then
    echo "e2e.sh: processes left running: ${left[*]}" >&2
    exit 1
  fi
  exit "$status"
}
trap cleanup EXIT

# A real run: 4 layers over 2 pipeline stages (ZB-H1, 4 micro-batches),
# 8 experts top-2 with bias balancing; the timeline of its first 2 steps.
"$weft" train --set "run.dir=\"$work\"" --set run.name=pp-moe --set run.trace_steps=2 \
  --set model.n_layer=4 --set model.n_head=2 --set model.n_embd=32 --set model.block_size=32 \
  --set train.batch_size=8 --set train.micro_batch_size=2 --set train.steps=60 --set train.eval_every=20 \
  --set model.moe.experts=8 --set model.moe.top_k=2 \
  --set parallel.pp=2 --set 'parallel.pp_schedule="zb-h1"' >"$out/train.log" 2>&1
real="$work/pp-moe"
# A second, shorter run of the same job with another seed, for the
# comparison of several runs.
"$weft" train --set "run.dir=\"$work\"" --set run.name=pp-moe-seed7 --set run.trace_steps=2 \
  --set model.n_layer=4 --set model.n_head=2 --set model.n_embd=32 --set model.block_size=32 \
  --set train.batch_size=8 --set train.micro_batch_size=2 --set train.steps=30 --set train.eval_every=10 \
  --set train.seed=7 --set model.moe.experts=8 --set model.moe.top_k=2 \
  --set parallel.pp=2 --set 'parallel.pp_schedule="zb-h1"' >"$out/train-seed7.log" 2>&1
second="$work/pp-moe-seed7"

# A run folder with the pipeline example's ZB-H1 trace (p = 4, m = 8) and
# synthetic logs.
run="$work/run"
mkdir -p "$run"
(cd "$work" && "$ex/schedules" --trace >/dev/null && mv zb-h1.trace.json "$run/trace.json")
"$ex/synth_run" "$run" 300 16 2

port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
dport=$(port)
chromedriver --port="$dport" --allowed-ips=127.0.0.1 >"$out/chromedriver.log" 2>&1 &
pids+=($!)
serve() { # RUN_DIR... -> sets $url (in this shell, so that `pids` keeps the server)
  local p; p=$(port)
  "$weft" viz "$@" --port "$p" --assets "$dist" >"$out/serve-$p.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 50); do curl -sf "http://127.0.0.1:$p/" >/dev/null && break; sleep 0.1; done
  url="http://127.0.0.1:$p/"
}
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$dport/status" >/dev/null && break; sleep 0.1; done

# Without --assets, the page built into the binary: the committed files.
p=$(port)
(cd "$work" && exec env -u WEFT_VIZ_ASSETS "$weft" viz "$real" --port "$p" >"$out/serve-embedded.log" 2>&1) &
pids+=($!)
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$p/" >/dev/null && break; sleep 0.1; done
for f in index.html weft_viz_web.js weft_viz_web_bg.wasm style.css; do
  curl -sf "http://127.0.0.1:$p/$f" | cmp -s - "$here/../viz/page/$f" ||
    { echo "e2e.sh: weft viz without --assets does not serve viz/page/$f" >&2; exit 1; }
done

serve "$real"
python3 "$here/e2e.py" "http://127.0.0.1:$dport" "$url" "$out" train "$real"
serve "$run"
python3 "$here/e2e.py" "http://127.0.0.1:$dport" "$url" "$out" run "$run"

# Two runs at once: both legends, a curve per run on every metrics chart,
# and the loss difference against the first run.
serve "$real" "$second"
python3 "$here/e2e.py" "http://127.0.0.1:$dport" "$url" "$out" compare "$real" "$second"

bad="$work/bad"
mkdir -p "$bad"
head -c 2000 "$run/trace.json" >"$bad/trace.json"
serve "$bad"
python3 "$here/e2e.py" "http://127.0.0.1:$dport" "$url" "$out" bad

if [ "${E2E_PERF:-0}" = 1 ]; then
  big="$work/big"
  "$ex/synth_run" "$big" 10000 64 1 100000
  serve "$big"
  python3 "$here/e2e.py" "http://127.0.0.1:$dport" "$url" "$out" perf
fi
echo "e2e.sh: all checks passed; screenshots in $out"
