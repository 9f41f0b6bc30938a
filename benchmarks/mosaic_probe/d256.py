"""Which pass of triton needs too much shared memory at head dim 256 in float16 (GPU)."""
import jax, jax.numpy as jnp, numpy as np
from hilbert_ring_jax import DilatedPattern, dilated_attention
p = DilatedPattern((512, 2048), (1, 4), causal=True)
rng = np.random.default_rng(0)
for dtype in (jnp.float16, jnp.bfloat16):
  q, k, v = (jnp.asarray(rng.standard_normal((1, 2048, 4, 256)), dtype) for _ in range(3))
  for impl in ("triton", "mosaic"):
    try:
      jax.block_until_ready(dilated_attention(q, k, v, p, implementation=impl))
      print(impl, dtype.__name__, "forward ok")
      g = jax.grad(lambda q, k, v: dilated_attention(q, k, v, p, implementation=impl).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
      jax.block_until_ready(g); print(impl, dtype.__name__, "backward ok")
    except Exception as e:
      print(impl, dtype.__name__, type(e).__name__, str(e)[:200])
