"""`merge`: against float64, at fully masked and overflowed rows (values and gradients), shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hilbert_ring_jax import merge

INF = np.inf


def merge_np(outs, lses):
  """float64 reference: lse = logsumexp_i lse_i, out = sum_i exp(lse_i - lse) o_i."""
  outs, lses = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
  lse = np.logaddexp.reduce(lses, axis=0)
  with np.errstate(invalid="ignore"):
    w = np.where(np.isfinite(lse), np.exp(lses - lse), 0.0)
  return np.einsum("k...,k...d->...d", w, outs), lse


def parts(k, seed, rows=(6, 5), d=4, spread=3.0, masked=0.0):
  """k partials `[rows..., d]`, lse `[rows...]`; a fraction `masked` of their rows unseen
  (lse_i = -inf, o_i = 0, as every partial has them)."""
  rng = np.random.default_rng(seed)
  outs = rng.standard_normal((k, *rows, d)).astype(np.float32)
  lses = (spread * rng.standard_normal((k, *rows))).astype(np.float32)
  unseen = rng.random(lses.shape) < masked
  lses[unseen], outs[unseen] = -INF, 0.0
  return outs, lses


def loss(outs, lses, c_out, c_lse):
  """A scalar of out and lse, with the usual guard on lse (which alone used to give NaN)."""
  out, lse = merge(list(outs), list(lses))
  return jnp.sum(out * c_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * c_lse)


def cotangents(outs, lses, seed=9):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(outs.shape[1:]).astype(np.float32),
          rng.standard_normal(lses.shape[1:]).astype(np.float32))


def grads(outs, lses):
  """Gradients of `loss` with respect to the stacked outs and lses."""
  return jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(outs), jnp.asarray(lses),
                                                 *cotangents(outs, lses))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("spread,masked", [(3.0, 0.0), (300.0, 0.0), (3.0, 0.4)])
def test_finite_rows_match_float64(k, spread, masked):
  outs, lses = parts(k, seed=k, spread=spread, masked=masked)
  lses[0, 0, 0] = 2.0  # at least one row surely seen
  out, lse = merge(list(jnp.asarray(outs)), list(jnp.asarray(lses)))
  ref_out, ref_lse = merge_np(outs, lses)
  seen = np.isfinite(ref_lse)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse)[seen], ref_lse[seen], rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(lse)[~seen] == -INF)


def test_finite_gradients_match_float64():
  """The gradient at seen rows, partially masked ones included, is the float64 one."""
  outs, lses = parts(3, seed=4, masked=0.3)
  lses[:, 0, 0] = -INF  # and one fully masked row
  g_outs, g_lses = grads(outs, lses)
  with jax.enable_x64():
    args = (jnp.asarray(x, jnp.float64) for x in (outs, lses, *cotangents(outs, lses)))
    ref_outs, ref_lses = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
  seen = np.isfinite(lses).any(axis=0)
  np.testing.assert_allclose(np.asarray(g_outs)[:, seen], np.asarray(ref_outs)[:, seen],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(g_lses)[:, seen], np.asarray(ref_lses)[:, seen],
                             rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fully_masked_rows(k):
  """Rows no partial sees: out = 0, lse = -inf, and finite gradients that are zero there."""
  outs, lses = parts(k, seed=1, masked=0.2)
  lses[:, 1], outs[:, 1] = -INF, 0.0  # row 1 is masked in every partial
  lses[:, 3, 2], outs[:, 3, 2] = -INF, 0.0
  masked = np.isneginf(lses).all(axis=0)
  out, lse = merge(list(jnp.asarray(outs)), list(jnp.asarray(lses)))
  assert np.all(np.asarray(out)[masked] == 0) and np.all(np.asarray(lse)[masked] == -INF)
  assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
  g_outs, g_lses = (np.asarray(g) for g in grads(outs, lses))
  assert np.all(np.isfinite(g_outs)) and np.all(np.isfinite(g_lses))
  assert np.all(g_lses[:, masked] == 0) and np.abs(g_lses[:, ~masked]).max() > 0
  if k > 1:  # one partial is returned as it is: its out's gradient passes through
    assert np.all(g_outs[:, masked] == 0)
  # Everything masked, under jit.
  g_outs, g_lses = jax.jit(grads)(np.zeros_like(outs), np.full_like(lses, -INF))
  assert np.all(np.asarray(g_lses) == 0) and (k == 1 or np.all(np.asarray(g_outs) == 0))


def test_positive_infinity_dominates():
  """A +inf lse (an overflowed denominator): out = mean of the +inf partials' outs, lse = +inf."""
  outs, lses = parts(3, seed=2, rows=(4,))
  lses[0, 0] = INF  # row 0: partial 0 alone
  lses[[1, 2], 1] = INF  # row 1: partials 1 and 2
  lses[:, 2] = [-INF, INF, -INF]  # row 2: partial 1, the others masked
  out, lse = merge(list(jnp.asarray(outs)), list(jnp.asarray(lses)))
  out = np.asarray(out)
  np.testing.assert_array_equal(lse[:3], [INF, INF, INF])
  np.testing.assert_allclose(out[0], outs[0, 0], rtol=1e-6)
  np.testing.assert_allclose(out[1], (outs[1, 1] + outs[2, 1]) / 2, rtol=1e-6)
  np.testing.assert_allclose(out[2], outs[1, 2], rtol=1e-6)
  ref_out, ref_lse = merge_np(outs[:, 3:], lses[:, 3:])  # row 3 is finite: unaffected
  np.testing.assert_allclose(out[3:], ref_out, rtol=1e-5)
  np.testing.assert_allclose(lse[3:], ref_lse, rtol=1e-6)
  g_outs, g_lses = (np.asarray(g) for g in grads(outs, lses))
  assert np.all(np.isfinite(g_outs)) and np.all(np.isfinite(g_lses))
  assert np.all(g_lses[:, :3] == 0)
  c_out = cotangents(outs, lses)[0]
  np.testing.assert_allclose(g_outs[:, 1], [0 * c_out[1], c_out[1] / 2, c_out[1] / 2])


def test_nan_stays_nan():
  outs, lses = parts(2, seed=3, rows=(3,))
  lses[0, 1] = np.nan
  out, lse = (np.asarray(x) for x in merge(list(jnp.asarray(outs)), list(jnp.asarray(lses))))
  assert np.isnan(lse[1]) and np.isnan(out[1]).all()
  assert np.isfinite(lse[[0, 2]]).all() and np.isfinite(out[[0, 2]]).all()


def test_unseen_partial_adds_nothing():
  """A partial with lse -inf adds exactly 0 to its row, also where its out is NaN or inf (a
  ring hides causal blocks by their lse alone): the row and its gradients equal the merge's
  without it."""
  outs, lses = parts(3, seed=4, rows=(3,))
  outs[1, 1], outs[1, 2, 0] = np.nan, np.inf
  lses[1, 1:] = -np.inf
  out, lse = merge(list(jnp.asarray(outs)), list(jnp.asarray(lses)))
  alone = merge([jnp.asarray(outs[0]), jnp.asarray(outs[2])],
                [jnp.asarray(lses[0]), jnp.asarray(lses[2])])
  np.testing.assert_array_equal(out[1:], alone[0][1:])
  np.testing.assert_array_equal(lse[1:], alone[1][1:])
  # Gradients: those of the merge without it; zero for the partial itself.
  loss = lambda outs, lses: sum(x.sum() for x in merge(outs, lses))
  grads = jax.grad(loss, (0, 1))(list(jnp.asarray(outs)), list(jnp.asarray(lses)))
  grads_alone = jax.grad(loss, (0, 1))([jnp.asarray(outs[0]), jnp.asarray(outs[2])],
                                       [jnp.asarray(lses[0]), jnp.asarray(lses[2])])
  for g, g_alone in zip(grads, grads_alone):
    assert np.all(np.asarray(g[1])[1:] == 0)
    for i, j in ((0, 0), (2, 1)):
      np.testing.assert_allclose(np.asarray(g[i])[1:], np.asarray(g_alone[j])[1:], rtol=1e-6)


@pytest.mark.parametrize("out_shapes,lse_shapes,match", [
    ([(3, 4), (3, 4)], [(3,), (4,)], r"lses\[1\] must have its out's shape"),
    ([(3, 4), (3, 4)], [(1,), (3,)], r"lses\[0\]"),  # would broadcast
    ([(3, 4), (3, 4)], [(3, 1), (3, 1)], r"lses\[0\]"),
    ([(3, 4)], [(4,)], r"lses\[0\]"),
    ([(3, 4), (3, 5)], [(3,), (3,)], r"outs must all have one shape.*outs\[1\]"),
    ([(3, 4), (1, 4)], [(3,), (1,)], r"outs\[1\]"),
    ([(), ()], [(), ()], "outs must have a last"),
    ([(3, 4)], [(3,), (3,)], "matching"),
])
def test_shapes_are_checked(out_shapes, lse_shapes, match):
  outs = [jnp.zeros(s) for s in out_shapes]
  lses = [jnp.zeros(s) for s in lse_shapes]
  with pytest.raises(ValueError, match=match):
    merge(outs, lses)
  with pytest.raises(ValueError, match=match):
    jax.jit(merge)(outs, lses)
