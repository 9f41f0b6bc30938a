"""Hilbert orderings: bijections, inverses, neighbour steps, and attention's invariance."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from hilbert_ring_jax import (DilatedPattern, dilated_attention, hilbert_permutation,
                              hilbert_permutation_per_segment, inverse_permutation, serialize,
                              unserialize)


def steps(shape):
  """L1 distances between consecutive cells of the curve, after checking it is a bijection."""
  perm = hilbert_permutation(shape)
  assert perm.shape == (int(np.prod(shape)),)
  np.testing.assert_array_equal(np.sort(perm), np.arange(np.prod(shape)))
  cells = np.stack(np.unravel_index(perm, shape), axis=-1)
  return np.abs(np.diff(cells, axis=0)).sum(axis=1)


@pytest.mark.parametrize("shape", [(2, 2), (4, 4), (8, 8), (32, 32), (128, 128), (2, 2, 2),
                                   (4, 4, 4), (8, 8, 8), (16, 16, 16)])
def test_power_of_two_grids_step_to_neighbours(shape):
  assert np.all(steps(shape) == 1)


def test_classic_curve_corners():
  """The classic curve on 2^k squares starts at (0, 0) and ends at the corner (0, side-1)."""
  for side in (2, 4, 16, 64):
    perm = hilbert_permutation((side, side))
    assert perm[0] == 0 and perm[-1] in (side - 1, (side - 1) * side)


@pytest.mark.parametrize("shape", list(itertools.product([1, 2, 3, 5, 7, 12, 31], repeat=2)))
def test_rectangles_are_continuous(shape):
  if np.prod(shape) > 1:
    assert np.all(steps(shape) == 1)


@pytest.mark.parametrize("shape", [(3, 5, 7), (6, 10, 14), (5, 5, 5), (2, 9, 9), (3, 4, 4),
                                   (9, 9, 9), (31, 33, 7), (1, 4, 5), (16, 8, 4), (8, 60, 90)])
def test_boxes_are_nearly_continuous(shape):
  s = steps(shape)
  assert np.mean(s == 1) >= 0.9 and np.mean(s) <= 1.1, (np.mean(s == 1), np.mean(s))


def test_even_boxes_are_continuous():
  for shape in [(2, 4, 6), (6, 10, 14), (16, 8, 4), (4, 12, 20)]:
    assert np.all(steps(shape) == 1), shape


def test_one_d_and_cache_isolation():
  np.testing.assert_array_equal(hilbert_permutation((5,)), np.arange(5))
  a = hilbert_permutation((4, 4))
  a[0] = 99  # a caller's copy: the next call is unaffected
  assert hilbert_permutation((4, 4))[0] == 0


def test_per_segment():
  perm = hilbert_permutation_per_segment(23, 8)
  np.testing.assert_array_equal(np.sort(perm), np.arange(23))
  # Segment of 8: a 4x4 grid whose cells t >= 8 are skipped; stays within the segment.
  curve = hilbert_permutation((4, 4))
  np.testing.assert_array_equal(perm[:8], curve[curve < 8])
  np.testing.assert_array_equal(perm[8:16], 8 + curve[curve < 8])
  np.testing.assert_array_equal(perm[16:], 16 + curve[curve < 7])  # the last: length 7


def test_inverse_and_round_trip():
  perm = hilbert_permutation((6, 10))
  inv = inverse_permutation(perm)
  np.testing.assert_array_equal(perm[inv], np.arange(60))
  np.testing.assert_array_equal(inv[perm], np.arange(60))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 60, 3)))
  np.testing.assert_array_equal(serialize(x, perm), np.asarray(x)[:, perm])
  np.testing.assert_array_equal(unserialize(serialize(x, perm), perm), x)
  # Under jit, with the permutation a closed-over host constant (checked while tracing).
  f = jax.jit(lambda x: unserialize(serialize(x, perm), perm))
  np.testing.assert_array_equal(f(x), x)
  # A concrete jax Array is host data too: converted and checked.
  np.testing.assert_array_equal(serialize(x, jnp.asarray(perm)), np.asarray(x)[:, perm])
  np.testing.assert_array_equal(unserialize(serialize(x, perm), jnp.asarray(perm)), x)
  inv_jax = inverse_permutation(jnp.asarray(perm))
  assert isinstance(inv_jax, np.ndarray)
  np.testing.assert_array_equal(inv_jax, inv)
  jnp_perm = jnp.asarray(perm)
  np.testing.assert_array_equal(jax.jit(lambda x: serialize(x, jnp_perm))(x),
                                np.asarray(x)[:, perm])


# The reproducers of traced non-permutations that used to pass silently under jit (duplicated
# rows, a NaN row, and an argsort that turned [0, 0, 1] into [0, 1, 2]), and a valid one: a
# traced perm cannot be checked, so it is refused unless validate=False.
@pytest.mark.parametrize("fn,perm", [
    ("serialize", [0, 0, 1, 2]), ("serialize", [0, 1, 2, 99]), ("unserialize", [0, 0, 1, 2]),
    ("serialize", [3, 2, 1, 0]), ("inverse", [0, 0, 1]), ("inverse", [2, 0, 1])])
def test_traced_permutation_is_refused(fn, perm):
  x = jnp.arange(8.0).reshape(1, 4, 2)
  f = {"serialize": lambda p: serialize(x, p), "unserialize": lambda p: unserialize(x, p),
       "inverse": inverse_permutation}[fn]
  with pytest.raises(ValueError, match=r"perm is a traced value .*validate=False"):
    jax.jit(f)(jnp.asarray(perm))
  # Built with jnp inside the traced function is traced too.
  with pytest.raises(ValueError, match="perm is a traced value"):
    jax.jit(lambda: f(jnp.asarray(perm)))()


def test_validate_false_under_jit():
  """A device-computed permutation: accepted traced, and right when it is one."""
  perm = hilbert_permutation((4, 6))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 24, 3)))
  ser = jax.jit(lambda x, p: serialize(x, p, validate=False))(x, jnp.asarray(perm))
  np.testing.assert_array_equal(ser, np.asarray(x)[:, perm])
  back = jax.jit(lambda y, p: unserialize(y, p, validate=False))(ser, jnp.asarray(perm))
  np.testing.assert_array_equal(back, x)
  inv = jax.jit(lambda p: inverse_permutation(p, validate=False))(jnp.asarray(perm))
  np.testing.assert_array_equal(inv, inverse_permutation(perm))
  # A permutation computed on the device from data: argsort of random keys.
  keys = jax.random.uniform(jax.random.key(0), (24,))
  dev = jax.jit(lambda k: inverse_permutation(jnp.argsort(k), validate=False))(keys)
  np.testing.assert_array_equal(dev, inverse_permutation(np.asarray(jnp.argsort(keys))))
  # Static properties are still checked: rank, integer dtype, length.
  for bad in (jnp.arange(23), jnp.arange(24.0), jnp.arange(24).reshape(4, 6)):
    with pytest.raises(ValueError, match="perm must be a 1-D integer permutation"):
      jax.jit(lambda p: serialize(x, p, validate=False))(bad)


def test_gradients_are_inverse_gathers():
  """The backward of a permutation is the inverse permutation, as a gather: no scatter-add
  (atomics on GPUs) in the compiled gradient, for host and traced permutations, under vmap,
  and of NumPy inputs (eager `jax.grad` hands the rule NumPy data)."""
  perm = hilbert_permutation((6, 10))
  rng = np.random.default_rng(2)
  x, ct = (jnp.asarray(rng.standard_normal((2, 60, 3)), jnp.float32) for _ in range(2))
  for fn, back in ((serialize, unserialize), (unserialize, serialize)):
    _, vjp = jax.vjp(lambda x: fn(x, perm), x)
    np.testing.assert_array_equal(vjp(ct)[0], back(ct, perm))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, perm) * ct)))
    np.testing.assert_array_equal(grad(x), back(ct, perm))
    assert "scatter" not in grad.lower(x).as_text()
    eager = jax.grad(lambda x: jnp.sum(fn(x, perm) * ct))(np.asarray(x))
    np.testing.assert_array_equal(eager, back(ct, perm))
    traced = jax.jit(jax.grad(lambda x, p: jnp.sum(fn(x, p, validate=False) * ct)))
    np.testing.assert_array_equal(traced(x, jnp.asarray(perm)), back(ct, perm))
    batched = jax.vmap(jax.grad(lambda x, c: jnp.sum(fn(x, perm) * c)))(x[None], ct[None])
    np.testing.assert_array_equal(batched[0], back(ct, perm))


@pytest.mark.parametrize("perm,detail", [
    ([0, 1, 3], r"perm\[2\] = 3 is out of range"), ([0, -1, 1], r"perm\[1\] = -1 is out"),
    ([1, 0, 1], r"perm\[2\] = 1 repeats perm\[0\]"), ([2, 0, 0, 3], r"perm\[2\] = 0 repeats")])
def test_not_a_permutation_names_the_value(perm, detail):
  for p in (perm, np.asarray(perm), jnp.asarray(perm)):
    with pytest.raises(ValueError, match=rf"perm is not a permutation of 0..{len(perm) - 1}: "
                                         rf"{detail}"):
      inverse_permutation(p)
  with pytest.raises(ValueError, match=detail):
    jax.jit(lambda x: serialize(x, perm))(jnp.zeros((1, len(perm))))


def test_within_segment_permutation_changes_nothing():
  """One branch, r = 1, non-causal: a permutation inside segments commutes with attention."""
  case = helpers.Case(48, 2, 2, (16,), (1,))
  q, k, v, *_ = helpers.random_inputs(case, jnp.float32, 5)
  pattern = case.pattern(causal=False)
  perm = hilbert_permutation_per_segment(48, 16)
  assert not np.array_equal(perm, np.arange(48))
  plain = dilated_attention(q, k, v, pattern)
  serial = unserialize(dilated_attention(*(serialize(x, perm) for x in (q, k, v)), pattern), perm)
  np.testing.assert_allclose(serial, plain, rtol=1e-5, atol=1e-6)
  # With dilation, residues are defined on processing order, so the order does matter.
  dilated = DilatedPattern((16,), (2,))
  moved = unserialize(dilated_attention(*(serialize(x, perm) for x in (q, k, v)), dilated), perm)
  assert not np.allclose(moved, dilated_attention(q, k, v, dilated), atol=1e-3)


def test_numpy_arrays_serialize_like_jax_arrays():
  """NumPy inputs work as jnp ones do (a regression: `.at` on a NumPy array); other types get
  a ValueError naming `x`."""
  x = np.random.default_rng(0).standard_normal((2, 16, 3)).astype(np.float32)
  perm = hilbert_permutation((4, 4))
  for fn in (serialize, unserialize):
    np.testing.assert_array_equal(fn(x, perm), fn(jnp.asarray(x), perm))
  np.testing.assert_array_equal(unserialize(serialize(x, perm), perm), x)
  for bad in (x.tolist(), "x"):
    with pytest.raises(ValueError, match="x must be a jax or NumPy array"):
      serialize(bad, perm)
