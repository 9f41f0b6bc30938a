#!/usr/bin/env bash
# Patterns for examples/lm_real.py's dilated model on one GPU: checks of the head-grouped ones
# against "xla", then the training step of each (profile_step.py --loop: steady-state ms a step).
#   bash benchmarks/mosaic_probe/pattern_probe.sh NAME="lm_real flags" ...   (base: the preset, with full)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
[ -n "${CHECK:-}" ] && timeout 200 python3 benchmarks/mosaic_probe/lm_check.py --hg 2>&1 | \
  tee "$OUT/hg_check.log" | grep -v Warning
for spec in "$@"; do
  name=${spec%%=*}; flags=${spec#*=}
  models=dilated; [ "$name" = base ] && models=dilated,full
  timeout 240 python3 benchmarks/profile_step.py --preset "${PRESET:-gpu}" --steps 0 \
    --loop "${LOOP:-200}" --models $models --set "$flags" --json "$OUT/speed_$name.json" \
    2>&1 | grep '^==\|Error' | sed "s/^/$name /"
done
