#!/usr/bin/env bash
# The training loop's stall per checkpoint, written in the background
# (`checkpoint.background = true`, the default) against every rank
# stopping for the write (`false`), on a model whose save takes seconds,
# and the step time around the saves. Prints a table; nothing is asserted.
#
#   bash scripts/bench-save-stall.sh [--set KEY=VALUE ...]
#
# Default job: GPT-2 small's blocks (12 × 768, 85 M parameters with the
# synthetic corpus' 256-token vocabulary): a save writes ~1.0 GB (the
# parameters and both AdamW moments, f32) into the run folder under
# $WEFT_BENCH_DIR (default the temp dir), fsynced.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p weft-trainer
weft=${CARGO_TARGET_DIR:-target}/release/weft
dir=${WEFT_BENCH_DIR:-${TMPDIR:-/tmp}}/weft-save-stall-$$
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir"
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), family $(lscpu | sed -n 's/^CPU family: *//p') model $(lscpu | sed -n 's/^Model: *//p'), $(nproc) cores; disk: $(df -h "$dir" | awk 'NR==2 {print $1}')"
for mode in true false; do
    "$weft" train --set run.dir="\"$dir\"" --set run.name="\"bg-$mode\"" \
        --set model.n_layer=12 --set model.n_embd=768 --set model.n_head=12 \
        --set model.block_size=256 --set train.batch_size=4 --set train.steps=16 \
        --set train.eval_every=0 --set checkpoint.every=4 --set checkpoint.keep_last=1 \
        --set checkpoint.background=$mode "$@" >/dev/null
done
python3 - "$dir" <<'PY'
import json, sys, statistics as st
d = sys.argv[1]
rows = {}
for mode in ("true", "false"):
    ev = [json.loads(l) for l in open(f"{d}/bg-{mode}/events.jsonl")]
    ck = [e for e in ev if e["event"] == "checkpoint"]
    steps = {r["step"]: r for r in (json.loads(l) for l in open(f"{d}/bg-{mode}/metrics.jsonl")) if "loss" in r}
    # a step's wall time from its tokens/s (the same tokens every step)
    secs = {s: 1024 / r["tokens_per_s"] for s, r in steps.items()}
    saved = {e["step"] for e in ck}
    # the steps after a save (its stall is in the step that saved, not
    # in these), and the others (not the first: it warms up)
    after = [secs[s + 1] for s in saved if s + 1 in secs]
    second = [secs[s + 2] for s in saved if s + 2 in secs]
    quiet = [t for s, t in secs.items() if s - 1 not in saved and s - 2 not in saved and s > 1]
    rows[mode] = (ck, after, second, quiet)
print("| saves | bytes a save | stall per save (s), mean of the saves before the last | the last save's stall (s) | write (s) | 1st step after a save (s) | 2nd step after (s) | other steps (s) |")
print("|---|---|---|---|---|---|---|---|")
for mode, name in (("false", "synchronous"), ("true", "background")):
    ck, after, second, quiet = rows[mode]
    mid = [e["stall_s"] for e in ck[:-1]]
    print(f"| {name} | {ck[0]['bytes']/1e9:.2f} GB | {st.mean(mid):.3f} | {ck[-1]['stall_s']:.3f} | {st.mean(e['write_s'] for e in ck):.2f} | {st.mean(after):.3f} | {st.mean(second):.3f} | {st.mean(quiet):.3f} |")
sync = st.mean(e["stall_s"] for e in rows["false"][0][:-1])
bg = st.mean(e["stall_s"] for e in rows["true"][0][:-1])
print(f"\nbackground stall / synchronous stall: {bg / sync:.3f}")
PY
