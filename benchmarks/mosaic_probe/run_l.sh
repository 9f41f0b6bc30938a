export PYTHONPATH=$PWD:$PWD/benchmarks
cd benchmarks
V=${V:-plain plain-split}
for v in $V; do
  (XLA_PYTHON_CLIENT_PREALLOCATE=false MOSAIC_GPU_DUMP_PTXAS=1 timeout 240 python3 mosaic_probe/l_fused.py --ptxas $v > $OUT/ptxas_$v.log 2>&1; echo "$v rc=$?") &
done
wait
for v in $V; do echo "== $v"; grep -i "spill stores" $OUT/ptxas_$v.log | head -3; tail -3 $OUT/ptxas_$v.log; done
timeout 400 python3 mosaic_probe/l_fused.py --checks --time ${T:-split,fused,plain,plain-split} --json $OUT/fused.json 2>&1 | grep -v "^  " | tail -30
