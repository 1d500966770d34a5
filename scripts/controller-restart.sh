#!/usr/bin/env bash
# The controller of a running job SIGKILLed and started again with --resume-job: how long from
# the kill to the next completed step, and where that time goes. Runs TRIALS jobs of 2 agents x 2
# workers on loopback (the default model unless MODEL_FLAGS says otherwise), kills each job's
# controller after KILL_AT steps, starts it again after DOWN seconds, and prints each job's
# `reconfiguration` record (cause "controller") from its --json-log, one JSON line each, with the
# wall time from the kill to the first step trained after the takeover, and the steps logged
# (each once: the job's --steps).
#
#   scripts/controller-restart.sh [TRIALS] [DOWN]      (defaults: 3 trials, 0 s down)
#   LAZARUS=target/release/lazarus KILL_AT=40 STEPS=120 MODEL_FLAGS="--d-model 32 ..." scripts/controller-restart.sh
set -euo pipefail
TRIALS=${1:-3}
DOWN=${2:-0}
LAZARUS=${LAZARUS:-target/release/lazarus}
KILL_AT=${KILL_AT:-40}
STEPS=${STEPS:-120}
PORT=${PORT:-23461}
read -r -a MODEL <<<"${MODEL_FLAGS:-}"
[ -x "$LAZARUS" ] || { echo "no $LAZARUS: cargo build --release first" >&2; exit 1; }
work=$(mktemp -d)
trap 'pkill -P $$ 2>/dev/null || true; rm -rf "$work"' EXIT
steps_logged() { grep -c '"loss"' "$1" 2>/dev/null || true; }
for t in $(seq 1 "$TRIALS"); do
  d="$work/$t"; mkdir -p "$d"
  args=(--listen "127.0.0.1:$PORT" --secret-file "$d/secret" --workers 4 --gpus-per-node 2 --steps "$STEPS"
        --json-log "$d/log.jsonl" --checkpoint-dir "$d/ck" --checkpoint-every 1000 "${MODEL[@]}")
  "$LAZARUS" controller "${args[@]}" >"$d/controller.txt" 2>&1 &
  ctl=$!
  until [ -s "$d/secret" ] && grep -q "listening" "$d/controller.txt"; do sleep 0.05; done
  for a in 1 2; do
    "$LAZARUS" agent --controller "127.0.0.1:$PORT" --gpus 2 --secret-file "$d/secret" >"$d/agent$a.txt" 2>&1 &
  done
  until [ "$(steps_logged "$d/log.jsonl")" -ge "$KILL_AT" ]; do sleep 0.01; done
  kill -9 "$ctl"; wait "$ctl" 2>/dev/null || true
  killed=$(date +%s.%N)
  sleep "$DOWN"
  "$LAZARUS" controller "${args[@]}" --resume-job >"$d/again.txt" 2>&1 &
  again=$!
  # The record is logged with the first step trained after the takeover (a step finished
  # while there was no controller is logged before it, from the agents' copies).
  until grep -q '"cause":"controller"' "$d/log.jsonl"; do sleep 0.005; done
  next=$(date +%s.%N)
  wait "$again"
  wait
  record=$(grep '"cause":"controller"' "$d/log.jsonl" | tail -1)
  logged=$(steps_logged "$d/log.jsonl")
  python3 -c "
import json, sys
r = json.loads(sys.argv[1])
r['kill_to_next_step_s'] = round(float(sys.argv[2]) - float(sys.argv[3]), 3)
r['steps_logged'] = int(sys.argv[4])
print(json.dumps(r))" "$record" "$next" "$killed" "$logged"
  PORT=$((PORT + 1))
done
