#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one run, on a machine with a GPU, a driver ≥ 580 with
# the CUDA 13 libraries, and python3 with PyTorch (the peer of the benchmarks): the GPU tests
# (kernels against the CPU and against candle's composites, the model's gradients, training and
# checkpoints, GPU workers with real processes and signals), then the benchmarks side by side with
# PyTorch eager at the default and the 555 M-parameter shape in f32 and bf16 (with where a step's
# time goes), each switch against its "before" (GemmEx for every product, the memory pool trimmed),
# workers sharing the GPU at both shapes, recovery, and Mixtral's blocks at both shapes.
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
  json=$(env $env timeout "$secs" "$lz" bench train --device cuda --json "$@" 2>>"$out/profile.txt" | tail -n 1)
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
# --- workers sharing the GPU: tokens/s from their step logs, where their steps' time goes -------
workers() { # tag, seconds, workers, steps, args...
  local tag=$1 secs=$2 n=$3 steps=$4; shift 4
  if [ "$(left)" -lt $((secs / 2)) ]; then log "SKIP workers $tag (budget)"; return; fi
  local l=$work/$tag.jsonl prof=$work/profile-$tag
  # Each worker profiles its steps (LAZARUS_WORKER_PROFILE: one JSON line per step, phases
  # synchronised with the GPU at their edges).
  if ! LAZARUS_WORKER_PROFILE=$prof timeout "$secs" "$lz" train --workers "$n" --device cuda --steps "$steps" --json-log "$l" --quiet "$@" >/dev/null 2>>"$out/tests.log"; then
    log "FAIL workers $tag"
    return
  fi
  python3 - "$tag" "$n" "$l" "$prof" <<'PY' | tee -a "$out/workers.jsonl"
import collections, glob, json, statistics, sys
tag, n, path, prof = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
steps = [json.loads(x) for x in open(path) if '"loss"' in x]
t = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])][2:]
tokens = steps[-1]["tokens"]
# Per (phase, scope): the median over each worker's steps after its first three, averaged over
# the workers.
per = collections.defaultdict(list)
for f in glob.glob(prof + "/worker-*.jsonl"):
    lines = [json.loads(x) for x in open(f)][3:]
    for key in {(s["phase"], s["scope"]) for ln in lines for s in ln["scopes"]}:
        rows = [r for r in (next((s for s in ln["scopes"] if (s["phase"], s["scope"]) == key), None) for ln in lines) if r]
        per[key].append((statistics.median(r["wall_s"] for r in rows), statistics.median(r["gpu_s"] for r in rows), statistics.median(r["calls"] for r in rows)))
profile = [{"phase": p, "scope": s, "wall_ms": 1e3 * statistics.mean(v[0] for v in vs), "gpu_ms": 1e3 * statistics.mean(v[1] for v in vs), "calls": statistics.mean(v[2] for v in vs)} for (p, s), vs in sorted(per.items())]
print(json.dumps({"tag": tag, "workers": n, "steps": len(steps), "step_s_median": statistics.median(t), "tokens_per_s": tokens / statistics.median(t), "last_loss": steps[-1]["loss"], "profile": profile}))
PY
  python3 - "$out/workers.jsonl" <<'PY' | tee -a "$out/summary.txt"
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(f"{r['tag']:<26} {r['tokens_per_s']:>9.0f} tok/s  step {1e3 * r['step_s_median']:7.1f} ms  (profiled; per worker, ms)")
for p in r["profile"]:
    if p["scope"] == "(phase)" or p["wall_ms"] > 0.02 * 1e3 * r["step_s_median"]:
        print(f"    {p['phase']:<10} {p['scope']:<18} wall {p['wall_ms']:8.2f}  gpu {p['gpu_ms']:8.2f}  calls {p['calls']:.0f}")
PY
}

# --- recovery on GPU workers ---------------------------------------------------------------------
recovery() {
  if [ "$(left)" -lt 60 ]; then log "SKIP bench recovery (budget)"; return; fi
  timeout 150 "$lz" bench recovery --device cuda --workers 4 --kills 3 --json --quiet >"$out/recovery.json" 2>>"$out/tests.log" \
    && log "recovery: $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: v for k, v in r.items() if not isinstance(v, list)})" "$out/recovery.json")" \
    || log "FAIL bench recovery"
}

# --- held-out loss over GPU workers against the checkpoint's, evaluated by one CPU process -------
workers_eval() {
  if [ "$(left)" -lt 30 ]; then log "SKIP workers-eval (budget)"; return; fi
  python3 -c "print('the quick brown fox jumps over the lazy dog; ' * 400)" >"$work/held.txt"
  if ! timeout 90 "$lz" train --workers 2 --device cuda --steps 6 --eval-data "$work/held.txt" --eval-every 3 --eval-windows 20 \
      --checkpoint-dir "$work/ck-eval" --json-log "$work/eval.jsonl" --quiet >/dev/null 2>>"$out/tests.log" \
    || ! timeout 60 "$lz" eval --checkpoint "$work/ck-eval" --data "$work/held.txt" --windows 20 --json >"$work/eval-cpu.json" 2>>"$out/tests.log"; then
    log "FAIL workers-eval"
    return
  fi
  python3 - "$work/eval.jsonl" "$work/eval-cpu.json" <<'PY' | tee -a "$out/summary.txt"
import json, sys
evals = [json.loads(x) for x in open(sys.argv[1]) if '"eval"' in x]
cpu = json.load(open(sys.argv[2]))
gpu = evals[-1]["loss"]
ok = [e["step"] for e in evals] == [3, 6] and abs(gpu - cpu["loss"]) <= 1e-4 * cpu["loss"]
print(f"{'PASS' if ok else 'FAIL'} workers-eval: steps {[e['step'] for e in evals]}, 2 GPU workers {gpu:.6f} vs the checkpoint on the CPU {cpu['loss']:.6f}")
PY
}

# What each switch buys, at the shapes where it matters (LAZARUS_GEMM=ex: cuBLAS choosing a kernel
# for every expert's product, against cuBLASLt's algorithm per shape class; LAZARUS_GPU_POOL=trim:
# the memory pool handing freed memory back at every synchronisation; LAZARUS_ATTENTION=simt: the
# attention's products on the CUDA cores instead of the tensor cores; LAZARUS_ADAMW=per-tensor:
# AdamW launched tensor by tensor instead of once over the list). SWITCHES says which.
switches() {
  for sw in ${SWITCHES:-attention adamw}; do
    case $sw in
      gemmex) bench large-bf16-gemmex 60 "LAZARUS_GEMM=ex" $large --iters 5 --dtype bf16 --no-torch --profile
              bench default-bf16-gemmex 40 "LAZARUS_GEMM=ex" --dtype bf16 --no-torch --profile ;;
      pool) bench large-bf16-pool-trim 60 "LAZARUS_GPU_POOL=trim" $large --iters 5 --dtype bf16 --no-torch --profile ;;
      attention) bench large-bf16-attention-simt 60 "LAZARUS_ATTENTION=simt" $large --iters 5 --dtype bf16 --no-torch --profile ;;
      adamw) bench default-bf16-adamw-per-tensor 40 "LAZARUS_ADAMW=per-tensor" --dtype bf16 --no-torch --profile
             bench large-bf16-adamw-per-tensor 60 "LAZARUS_ADAMW=per-tensor" $large --iters 5 --dtype bf16 --no-torch --profile ;;
    esac
  done
}

# ORDER says which checks run, first to last; each is skipped when the budget has too little left,
# so a run cut short keeps what comes first. The default: everything, the headline figures first.
# What no GPU has run yet (Mixtral's GPU kernels, AdamW in one launch, a worker's own rows kept on
# the device, the Qwen3-MoE and DeepSeek-MoE options) comes first with ORDER="tests-model
# tests-training bench-mixtral bench-families switches workers workers-large".
for check in ${ORDER:-bench-large bench-default tests-model tests-training tests-workers tests-cli workers-eval switches workers workers-large recovery bench-mixtral bench-families}; do
  case $check in
    bench-large) bench large-f32 120 "" $large --iters 5 --profile
                 bench large-bf16 120 "" $large --iters 5 --dtype bf16 --profile ;;
    bench-default) bench default-f32 60 "" --profile
                   bench default-bf16 60 "" --dtype bf16 --profile ;;
    # Mixtral's blocks (RMSNorm, rotary positions, SwiGLU experts without biases) on the GPU ops.
    bench-mixtral) bench default-mixtral-f32 60 "" --arch mixtral --profile
                   bench default-mixtral-bf16 60 "" --arch mixtral --dtype bf16 --profile
                   bench large-mixtral-bf16 120 "" $large --arch mixtral --iters 5 --dtype bf16 --profile ;;
    # The other families on the GPU ops: Qwen3-MoE's query and key norms (an RMSNorm per head in
    # f32 between the bf16 projection and rotary positions) with its attention's shape (grouped
    # key/value heads, heads wider than d_model / heads), Qwen2-MoE's q/k/v biases and gated
    # shared expert, DeepSeek-MoE's sigmoid router with groups, a shared expert and the loss-free
    # bias.
    bench-families) bench default-qwen-bf16 60 "" --arch qwen-moe --kv-heads 2 --head-dim 96 --norm-eps 1e-6 --dtype bf16 --profile
                    bench default-qwen2-bf16 60 "" --arch qwen2-moe --kv-heads 2 --dtype bf16 --profile
                    bench default-deepseek-bf16 60 "" --arch deepseek-moe --experts 16 --top-k 4 --expert-groups 4 --top-groups 2 --balance bias --dtype bf16 --profile ;;
    tests-model) run_tests kernels-and-model 90 model-lib --test-threads 1 gpu mixed_precision cuda::lt ;;
    tests-training) run_tests training 60 model-training --test-threads 1 gpu ;;
    tests-workers) run_tests runtime-workers 60 runtime-gpu-workers --test-threads 1 ;;
    tests-cli) run_tests cli-workers 150 cli-gpu-workers --test-threads 1 ;;
    switches) switches ;;
    workers) workers default-w2 60 2 40
             workers default-w4 60 4 40 ;;
    # One planning step on the launcher's CPU copy of the 555 M model (the default three took most
    # of the time allowed).
    workers-large) workers large-w2 150 2 10 $large --profile-steps 1
                   # One replica of each expert (8 slots a worker): no replica gradients to sum.
                   workers large-w2-one-replica 120 2 10 $large --profile-steps 1 --slots-per-worker 8 ;;
    recovery) recovery ;;
    workers-eval) workers_eval ;;
    *) log "unknown check $check" ;;
  esac
done
log "done in $((SECONDS - start)) s"
echo "================ summary"
cat "$out/summary.txt"
