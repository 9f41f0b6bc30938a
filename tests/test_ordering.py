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
  # Under jit, with the permutation traced.
  f = jax.jit(lambda x, p: unserialize(serialize(x, p), p))
  np.testing.assert_array_equal(f(x, jnp.asarray(perm)), x)


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
