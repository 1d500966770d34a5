#!/usr/bin/env bash
# Peak resident memory of `lazarus train` on a Megatron indexed dataset of SMALL and of LARGE
# tokens (u8, random ids, documents of 2,048 tokens), the same run otherwise: streamed data
# holds a window at a time, so the peak should not grow with the file.
#   scripts/stream-memory.sh [LAZARUS] [SMALL_TOKENS] [LARGE_TOKENS]
# Needs LARGE_TOKENS bytes of disk under ${TMPDIR:-/tmp}.
set -euo pipefail
lz=${1:-target/release/lazarus}
small=${2:-20000000}
large=${3:-1000000000}
dir=$(mktemp -d "${TMPDIR:-/tmp}/lazarus-stream-XXXXXX")
trap 'rm -rf "$dir"' EXIT
make() { # PREFIX TOKENS
  python3 - "$1" "$2" <<'PY'
import array, os, sys
prefix, n = sys.argv[1], int(sys.argv[2])
doc = 2048
lengths = [doc] * (n // doc) + ([n % doc] if n % doc else [])
with open(prefix + ".bin", "wb") as f:
    left = n
    while left:
        k = min(left, 1 << 24)
        f.write(os.urandom(k))
        left -= k
with open(prefix + ".idx", "wb") as f:
    f.write(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([1]))
    f.write(len(lengths).to_bytes(8, "little") + (len(lengths) + 1).to_bytes(8, "little"))
    f.write(array.array("i", lengths).tobytes())
    offsets, at = array.array("q"), 0
    for l in lengths:
        offsets.append(at)
        at += l
    f.write(offsets.tobytes())
    f.write(array.array("q", range(len(lengths) + 1)).tobytes())
PY
}
for n in "$small" "$large"; do
  make "$dir/d$n" "$n"
  /usr/bin/time -f "%M" -o "$dir/rss" "$lz" train --data "$dir/d$n" --data-format megatron --vocab-size 256 \
    --steps 20 --no-save --quiet --d-model 64 --layers 2 --heads 2 --experts 4 --d-ff 64 --seq-len 128 --batch-size 8 >/dev/null
  echo "{\"tokens\": $n, \"file_bytes\": $(stat -c %s "$dir/d$n.bin"), \"peak_rss_kib\": $(cat "$dir/rss")}"
  rm -f "$dir/d$n.bin" "$dir/d$n.idx"
done
