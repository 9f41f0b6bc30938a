"""`dilated_attention` itself: what the "xla" backend's memory grows with, and the numerical
range on the ring. (Every backend against the reference: test_backends.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from hilbert_ring_jax import DilatedPattern, dilated_attention, sharded_dilated_attention


def _temp_bytes(n, w, r, grad):
  pattern = DilatedPattern((w,), (r,))
  x = jax.ShapeDtypeStruct((1, n, 2, 16), jnp.float32)
  f = lambda q, k, v: dilated_attention(q, k, v, pattern, implementation="xla").sum()
  f = jax.grad(f, argnums=(0, 1, 2)) if grad else f
  return jax.jit(f).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_xla_memory_is_linear_in_n_and_flat_in_w(grad):
  """Compiled temporary buffers: double N -> about double; grow w past a key block -> flat.

  (Below one key block of 512, a longer segment means a longer block, as it should.)
  """
  base = _temp_bytes(2048, 1024, 1, grad)
  assert _temp_bytes(2048, 2048, 1, grad) < 1.3 * base
  assert _temp_bytes(2048, 2048, 2, grad) < 1.3 * base
  assert 1.6 * base < _temp_bytes(4096, 1024, 1, grad) < 2.4 * base
  assert 1.6 * base < _temp_bytes(4096, 4096, 1, grad) < 2.4 * base


def test_huge_logits_forward_is_exact_on_the_ring():
  q, k, v = helpers.huge_logits(2)
  pattern = helpers.HUGE_LOGITS_CASE.pattern(causal=True)
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq")
  np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)
