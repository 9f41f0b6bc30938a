"""Heads split over devices (tensor parallelism): a call on a slice of the heads
(`DilatedPattern.head_offset`, `total_heads`) computes what the call on all heads does for
them, and `heads_axis=` sets that up for each shard inside a `shard_map`."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import reference_np
from hilbert_ring_jax import (DilatedPattern, dilated_attention, ring_dilated_attention,
                              sharded_dilated_attention)
from hilbert_ring_jax import ring as ring_module
from hilbert_ring_jax.backends import mosaic

AUTO = jax.sharding.AxisType.Auto
P = jax.sharding.PartitionSpec

# Head-dependent patterns: residues by head (rates that do not divide the slices' sizes), head
# groups (a slice may meet only some of them), GQA.
PATTERNS = {
    "residues": DilatedPattern((8, 24), (2, 3), causal=True),
    "groups": DilatedPattern((8, 16, 24), (1, 2, 4), head_groups=True),
    "groups_all": DilatedPattern((12, 24), (3, 2), offsets="all", head_groups=True,
                                 causal=True),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_a_slice_of_the_heads_lays_out_as_in_the_whole(name):
  """Residues, head ranges and visibility of heads `[o, o + H)` of `T`, against the whole
  call's layout of those heads."""
  pattern, n, total = PATTERNS[name], 24, 6
  whole = pattern.layout(n, total)
  for offset, heads in ((0, 2), (1, 2), (2, 3), (5, 1), (0, 6)):
    part = dataclasses.replace(pattern, head_offset=offset, total_heads=total)
    for w, p in zip(whole, part.layout(n, heads)):
      assert [p.residues(h) for h in range(heads)] == [
          w.residues(offset + h) for h in range(heads)]
      np.testing.assert_array_equal(p.visible(heads), w.visible(total)[offset:offset + heads])
    assert part.covering(heads) == (None if all(
        set(range(offset, offset + heads)) & set(w.heads) for w in whole) else tuple(
            b for b, w in enumerate(whole) if set(range(offset, offset + heads)) & set(w.heads)))


# Interpreted "pallas" (~3-7 s a pattern): the head groups without offsets "all" with
# `-m slow` ("groups_all" meets head groups too).
@pytest.mark.parametrize("name,implementation", [
    pytest.param(name, implementation, id=f"{name}-{implementation}", marks=(
        () if implementation == "xla" else
        (pytest.mark.pallas, pytest.mark.slow) if name == "groups" else pytest.mark.pallas))
    for implementation in ("xla", "pallas") for name in PATTERNS])
def test_a_call_on_a_slice_of_the_heads_matches_the_reference(name, implementation):
  """`dilated_attention` with `head_offset` and `total_heads` (a branch covering none of the
  slice's heads left out) against the float64 reference's rows of those heads."""
  pattern, n, total, offset, heads = PATTERNS[name], 24, 6, 3, 2
  part = dataclasses.replace(pattern, head_offset=offset, total_heads=total)
  case = helpers.Case(n, heads, 1, pattern.segment_lengths, pattern.dilation_rates,
                      pattern.offsets, pattern.head_groups)
  q, k, v, dout, dlse = helpers.random_inputs(case, jnp.float32, 3)
  (out, lse), grads = helpers.with_grads(
      lambda q, k, v: dilated_attention(q, k, v, part, return_lse=True,
                                        implementation=implementation))(q, k, v, (dout, dlse))
  m = reference_np.multiplicity(n, total, pattern.segment_lengths, pattern.dilation_rates,
                                pattern.causal, pattern.offsets, pattern.head_groups)
  ref_out, ref_lse, ref_grads = reference_np.attention(
      q, k, v, m[offset:offset + heads], 16 ** -0.5, dout, dlse)
  assert helpers.rel_err(out, ref_out) < helpers.TOL[jnp.float32]
  helpers.check_lse(lse, ref_lse, helpers.TOL[jnp.float32])
  for g, ref in zip(grads, ref_grads):
    assert helpers.rel_err(g, ref) < 2 * helpers.TOL[jnp.float32]


def _inputs(shape, kv_heads, seed=0):
  """q, k, v, dout and dlse (`helpers.random_inputs`) of `[B, N, H, D]` queries."""
  b, n, h, d = shape
  case = helpers.Case(n, h, kv_heads, (n,), (1,), batch=b, head_dim=d)
  return helpers.random_inputs(case, jnp.float32, seed)


def _equal_with_grads(fn, whole, inputs):
  """`fn` and `whole` agree on outputs, lse and gradients."""
  helpers.assert_same_results(helpers.results_with_grads(fn, inputs),
                              helpers.results_with_grads(whole, inputs))


# (The oldest JAX meets two mesh axes in test_ring.py's data x sequence ring.)
# (`-m slow`, ~8-16 s each: residues by head, which the packed and ring tests below split by
# `heads_axis` too, and head groups without offsets "all", which "groups_all" meets.)
@pytest.mark.parametrize("name,kv_heads", [pytest.param("residues", 4, marks=pytest.mark.slow),
                                           ("groups_all", 4),
                                           pytest.param("groups", 8, marks=pytest.mark.slow)])
def test_heads_axis_computes_each_shards_heads_as_the_whole_call(name, kv_heads):
  """`dilated_attention(heads_axis=)` in a `shard_map` splitting 8 heads over 4 devices equals
  one call on all of them (shards that compute differently each take their own program);
  without `heads_axis` each device numbers its heads from 0, and the result differs."""
  pattern = PATTERNS[name]
  mesh = jax.make_mesh((4,), ("model",), axis_types=(AUTO,), devices=jax.devices()[:4])
  inputs = _inputs((1, 48, 8, 8), kv_heads)
  split = lambda axis: jax.shard_map(
      lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True, heads_axis=axis),
      mesh=mesh, in_specs=P(None, None, "model"), out_specs=P(None, None, "model"))
  whole = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True)
  _equal_with_grads(split("model"), whole, inputs)
  if name == "residues":  # (head groups of 2 heads: 3 branches need 3, without heads_axis)
    out, _ = jax.jit(split(None))(*inputs[:3])
    assert not np.allclose(out, whole(*inputs[:3])[0], atol=1e-3)


# Tensor x sequence parallelism on a (model 2, seq 4) mesh, LongNet with 2 heads a shard (the
# two shards read other residues: each kernel call and compaction switches on the shard, the
# collectives between them alike), 1024 keys a shard: a local branch, a ring whose steps call
# kernels on dilated segments, a compact ring.
RING_TP = DilatedPattern((512, 2048, 4096), (1, 2, 4), causal=True)


def test_ring_with_heads_axis_on_a_model_by_sequence_mesh():
  """The ring inside a user's `shard_map` equals one call, gradients too (`RING_TP`)."""
  assert len({p.shard_key(2) for p in (dataclasses.replace(RING_TP, head_offset=o,
                                                           total_heads=4) for o in (0, 2))}) == 2
  _ring_equals_one_call(RING_TP, _inputs((1, 4096, 4, 8), 2, seed=1))


def _ring_over_model_and_seq(pattern):
  """`(q, k, v) -> (out, lse)`: the ring inside a user's `shard_map` over a (model 2, seq 4)
  mesh, the heads over "model"."""
  mesh = jax.make_mesh((2, 4), ("model", "seq"), axis_types=(AUTO, AUTO))
  spec = P(None, "seq", "model")
  return jax.shard_map(
      lambda q, k, v: ring_dilated_attention(q, k, v, pattern, axis_name="seq",
                                             heads_axis="model", return_lse=True),
      mesh=mesh, in_specs=spec, out_specs=(spec, spec))


def _ring_equals_one_call(pattern, inputs):
  """`_ring_over_model_and_seq` equals one call on all heads: outputs, lse and gradients."""
  whole = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True)
  _equal_with_grads(_ring_over_model_and_seq(pattern), whole, inputs)


def test_ring_with_heads_axis_and_head_groups_of_one_branch():
  """Head groups of one branch are all the heads: the shards differ in residues only (2 heads
  a shard, rate 4), which a ring runs."""
  pattern = DilatedPattern((64,), (4,), causal=True, head_groups=True)
  mesh = jax.make_mesh((2, 4), ("model", "seq"), axis_types=(AUTO, AUTO))
  q, k, v, _, _ = _inputs((1, 64, 4, 8), 4, seed=3)
  out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
                                  heads_axis="model")
  np.testing.assert_allclose(out, dilated_attention(q, k, v, pattern), rtol=1e-5, atol=1e-5)


# (~9 s, `-m slow`: the 16-bit test below runs the same plans at half the length against the
# float64 reference.)
@pytest.mark.slow
def test_ring_with_heads_axis_and_head_groups_of_several_branches():
  """Head groups of several branches split over 2 shards of 4 heads: each shard covers some
  branches only (the first shard's heads none of the 4096-token branch's, the second's none
  of the 512-token one's), and still meets every branch's collectives (the 2048 and 4096
  tokens ones span shards of 1024); the ring inside a user's `shard_map` equals one call,
  gradients too."""
  pattern = DilatedPattern((512, 2048, 4096), (1, 2, 4), causal=True, head_groups=True)
  shards = [dataclasses.replace(pattern, head_offset=o, total_heads=8) for o in (0, 4)]
  assert [[bool(h1 > h0) for h0, h1 in p.head_ranges(4)] for p in shards] == [
      [True, True, False], [False, True, True]]
  _ring_equals_one_call(pattern, _inputs((1, 4096, 8, 8), 2, seed=4))


# (float16, ~12 s, with `-m slow`: bfloat16 takes the same switches.)
@pytest.mark.parametrize("dtype", [jnp.bfloat16,
                                   pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_ring_with_heads_axis_and_head_groups_in_16_bits(dtype):
  """The rings above in 16 bits: on the shard none of whose heads is in the local branch, that
  branch's empty step returns its zeros in the dtype the other shard's backend returns (a
  `lax.switch` needs equal types); outputs, lse and gradients against the float64
  reference (at half the length: shards of 512 rows, the same plans: the first shard's heads
  none of the 2048-token branch's, the second's none of the 256-token one's)."""
  pattern = DilatedPattern((256, 1024, 2048), (1, 2, 4), causal=True, head_groups=True)
  shards = [dataclasses.replace(pattern, head_offset=o, total_heads=8) for o in (0, 4)]
  assert [[bool(h1 > h0) for h0, h1 in p.head_ranges(4)] for p in shards] == [
      [True, True, False], [False, True, True]]
  ring = _ring_over_model_and_seq(pattern)
  case = helpers.Case(2048, 8, 2, pattern.segment_lengths, pattern.dilation_rates,
                      head_groups=True)
  inputs = helpers.random_inputs(case, dtype, 5)
  (out, lse), grads = helpers.with_grads(ring)(*inputs[:3], tuple(inputs[3:]))
  helpers.check_result(case, True, dtype, inputs, out, lse, grads)


@pytest.mark.slow  # ~20 s: the same switches in zigzag order, ids beside the keys
def test_sharded_with_heads_axis_packed_in_zigzag_order(monkeypatch):
  """`sharded_dilated_attention` (no replicas: no warning) with packed documents, its rings
  in zigzag order (`RING_TP`), equals one call."""
  mesh = jax.make_mesh((2, 4), ("model", "seq"), axis_types=(AUTO, AUTO))
  inputs, pattern = _inputs((1, 4096, 4, 8), 2, seed=1), RING_TP
  monkeypatch.setattr(ring_module, "SMALL_STEP_ROWS", 0)
  ids = jnp.asarray(np.repeat(np.arange(9), 500)[None, :4096], jnp.int32)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no replicas along "model"
    out, _ = sharded_dilated_attention(*inputs[:3], pattern, mesh=mesh, axis_name="seq",
                                       heads_axis="model", segment_ids=ids, return_lse=True)
  assert tuple(out.sharding.spec[1:3]) == ("seq", "model")
  np.testing.assert_allclose(out, dilated_attention(*inputs[:3], pattern, segment_ids=ids),
                             rtol=1e-5, atol=1e-5)


def test_bad_heads_axis_raises_naming_it():
  mesh = jax.make_mesh((2, 4), ("model", "seq"), axis_types=(AUTO, AUTO))
  pattern = PATTERNS["residues"]
  q, k, v, _, _ = _inputs((1, 48, 4, 8), 2)
  in_map = lambda fn, kv_spec=P(None, None, "model"): jax.shard_map(
      fn, mesh=mesh, in_specs=(P(None, None, "model"), kv_spec, kv_spec),
      out_specs=P(None, None, "model"))
  with pytest.raises(ValueError, match="heads_axis='model' is not bound"):
    dilated_attention(q, k, v, pattern, heads_axis="model")
  with pytest.raises(ValueError, match="heads_axis must be None or a mesh axis name"):
    dilated_attention(q, k, v, pattern, heads_axis=1)
  offset = DilatedPattern((8,), (2,), head_offset=2, total_heads=8)
  with pytest.raises(ValueError, match="give a pattern without them"):
    in_map(lambda q, k, v: dilated_attention(q, k, v, offset, heads_axis="model"))(q, k, v)
  with pytest.raises(ValueError, match="k and v must split their heads over heads_axis"):
    in_map(lambda q, k, v: dilated_attention(q, k, v, pattern, heads_axis="model"),
           P())(q, k, v)
  # q whole on every device of the axis (in_specs without it): all heads, not a slice.
  whole = jax.shard_map(lambda q, k, v: dilated_attention(q, k, v, pattern, heads_axis="model"),
                        mesh=mesh, in_specs=(P(),) * 3, out_specs=P())
  with pytest.raises(ValueError, match="q is the same on every device of heads_axis='model'"):
    whole(q, k, v)
  for bad in ("seq", "tensor"):  # the sequence's axis; no axis of the mesh
    with pytest.raises(ValueError, match="heads_axis must be None or a mesh axis other"):
      sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq", heads_axis=bad)
  with pytest.raises(ValueError, match="k's 1 heads must be divisible by the size 2"):
    sharded_dilated_attention(q, k[:, :, :1], v[:, :, :1], pattern, mesh=mesh,
                              axis_name="seq", heads_axis="model")


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_offset=-1), "head_offset must be an int >= 0"),
    (dict(head_offset=True), "head_offset must be an int >= 0"),
    (dict(total_heads=0), "total_heads must be an int >= 1"),
    (dict(head_offset=4, total_heads=4), "head_offset must be below total_heads")])
def test_bad_head_offsets_raise_naming_them(kwargs, match):
  with pytest.raises(ValueError, match=match):
    DilatedPattern((8,), (2,), **kwargs)


def test_a_slice_past_total_heads_raises():
  q = k = v = jnp.zeros((1, 8, 4, 8))
  with pytest.raises(ValueError, match="exceed total_heads=6"):
    dilated_attention(q, k, v, DilatedPattern((8,), (2,), head_offset=3, total_heads=6))


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_gpu_kernels_on_a_slice_of_the_heads(implementation):
  """The GPU kernels (bf16, D = 128) on heads 5-10 of 16 equal the whole call's rows of them:
  LongNet with head groups (the slice meets two of four) and residues by head."""
  if implementation == "mosaic" and not mosaic.is_hopper():
    pytest.skip("the mosaic kernels run on Hopper GPUs")
  if implementation == "triton":
    pytest.importorskip("jax_triton")
  pattern = DilatedPattern((512, 1024, 2048, 4096), (1, 2, 4, 8), causal=True,
                           head_groups=True)
  part = dataclasses.replace(pattern, head_offset=5, total_heads=16)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 4096, 16, 128)), jnp.bfloat16) for _ in "qkv")
  whole = dilated_attention(q, k, v, pattern, implementation=implementation)[:, :, 5:11]
  out = dilated_attention(q[:, :, 5:11], k[:, :, 5:11], v[:, :, 5:11], part,
                          implementation=implementation)
  assert helpers.rel_err(out, whole) < 1e-2


def test_heads_axis_with_packed_documents():
  """`segment_ids` (replicated over "model") through the shards' switch and through the ring
  with `heads_axis`: equal to one call's."""
  pattern = DilatedPattern((64, 256), (1, 4), causal=True)
  q, k, v, _, _ = _inputs((1, 256, 8, 16), 8, seed=2)
  ids = jnp.asarray(np.repeat(np.arange(5), 52)[None, :256], jnp.int32)
  expected = dilated_attention(q, k, v, pattern, segment_ids=ids)
  heads = jax.make_mesh((4,), ("model",), axis_types=(AUTO,), devices=jax.devices()[:4])
  spec = P(None, None, "model")
  split = jax.jit(jax.shard_map(
      lambda q, k, v, ids: dilated_attention(q, k, v, pattern, segment_ids=ids,
                                             heads_axis="model"),
      mesh=heads, in_specs=(spec, spec, spec, P()), out_specs=spec))
  np.testing.assert_allclose(split(q, k, v, ids), expected, rtol=1e-5, atol=1e-5)
  mesh = jax.make_mesh((2, 4), ("model", "seq"), axis_types=(AUTO, AUTO))
  out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
                                  heads_axis="model", segment_ids=ids)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
