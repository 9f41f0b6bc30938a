#!/usr/bin/env bash
# Nsight Compute profiles of single calls (n_profile.py) and the interleaved A/B of Config
# variants (m_persistent.py), in one device call:
#   bash benchmarks/mosaic_probe/n_run.sh "ab:--shapes 4,6 --variant persistent=True" \
#       "prof:lnc64:--shape longnet-causal-64" "prof:tk32:--shape full-32k --impl tokamax"
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
WHEELS=$(ls .whl/*.whl .whl_tk/*.whl 2>/dev/null)
[ -n "$WHEELS" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site $WHEELS
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
NCU=(ncu --clock-control none --profile-from-start off --section SpeedOfLight
     --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis
     --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis)
for job in "$@"; do
  echo "=== $job ($(date +%T))"
  case $job in
    ab:*) timeout 330 python3 benchmarks/mosaic_probe/m_persistent.py ${job#ab:} \
            2>&1 | tee -a "$OUT/ab.log" | grep -v '^{' ;;
    prof:*) rest=${job#prof:}; name=${rest%%:*}; argv=${rest#*:}
            timeout 200 "${NCU[@]}" -f -o "/tmp/prof_$name" python3 \
              benchmarks/mosaic_probe/n_profile.py $argv > "$OUT/prof_$name.log" 2>&1
            ncu --import "/tmp/prof_$name.ncu-rep" --page details > "$OUT/prof_$name.txt" 2>&1
            tail -2 "$OUT/prof_$name.log"
            grep -E '^  [a-zA-Z_]|Duration|Elapsed Cycles|SM Active Cycles|Executed Ipc|Registers Per|Achieved Occupancy|L2 Hit Rate|Compute \(SM\) Throughput|DRAM Throughput|Grid Size|Waves Per SM|Issued Warp Per|No Eligible|Warp Cycles Per Issued' \
              "$OUT/prof_$name.txt" | head -80 ;;
    src:*) rest=${job#src:}; name=${rest%%:*}; rest=${rest#*:}; skip=${rest%%:*}; argv=${rest#*:}
           # The (skip+1)-th mosaic kernel of the call: stall samples per SASS instruction.
           timeout 200 ncu --clock-control none --profile-from-start off -k regex:mosaic \
             --launch-skip "$skip" --launch-count 1 --section SourceCounters \
             --section WarpStateStats -f -o "/tmp/src_$name" python3 \
             benchmarks/mosaic_probe/n_profile.py $argv > "$OUT/src_$name.log" 2>&1
           ncu --import "/tmp/src_$name.ncu-rep" --page source --csv --print-source sass \
             > "/tmp/src_$name.csv" 2>&1
           gzip -c "/tmp/src_$name.csv" > "$OUT/src_$name.csv.gz"
           python3 benchmarks/mosaic_probe/n_top.py "/tmp/src_$name.csv" > "$OUT/src_$name.txt" 2>&1
           head -45 "$OUT/src_$name.txt" ;;
  esac
done
