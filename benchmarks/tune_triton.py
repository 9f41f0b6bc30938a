"""Checks the "triton" backend on the GPU and sweeps its block configurations.

1. Checks: triton against xla at float32 "highest" precision (relative L2 of out, lse and
   the three gradients) over shapes that exercise GQA, ragged segments, both offsets, head
   groups, causal, and bf16/f16/f32.
2. Sweeps: every candidate `Tiles` of the forward, dq and dk/dv kernels, timed apart (device-
   synchronized medians), on full attention and the LongNet pattern; cuDNN in the same run.
Usage: python benchmarks/tune_triton.py [--n 16384] [--json out.json] [--skip-checks]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from timing import median_ms
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax.backends import triton as tb

FWD = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
       (128, 32, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2)]
DQ = [(128, 32, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 4),
      (128, 64, 8, 3)]
DKDV = [(32, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (32, 64, 4, 4),
        (64, 128, 8, 3)]


def rel(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  ok = np.isfinite(ref)
  return float(np.linalg.norm(np.where(ok, x - ref, 0)) / max(np.linalg.norm(ref[ok]), 1e-30))


def checks():
  bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
  shapes = [(4096, 4, 4, 128, (512, 1024, 2048), (1, 2, 4), bf16, {}),
            (4096, 8, 2, 64, (1024, 4096), (1, 4), bf16, {}),
            (3000, 4, 4, 64, (512, 1000), (1, 3), bf16, {}),
            (8192, 4, 4, 128, (8192,), (1,), bf16, {}),
            (2048, 6, 3, 128, (256, 2048), (2, 4), bf16, {"offsets": "all"}),
            (2048, 5, 5, 32, (128, 512, 2048), (1, 2, 4), f16, {"head_groups": True}),
            (1024, 4, 2, 128, (256, 1024), (1, 2), f32, {}),
            (512, 2, 2, 256, (128, 512), (1, 4), f32, {}),
            (1000, 6, 2, 256, (300, 1000), (3, 4), bf16, {"head_groups": True})]
  worst = 0.0
  for n, h, hkv, d, segs, rates, dtype, extra in shapes:
    for causal in (False, True):
      pattern = DilatedPattern(segs, rates, causal=causal, **extra)
      rng = np.random.default_rng(0)
      q = jnp.asarray(rng.standard_normal((1, n, h, d)), dtype)
      k, v = (jnp.asarray(rng.standard_normal((1, n, hkv, d)), dtype) for _ in range(2))
      do = jnp.asarray(rng.standard_normal(q.shape), dtype)
      dl = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)

      def run(impl):
        f = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True,
                                              implementation=impl)
        (o, l), vjp = jax.vjp(jax.jit(f), q, k, v)
        return (o, l, *vjp((do, dl)))

      with jax.default_matmul_precision("highest"):
        ref = run("xla")
      got = run("triton")
      errs = [rel(g, r) for g, r in zip(got, ref)]
      worst = max(worst, max(errs) / (1e-4 if dtype == f32 else 3e-2))
      inf_ok = bool(np.array_equal(np.isneginf(np.asarray(got[1])), np.isneginf(np.asarray(ref[1]))))
      print(f"check N={n} H={h}/{hkv} D={d} {jnp.dtype(dtype).name} {segs}x{rates} {extra} "
            f"causal={causal}: out/lse/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs) +
            f" -inf match {inf_ok}", flush=True)
  print(f"checks: worst error / tolerance = {worst:.2f}", flush=True)


def inputs(n, h, d, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((1, n, h, d)), jnp.bfloat16) for _ in range(4)]


def sweep(kind, candidates, n, h, d, pattern, rows):
  q, k, v, do = inputs(n, h, d)
  scale = d ** -0.5
  flops = 4 * d * pattern.visible_pairs(n, h) * (1.0 if kind == "fwd" else 2.5)
  _, lse = dilated_attention(q, k, v, pattern, return_lse=True, implementation="xla"
                             if n <= 8192 else "triton")
  delta = jnp.zeros(lse.shape, jnp.float32)
  for cand in candidates:
    m, n_, warps, stages = cand
    config = tb.Config(**{kind: tb.Tiles(block_m=m, block_n=n_, num_warps=warps,
                                         num_stages=stages)})
    if kind == "fwd":
      fn = jax.jit(lambda q, k, v: tb.forward(q, k, v, pattern, scale, config=config,
                                              out_dtype=q.dtype))
      args = (q, k, v)
    else:
      fn = jax.jit(lambda q, k, v, do, lse, delta: tb.backward(q, k, v, do, lse, delta, pattern,
                                                                scale, config=config))
      args = (q, k, v, do, lse, delta)
    try:
      ms = median_ms(fn, args, runs=7)
      row = dict(kind=kind, cfg=cand, n=n, causal=pattern.causal,
                 pattern=str(pattern.branches), ms=ms, tflops=flops / ms / 1e9)
    except Exception as e:
      row = dict(kind=kind, cfg=cand, n=n, error=f"{type(e).__name__}: {str(e)[:200]}")
    rows.append(row)
    print(json.dumps(row), flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=int, default=16384)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--skip-checks", action="store_true")
  ap.add_argument("--kinds", default="fwd,dq,dkdv")
  ap.add_argument("--patterns", default="full,causal,longnet")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  print(jax.__version__, jax.devices(), flush=True)
  if not args.skip_checks:
    checks()
  n, h, d = args.n, args.heads, args.head_dim
  rows = []
  patterns = {"full": DilatedPattern((n,), (1,)),
              "causal": DilatedPattern((n,), (1,), causal=True),
              "longnet": DilatedPattern((2048, 4096, 8192), (1, 2, 4))}
  patterns = [patterns[name] for name in args.patterns.split(",")]
  for pattern in patterns:
    q, k, v, do = inputs(n, h, d)
    if pattern.num_branches == 1:
      f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=pattern.causal, implementation="cudnn"))
      ms = median_ms(f, (q, k, v), runs=7)
      fb = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: jax.nn.dot_product_attention(
          *a, is_causal=pattern.causal, implementation="cudnn"), q, k, v)[1](do))
      ms_fb = median_ms(fb, (q, k, v, do), runs=7)
      flops = 4 * d * pattern.visible_pairs(n, h)
      row = dict(kind="cudnn", n=n, causal=pattern.causal, ms=ms, tflops=flops / ms / 1e9,
                 fwdbwd_ms=ms_fb, fwdbwd_tflops=3.5 * flops / ms_fb / 1e9)
      rows.append(row)
      print(json.dumps(row), flush=True)
    for kind, cands in (("fwd", FWD), ("dq", DQ), ("dkdv", DKDV)):
      if kind in args.kinds:
        sweep(kind, cands, n, h, d, pattern, rows)
  print("\nsummary (TFLOP/s; dq and dkdv rows time the whole backward with that kernel's config)")
  for row in rows:
    if "error" in row:
      print(f"  {row['kind']:6} {row['cfg']} N={row['n']} error {row['error'][:80]}")
    else:
      extra = f" fwd+bwd {row['fwdbwd_tflops']:.0f}" if "fwdbwd_tflops" in row else ""
      print(f"  {row['kind']:6} {str(row.get('cfg', '')):18} N={row['n']} causal={row['causal']!s:5}"
            f" {row.get('pattern', 'full')[:40]:40} {row['ms']:8.3f} ms {row['tflops']:6.0f}{extra}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f,
                indent=1, default=str)


if __name__ == "__main__":
  main()
