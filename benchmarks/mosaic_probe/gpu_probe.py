"""On a Hopper GPU: do dilated (strided) TMA tiles compile and run, and how fast is JAX's own
Mosaic GPU attention next to cuDNN? The baseline for the Mosaic backend (docs/MOSAIC_GPU.md).

  python benchmarks/mosaic_probe/gpu_probe.py [--n 32768] [--json out.json]
"""

import argparse
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import attention_mgpu as am

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # benchmarks/
from timing import median_ms  # noqa: E402


def strided_tiles(b=2, n=8192, h=8, d=128, w=2048, r=4, t=64):
  """Copies every dilated tile of the free view `[B, N/w, w/r, r, H, D]` through TMA (one
  residue and head per program) and checks it against a transpose done by XLA."""
  s, rows = n // w, w // r
  tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  x = jax.random.normal(jax.random.key(0), (b, n, h, d), jnp.bfloat16)
  x6 = x.reshape(b, s, rows, r, h, d)

  def body(x_gmem, o_gmem, x_smem, bar):
    bi, si, ch = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("ch")
    c, hi = ch // h, ch % h
    for i in range(rows // t):
      plgpu.copy_gmem_to_smem(x_gmem.at[bi, si, pl.ds(i * t, t), c, hi], x_smem, bar)
      plgpu.barrier_wait(bar)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(x_smem, o_gmem.at[bi, si, c, hi, pl.ds(i * t, t)])
      plgpu.wait_smem_to_gmem(0)

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((b, s, r, h, rows, d), jnp.bfloat16),
                   scratch_types=[plgpu.SMEM((t, d), jnp.bfloat16, transforms=tr),
                                  plgpu.Barrier()],
                   grid=(b, s, r * h), grid_names=("b", "s", "ch"))
  out = jax.jit(f)(x6)
  ref = x6.transpose(0, 1, 3, 4, 2, 5)
  ok = bool(jnp.array_equal(out, ref))
  ms = median_ms(jax.jit(f), (x6,), runs=10)
  gbs = 2 * x.size * 2 / ms / 1e6
  return dict(test="strided_tma_tiles", ok=ok, ms=ms, gb_per_s=gbs, shape=[b, n, h, d, w, r])


def attention_peers(n, h=16, d=128, runs=5):
  q, k, v, do = (jax.random.normal(jax.random.key(i), (1, n, h, d), jnp.bfloat16)
                 for i in range(4))
  flops = 4 * n * n * h * d
  rows = []
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
  cands = {"cudnn": cudnn}
  for bq, bkv, steps in ((64, 128, 2), (64, 64, 2), (128, 64, 2)):
    cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps,
                          block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    cands[f"mgpu_{bq}x{bkv}x{steps}"] = lambda q, k, v, cfg=cfg: am.attention(q, k, v, cfg)
  ref = jax.jit(cudnn)(q, k, v).astype(jnp.float32)
  for name, fn in cands.items():
    row = dict(test="attention", impl=name, n=n)
    try:
      out = jax.jit(fn)(q, k, v).astype(jnp.float32)
      row["rel_err_vs_cudnn"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
      ms = median_ms(jax.jit(fn), (q, k, v), runs=runs)
      row.update(fwd_ms=ms, fwd_tflops=flops / ms / 1e9)
      fb = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
      ms = median_ms(fb, (q, k, v, do), runs=runs)
      row.update(fwdbwd_ms=ms, fwdbwd_tflops=3.5 * flops / ms / 1e9)
    except Exception as e:  # a config the kernel rejects is reported
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=int, default=32768)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  if am.cuda_versions is None:  # a CPU-only jaxlib: lets the module's version check pass
    am.cuda_versions = types.SimpleNamespace(cuda_runtime_get_version=lambda: 13000)
  print(jax.__version__, jax.devices(), flush=True)
  rows = []
  try:
    rows.append(strided_tiles())
  except Exception as e:
    rows.append(dict(test="strided_tma_tiles", error=f"{type(e).__name__}: {str(e)[:300]}"))
  print(json.dumps(rows[-1]), flush=True)
  rows += attention_peers(args.n)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f,
                indent=1)


if __name__ == "__main__":
  main()
