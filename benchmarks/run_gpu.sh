#!/usr/bin/env bash
# How the GPU figures of docs/performance.md are taken on the lent machines (device tool):
# installs the carried wheels (WHL, default .whl: jax-triton), prints versions, then runs the
# named stages, logs under $OUT.
#   bash benchmarks/run_gpu.sh tests-triton tune-triton bench-full ...
#   WHL=.whl4 SITE=/tmp/site4 bash benchmarks/run_gpu.sh tests-triton   # another jax-triton
# The real-data examples (docs/real_data.md): one LM per call, each under 10 minutes; their
# results merge in out/lm_real/lm_real.json on a machine kept warm, copied to $OUT each time:
#   bash benchmarks/run_gpu.sh lm-dilated    (then lm-full, lm-local, digits)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
WHL=${WHL:-.whl}; SITE=${SITE:-/tmp/site}
# WHL_EXTRA (directories, space-separated) is installed alongside: .whl_tk (tokamax and the
# wheels it needs) made with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform \
#     manylinux2014_x86_64 -d .whl_tk tokamax==0.0.17 qwix einshape immutabledict \
#     pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection absl-py
# and .whl_ex (the examples' needs: the same command with -d .whl_ex scikit-learn joblib
#     threadpoolctl tqdm matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing
#     python-dateutil six, and --platform manylinux_2_28_x86_64).
# JAX 0.12 (the machines' own is 0.11.2): its four wheels (233 MB) exceed a call's 64 MiB, so
# they travel in parts of 58 MiB, one a call, to a machine kept warm (the next call within 30 s):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform \
#     manylinux_2_27_x86_64 -d /tmp/w12 jax==0.12.0.1 jaxlib==0.12.0.1 \
#     jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1
#   tar cf - -C /tmp/w12 . | split -b 58M -d - /tmp/j12part  # 4 parts: one in each of the
#   # git-ignored .j12a .. .j12d (echo /.j12a/ >> .git/info/exclude, ...)
#   then 3 calls `mkdir -p /tmp/j12 && cp .j12a/* /tmp/j12/` (carry .j12a; then b, c) and
#   J12=.j12d bash benchmarks/run_gpu.sh STAGES               (carry .j12d)
# On the lent H200s XLA 0.12's collective kernels failed (docs/ring.md, "What to set"): with
# several GPUs add XLA_FLAGS=--xla_gpu_experimental_use_collective_kernels=.
WHEELS=$(for d in "$WHL" ${WHL_EXTRA:-}; do ls "$d"/*.whl; done 2>/dev/null)
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" $WHEELS && export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
if [ -n "${J12:-}" ]; then
  mkdir -p /tmp/j12 && cp "$J12"/* /tmp/j12/ && (cd /tmp/j12 && cat j12part* | tar xf - && \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site12 ./*.whl) && export PYTHONPATH=/tmp/site12:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# NO_NVJITLINK=1: every stage with tools/no_nvjitlink.c preloaded (JAX 0.12: setmaxnreg back).
if [ -n "${NO_NVJITLINK:-}" ]; then
  cc -shared -fPIC -O2 -o /tmp/no_nvjitlink.so tools/no_nvjitlink.c -ldl && \
    export LD_PRELOAD=/tmp/no_nvjitlink.so
fi
# On JAX 0.11 the gathering kernel (ring.KERNEL_GATHER) needs custom calls out of XLA's
# command buffers; on 0.12 (J12) its stages run under XLA's default command buffers.
NO_CB=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN
[ -n "${J12:-}" ] && NO_CB=
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "
import jax, triton
try:
  import jax_triton; jt = jax_triton.__version__
except ImportError:
  jt = None
from hilbert_ring_jax.backends import hopper
print('jax', jax.__version__, 'triton', triton.__version__, 'jax-triton', jt, jax.devices(),
      'registers move:', hopper.REGISTERS_MOVE)"
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    tests-triton) timeout 360 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention.py \
                    tests/test_backends.py -k triton 2>&1 | tail -25 ;;
    tests-triton-quick) timeout 200 python3 -m pytest -q -x -p no:cacheprovider \
                    tests/test_attention.py tests/test_backends.py -k "triton and (float32 or \
                    low_precision or partials or overflow or huge)" 2>&1 | tail -15 ;;
    tests-triton-numerics) timeout 120 python3 -m pytest -q -p no:cacheprovider \
                    tests/test_attention.py -k "triton and (overflow or huge)" 2>&1 | tail -15 ;;
    checks-triton) timeout 240 python3 benchmarks/tune_triton.py --kinds none --patterns longnet \
                    2>&1 | grep -v '^{' | tail -25 ;;
    tests-mosaic) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_mosaic.py \
                    2>&1 | tee "$OUT/tests_mosaic.log" | tail -25 ;;
    checks-mosaic) timeout 280 python3 benchmarks/tune_mosaic.py --skip-timings \
                   --json "$OUT/mosaic_checks.json" 2>&1 | tee "$OUT/mosaic_checks.log" | \
                   grep -v '^{\|^  \|^Traceback' | tail -40 ;;
    time-mosaic) timeout 560 python3 benchmarks/tune_mosaic.py --skip-checks --no-cross \
                   --json "$OUT/mosaic.json" 2>&1 | tee "$OUT/mosaic.log" | \
                   grep -v '^{\|^  \|^Traceback' | tail -60 ;;
    quick-mosaic) timeout 380 python3 benchmarks/tune_mosaic.py --quick --no-cross \
                   --json "$OUT/mosaic_quick.json" 2>&1 | tee "$OUT/mosaic_quick.log" | \
                   grep -v '^{\|^  \|^Traceback' | tail -50 ;;
    tune-mosaic) timeout 420 python3 benchmarks/tune_mosaic.py --json "$OUT/mosaic.json" \
                   2>&1 | tee "$OUT/mosaic.log" | grep -v '^{\|^  \|^Traceback' | tail -50 ;;
    tests-pallas) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_backends.py \
                    tests/test_pallas.py tests/test_packed_kernels.py -k pallas 2>&1 | tail -25 ;;
    tune-triton) timeout 360 python3 benchmarks/tune_triton.py --json "$OUT/tune_triton.json" \
                   2>&1 | tee "$OUT/tune_triton.log" | grep -v '^{' ;;
    tune-triton-fast) timeout 300 python3 benchmarks/tune_triton.py --skip-checks \
                   --json "$OUT/tune_triton.json" 2>&1 | tee "$OUT/tune_triton.log" | tail -5 ;;
    bench-full) timeout 200 python3 benchmarks/bench_attention.py --pattern full \
                  --seq-len 8192,32768,131072 --impl triton,pallas,cudnn,jax_mha,dense_xla \
                  --json "$OUT/full.json" --plot "$OUT/full.png" 2>&1 | grep -v '^{' ;;
    bench-causal) timeout 100 python3 benchmarks/bench_attention.py --pattern full --causal \
                  --seq-len 32768,131072 --impl triton,pallas,cudnn \
                  --json "$OUT/causal.json" 2>&1 | grep -v '^{' ;;
    bench-full-quick) timeout 150 python3 benchmarks/bench_attention.py --pattern full \
                  --seq-len 32768,131072 --impl triton,cudnn --json "$OUT/full.json" 2>&1 | \
                  grep -v '^{' ;;
    bench-longnet-quick) timeout 120 python3 benchmarks/bench_attention.py --pattern longnet \
                  --seq-len 32768,131072 --impl triton,folded_cudnn \
                  --json "$OUT/longnet.json" 2>&1 | grep -v '^{' ;;
    bench-longnet) timeout 150 python3 benchmarks/bench_attention.py --pattern longnet \
                  --seq-len 32768,131072 --impl triton,pallas,folded_cudnn,xla \
                  --json "$OUT/longnet.json" --plot "$OUT/longnet.png" 2>&1 | grep -v '^{' ;;
    memory) timeout 100 python3 benchmarks/bench_attention.py --memory 1048576 \
                  --impl triton,pallas,folded_cudnn --json "$OUT/memory.json" 2>&1 | tail -4 ;;
    longest) timeout 150 python3 benchmarks/bench_attention.py --longest --pattern longnet \
                  --heads 8 --impl triton --json "$OUT/longest.json" 2>&1 | \
                  python3 -c "import sys, json; [print(l.strip()[:300]) for l in sys.stdin]" | \
                  sed 's/"fwd_bytes.*fwdbwd_ms/ ... "fwdbwd_ms/' | tail -6 ;;
    bench-decode) XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95} timeout 580 \
                  python3 benchmarks/bench_decode.py --json "$OUT/decode.json" 2>&1 | \
                  grep -v "^W1\|^I1\|bfc_allocator\|^\*" ;;
    tests-decode) timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
                  -k "mosaic or jit or steps_match" 2>&1 | tail -15 ;;
    quickstart) timeout 300 python3 examples/quickstart.py 2>&1 | tail -12 ;;
    generate) timeout 580 python3 examples/generate.py --preset gpu 2>&1 | tail -3 ;;
    tests-ring) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_ring.py \
                  -k gpus 2>&1 | tail -15 ;;
    tests-ring-all) timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu \
                  tests/test_ring.py tests/test_tensor_parallel.py 2>&1 | tail -15 ;;
    tests-kernel-gather) XLA_FLAGS="${XLA_FLAGS:-} $NO_CB" \
                  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu \
                  tests/test_kernel_gather.py 2>&1 | tail -15 ;;
    ring-kernel-gather) XLA_FLAGS="${XLA_FLAGS:-} $NO_CB" \
                  timeout 560 python3 benchmarks/ring_ab.py --patterns full --passes fwd,fwdbwd \
                  --per-gpu 8192,32768 --set KERNEL_GATHER=True --rounds 3 \
                  --json "$OUT/kernel_gather_ab.json" 2>&1 | grep -v "^W1\|^I1\|bfc_allocator" ;;
    ring-kernel-gather-causal) XLA_FLAGS="${XLA_FLAGS:-} $NO_CB" \
                  timeout 560 python3 benchmarks/ring_ab.py --causal --patterns full \
                  --passes fwd,fwdbwd --per-gpu 8192,32768 --set KERNEL_GATHER=True --rounds 5 \
                  --json "$OUT/causal_kernel_gather_ab.json" 2>&1 | \
                  grep -v "^W1\|^I1\|bfc_allocator" ;;
    ring-zigzag-causal|ring-zigzag-causal-fwdbwd)  # performance.md's zigzag tables: natural
                  # against zigzag shards, each with and without the kernel (4 GPUs: ~250 s a pass)
                  XLA_FLAGS="${XLA_FLAGS:-} $NO_CB" timeout 560 python3 benchmarks/ring_ab.py \
                  --causal --patterns full --per-gpu 8192,32768 --set KERNEL_GATHER=True \
                  --layout zigzag --rounds 5 --passes \
                  $([ "$stage" = ring-zigzag-causal ] && echo fwd,fwdbwd || echo fwdbwd) \
                  --json "$OUT/$stage.json" 2>&1 | grep -v "^W1\|^I1\|bfc_allocator" ;;
    ring) timeout 420 python3 benchmarks/ring_scaling.py --devices 1,$(nvidia-smi -L | wc -l) \
              --per-gpu 8192,32768 --strong 65536 --runs 3 --longest --longest-start 4194304 \
              --json "$OUT/ring.json" 2>&1 | grep -v "^W1\|^I1\|bfc_allocator\|^\*" ;;
    ring-table|ring-table-causal)  # performance.md's table of the ring over every GPU here
                  timeout 560 python3 benchmarks/ring_scaling.py \
                  --devices 1,$(nvidia-smi -L | wc -l) --per-gpu 8192,32768 --strong 0 --runs 5 \
                  $([ "$stage" = ring-table-causal ] && echo --causal) \
                  --json "$OUT/$stage.json" 2>&1 | grep -v "^W1\|^I1\|bfc_allocator\|^\*" ;;
    ring-profile-8k)  # where the 8K rows' time goes: each kernel by op (command buffers off)
                  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout 560 \
                  python3 benchmarks/ring_profile.py --per-gpu 8192 --patterns full,longnet \
                  --passes fwd,fwdbwd --runs 3 --json "$OUT/ring_profile_8k.json" 2>&1 | \
                  grep -v "^W1\|^I1\|bfc_allocator" ;;
    lm-dilated|lm-full|lm-local) timeout 540 python3 examples/lm_real.py --preset gpu \
                  --models "${stage#lm-}" --out-dir out/lm_real 2>&1 | tr '\r' '\n' | \
                  grep -v -E 'it/s\]|s/it\]' | tail -25
                cp out/lm_real/lm_real.json out/lm_real/lm_real.png "$OUT"/ 2>/dev/null ;;
    lm-full-ours) timeout 540 python3 examples/lm_real.py --preset gpu --models full \
                  --full-impl ours --out-dir out/lm_real_ours 2>&1 | tr '\r' '\n' | \
                  grep -v -E 'it/s\]|s/it\]' | tail -25
                cp out/lm_real_ours/lm_real.json "$OUT"/lm_real_ours.json 2>/dev/null ;;
    digits) timeout 540 python3 examples/image_digits.py --preset gpu \
                  --out-dir out/image_digits 2>&1 | tr '\r' '\n' | \
                  grep -v -E 'it/s\]|s/it\]' | tail -25
                cp out/image_digits/image_digits.json out/image_digits/image_digits.png \
                  "$OUT"/ 2>/dev/null ;;
    *) echo "unknown stage $stage" ;;
  esac
done
