"""Triton backward tiles that fit shared memory at head dim 256 in float16 (GPU probe)."""
import jax, jax.numpy as jnp, numpy as np
from hilbert_ring_jax import DilatedPattern, dilated_attention
from hilbert_ring_jax.backends.triton import Config, Tiles
p = DilatedPattern((512, 2048), (1, 4), causal=True)
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((1, 2048, 4, 256)), jnp.float16) for _ in range(3))
ref = jax.grad(lambda q: dilated_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), p, implementation="xla").sum())(q)
for dq, dkdv in [((128, 32, 8, 2), (32, 64, 8, 1)), ((64, 32, 4, 2), (32, 32, 4, 2)),
                 ((64, 32, 8, 2), (32, 64, 8, 2)), ((128, 32, 8, 1), (32, 32, 8, 2))]:
  cfg = Config(dq=Tiles(block_m=dq[0], block_n=dq[1], num_warps=dq[2], num_stages=dq[3]),
               dkdv=Tiles(block_m=dkdv[0], block_n=dkdv[1], num_warps=dkdv[2], num_stages=dkdv[3]))
  try:
    g = jax.grad(lambda q, k, v: dilated_attention(q, k, v, p, implementation="triton", config=cfg).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
    err = float(jnp.linalg.norm(g[0].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    print("d256 f16 tiles", dq, dkdv, "ok, dq rel err", err, flush=True)
  except Exception as e:
    print("d256 f16 tiles", dq, dkdv, type(e).__name__, str(e)[:120], flush=True)
