#!/usr/bin/env bash
# Runs weft's train_step bench and the PyTorch baseline back to back on the
# same machine with the same thread count, then prints tokens/s ratios.
#
#   PYTHON=/path/to/venv/bin/python model/reference/bench_compare.sh [a|b]... [--steps N]
#
# Tokens/s are from the best timed step of each (the least disturbed on a
# shared machine); run it twice and compare if the machine is busy.
#
# Needs a Python with torch and transformers (see make_fixtures.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
THREADS=${RAYON_NUM_THREADS:-$(nproc)}
export RAYON_NUM_THREADS=$THREADS
# WEFT_BENCH: an already built train_step bench binary (else cargo builds it).
if [ -n "${WEFT_BENCH:-}" ]; then
  weft=$("$WEFT_BENCH" "$@")
else
  weft=$(cargo bench -q -p weft-model --bench train_step -- "$@")
fi
torch=$("$PYTHON" model/reference/bench_torch.py --threads "$THREADS" "$@")
echo "## weft"; echo "$weft"; echo; echo "## PyTorch"; echo "$torch"; echo
echo "| config | weft tokens/s | PyTorch tokens/s | ratio | weft GFLOP/s |"
echo "|---|---|---|---|---|"
join -t'|' <(echo "$weft" | awk -F'|' '/^\| [ab] /{gsub(/ /,"",$2); print $2"|"$9"|"$10}' | sort) \
           <(echo "$torch" | awk -F'|' '/^\| [ab] /{gsub(/ /,"",$2); print $2"|"$8}' | sort) |
  awk -F'|' '{printf "| %s | %s | %s | %.2fx | %s |\n", $1, $2, $4, $2/$4, $3}'
