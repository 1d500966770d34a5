#!/usr/bin/env bash
# Build what scripts/gpu-check.sh runs on a GPU machine, here (no GPU needed): the CUDA build of
# the CLI and the test binaries with GPU tests, stripped and xz-compressed into .gpu/ (ignored by
# git; a few MB each), with the commit they were built from.
#
#   scripts/gpu-prepare.sh            # then carry .gpu to the GPU machine and run scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu
rm -rf "$out" && mkdir -p "$out"
build() { scripts/cargo-cuda "$@" --release --features cuda; }
build build -p lazarus-cli
json=$(mktemp)
build test -p lazarus-model -p lazarus-runtime -p lazarus-cli --no-run --message-format=json >"$json"
# Each test binary under a stable name: the crate's target name.
python3 - "$json" "$out" <<'PY'
import json, shutil, sys
# (directory of the crate, its test target) -> the name in .gpu
want = {("crates/model", "lazarus_model"): "model-lib", ("crates/model", "training"): "model-training",
        ("crates/runtime", "gpu_workers"): "runtime-gpu-workers", ("crates/cli", "gpu_workers_cli"): "cli-gpu-workers"}
found = {}
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"].get("test"):
        continue
    for (crate, target), name in want.items():
        if m["target"]["name"] == target and m["manifest_path"].endswith(crate + "/Cargo.toml"):
            found[name] = m["executable"]
missing = sorted(set(want.values()) - set(found))
if missing:
    sys.exit(f"gpu-prepare: test binaries not built: {missing}")
for name, exe in found.items():
    shutil.copy(exe, f"{sys.argv[2]}/{name}")
PY
cp target/cuda/release/lazarus "$out/lazarus"
# The CLI tests start the binary they were built beside: where gpu-check.sh puts it back.
echo "$(pwd)/target/cuda/release/lazarus" >"$out/cli-path"
git rev-parse --short HEAD >"$out/commit"
git status --porcelain | grep -q . && echo "+uncommitted changes" >>"$out/commit" || true
for f in "$out"/lazarus "$out"/model-lib "$out"/model-training "$out"/runtime-gpu-workers "$out"/cli-gpu-workers; do
  strip "$f"
  xz -T2 -6 "$f"
done
du -sh "$out"
