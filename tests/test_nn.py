"""Flax layers: the NNX module, `dilated_attention_fn` and the Linen twin."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import reference_np
from hilbert_ring_jax import (DilatedMultiHeadAttention, DilatedPattern, dilated_attention,
                              dilated_attention_fn, dilated_attention_reference,
                              hilbert_permutation, hilbert_permutation_per_segment, linen,
                              serialize, unserialize)

B, N, F, H, HKV = 2, 16, 16, 4, 2  # N = 4 x 4 grid; head dim 4
PATTERN = DilatedPattern((8, 16), (1, 2))
CAUSAL = DilatedPattern((4, 16), (1, 4), causal=True)
RANDOM_PERM = np.random.default_rng(0).permutation(N)
ORDERINGS = {
    "none": (dict(), None),
    "hilbert": (dict(ordering="hilbert", grid_shape=(4, 4)), hilbert_permutation((4, 4))),
    "per_segment": (dict(ordering="hilbert_per_segment"), hilbert_permutation_per_segment(N, 8)),
    "explicit": (dict(ordering=RANDOM_PERM), RANDOM_PERM),
}


@pytest.fixture(autouse=True)
def _full_precision():
  """float32 matmuls in full precision on GPUs too (they default to TF32 there)."""
  with jax.default_matmul_precision("highest"):
    yield


def make_layer(pattern=PATTERN, seed=0, **kwargs):
  kwargs = dict(dict(num_heads=H, in_features=F, num_kv_heads=HKV), **kwargs)
  return DilatedMultiHeadAttention(pattern=pattern, rngs=nnx.Rngs(seed), **kwargs)


def inputs(seed=1, n=N):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, n, F)), jnp.float32)


def params(layer):
  return nnx.to_pure_dict(nnx.state(layer, nnx.Param))


def forward_np(p, x, pattern, perm=None, num_heads=H):
  """The layer in float64 NumPy: projections, reference_np attention, output projection."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x, np.float64)
  x = x if perm is None else x[:, perm]
  q, k, v = (np.einsum("BNF,FHD->BNHD", x, p[name]["kernel"]) + p[name]["bias"]
             for name in ("query", "key", "value"))
  m = reference_np.multiplicity(x.shape[1], num_heads, pattern.segment_lengths,
                                pattern.dilation_rates, pattern.causal, pattern.offsets,
                                pattern.head_groups)
  out, _ = reference_np.attention(q, k, v, m, q.shape[-1] ** -0.5)
  y = np.einsum("BNHD,HDO->BNO", out, p["out"]["kernel"]) + p["out"]["bias"]
  return y if perm is None else y[:, np.argsort(perm)]


@pytest.mark.parametrize("ordering", list(ORDERINGS))
def test_against_reference(ordering):
  kwargs, perm = ORDERINGS[ordering]
  layer = make_layer(qkv_features=24 if ordering == "none" else F, out_features=12, **kwargs)
  x = inputs()
  y = layer(x)
  assert y.shape == (B, N, 12) and y.dtype == jnp.float32
  ref = forward_np(params(layer), x, PATTERN, perm)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_gqa_parameter_shapes():
  p = params(nnx.eval_shape(lambda: make_layer(qkv_features=32)))
  assert p["query"]["kernel"].shape == (F, H, 8)
  assert p["key"]["kernel"].shape == p["value"]["kernel"].shape == (F, HKV, 8)
  assert p["out"]["kernel"].shape == (H, 8, F)


def test_jit_and_grad_match_dense_reference():
  """Values and parameter gradients under nnx.jit against a dense float32 composition."""
  layer = make_layer(ordering="hilbert", grid_shape=(4, 4))
  x = inputs()
  target = inputs(seed=2)
  perm = hilbert_permutation((4, 4))

  @nnx.jit
  def loss_and_grad(layer, x):
    return nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(layer)

  @jax.jit
  def dense_loss(p):
    xs = serialize(x, perm)
    q, k, v = (jnp.einsum("BNF,FHD->BNHD", xs, p[n]["kernel"]) + p[n]["bias"]
               for n in ("query", "key", "value"))
    out = dilated_attention_reference(q, k, v, PATTERN)
    y = jnp.einsum("BNHD,HDO->BNO", out, p["out"]["kernel"]) + p["out"]["bias"]
    return jnp.mean((unserialize(y, perm) - target) ** 2)

  loss, grads = loss_and_grad(layer, x)
  ref_loss, ref_grads = jax.value_and_grad(dense_loss)(params(layer))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, r in zip(jax.tree.leaves(nnx.to_pure_dict(grads)), jax.tree.leaves(ref_grads)):
    assert np.abs(r).max() > 0
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_dropout():
  x = inputs()
  plain = make_layer()
  layer = make_layer(dropout_rate=0.5)
  nnx.update(layer, nnx.state(plain, nnx.Param))
  expected = plain(x)
  np.testing.assert_array_equal(layer(x, deterministic=True), expected)
  a = layer(x, rngs=nnx.Rngs(dropout=1))
  b = layer(x, rngs=nnx.Rngs(dropout=1))
  c = layer(x, rngs=nnx.Rngs(dropout=2))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c) and not np.allclose(a, expected)
  # The layer's own stream advances between calls.
  assert not np.allclose(layer(x), layer(x))
  # Constructor default, per-call override, and model.eval().
  eval_layer = make_layer(dropout_rate=0.5, deterministic=True)
  nnx.update(eval_layer, nnx.state(plain, nnx.Param))
  np.testing.assert_array_equal(eval_layer(x), expected)
  assert not np.allclose(eval_layer(x, deterministic=False), expected)
  layer.eval()
  np.testing.assert_array_equal(layer(x), expected)


@pytest.mark.parametrize("ordering", ["hilbert", "per_segment", "explicit"])
def test_ordering_equivariance(ordering):
  kwargs, perm = ORDERINGS[ordering]
  ordered = make_layer(**kwargs)
  plain = make_layer(seed=5)
  nnx.update(plain, nnx.state(ordered, nnx.Param))
  x = inputs()
  y = ordered(x)
  np.testing.assert_allclose(y, unserialize(plain(serialize(x, perm)), perm), rtol=1e-6,
                             atol=1e-6)
  assert not np.allclose(y, plain(x), atol=1e-3)  # the order matters for this pattern


@pytest.mark.parametrize("ordering", ["none", "explicit"])
def test_causal_leak(ordering):
  """Perturbing the tokens processed after position t leaves outputs up to t unchanged."""
  kwargs, perm = ORDERINGS[ordering]
  perm = np.arange(N) if perm is None else perm
  layer = make_layer(CAUSAL, **kwargs)
  x = inputs()
  t = 9
  noise = np.zeros(x.shape, np.float32)
  noise[:, perm[t + 1:]] = 100 * np.random.default_rng(3).standard_normal((B, N - t - 1, F))
  fn = nnx.jit(lambda m, x: m(x))
  y, y2 = fn(layer, x), fn(layer, x + noise)
  np.testing.assert_array_equal(y[:, perm[:t + 1]], y2[:, perm[:t + 1]])
  assert not np.allclose(y[:, perm[t + 1:]], y2[:, perm[t + 1:]])


def test_linen_parity():
  kwargs = dict(num_heads=H, num_kv_heads=HKV, qkv_features=24, out_features=12,
                pattern=PATTERN, ordering="hilbert", grid_shape=(4, 4))
  layer = DilatedMultiHeadAttention(in_features=F, rngs=nnx.Rngs(0), **kwargs)
  module = linen.DilatedMultiHeadAttention(**kwargs)
  x = inputs()
  variables = module.init(jax.random.PRNGKey(7), x)
  shapes = lambda tree: jax.tree.map(jnp.shape, tree)
  assert shapes(dict(variables["params"])) == shapes(params(layer))
  y = module.apply({"params": params(layer)}, x)
  np.testing.assert_allclose(y, layer(x), rtol=1e-6, atol=1e-6)
  # Dropout: deterministic is the identity; otherwise the `dropout` rng collection decides.
  drop = linen.DilatedMultiHeadAttention(dropout_rate=0.5, **kwargs)
  apply = lambda seed, det: drop.apply({"params": params(layer)}, x, deterministic=det,
                                       rngs={"dropout": jax.random.PRNGKey(seed)})
  np.testing.assert_array_equal(apply(0, True), y)
  np.testing.assert_array_equal(apply(0, False), apply(0, False))
  assert not np.allclose(apply(0, False), apply(1, False))


def test_attention_fn_in_nnx_multi_head_attention():
  fn = dilated_attention_fn(CAUSAL)
  mha = nnx.MultiHeadAttention(H, F, num_kv_heads=HKV, attention_fn=fn, decode=False,
                               rngs=nnx.Rngs(0))
  x = inputs()
  y = mha(x)
  q, k, v = mha.query(x), mha.key(x), mha.value(x)
  assert k.shape == (B, N, HKV, F // H)
  np.testing.assert_allclose(y, mha.out(dilated_attention(q, k, v, CAUSAL)), rtol=1e-6, atol=1e-6)
  # Same parameters in the layer give the same numbers.
  layer = make_layer(CAUSAL, seed=3)
  nnx.update(layer, nnx.state(mha, nnx.Param))
  np.testing.assert_allclose(layer(x), y, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(mha(x, is_causal=True), y, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="mask"):
    mha(x, mask=jnp.ones((B, H, N, N), bool))
  with pytest.raises(ValueError, match="bias"):
    fn(q, k, v, bias=jnp.zeros((B, H, N, N)))
  with pytest.raises(ValueError, match="is_causal"):
    dilated_attention_fn(PATTERN)(q, k, v, is_causal=True)
  # Several batch dims, and dropout applied to the output when asked for.
  y5 = fn(*(x.reshape((1,) + x.shape) for x in (q, k, v)))
  np.testing.assert_allclose(y5[0], dilated_attention(q, k, v, CAUSAL), rtol=1e-6, atol=1e-6)
  dropped = fn(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(0))
  kept = dropped != 0
  assert 0.3 < float(jnp.mean(kept)) < 0.7
  np.testing.assert_allclose(dropped[kept], 2 * dilated_attention(q, k, v, CAUSAL)[kept],
                             rtol=1e-6)


def test_optimizer_steps_reduce_loss():
  layer = make_layer(CAUSAL)
  optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)
  x, target = inputs(), inputs(seed=2)

  @nnx.jit
  def step(layer, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(layer)
    optimizer.update(layer, grads)
    return loss

  losses = [float(step(layer, optimizer)) for _ in range(10)]
  assert losses[-1] < 0.8 * losses[0], losses


def test_checkpoint_roundtrip(tmp_path):
  layer = make_layer(ordering="hilbert", grid_shape=(4, 4))
  x = inputs()
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", nnx.state(layer, nnx.Param))
  checkpointer.wait_until_finished()
  other = make_layer(seed=9, ordering="hilbert", grid_shape=(4, 4))
  assert not np.allclose(other(x), layer(x))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(other, nnx.Param))
  nnx.update(other, checkpointer.restore(tmp_path / "ckpt", abstract))
  np.testing.assert_array_equal(other(x), layer(x))


@pytest.mark.parametrize("kwargs,match", [
    (dict(qkv_features=18), "qkv_features=18 must be divisible by num_heads=4"),
    (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
    (dict(ordering="hilbert"), "grid_shape"),
    (dict(ordering="morton"), "ordering='morton'"),
    (dict(ordering=np.array([0, 2, 2, 1])), "permutation"),
    (dict(ordering=np.array([0.0, 1.0])), "permutation"),
    (dict(ordering="hilbert_per_segment", grid_shape=(4, 4)), "grid_shape"),
    (dict(dropout_rate=1.0), "dropout_rate"),
    (dict(seq_axis="seq"), "seq_axis"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_layer(**kwargs)
  linen_kwargs = dict(dict(num_heads=H, num_kv_heads=HKV, pattern=PATTERN), **kwargs)
  with pytest.raises(ValueError, match=match):
    linen.DilatedMultiHeadAttention(**linen_kwargs).init(jax.random.PRNGKey(0), inputs())


@pytest.mark.parametrize("kwargs,match", [
    (dict(ordering="hilbert", grid_shape=(4, 8)), r"grid_shape=\(4, 8\) has 32 tokens"),
    (dict(ordering=np.arange(8)), "ordering has 8 tokens"),
])
def test_size_mismatch_at_call(kwargs, match):
  layer = make_layer(**kwargs)
  with pytest.raises(ValueError, match=match):
    layer(inputs())
  with pytest.raises(ValueError, match="in_features=16"):
    make_layer()(jnp.ones((B, N, 8)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(in_features=-8), "in_features=-8"),
    (dict(in_features=8.5), "in_features=8.5"),
    (dict(in_features=0), "in_features=0"),
    (dict(out_features=0), "out_features=0"),
    (dict(dropout_rate="0.1"), "dropout_rate='0.1'"),
])
def test_layer_argument_types(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_layer(**kwargs)


def test_mesh_needs_seq_axis():
  mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  layer = make_layer(mesh=mesh)
  with pytest.raises(ValueError, match="seq_axis"):
    layer(inputs())


def test_layers_with_data_and_sequence_axes():
  """NNX and Linen layers on a (data=2, seq=4) mesh equal the single-device layer."""
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = inputs()
  sharded = make_layer(mesh=mesh, seq_axis="seq", batch_axis="data")
  np.testing.assert_allclose(jax.jit(lambda x: sharded(x))(x), make_layer()(x), rtol=1e-5,
                             atol=1e-5)
  module = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN,
                                           mesh=mesh, seq_axis="seq", batch_axis="data")
  plain = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN)
  params = plain.init(jax.random.PRNGKey(0), x)
  np.testing.assert_allclose(jax.jit(module.apply)(params, x), plain.apply(params, x),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="batch_axis"):
    make_layer(batch_axis="data")
