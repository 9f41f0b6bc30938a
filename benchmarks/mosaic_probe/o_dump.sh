#!/usr/bin/env bash
# PTX and ptxas reports of the kernels j_ptxas.py compiles (a forward and its backward),
# with module flags of backends/mosaic.py set ("NAME=value,..."; "" for none), for analysis
# elsewhere (ptxas and nvdisasm run on a CPU machine: the nvidia-cuda-nvcc and
# nvidia-cuda-nvdisasm wheels):
#   bash benchmarks/mosaic_probe/o_dump.sh fused128 "" 128 fused
# writes $OUT/NAME.tgz (entry_*.ptx, entry_*.ptxas of each kernel compiled, the log).
set -uo pipefail
OUT=${OUT:-out}; name=$1; flags=$2; shift 2
dir=/tmp/dump_$name; mkdir -p "$dir"
MOSAIC_GPU_DUMP_TO=$dir MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=$PWD \
  timeout 250 python3 -c "
import runpy, sys
from hilbert_ring_jax.backends import mosaic
for kv in '$flags'.split(','):
  if kv:
    k, v = kv.split('='); setattr(mosaic, k, eval(v))
sys.argv = ['j_ptxas.py', *sys.argv[1:]]
runpy.run_path('benchmarks/mosaic_probe/j_ptxas.py', run_name='__main__')
" "$@" > "$dir/log.txt" 2>&1
echo "== $name ($flags $*)"; grep -h -E "spill stores|Used [0-9]+ registers" "$dir"/*.ptxas
tar czf "$OUT/$name.tgz" -C "$dir" $(cd "$dir" && ls *.ptx *.ptxas log.txt)
