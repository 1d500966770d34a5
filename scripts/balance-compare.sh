#!/usr/bin/env bash
# Load balance and loss of the same run under each way of balancing the experts: no balancing
# (the auxiliary loss weighted 0), Switch's auxiliary loss (weight 0.01), DeepSeek-V3's
# loss-free routing bias, and both. The same seed, data and steps otherwise; 16 experts top-2,
# where an unbalanced router soon sends a third of a layer's tokens to one expert.
# Prints, per setting, the busiest expert's tokens over the mean (averaged over the last
# quarter of the steps and the MoE layers, and the worst of them) and the mean loss there.
#   scripts/balance-compare.sh [LAZARUS] [STEPS] [SEED]
set -euo pipefail
lz=${1:-target/release/lazarus}
steps=${2:-400}
seed=${3:-0}
dir=$(mktemp -d "${TMPDIR:-/tmp}/lazarus-balance-XXXXXX")
trap 'rm -rf "$dir"' EXIT
shape=(--steps "$steps" --seed "$seed" --d-model 128 --layers 2 --heads 4 --experts 16 --top-k 2 --d-ff 256)
run() { # NAME FLAGS...
  local name=$1
  shift
  "$lz" train "${shape[@]}" "$@" --json-log "$dir/$name.jsonl" --checkpoint-dir "$dir/$name" >/dev/null 2>&1
}
run none --balance aux --aux-loss-coef 0
run aux --balance aux --aux-loss-coef 0.01
run bias --balance bias
run both --balance both --aux-loss-coef 0.01
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
print(f"{'balance':<34}{'max/mean load':>14}{'worst':>8}{'loss':>9}")
for name, what in [("none", "none (aux loss weight 0)"), ("aux", "aux loss (0.01)"), ("bias", "loss-free bias (γ 0.001)"), ("both", "both")]:
    rows = [json.loads(l) for l in open(f"{d}/{name}.jsonl")]
    last = rows[-max(1, len(rows) // 4):]
    ratios = [max(l) * len(l) / sum(l) for r in last for l in r["expert_load"] if sum(l)]
    loss = sum(r["loss"] for r in last) / len(last)
    print(f"{what:<34}{sum(ratios) / len(ratios):>14.3f}{max(ratios):>8.2f}{loss:>9.4f}")
PY
