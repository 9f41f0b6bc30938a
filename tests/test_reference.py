"""The float64 reference itself: its analytic gradients agree with finite differences."""

import numpy as np

import reference_np


def test_reference_gradients_match_finite_differences():
  rng = np.random.default_rng(0)
  b, n, h, hkv, d = 1, 10, 4, 2, 3
  q = rng.standard_normal((b, n, h, d))
  k, v = rng.standard_normal((2, b, n, hkv, d))
  dout = rng.standard_normal(q.shape)
  dlse = rng.standard_normal(q.shape[:3])
  m = reference_np.multiplicity(n, h, (4, 6), (1, 2), causal=True, offsets="all")
  scale = 0.7

  def loss(q, k, v):
    out, lse = reference_np.attention(q, k, v, m, scale)
    return np.sum(out * dout) + np.sum(lse * dlse)

  _, _, grads = reference_np.attention(q, k, v, m, scale, dout, dlse)
  eps = 1e-6
  for i, x in enumerate((q, k, v)):
    for idx in [tuple(rng.integers(0, s) for s in x.shape) for _ in range(6)]:
      plus, minus = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
      plus[i][idx] += eps
      minus[i][idx] -= eps
      numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
      np.testing.assert_allclose(grads[i][idx], numeric, rtol=1e-6, atol=1e-7)


def test_multiplicity_counts_shared_keys_twice():
  # Two identical branches: every visible key counts twice, and the softmax is unchanged.
  m2 = reference_np.multiplicity(8, 1, (4, 4), (1, 1))
  m1 = reference_np.multiplicity(8, 1, (4,), (1,))
  np.testing.assert_array_equal(m2, 2 * m1)
  assert m1[0, 0, :4].tolist() == [1, 1, 1, 1] and m1[0, 0, 4:].sum() == 0
