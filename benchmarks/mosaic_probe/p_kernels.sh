#!/usr/bin/env bash
# Device time of every kernel of one call (n_profile.py's second call), by Nsight Compute's
# gpu__time_duration (one pass a kernel, kernels serialized), summed per kernel name:
#   bash benchmarks/mosaic_probe/p_kernels.sh lmfb --shape lm --backward [--flags NAME=value]
# writes $OUT/kern_NAME.csv and prints the per-name table and the total.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; name=$1; shift
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 240 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
  --csv --print-units base python3 benchmarks/mosaic_probe/n_profile.py "$@" \
  > "/tmp/kern_$name.raw" 2>&1
grep '^"' "/tmp/kern_$name.raw" > "$OUT/kern_$name.csv"
echo "== $name ($*)"
python3 - "$OUT/kern_$name.csv" <<'PY'
import csv, collections, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = collections.defaultdict(list)
for r in rows:
  if r.get("Metric Name") == "gpu__time_duration.sum":
    by[r["Kernel Name"][:60]].append(float(r["Metric Value"].replace(",", "")) / 1e3)
total = sum(sum(v) for v in by.values())
for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
  print(f"{sum(v):9.1f} us  x{len(v):3d}  {k}   [{' '.join(f'{t:.1f}' for t in v[:6])}]")
print(f"{total:9.1f} us  total over {sum(len(v) for v in by.values())} kernels")
PY
