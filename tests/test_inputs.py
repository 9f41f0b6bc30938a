"""Every "Bad input" of SPEC.md raises ValueError naming the argument; patterns behave."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hilbert_ring_jax import (DilatedPattern, dilated_attention, dilated_attention_reference,
                              hilbert_permutation, hilbert_permutation_per_segment,
                              inverse_permutation, ring_dilated_attention, serialize,
                              unserialize)
from hilbert_ring_jax.ring import sharded_dilated_attention

pytestmark = pytest.mark.old_jax  # what each JAX version accepts differs: CI runs both

P = DilatedPattern((8,), (1,))


@pytest.mark.parametrize("kwargs,match", [
    (dict(segment_lengths=(), dilation_rates=()), "segment_lengths"),
    (dict(segment_lengths=(8, 16), dilation_rates=(1,)), "dilation_rates"),
    (dict(segment_lengths=(0,), dilation_rates=(1,)), "segment_lengths"),
    (dict(segment_lengths=(8,), dilation_rates=(0,)), "dilation_rates"),
    (dict(segment_lengths=(4,), dilation_rates=(5,)), "dilation_rates"),
    (dict(segment_lengths=(8.0,), dilation_rates=(1,)), "segment_lengths"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), offsets="every"), "offsets"),
    (dict(segment_lengths=(8,), dilation_rates=(1,), causal="yes"), "causal"),
])
def test_bad_pattern(kwargs, match):
  with pytest.raises(ValueError, match=match):
    DilatedPattern(**kwargs)


def test_pattern_normalizes_and_hashes():
  p = DilatedPattern([8, 16], [1, 2])
  assert p.segment_lengths == (8, 16) and p.branches == ((8, 1), (16, 2))
  assert hash(p) == hash(DilatedPattern((8, 16), (1, 2)))
  assert DilatedPattern(8, 2).branches == ((8, 2),)
  assert DilatedPattern(np.array([8, 16]), np.arange(1, 3)) == p  # NumPy vectors, as lists
  with pytest.raises(ValueError, match="segment_lengths must hold ints"):
    DilatedPattern(np.array([8.0, 16.0]), (1, 2))
  # NumPy bools, as configs give flags, are taken as bools (NumPy ints are taken as ints).
  flags = DilatedPattern((8, 16), (1, 2), causal=np.True_, head_groups=np.bool_(False))
  assert flags == DilatedPattern((8, 16), (1, 2), causal=True) and type(flags.causal) is bool
  q = jnp.ones((1, 16, 2, 4))
  assert len(dilated_attention(q, q, q, flags, return_lse=np.True_)) == 2
  with pytest.raises(ValueError, match="return_lse must be a bool"):
    dilated_attention(q, q, q, flags, return_lse=1)


def test_head_ranges():
  p = DilatedPattern((4, 8, 16), (1, 2, 4), head_groups=True)
  assert p.head_ranges(5) == ((0, 2), (2, 4), (4, 5))
  assert p.head_ranges(3) == ((0, 1), (1, 2), (2, 3))
  assert DilatedPattern((4, 8), (1, 2)).head_ranges(3) == ((0, 3), (0, 3))


def test_visible_pairs_counts_the_multiplicity():
  p = DilatedPattern((4, 8), (1, 2), causal=True, offsets="all")
  n, h = 10, 2
  # Branch (4, 1): segments 4, 4, 2 -> 10 + 10 + 3 causal pairs; branch (8, 2): segment of 8
  # with residues of 4 tokens each (10 + 10), a segment of 2 with one token per residue (2).
  assert p.visible_pairs(n, h) == h * ((10 + 10 + 3) + (10 + 10 + 2))
  # Distinct: branch (8, 2)'s causal pairs inside a segment of 4 are branch (4, 1)'s too: 3 per
  # residue in [0, 4) and in [4, 8), and the diagonal (8, 8), (9, 9) of the short segments.
  assert p.visible_pairs(n, h, distinct=True) == h * ((10 + 10 + 3) + (10 + 10 + 2) - 14)
  # Some branches' pairs (a launch's: the mosaic backward's keys a query reads).
  assert p.visible_pairs(n, h, branches=(1,)) == h * (10 + 10 + 2)
  with pytest.raises(ValueError, match="branches=None with distinct=True"):
    p.visible_pairs(n, h, distinct=True, branches=(1,))
  assert p.visible_pairs(np.int64(n), np.int32(h)) == p.visible_pairs(n, h)
  for distinct in (False, True):  # both counts check their arguments alike
    for args, name in (((0, h), "seq_len=0"), ((-5, h), "seq_len=-5"), ((10.0, h), "seq_len"),
                       ((n, 0), "num_heads=0"), ((n, True), "num_heads=True")):
      with pytest.raises(ValueError, match=f"{name}"):
        p.visible_pairs(*args, distinct=distinct)


@pytest.mark.parametrize("segments,rates", [((8,), (1,)), ((4, 8, 16), (1, 2, 4)),
                                            ((6, 10, 25), (1, 3, 5)), ((16, 64), (4, 16)),
                                            ((5, 7), (2, 3))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("offsets", ["head", "all"])
@pytest.mark.parametrize("head_groups", [False, True])
def test_visible_pairs_distinct_counts_the_dense_union(segments, rates, causal, offsets,
                                                       head_groups):
  p = DilatedPattern(segments, rates, causal=causal, offsets=offsets, head_groups=head_groups)
  for n, h in ((23, 4), (64, 3), (40, 8)):
    if head_groups and h < len(segments):
      continue
    union = np.zeros((h, n, n), bool)
    for br in p.layout(n, h):
      union |= br.visible(h)
    assert p.visible_pairs(n, h, distinct=True) == union.sum()
    assert p.visible_pairs(n, h, distinct=True) <= p.visible_pairs(n, h)


x = jnp.zeros((1, 8, 2, 4))


@pytest.mark.parametrize("q,k,v,pattern,match", [
    (x[0], x, x, P, "q"),
    (x, x[..., None], x, P, "k"),
    (x, x, x[:, :4], P, "v"),
    (x, x[:, :4], x[:, :4], P, "sequence length"),
    (x, jnp.zeros((2, 8, 2, 4)), jnp.zeros((2, 8, 2, 4)), P, "batch"),
    (x, x[..., :2], x[..., :2], P, "head dim"),
    (jnp.zeros((1, 8, 3, 4)), x, x, P, "heads"),
    (x.astype(jnp.int32), x, x, P, "q"),
    (x, x.astype(jnp.bfloat16), x.astype(jnp.bfloat16), P, "dtype"),
    (x, x, x, DilatedPattern((4, 8, 8), (1, 2, 4), head_groups=True), "head_groups"),
    (x, x, x, "pattern", "pattern"),
])
def test_bad_attention_inputs(q, k, v, pattern, match):
  with pytest.raises(ValueError, match=match):
    dilated_attention(q, k, v, pattern)


@pytest.mark.parametrize("scale", [float("nan"), "0.5", True, jnp.ones(2), jnp.float32(np.inf)])
def test_bad_scale(scale):
  with pytest.raises(ValueError, match="scale"):
    dilated_attention(x, x, x, P, scale=scale)


def test_scale_may_be_a_concrete_scalar_not_a_traced_one():
  """NumPy and JAX scalars are numbers like Python's; under `jit` a traced scale is refused
  (the kernels take it as a constant): pass it as a static argument."""
  want = dilated_attention(x, x, x, P, scale=0.25)
  for scale in (np.float32(0.25), jnp.float32(0.25), jnp.asarray(0.25, jnp.bfloat16)):
    np.testing.assert_array_equal(dilated_attention(x, x, x, P, scale=scale), want)
  with pytest.raises(ValueError, match="scale must be static"):
    jax.jit(lambda s: dilated_attention(x, x, x, P, scale=s))(0.25)


@pytest.mark.parametrize("grid", [(0, 4), (2, 3, 4, 5), (2.5, 4), "ab", -3, (1 << 20, 1 << 20)])
def test_bad_grid(grid):
  with pytest.raises(ValueError, match="grid_shape"):
    hilbert_permutation(grid)


@pytest.mark.parametrize("perm", [[0, 0, 1], [0, 1, 3], [[0, 1, 2]], [0.0, 1.0, 2.0]])
def test_bad_permutation(perm):
  with pytest.raises(ValueError, match="perm"):
    inverse_permutation(perm)


def test_permutation_length_must_match():
  y = jnp.zeros((1, 4, 2))
  with pytest.raises(ValueError, match="perm"):
    serialize(y, np.arange(3))
  with pytest.raises(ValueError, match="perm"):
    unserialize(y, np.arange(5))


@pytest.mark.parametrize("n,w,match", [(0, 4, "n"), (8, 0, "w"), (8, 2.0, "w")])
def test_bad_per_segment(n, w, match):
  with pytest.raises(ValueError, match=match):
    hilbert_permutation_per_segment(n, w)


@pytest.mark.parametrize("q,match", [
    (jnp.zeros((0, 8, 2, 4)), "q must have B, N, H and D"),
    (jnp.zeros((1, 8, 0, 4)), "q must have B, N, H and D"),
    (jnp.zeros((1, 8, 2, 0)), "q must have B, N, H and D"),
    (jnp.zeros((1, 8, 2, 4), jnp.float8_e4m3fn), "q must be float32, bfloat16 or float16"),
    (np.zeros((1, 8, 2, 4), np.int8), "q must be float32"),
    ([[[[0.0] * 4] * 2] * 8], "q must be an array"),
])
def test_input_gaps(q, match):
  """Zero-size axes, unsupported floats and non-arrays: a ValueError naming the argument."""
  kv = jnp.zeros((1, 8, 1, 4))  # q is checked first
  with pytest.raises(ValueError, match=match):
    dilated_attention(q, kv, kv, P)


def test_flags_and_reference_are_checked():
  with pytest.raises(ValueError, match="return_lse"):
    dilated_attention(x, x, x, P, return_lse="no")
  # The dense reference validates like the function.
  for q, k, v, match in [(x.astype(jnp.int32),) * 3 + ("q",),
                         (x, x, x[:, :, :1], "k and v"),
                         (x, jnp.zeros((2, 8, 2, 4)), jnp.zeros((2, 8, 2, 4)), "batch")]:
    with pytest.raises(ValueError, match=match):
      dilated_attention_reference(q, k, v, P)


def test_ring_outside_shard_map():
  with pytest.raises(ValueError, match="axis_name='seq' is not bound"):
    ring_dilated_attention(x, x, x, P, axis_name="seq")


def test_ring_of_unsharded_inputs():
  """Inside a shard_map that tracks what varies, an input that is the same on every device
  of the axis (in_specs without it) is refused by name; without that tracking it is not
  knowable, and with one device it is a shard."""
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  pattern = DilatedPattern((8, 32), (1, 2))
  q = jnp.zeros((1, 32, 2, 8))
  ring = lambda q, k, v: ring_dilated_attention(q, k, v, pattern, axis_name="seq")
  seq, whole = jax.P(None, "seq"), jax.P()
  shard = q[:, :8]  # a shard's shape, given whole
  for specs, inputs, name in (((whole,) * 3, (q, q, q), "q"),
                              ((seq, seq, whole), (q, q, shard), "v")):
    f = jax.shard_map(ring, mesh=mesh, in_specs=specs, out_specs=seq)
    with pytest.raises(ValueError, match=f"{name} is the same on every device of "
                                         f"axis_name='seq'"):
      jax.eval_shape(f, *inputs)
  jax.eval_shape(jax.shard_map(ring, mesh=mesh, in_specs=(whole,) * 3, out_specs=seq,
                               check_vma=False), q, q, q)
  one = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                      devices=jax.devices()[:1])
  jax.eval_shape(jax.shard_map(ring, mesh=one, in_specs=(whole,) * 3, out_specs=seq), q, q, q)


def test_unused_mesh_axis_warns():
  """A mesh axis neither the sequence nor the batch uses holds replicas: a warning says so and
  names `batch_axis`; the result is still exact."""
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64, 2, 8)), jnp.float32)
  pattern = DilatedPattern((16, 64), (1, 4))
  with pytest.warns(UserWarning, match=r"mesh axes \['data'\].*batch_axis='data'"):
    out = sharded_dilated_attention(q, q, q, pattern, mesh=mesh, axis_name="seq")
  ref = jax.jit(lambda q: dilated_attention_reference(q, q, q, pattern))(q)  # one program
  np.testing.assert_allclose(out, ref, atol=1e-5)
  with warnings.catch_warnings():  # (the check is Python's, before tracing: traced only)
    warnings.simplefilter("error")
    jax.eval_shape(lambda q: sharded_dilated_attention(q, q, q, pattern, mesh=mesh,
                                                       axis_name="seq", batch_axis="data"), q)
