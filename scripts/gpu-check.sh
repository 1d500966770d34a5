#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one run, on a machine with a GPU, a driver ≥ 580 with
# the CUDA 13 libraries, and python3 with PyTorch (the peer of the benchmarks): the GPU tests
# (kernels against the CPU and against candle's composites, the model's gradients, training and
# checkpoints, GPU workers with real processes and signals), then the benchmarks side by side with
# PyTorch eager at the default and the 555 M-parameter shape in f32 and bf16 (with where a step's
# time goes), each switch against its "before" (GemmEx for every product, the memory pool trimmed),
# workers sharing the GPU at both shapes, and recovery.
#
#   scripts/gpu-prepare.sh                 # here: builds .gpu/ (no GPU needed)
#   scripts/gpu-check.sh .gpu OUT [BUDGET] # there: OUT gets the logs; BUDGET seconds (default 380)
#
# Each step runs under its own time limit and is skipped when the budget has too little left;
# the output's last lines are a summary table. Results in OUT (at most 8 files): gpu.txt,
# tests.log, bench.jsonl (one `bench train --json` line per run, tagged), profile.txt, workers.jsonl,
# recovery.json, summary.txt.
set -uo pipefail
bin=${1:?prepared binaries (.gpu)} out=${2:?output folder} budget=${3:-380}
mkdir -p "$out"
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
log() { echo "[$(date +%T) +$((SECONDS - start))s] $*" | tee -a "$out/summary.txt"; }
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:/usr/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1

# --- the binaries -------------------------------------------------------------------------------
work=$(mktemp -d)
for f in lazarus model-lib model-training runtime-gpu-workers cli-gpu-workers; do
  python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$bin/$f.xz" "$work/$f" && chmod +x "$work/$f"
done
# The CLI tests start the lazarus binary from the path they were built with.
cli_path=$(cat "$bin/cli-path")
mkdir -p "$(dirname "$cli_path")" && cp "$work/lazarus" "$cli_path"
lz=$work/lazarus
log "commit $(tr '\n' ' ' <"$bin/commit")"
{ nvidia-smi; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"; } >"$out/gpu.txt" 2>&1
log "$(grep -m1 -o 'NVIDIA [A-Z0-9]* [A-Za-z0-9 ]*' "$out/gpu.txt" || echo 'GPU ?')"

# --- tests ----------------------------------------------------------------------------------------
run_tests() { # name, seconds, binary, filter args...
  local name=$1 secs=$2 exe=$3; shift 3
  if [ "$(left)" -lt $((secs / 2)) ]; then log "SKIP tests $name (budget)"; return; fi
  echo "=== $name: $exe $*" >>"$out/tests.log"
  if timeout "$secs" "$work/$exe" "$@" >>"$out/tests.log" 2>&1; then
    log "PASS tests $name ($(grep -c '^test .* ok$' "$out/tests.log") ok so far)"
  else
    log "FAIL tests $name (exit $?): $(grep -E '^test .* FAILED|panicked' "$out/tests.log" | tail -3 | tr '\n' ' ')"
  fi
}

# --- benchmarks -------------------------------------------------------------------------------
large="--d-model 1024 --heads 16 --experts 16 --d-ff 4096 --batch-size 32 --seq-len 512"
bench() { # tag, seconds, env, args...
  local tag=$1 secs=$2 env=$3; shift 3
  if [ "$(left)" -lt $((secs / 2)) ]; then log "SKIP bench $tag (budget)"; return; fi
  local json
  json=$(env $env timeout "$secs" "$lz" bench train --device cuda --json --quiet "$@" 2>>"$out/profile.txt" | tail -n 1)
  if [ -z "$json" ]; then log "FAIL bench $tag"; return; fi
  echo "{\"tag\":\"$tag\",\"result\":$json}" >>"$out/bench.jsonl"
  python3 - "$tag" "$json" <<'PY' | tee -a "$out/summary.txt"
import json, sys
tag, r = sys.argv[1], json.loads(sys.argv[2])
l, t = r["lazarus"], r.get("pytorch")
mem = l.get("gpu_memory") or {}
line = f"{tag:<26} {l['tokens_per_s']:>9.0f} tok/s  step {l['step_s']*1e3:7.1f} ms  {100*l['utilisation']:5.1f}% of {l['peak_dtype']} peak ({l['peak_gflops']/1e3:.0f} TF/s)"
line += f"  launches {l.get('launches_per_step') or 0:.0f}  mem {mem.get('used_peak', 0)/2**30:.1f} GiB"
if t:
    line += f"  | PyTorch {t['tokens_per_s']:.0f} tok/s  ratio {r['ratio_vs_pytorch']:.2f}"
print(line)
for p in l.get("profile", []):
    if p["scope"] in ("(step)", "(phase)") or max(p["gpu_s"], p["wall_s"]) > 0.02 * l["step_s"]:
        print(f"    {p['phase']:<10} {p['scope']:<32} gpu {p['gpu_s']*1e3:8.2f} ms  wall {p['wall_s']*1e3:8.2f} ms  calls {p['calls_per_step']:.0f}")
PY
}
# The headline figures first, then the tests, then the rest: a run cut short keeps what matters.
bench large-f32 120 "" $large --iters 5 --profile
bench large-bf16 120 "" $large --iters 5 --dtype bf16 --profile
bench default-f32 60 "" --profile
bench default-bf16 60 "" --dtype bf16 --profile
run_tests kernels-and-model 90 model-lib --test-threads 1 gpu mixed_precision cuda::lt
run_tests training 60 model-training --test-threads 1 gpu
run_tests runtime-workers 60 runtime-gpu-workers --test-threads 1
run_tests cli-workers 150 cli-gpu-workers --test-threads 1
# What each switch buys, at the shapes where it matters (LAZARUS_GEMM=ex: cuBLAS choosing a kernel
# for every expert's product, against cuBLASLt's algorithm per shape class; LAZARUS_GPU_POOL=trim:
# the memory pool handing freed memory back at every synchronisation; LAZARUS_ATTENTION=simt: the
# attention's products on the CUDA cores instead of the tensor cores). SWITCHES says which to
# measure: default attention; all three with SWITCHES="gemmex pool attention".
for sw in ${SWITCHES:-attention}; do
  case $sw in
    gemmex) bench large-bf16-gemmex 60 "LAZARUS_GEMM=ex" $large --iters 5 --dtype bf16 --no-torch --profile
            bench default-bf16-gemmex 40 "LAZARUS_GEMM=ex" --dtype bf16 --no-torch --profile ;;
    pool) bench large-bf16-pool-trim 60 "LAZARUS_GPU_POOL=trim" $large --iters 5 --dtype bf16 --no-torch --profile ;;
    attention) bench large-bf16-attention-simt 60 "LAZARUS_ATTENTION=simt" $large --iters 5 --dtype bf16 --no-torch --profile ;;
  esac
done

# --- workers sharing the GPU: tokens/s from their step logs ------------------------------------
workers() { # tag, seconds, workers, steps, args...
  local tag=$1 secs=$2 n=$3 steps=$4; shift 4
  if [ "$(left)" -lt $((secs / 2)) ]; then log "SKIP workers $tag (budget)"; return; fi
  local l=$work/$tag.jsonl
  if ! timeout "$secs" "$lz" train --workers "$n" --device cuda --steps "$steps" --json-log "$l" --quiet "$@" >/dev/null 2>>"$out/tests.log"; then
    log "FAIL workers $tag"
    return
  fi
  python3 - "$tag" "$n" "$l" <<'PY' | tee -a "$out/workers.jsonl"
import json, statistics, sys
tag, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
steps = [json.loads(x) for x in open(path) if '"loss"' in x]
t = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])][2:]
tokens = steps[-1]["tokens"]
print(json.dumps({"tag": tag, "workers": n, "steps": len(steps), "step_s_median": statistics.median(t), "tokens_per_s": tokens / statistics.median(t), "last_loss": steps[-1]["loss"]}))
PY
}
workers default-w2 60 2 40
workers default-w4 60 4 40
workers large-w2 120 2 10 $large

# --- recovery on GPU workers ---------------------------------------------------------------------
if [ "$(left)" -gt 60 ]; then
  timeout 150 "$lz" bench recovery --device cuda --workers 4 --kills 3 --json --quiet >"$out/recovery.json" 2>>"$out/tests.log" \
    && log "recovery: $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: v for k, v in r.items() if not isinstance(v, list)})" "$out/recovery.json")" \
    || log "FAIL bench recovery"
else
  log "SKIP bench recovery (budget)"
fi
log "done in $((SECONDS - start)) s"
echo "================ summary"
cat "$out/summary.txt"
