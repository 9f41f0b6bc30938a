set -x
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site

cd benchmarks
timeout 420 python3 mosaic_probe/k_knobs.py --json $OUT/knobs.json 2>&1 | grep -v "^  " | tail -60
MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 mosaic_probe/k_knobs.py --ptxas 2>&1 | grep -i "===\|spill\|registers\|error" | head -40
