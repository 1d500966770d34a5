#!/usr/bin/env bash
# Peak resident memory of `lazarus train` on a Parquet or Arrow text dataset of SMALL and of
# LARGE bytes of text (pyarrow writes it: seeded sentences, rows of ~1 kB; Parquet in row groups
# of 64k rows, snappy; Arrow as `datasets` writes its cache, a stream of 1,000-row batches), the
# same run otherwise: the first run of each reads the file into its token cache, a second trains
# from the cache. Neither should grow with the file.
#   PYTHON=python-with-pyarrow [FORMAT=parquet|arrow] scripts/table-memory.sh [LAZARUS] [SMALL_BYTES] [LARGE_BYTES]
# Needs about 3 x LARGE_BYTES of disk under ${TMPDIR:-/tmp}.
set -euo pipefail
lz=${1:-target/release/lazarus}
small=${2:-20000000}
large=${3:-2000000000}
py=${PYTHON:-python3}
format=${FORMAT:-parquet}
dir=$(mktemp -d "${TMPDIR:-/tmp}/lazarus-table-XXXXXX")
trap 'rm -rf "$dir"' EXIT
make() { # FILE BYTES
  "$py" - "$1" "$2" "$format" <<'PY'
import random, sys
import pyarrow as pa, pyarrow.parquet as pq
path, want, format = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(1)
words = "the a cat dog sat ran on under mat tree quickly slowly big small red blue and while house river".split()
pool = [" ".join(rng.choice(words) for _ in range(rng.randint(100, 260))) + "." for _ in range(4096)]
schema = pa.schema([("text", pa.string())])
written = 0
if format == "parquet":
    with pq.ParquetWriter(path, schema) as w:
        while written < want:
            rows = [pool[rng.randrange(len(pool))] for _ in range(65536)]
            w.write_table(pa.table({"text": rows}, schema=schema), row_group_size=65536)
            written += sum(map(len, rows))
else:
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        while written < want:
            rows = [pool[rng.randrange(len(pool))] for _ in range(1000)]
            w.write_batch(pa.record_batch({"text": rows}, schema=schema))
            written += sum(map(len, rows))
PY
}
for n in "$small" "$large"; do
  make "$dir/d$n.$format" "$n"
  for pass in convert cached; do
    /usr/bin/time -f "%M %e" -o "$dir/rss" "$lz" train --data "$dir/d$n.$format" --data-cache "$dir/cache" \
      --steps 20 --no-save --quiet --d-model 64 --layers 2 --heads 2 --experts 4 --d-ff 64 --seq-len 128 --batch-size 8 >/dev/null
    read -r rss secs < "$dir/rss"
    echo "{\"format\": \"$format\", \"text_bytes\": $n, \"file_bytes\": $(stat -c %s "$dir/d$n.$format"), \"pass\": \"$pass\", \"peak_rss_kib\": $rss, \"seconds\": $secs}"
  done
  rm -rf "$dir/d$n.$format" "$dir/cache"
done
