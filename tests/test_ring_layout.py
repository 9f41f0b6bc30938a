"""The ring on shards in zigzag order (`layout="zigzag"`): equal to one device's result on the
sequence in that order (`zigzag_positions`), gradients too, for every way a branch runs on such
shards; a causal ring over the whole axis moves no queries, keys or outputs into zigzag order
and back."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from hilbert_ring_jax import (DilatedPattern, dilated_attention, inverse_permutation,
                              sharded_dilated_attention, zigzag_positions)
from hilbert_ring_jax import ring as ring_module
from hilbert_ring_jax.backends import xla

AUTO = jax.sharding.AxisType.Auto


def test_zigzag_positions():
  """Shard `p` of `P` holds chunks `p` and `2P - 1 - p` of `2P`, a permutation of the
  positions; bad arguments raise naming them."""
  np.testing.assert_array_equal(zigzag_positions(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  perm = zigzag_positions(24, 3)
  assert perm.dtype == np.int32 and sorted(perm) == list(range(24))
  chunks = perm.reshape(3, 2, 4)[:, :, 0] // 4  # each shard's (early, late) chunk
  np.testing.assert_array_equal(chunks, [[0, 5], [1, 4], [2, 3]])
  np.testing.assert_array_equal(zigzag_positions(6, 1), np.arange(6))
  with pytest.raises(ValueError, match="n=10 must be divisible"):
    zigzag_positions(10, 3)
  for bad in ((0, 2), (8, 0), (8.0, 2), (8, True)):
    with pytest.raises(ValueError, match="must be a positive int"):
      zigzag_positions(*bad)


def test_bad_layout_raises_naming_it():
  m = jax.make_mesh((4,), ("seq",), axis_types=(AUTO,), devices=jax.devices()[:4])
  pattern = DilatedPattern((16,), (1,), causal=True)
  x = jnp.zeros((1, 16, 2, 8))
  with pytest.raises(ValueError, match='layout must be "natural" or "zigzag"'):
    sharded_dilated_attention(x, x, x, pattern, mesh=m, axis_name="seq", layout="striped")
  y = jnp.zeros((1, 12, 2, 8))  # shards of 3 rows
  with pytest.raises(ValueError, match='layout="zigzag" .* shard length 3 must be even'):
    sharded_dilated_attention(y, y, y, DilatedPattern((12,), (1,)), mesh=m, axis_name="seq",
                              layout="zigzag")


# (data, seq, tokens a shard, H, Hkv, pattern over N, ring settings, packed). Heads and head
# dims small, shards of 512-1024 rows, key blocks of 128: several a step (kept short for CI:
# the ring's own tests run these plans at 1024 rows and more in natural order).
CASES = {
    # A whole causal ring gathered in zigzag order, on the shards as they are.
    "full_causal": (1, 4, 512, 2, 1, lambda n: DilatedPattern((n,), (1,), causal=True), {},
                    False),
    # ... rotating its keys.
    "full_causal_rotating": (1, 4, 512, 2, 1, lambda n: DilatedPattern((n,), (1,),
                                                                       causal=True),
                             {"GATHER_LIMIT_BYTES": 0}, False),
    # Packed: local segments, one of them a whole shard, so that their one call moves into
    # natural order (with the sub-ring of 2 shards), and a compact whole ring (as it is, small).
    "longnet_causal_packed": (1, 4, 1024, 2, 2, lambda n: DilatedPattern(
        (512, 1024, 2048, n), (1, 1, 2, 4), causal=True), {}, True),
    # Local segments all within half-shards: their one call on the shards as they are.
    "locals_within_halves": (1, 4, 512, 2, 2, lambda n: DilatedPattern(
        (128, 256, n), (1, 2, 4), causal=True), {}, False),
    # Data x sequence: non-causal, the whole ring dilated (as it is) beside the gather
    # fallback (moved).
    "data2_seq4_gather": (2, 4, 512, 2, 1, lambda n: DilatedPattern((768, n), (1, 2)), {},
                          False),
}


def _layout_case(name, monkeypatch):
  *problem, settings, packed = CASES[name]
  for setting, value in settings.items():
    monkeypatch.setattr(ring_module, setting, value)
  return (*helpers.ring_problem(*problem), packed)


# With `-m slow`: local branches all within half-shards (the layers' test below computes such
# a call too) and the gather fallback on a data x sequence mesh (moved as the packed case is).
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow)
    if name in ("locals_within_halves", "data2_seq4_gather") else name for name in CASES])
def test_zigzag_layout_equals_one_device(monkeypatch, name):
  """Outputs, lse and gradients of the ring on the sequence in zigzag order, put back in
  natural order, equal one device's on the natural sequence; the plans run on the shards as
  they are or moved into natural order and back, both in each mixed case."""
  case, pattern, m, packed = _layout_case(name, monkeypatch)
  seq = m.shape["seq"]
  # pylint: disable-next=protected-access
  plans = list(ring_module._plans(pattern, case.n // seq, seq, case.heads,
                                  case.heads // case.kv_heads, layout="zigzag"))
  as_given = {plan.layout == "zigzag" for plan in plans}
  assert as_given == ({True} if name in ("full_causal", "full_causal_rotating",
                                         "locals_within_halves") else {True, False})
  perm = zigzag_positions(case.n, seq)
  back = inverse_permutation(perm)
  ids = (jnp.asarray(np.random.default_rng(3).integers(0, 3, (case.batch, case.n)).cumsum(1),
                     jnp.int32) if packed else None)  # documents of ~1.5 tokens to ~all
  batch_axis = "data" if "data" in m.shape else None
  config = xla.Config(key_block=128)

  def ring(q, k, v):
    out, lse = sharded_dilated_attention(
        q[:, perm], k[:, perm], v[:, perm], pattern, mesh=m, axis_name="seq",
        batch_axis=batch_axis, segment_ids=None if ids is None else ids[:, perm],
        return_lse=True, config=config, layout="zigzag")
    return out[:, back], lse[:, back]

  single = lambda q, k, v: dilated_attention(q, k, v, pattern, segment_ids=ids,
                                             return_lse=True)
  inputs = helpers.random_inputs(case, jnp.float32, 31)
  helpers.assert_same_results(helpers.results_with_grads(jax.jit(ring), inputs),
                              helpers.results_with_grads(jax.jit(single), inputs))


@pytest.mark.parametrize("name", CASES)
def test_plans_in_natural_order_move_once(monkeypatch, name):
  """The plans that run in natural order share one move of the inputs there and one move of
  their merged results back (forward: o and lse; backward: the summed gradients); a call whose
  plans all run on the shards as they are (the local branches' one call included) moves
  nothing."""
  case, pattern, m, packed = _layout_case(name, monkeypatch)
  moves = []
  real = ring_module._zigzag_moves  # pylint: disable=protected-access
  monkeypatch.setattr(ring_module, "_zigzag_moves", lambda axis_name, xs, to_natural: (
      moves.append(to_natural), real(axis_name, xs, to_natural))[1])
  ids = jnp.zeros((case.batch, case.n), jnp.int32) if packed else None
  call = lambda q, k, v: sharded_dilated_attention(
      q, k, v, pattern, mesh=m, axis_name="seq", batch_axis="data" if "data" in m.shape else None,
      segment_ids=ids, layout="zigzag").sum()
  q, k, v, _, _ = helpers.random_inputs(case, jnp.float32, 1)
  jax.make_jaxpr(jax.grad(call, (0, 1, 2)))(q, k, v)
  # Each traced pass (forward and backward; JAX may trace the forward more than once) moves in
  # once and back once: two plans run in natural order in "longnet_causal_packed", one in the
  # other, so a move back per plan would show there.
  natural = name in ("longnet_causal_packed", "data2_seq4_gather")
  if natural:
    assert len(moves) >= 4 and moves == [True, False] * (len(moves) // 2), moves
  else:
    assert moves == [], moves


@pytest.mark.slow  # ~9 s; test_tensor_parallel runs the switch in natural order by default
def test_zigzag_layout_with_head_shards():
  """Heads split over a mesh axis whose shards read other residues (`heads_axis`, a switch
  between the collectives): a local branch of whole shards (moved into natural order and
  back) and a compact whole causal ring on zigzag shards, outputs, lse and gradients."""
  pattern = DilatedPattern((128, 512), (1, 4), causal=True)
  case = helpers.Case(512, 4, 4, pattern.segment_lengths, pattern.dilation_rates, head_dim=8)
  m = jax.make_mesh((2, 4), ("model", "seq"), axis_types=(AUTO, AUTO))
  perm = zigzag_positions(512, 4)
  back = inverse_permutation(perm)

  def ring(q, k, v):
    out, lse = sharded_dilated_attention(q[:, perm], k[:, perm], v[:, perm], pattern, mesh=m,
                                         axis_name="seq", heads_axis="model", return_lse=True,
                                         layout="zigzag")
    return out[:, back], lse[:, back]

  single = lambda q, k, v: dilated_attention(q, k, v, pattern, return_lse=True)
  inputs = helpers.random_inputs(case, jnp.float32, 32)
  helpers.assert_same_results(helpers.results_with_grads(jax.jit(ring), inputs),
                              helpers.results_with_grads(jax.jit(single), inputs))


def test_zigzag_layout_in_bf16():
  """bf16 inputs on zigzag shards, where the plans moved into natural order (a local call
  holding a branch of whole shards, in bf16, and a sub-ring, in float32) merge their partials
  before the move back: gradients in bf16, within the bf16 tolerance of one device's result."""
  case, pattern, m = helpers.ring_problem(1, 4, 512, 2, 2, lambda n: DilatedPattern(
      (256, 512, 1024, n), (1, 1, 2, 4), causal=True))
  perm = zigzag_positions(case.n, 4)
  q, k, v, dout, _ = helpers.random_inputs(case, jnp.bfloat16, 33)
  loss = lambda f, dout: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * dout)
  want = jax.jit(jax.grad(loss(lambda q, k, v: dilated_attention(q, k, v, pattern), dout),
                          (0, 1, 2)))(q, k, v)
  ring = lambda q, k, v: sharded_dilated_attention(q, k, v, pattern, mesh=m, axis_name="seq",
                                                   layout="zigzag")
  got = jax.jit(jax.grad(loss(ring, dout[:, perm]), (0, 1, 2)))(q[:, perm], k[:, perm],
                                                                  v[:, perm])
  for g, ref in zip(got, want):
    assert g.dtype == jnp.bfloat16
    assert helpers.rel_err(g, np.asarray(ref, np.float64)[:, perm]) < helpers.TOL[jnp.bfloat16]


def _collectives(pattern, layout):
  """`(shape, kind)` of the collectives of the ring's forward and backward over 4 shards of
  32, as lowered, sorted."""
  return sorted((re.sub(r"\{.*\}", "", shape), kind) for shape, kind in
                helpers.ring_collectives(pattern, n=128, grad=True, layout=layout))


def test_a_whole_causal_ring_on_zigzag_shards_moves_only_keys(monkeypatch):
  """Full causal attention over 4 shards of 32, gathered: in natural order the queries, keys,
  values, outputs and the backward's rows move into zigzag order and back (collective
  permutes of half-shards); on shards in zigzag order only the keys' all-gathers (the
  forward's and the backward's, as lowered) and their gradients' one reduce-scatter (dk and dv
  joined along the head dim) remain (small rings take zigzag order there too)."""
  pattern = DilatedPattern((128,), (1,), causal=True)
  monkeypatch.setattr(ring_module, "SMALL_STEP_ROWS", 0)  # natural order's rings in zigzag
  natural = _collectives(pattern, "natural")
  assert ("f32[1,16,2,16]", "collective-permute") in natural
  monkeypatch.setattr(ring_module, "SMALL_STEP_ROWS", 4096)
  assert _collectives(pattern, "zigzag") == [
      ("f32[1,128,2,16]", "all-gather")] * 4 + [("f32[1,32,2,32]", "reduce-scatter")]


def test_layers_on_zigzag_shards():
  """Both layers with `mesh=` and `layout="zigzag"` (rotary positions and the sown weights
  included) on the sequence in zigzag order equal the single-device layer on it in natural
  order, put in the same order; gradients too (Linen). 512 tokens a device on 2."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from hilbert_ring_jax import (  # pylint: disable=g-import-not-at-top
      DilatedMultiHeadAttention, linen)
  pattern = DilatedPattern((256, 1024), (1, 2), causal=True)
  m = jax.make_mesh((2,), ("seq",), axis_types=(AUTO,), devices=jax.devices()[:2])
  perm = zigzag_positions(1024, 2)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 1024, 16)), jnp.float32)
  make = lambda **kw: DilatedMultiHeadAttention(2, 16, pattern=pattern, rotary_base=1e4,
                                                rngs=nnx.Rngs(0), **kw)
  zigzag, plain = make(mesh=m, seq_axis="seq", layout="zigzag"), make()
  got, got_sown = nnx.capture(zigzag, nnx.Intermediate)(x[:, perm], sow_weights=True)
  want, want_sown = nnx.capture(plain, nnx.Intermediate)(x, sow_weights=True)
  np.testing.assert_allclose(got, want[:, perm], rtol=1e-5, atol=1e-5)
  weights = lambda sown: sown["attention_weights"][0]
  np.testing.assert_allclose(weights(got_sown), weights(want_sown)[..., perm, :][..., perm],
                             rtol=1e-5, atol=1e-6)
  module = linen.DilatedMultiHeadAttention(num_heads=2, pattern=pattern, rotary_base=1e4,
                                           mesh=m, seq_axis="seq", layout="zigzag")
  single = linen.DilatedMultiHeadAttention(num_heads=2, pattern=pattern, rotary_base=1e4)
  params = jax.jit(single.init)(jax.random.PRNGKey(0), x[:, :512])
  loss = lambda mod, x: lambda p: jnp.sum(mod.apply(p, x) ** 2)
  g, ref = (jax.jit(jax.grad(loss(mod, y)))(params)
            for mod, y in ((module, x[:, perm]), (single, x)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), g, ref)


def test_layers_check_the_layout():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from hilbert_ring_jax import (  # pylint: disable=g-import-not-at-top
      DilatedMultiHeadAttention, linen)
  pattern = DilatedPattern((16,), (1,), causal=True)
  m = jax.make_mesh((2,), ("seq",), axis_types=(AUTO,), devices=jax.devices()[:2])
  make = lambda **kw: DilatedMultiHeadAttention(2, 8, pattern=pattern, rngs=nnx.Rngs(0), **kw)
  with pytest.raises(ValueError, match='layout must be "natural" or "zigzag"'):
    make(mesh=m, seq_axis="seq", layout="Zigzag")
  with pytest.raises(ValueError, match="it needs mesh="):
    make(layout="zigzag")
  with pytest.raises(ValueError, match="it needs ordering=None"):
    make(mesh=m, seq_axis="seq", layout="zigzag", ordering="hilbert_per_segment")
  module = linen.DilatedMultiHeadAttention(num_heads=2, pattern=pattern, layout="zigzag")
  with pytest.raises(ValueError, match="it needs mesh="):
    module.init(jax.random.PRNGKey(0), jnp.ones((1, 16, 8)))
  layer = make(mesh=m, seq_axis="seq", layout="zigzag")
  with pytest.raises(ValueError, match="seq_axis='seq': its 10 tokens must be divisible by 4"):
    layer(jnp.ones((1, 10, 8)))
