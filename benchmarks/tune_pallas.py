"""Sweeps `Config`s of the pallas backend on the GPU: forward and backward timed apart.

Usage:
  python benchmarks/tune_pallas.py --n 16384 --head-dim 128 --json tune.json
Prints one line per configuration (median ms, TFLOP/s on visible FLOPs: forward 4*B*D*pairs,
backward 2.5x that) for full attention and the LongNet pattern.
"""

from __future__ import annotations

import argparse
import ast
import json

import jax
import jax.numpy as jnp
import numpy as np

from timing import median_ms
from hilbert_ring_jax import DilatedPattern
from hilbert_ring_jax.backends import pallas

# (block_q, block_k, num_warps, num_stages)
FORWARD = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2),
           (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)]
# (block_q_dq, block_k_dq, block_q_dkv, block_k_dkv, num_warps_bwd, num_stages_bwd)
BACKWARD = [(64, 64, 64, 64, 8, 2), (64, 64, 64, 64, 4, 2), (128, 32, 32, 128, 4, 3),
            (128, 32, 32, 128, 8, 3), (128, 64, 64, 128, 8, 2), (64, 32, 32, 64, 4, 3),
            (128, 64, 32, 128, 8, 3), (64, 64, 32, 128, 8, 2), (128, 32, 64, 128, 8, 2),
            (32, 32, 32, 32, 4, 3), (128, 32, 32, 128, 4, 4), (64, 32, 32, 128, 4, 3)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--json", default=None)
  parser.add_argument("--forward", type=ast.literal_eval, default=FORWARD,
                      help="list of (block_q, block_k, num_warps, num_stages)")
  parser.add_argument("--backward", type=ast.literal_eval, default=BACKWARD,
                      help="list of (block_q_dq, block_k_dq, block_q_dkv, block_k_dkv, "
                           "num_warps_bwd, num_stages_bwd)")
  parser.add_argument("--patterns", default="full,longnet")
  args = parser.parse_args()
  n, h, d = args.n, args.heads, args.head_dim
  rng = np.random.default_rng(0)
  q, k, v, dout = (jnp.asarray(rng.standard_normal((1, n, h, d)), jnp.bfloat16)
                   for _ in range(4))
  scale = d ** -0.5
  rows = []
  for name, pattern in (("full", DilatedPattern((n,), (1,), causal=args.causal)),
                        ("longnet", DilatedPattern((2048, 4096, 8192), (1, 2, 4),
                                                   causal=args.causal))):
    if name not in args.patterns.split(","):
      continue
    flops = 4 * d * pattern.visible_pairs(n, h)
    out, lse = jax.jit(lambda q, k, v: pallas.forward(q, k, v, pattern, scale,
                                                      out_dtype=q.dtype))(q, k, v)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    for cfg in args.forward:
      bs = pallas.Config(block_q=cfg[0], block_k=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
      fn = jax.jit(lambda q, k, v, bs=bs: pallas.forward(q, k, v, pattern, scale, config=bs,
                                                         out_dtype=q.dtype))
      try:
        ms = median_ms(fn, (q, k, v), runs=7)
        row = {"pattern": name, "pass": "fwd", "cfg": cfg, "ms": ms, "tflops": flops / ms / 1e9}
      except Exception as e:  # a configuration Triton cannot build is reported
        row = {"pattern": name, "pass": "fwd", "cfg": cfg, "error": str(e)[:200]}
      rows.append(row)
      print(json.dumps(row), flush=True)
    for cfg in args.backward:
      bs = pallas.Config(block_q_dq=cfg[0], block_k_dq=cfg[1], block_q_dkv=cfg[2],
                         block_k_dkv=cfg[3], num_warps_bwd=cfg[4], num_stages_bwd=cfg[5])
      fn = jax.jit(lambda *a, bs=bs: pallas.backward(*a, pattern, scale, config=bs))
      try:
        ms = median_ms(fn, (q, k, v, dout, lse, delta), runs=7)
        row = {"pattern": name, "pass": "bwd", "cfg": cfg, "ms": ms,
               "tflops": 2.5 * flops / ms / 1e9}
      except Exception as e:
        row = {"pattern": name, "pass": "bwd", "cfg": cfg, "error": str(e)[:200]}
      rows.append(row)
      print(json.dumps(row), flush=True)
  print(f"\ndevice={jax.devices()[0].device_kind} n={n} heads={h} head_dim={d} "
        f"causal={args.causal}")
  for row in rows:
    val = f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s" if "ms" in row else row["error"]
    print(f"{row['pattern']:8s} {row['pass']} {str(row['cfg']):28s} {val}")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
