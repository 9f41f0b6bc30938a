"""Probe (GPU): ptxas register and spill report of the mosaic backward kernels.

  MOSAIC_GPU_DUMP_PTXAS=1 python3 benchmarks/mosaic_probe/j_ptxas.py 2>&1 | grep -i "spill\\|registers"
  python3 benchmarks/mosaic_probe/j_ptxas.py 128 fused    # one head dim and form only
"""
import sys

import jax
import jax.numpy as jnp

from hilbert_ring_jax import DilatedPattern
from hilbert_ring_jax.api import _Dispatch
from hilbert_ring_jax.backends import base, mosaic

only = sys.argv[1:]
for d in (128, 64):
  for name, cfg in (("fused", {"fused_backward": True}), ("unfused", {"fused_backward": False})):
    if only and (str(d) != only[0] or name != only[1]):
      continue
    print(f"=== D={d} {name}", flush=True)
    pattern = DilatedPattern((2048, 4096, 8192), (1, 2, 4))
    kern = _Dispatch(pattern, d ** -0.5, "mosaic", "mosaic", mosaic.Config(**cfg))
    x = jnp.ones((1, 8192, 2, d), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jax.vjp(lambda *a: base.attention(*a, kern)[0], q, k, v)[1](q))
    jax.block_until_ready(f(x, x, x))
    sys.stdout.flush()
