export PYTHONPATH=$PWD:$PWD/benchmarks
cd benchmarks
V=${V:-dq-halves dq-halves-240}
for v in $V; do
  (XLA_PYTHON_CLIENT_PREALLOCATE=false MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python3 mosaic_probe/l_fused.py --ptxas $v > $OUT/ptxas_$v.log 2>&1; echo "$v rc=$?") &
done
wait
for v in $V; do echo "== $v"; grep -i "spill stores" $OUT/ptxas_$v.log | grep -v " 0 bytes spill stores" | head -3; done
timeout 330 python3 mosaic_probe/l_fused.py --checks --time ${T:-split,fused,dq-halves,dq-halves-240} --json $OUT/fused.json 2>&1 | grep -v "^  " | tail -30
