#!/usr/bin/env bash
# What Muon costs a step against AdamW: runs of the same job alternated
# (AdamW, Muon, AdamW, Muon, ...), each a median step time from its
# metrics (the first fifth of the steps not counted), and the ratio
# Muon/AdamW of each pair. Prints a table; nothing is asserted.
#
#   bash scripts/bench-muon-step.sh [ROUNDS] [--set KEY=VALUE ...]
#
# Jobs: the default job (fp32 and bf16) and GPT-2 small's blocks
# (12 × 768, 85 M parameters with the synthetic corpus' vocabulary) at
# 8 × 256 tokens a step, where Newton–Schulz's d³ meets a small batch.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
cargo build --release -q -p weft-trainer
weft=${CARGO_TARGET_DIR:-target}/release/weft
dir=${WEFT_BENCH_DIR:-${TMPDIR:-/tmp}}/weft-muon-step-$$
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir"
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), family $(lscpu | sed -n 's/^CPU family: *//p') model $(lscpu | sed -n 's/^Model: *//p'), $(nproc) cores"
jobs=(
    "default-fp32|--set train.steps=100"
    "default-bf16|--set train.steps=100 --set train.precision=\"bf16\""
    "gpt2-small-fp32|--set train.steps=15 --set model.n_layer=12 --set model.n_embd=768 --set model.n_head=12 --set model.block_size=256 --set train.batch_size=8"
)
for job in "${jobs[@]}"; do
    name=${job%%|*}
    read -r -a sets <<<"${job#*|}"
    for r in $(seq "$rounds"); do
        for opt in adamw muon; do
            eval "args=(${sets[*]})"
            "$weft" train --set run.dir="\"$dir\"" --set run.name="\"$name-$opt-$r\"" \
                --set train.eval_every=0 --set checkpoint.every=0 --set run.tensorboard=false \
                --set optim.name="\"$opt\"" "${args[@]}" "$@" >/dev/null
        done
    done
done
python3 - "$dir" "$rounds" <<'PY'
import json, sys, statistics as st
d, rounds = sys.argv[1], int(sys.argv[2])
def step_s(run):
    recs = [json.loads(l) for l in open(f"{d}/{run}/metrics.jsonl")]
    recs = [r for r in recs if "loss" in r]
    tokens = 2048  # every job here: 32 × 64 or 8 × 256 tokens a step
    skip = max(1, len(recs) // 5)
    return st.median(tokens / r["tokens_per_s"] for r in recs[skip:])
print("| job | AdamW s/step (median of rounds) | Muon s/step | Muon/AdamW per pair | median ratio |")
print("|---|---|---|---|---|")
for job in ("default-fp32", "default-bf16", "gpt2-small-fp32"):
    a = [step_s(f"{job}-adamw-{r}") for r in range(1, rounds + 1)]
    m = [step_s(f"{job}-muon-{r}") for r in range(1, rounds + 1)]
    ratios = [x / y for x, y in zip(m, a)]
    print(f"| {job} | {st.median(a):.4f} | {st.median(m):.4f} | {' '.join(f'{r:.3f}' for r in ratios)} | {st.median(ratios):.3f} |")
PY
