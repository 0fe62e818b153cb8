#!/usr/bin/env bash
# Runs weft's train_step bench and the PyTorch baseline back to back on the
# same machine with the same thread count, then prints tokens/s ratios.
#
#   PYTHON=/path/to/venv/bin/python model/reference/bench_compare.sh [a|b|l]... [--steps N] [--precision fp32|bf16|fp16|both|all]
#
# Tokens/s are from the best timed step of each (the least disturbed on a
# shared machine). REPEAT=N (default 1) alternates the two N times and
# keeps each one's best tokens/s per configuration, so a burst of load
# from other jobs on a shared machine hits both alike; the load average
# before and after each run is printed.
#
# Needs a Python with torch and transformers (see make_fixtures.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
THREADS=${RAYON_NUM_THREADS:-$(nproc)}
REPEAT=${REPEAT:-1}
export RAYON_NUM_THREADS=$THREADS
# WEFT_BENCH: an already built train_step bench binary (else cargo builds it).
if [ -z "${WEFT_BENCH:-}" ]; then
  cargo bench -q -p weft-model --bench train_step --no-run
fi
load() { cut -d' ' -f1-3 /proc/loadavg; }
weft_all=""
torch_all=""
for i in $(seq "$REPEAT"); do
  echo "## run $i, load average before: $(load)"
  if [ -n "${WEFT_BENCH:-}" ]; then
    weft=$("$WEFT_BENCH" "$@")
  else
    weft=$(cargo bench -q -p weft-model --bench train_step -- "$@")
  fi
  torch=$("$PYTHON" model/reference/bench_torch.py --threads "$THREADS" "$@")
  echo "### weft"; echo "$weft"; echo; echo "### PyTorch"; echo "$torch"; echo
  echo "load average after: $(load)"; echo
  weft_all+="$weft"$'\n'
  torch_all+="$torch"$'\n'
done
# Best tokens/s per configuration and precision: weft's column 10 (GFLOP/s
# in 11), PyTorch's 9.
best() { awk -F'|' -v col="$1" -v gcol="$2" '/^\| [abl] /{k=$2"-"$3; gsub(/ /,"",k); if ($col+0 > best[k]+0) {best[k]=$col+0; g[k]=$gcol+0}} END {for (k in best) print k"|"best[k]"|"g[k]}' | sort; }
echo "| config-precision | weft tokens/s | PyTorch tokens/s | ratio | weft GFLOP/s |"
echo "|---|---|---|---|---|"
join -t'|' <(echo "$weft_all" | best 10 11) <(echo "$torch_all" | best 9 10) |
  awk -F'|' '{printf "| %s | %s | %s | %.2fx | %s |\n", $1, $2, $4, $2/$4, $3}'
