#!/usr/bin/env bash
# The long soak (not CI): one `--deterministic` job of `lazarus controller` and up to three agents
# of two workers, each agent on a network namespace of its own where namespaces can be made
# (root and iproute2), under at least FAULTS faults and FAULTS SIGKILLs drawn from the seed —
# workers, agents and every holder of an expert SIGKILLed, workers SIGSTOPped, preemption
# notices, newcomers killed, the controller SIGKILLed and started again with --resume-job, links
# cut and healed — with a stranger's hostile connections at every port of the job throughout (each
# rank's as it opens, the controller's and /metrics every 2 s), and checked in bits: every step logged once with the loss of an uninterrupted
# run on one worker, the same data cursor, and a final checkpoint whose tensors have the same
# bytes (crates/cli/tests/soak_cli.rs says how).
#
#   scripts/soak.sh [FAULTS] [SEED]        # default 1000 faults, seed 1; a release build
#
# The job's length is FAULTS × 60 steps (LAZARUS_SOAK_STEPS overrides it), so that faults come
# ~20 steps apart. It prints the time each kind of fault cost; its output ends with the test's
# verdict.
set -euo pipefail
cd "$(dirname "$0")/.."
faults=${1:-1000}
seed=${2:-1}
export LAZARUS_SOAK_FAULTS=$faults LAZARUS_SOAK_KILLS=$faults LAZARUS_SOAK_SEED=$seed
export LAZARUS_SOAK_STEPS=${LAZARUS_SOAK_STEPS:-$((faults * 60))}
echo "soak: $faults faults and $faults SIGKILLs over $LAZARUS_SOAK_STEPS steps, seed $seed" >&2
exec cargo test --release -p lazarus-cli --test soak_cli -- --ignored --nocapture a_soak_of_fifty_kills_and_more_loses_nothing
