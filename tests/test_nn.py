"""Flax layers: the NNX module, `dilated_attention_fn` and the Linen twin."""

import contextlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import helpers
import reference_np
from hilbert_ring_jax import (DilatedMultiHeadAttention, DilatedPattern, dilated_attention,
                              dilated_attention_fn, dilated_attention_reference,
                              hilbert_permutation, hilbert_permutation_per_segment, linen,
                              serialize, unserialize)
from hilbert_ring_jax.layers_common import rotate

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


def make_layer(pattern=PATTERN, seed=0, rngs=None, **kwargs):
  kwargs = dict(dict(num_heads=H, in_features=F, num_kv_heads=HKV), **kwargs)
  rngs = nnx.Rngs(seed) if rngs is None else rngs
  return DilatedMultiHeadAttention(pattern=pattern, rngs=rngs, **kwargs)


def inputs(seed=1, n=N):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, n, F)), jnp.float32)


def params(layer):
  return nnx.to_pure_dict(nnx.state(layer, nnx.Param))


def projections_np(p, x, perm=None, xk=None, xv=None, key_mask=None):
  """float64 q, k, v of the layer's parameters `p` (keys from `xk`, values from `xv`, default
  `x`) and the key mask (default: all visible), in the processing order of `perm`."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x, np.float64)
  xk = x if xk is None else np.asarray(xk, np.float64)
  xv = xk if xv is None else np.asarray(xv, np.float64)
  key_mask = np.ones(xk.shape[:2], bool) if key_mask is None else np.asarray(key_mask)
  if perm is not None:
    x, xk, xv, key_mask = (a[:, perm] for a in (x, xk, xv, key_mask))
  q, k, v = (np.einsum("BNF,FHD->BNHD", a, p[name]["kernel"]) + p[name]["bias"]
             for name, a in (("query", x), ("key", xk), ("value", xv)))
  return p, q, k, v, key_mask


def multiplicity_np(pattern, n_q, n_k, num_heads=H):
  """`reference_np.multiplicity` `[H, n_q, n_k]`; keys of another length than the queries only
  under a pattern that shows every key to every query (FULL), whatever the length."""
  return reference_np.multiplicity(max(n_q, n_k), num_heads, pattern.segment_lengths,
                                   pattern.dilation_rates, pattern.causal, pattern.offsets,
                                   pattern.head_groups)[:, :n_q, :n_k]


def forward_np(p, x, pattern, perm=None, num_heads=H, xk=None, xv=None, key_mask=None):
  """The layer in float64 NumPy: projections, reference_np attention with the keys where
  `key_mask [B, Nk]` is False removed from visibility, output projection."""
  p, q, k, v, key_mask = projections_np(p, x, perm, xk, xv, key_mask)
  m = multiplicity_np(pattern, q.shape[1], k.shape[1], num_heads)
  out = np.concatenate([
      reference_np.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], m * key_mask[b],
                             q.shape[-1] ** -0.5)[0] for b in range(len(q))])
  y = np.einsum("BNHD,HDO->BNO", out, p["out"]["kernel"]) + p["out"]["bias"]
  return y if perm is None else y[:, np.argsort(perm)]


def weights_np(p, x, pattern, perm=None, key_mask=None):
  """The attention probabilities `[B, H, N, N]` in float64, in the caller's token order."""
  _, q, k, _, key_mask = projections_np(p, x, perm, key_mask=key_mask)
  k = np.repeat(k, H // HKV, axis=2)
  s = q.shape[-1] ** -0.5 * np.einsum("bihd,bjhd->bhij", q, k)
  m = multiplicity_np(pattern, q.shape[1], k.shape[1])[None] * key_mask[:, None, None, :]
  e = np.where(m > 0, m * np.exp(s - s.max(-1, keepdims=True)), 0.0)
  w = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  if perm is not None:
    inv = np.argsort(perm)
    w = w[:, :, inv][:, :, :, inv]
  return w


def key_mask_np(seed=4, batch=B, n=N):
  """`[batch, n]` bool: keys hidden at random, and in the second example the first segment of
  PATTERN's first branch, so that its queries of the other residue see no key in half the
  heads."""
  mask = np.random.default_rng(seed).random((batch, n)) < 0.7
  mask[1] = np.arange(n) >= 8
  return mask


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
  layer = make_layer(dropout_rate=0.5, deterministic=False)
  nnx.update(layer, nnx.state(plain, nnx.Param))
  expected = plain(x)
  np.testing.assert_array_equal(layer(x, deterministic=True), expected)
  a = layer(x, rngs=nnx.Rngs(dropout=1))
  b = layer(x, rngs=nnx.Rngs(dropout=1))
  c = layer(x, rngs=nnx.Rngs(dropout=2))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c) and not np.allclose(a, expected)
  # A stream or a key in place of the Rngs, as nnx.Dropout takes them.
  np.testing.assert_array_equal(layer(x, rngs=nnx.Rngs(dropout=1).dropout), a)
  np.testing.assert_array_equal(layer(x, rngs=nnx.Rngs(dropout=1).dropout()), a)
  # The layer's own stream advances between calls.
  assert not np.allclose(layer(x), layer(x))
  # Constructor default, per-call override, and model.eval().
  eval_layer = make_layer(dropout_rate=0.5, deterministic=True)
  nnx.update(eval_layer, nnx.state(plain, nnx.Param))
  np.testing.assert_array_equal(eval_layer(x), expected)
  assert not np.allclose(eval_layer(x, deterministic=False), expected)
  layer.eval()
  np.testing.assert_array_equal(layer(x), expected)
  layer.train()
  assert not np.allclose(layer(x), expected)
  np.testing.assert_array_equal(nnx.view(layer, deterministic=True)(x), expected)


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


def test_rotary_position_embedding():
  """`rotary_base`: q and k turned by position (checked against complex multiplication),
  scores depending on positions only through their difference, applied in the layer after
  the projections at the tokens' positions in the caller's order (so an ordering keeps them),
  in both layers alike; bad bases raise ValueError."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1, N, H, 8))
  pos = rng.permutation(40)[:N]
  rq, rk = rotate(jnp.asarray(x, jnp.float32), jnp.asarray(x[:, :, :2], jnp.float32), 100.0, pos)
  z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * pos[:, None, None] * 100.0 ** (-np.arange(4) / 4))
  np.testing.assert_allclose(rq, np.concatenate([z.real, z.imag], -1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rk, rq[:, :, :2], rtol=1e-6)
  score = lambda p: jnp.einsum("bnhd,bmhd->bhnm", *rotate(*(jnp.asarray(x, jnp.float32),) * 2,
                                                          100.0, p))
  np.testing.assert_allclose(score(pos + 7), score(pos), rtol=1e-4, atol=1e-4)
  # In the layer: the projections, then the turn at the caller's positions, then attention.
  for kwargs, perm in (ORDERINGS["none"], ORDERINGS["hilbert"]):
    layer = make_layer(CAUSAL, rotary_base=50.0, **kwargs)
    xs = inputs()
    serial = xs if perm is None else serialize(xs, perm)
    q, k = rotate(layer.query(serial), layer.key(serial), 50.0,
                  np.arange(N) if perm is None else perm)
    want = layer.out(dilated_attention(q, k, layer.value(serial), CAUSAL))
    want = want if perm is None else unserialize(want, perm)
    np.testing.assert_allclose(layer(xs), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(make_layer(CAUSAL, **kwargs)(xs), want, atol=1e-3)
    module = linen.DilatedMultiHeadAttention(H, num_kv_heads=HKV, pattern=CAUSAL,
                                             rotary_base=50.0, **kwargs)
    np.testing.assert_allclose(module.apply({"params": params(layer)}, xs), want, rtol=1e-5,
                               atol=1e-5)
  for bad in (1.0, 0, -5.0, float("inf"), True, "10000"):
    with pytest.raises(ValueError, match="rotary_base"):
      make_layer(rotary_base=bad)
  with pytest.raises(ValueError, match="even head dim"):
    make_layer(qkv_features=12, rotary_base=100.0)  # head dim 3
  with pytest.raises(ValueError, match="rotary_base"):
    linen.DilatedMultiHeadAttention(H, pattern=PATTERN, rotary_base=0.5).init(
        jax.random.PRNGKey(0), inputs())


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
  # An argument it does not take raises where it asks for something (a misspelt one is not
  # dropped); None asks for nothing (an argument a newer Flax may pass).
  with pytest.raises(ValueError, match="takes no segment_id "):
    fn(q, k, v, segment_id=jnp.zeros((B, N), jnp.int32))
  np.testing.assert_array_equal(fn(q, k, v, newer_flag=None), fn(q, k, v))
  if "input_positions" in inspect.signature(nnx.MultiHeadAttention.__call__).parameters:
    with pytest.raises(ValueError, match="input_positions.*rotary"):
      mha(x, input_positions=jnp.arange(N))
  # Several batch dims, and dropout applied to the output when asked for.
  y5 = fn(*(x.reshape((1,) + x.shape) for x in (q, k, v)))
  np.testing.assert_allclose(y5[0], dilated_attention(q, k, v, CAUSAL), rtol=1e-6, atol=1e-6)
  dropped = fn(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(0))
  kept = dropped != 0
  assert 0.3 < float(jnp.mean(kept)) < 0.7
  np.testing.assert_allclose(dropped[kept], 2 * dilated_attention(q, k, v, CAUSAL)[kept],
                             rtol=1e-6)


@pytest.mark.parametrize("ordering", ["none", "explicit"])
def test_key_mask_against_reference(ordering):
  """A mask that hides keys removes them from what the pattern shows (in the caller's order,
  with an ordering too); broadcasting and float masks as Flax takes them."""
  kwargs, perm = ORDERINGS[ordering]
  layer = make_layer(**kwargs)
  x, mask = inputs(), key_mask_np()
  y = layer(x, mask=mask[:, None, None, :])
  np.testing.assert_allclose(y, forward_np(params(layer), x, PATTERN, perm, key_mask=mask),
                             rtol=1e-5, atol=1e-5)
  assert not np.allclose(y, layer(x), atol=1e-3)
  np.testing.assert_array_equal(layer(x, mask=mask[:, None, None, :].astype(np.float32)), y)
  shared = np.broadcast_to(mask[0], (B, 1, 1, N))
  np.testing.assert_array_equal(layer(x, mask=mask[0]), layer(x, mask=shared))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_attention_fn_hides_masked_keys(dtype):
  """Values and gradients against the float64 reference with the masked keys removed from
  visibility; a query left with no key (all of the third example's) gives exactly 0 and no
  gradient. float16 computes in float32 there."""
  case = helpers.Case(n=N, heads=H, kv_heads=HKV, segment_lengths=PATTERN.segment_lengths,
                      dilation_rates=PATTERN.dilation_rates, batch=3)
  q, k, v, dout, _ = helpers.random_inputs(case, dtype, 0)
  mask = np.concatenate([key_mask_np(batch=2), np.zeros((1, N), bool)])
  fn = dilated_attention_fn(PATTERN)
  out, grads = helpers.with_grads(lambda q, k, v: fn(q, k, v, mask=mask[:, None, None, :]))(
      q, k, v, dout)
  assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
  m = multiplicity_np(PATTERN, N, N)
  empty = 0
  for b in range(3):
    mb = m * mask[b]
    ref_out, _, ref_grads = reference_np.attention(
        *(np.asarray(a[b:b + 1], np.float64) for a in (q, k, v)), mb, case.head_dim ** -0.5,
        np.asarray(dout[b:b + 1], np.float64), np.zeros((1, N, H)))
    rows = (mb.sum(-1) == 0).T  # [N, H]: queries that see no key
    empty += rows.sum()
    np.testing.assert_array_equal(np.asarray(out[b])[rows], 0)
    np.testing.assert_array_equal(np.asarray(grads[0][b])[rows], 0)
    if b < 2:
      assert helpers.rel_err(out[b:b + 1], ref_out) < helpers.TOL[dtype]
      for g, ref in zip(grads, ref_grads):
        assert helpers.rel_err(g[b:b + 1], ref) < 2 * helpers.TOL[dtype]
    else:
      for g in grads:
        np.testing.assert_array_equal(g[b], 0)
  assert N * H < empty < 3 * N * H  # the second example has some, the third only such rows
  for bad in (np.ones((3, 1, N, N), bool), np.ones((3, H, 1, N), bool), np.ones((2, N), bool)):
    with pytest.raises(ValueError, match="mask must hide keys only"):
      fn(q, k, v, mask=bad)
  with pytest.raises(ValueError, match="scale"):
    dilated_attention_fn(PATTERN, scale=0.0)(q, k, v, mask=mask[:, None, None, :])


def test_leading_batch_dims():
  """Any leading batch dims (none: one sequence) are flattened and restored, the mask with
  them, in both layers."""
  layer = make_layer()
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, N, F)), jnp.float32)
  mask = key_mask_np(batch=6).reshape(2, 3, N)
  y = layer(x, mask=mask[..., None, None, :])
  ref = forward_np(params(layer), x.reshape(6, N, F), PATTERN, key_mask=mask.reshape(6, N))
  np.testing.assert_allclose(y, ref.reshape(2, 3, N, F), rtol=1e-5, atol=1e-5)
  one = layer(x[0, 0])  # [N, F]
  assert one.shape == (N, F)
  np.testing.assert_allclose(one, forward_np(params(layer), x[0, :1], PATTERN)[0], rtol=1e-5,
                             atol=1e-5)
  module = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN)
  np.testing.assert_allclose(module.apply({"params": params(layer)}, x,
                                          mask=mask[..., None, None, :]), y, rtol=1e-6,
                             atol=1e-6)
  with pytest.raises(ValueError, match="in_features=16"):
    layer(x[0, 0, 0])


def test_keys_and_values_from_other_inputs():
  """inputs_k and inputs_v (in_kv_features) at the queries' positions under a dilated pattern;
  of another length under a pattern that shows every key to every query, where the layer
  computes what nnx.MultiHeadAttention does with the same weights and key mask."""
  rng = np.random.default_rng(3)
  x = inputs()
  xk, xv = (jnp.asarray(rng.standard_normal((B, N, 12)), jnp.float32) for _ in range(2))
  layer = make_layer(in_kv_features=12)
  assert layer.key.kernel.shape == (12, HKV, F // H)
  np.testing.assert_allclose(layer(x, xk, xv), forward_np(params(layer), x, PATTERN, xk=xk,
                                                          xv=xv), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(layer(x, xk), layer(x, xk, xk))
  full = make_layer(FULL, in_kv_features=12)
  mha = nnx.MultiHeadAttention(H, F, num_kv_heads=HKV, in_kv_features=12, decode=False,
                               rngs=nnx.Rngs(0))
  nnx.update(full, nnx.state(mha, nnx.Param))
  ordered = make_layer(FULL, in_kv_features=12, ordering=RANDOM_PERM)
  nnx.update(ordered, nnx.state(mha, nnx.Param))
  mask = rng.random((B, N)) < 0.6
  mask[:, 0] = True  # every query sees a key, as Flax needs to agree
  for n_q, n_k in ((6, N), (N, 10)):
    args = x[:, :n_q], xk[:, :n_k], xv[:, :n_k]
    mask_k = mask[:, None, None, :n_k]
    y = full(*args, mask=mask_k)
    np.testing.assert_allclose(y, forward_np(params(full), *args[:1], FULL, xk=args[1],
                                             xv=args[2], key_mask=mask[:, :n_k]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, mha(*args, mask=mask_k), rtol=1e-5, atol=1e-5)
    if n_q == N:  # a token order of the queries changes nothing then
      np.testing.assert_allclose(ordered(*args, mask=mask_k), y, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="different lengths"):
    layer(x, xk[:, :10])
  with pytest.raises(ValueError, match="rotary_base"):
    make_layer(FULL, in_kv_features=12, rotary_base=100.0)(x, xk[:, :10])
  with pytest.raises(ValueError, match="inputs_v needs inputs_k"):
    layer(x, inputs_v=xv)
  with pytest.raises(ValueError, match="batch dims of inputs_q"):
    layer(x, xk[:1])
  with pytest.raises(ValueError, match="in_kv_features=12"):
    layer(x, x)
  with pytest.raises(ValueError, match="same length"):
    full(x, xk, xv[:, :10])


def test_sow_weights():
  """sow_weights records the attention probabilities `[B, H, N, Nk]` (hidden keys 0) in the
  caller's order, as nnx.MultiHeadAttention sows its own; so do dilated_attention_fn inside
  nnx.MultiHeadAttention and the Linen twin (into `intermediates`)."""
  kwargs, perm = ORDERINGS["explicit"]
  layer = make_layer(**kwargs)
  x, mask = inputs(), key_mask_np()
  mask4 = mask[:, None, None, :]
  y, sown = nnx.capture(layer, nnx.Intermediate)(x, mask=mask4, sow_weights=True)
  (w,) = sown["attention_weights"]
  np.testing.assert_allclose(w, weights_np(params(layer), x, PATTERN, perm, mask), atol=1e-6)
  np.testing.assert_array_equal(y, layer(x, mask=mask4))
  assert not nnx.capture(layer, nnx.Intermediate)(x)[1]
  module = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN,
                                           ordering=RANDOM_PERM)
  _, state = module.apply({"params": params(layer)}, x, mask=mask4, sow_weights=True,
                          mutable=["intermediates"])
  np.testing.assert_allclose(state["intermediates"]["attention_weights"][0], w, atol=1e-6)
  mha = nnx.MultiHeadAttention(H, F, num_kv_heads=HKV, attention_fn=dilated_attention_fn(PATTERN),
                               decode=False, rngs=nnx.Rngs(0))
  _, sown = nnx.capture(mha, nnx.Intermediate)(x, mask=mask4, sow_weights=True)
  np.testing.assert_allclose(sown["attention_weights"][0],
                             weights_np(params(mha), x, PATTERN, key_mask=mask), atol=1e-6)


def test_keep_rngs():
  """keep_rngs=False keeps no dropout stream (none is needed at construction): calls that drop
  out take rngs."""
  x = inputs()
  layer = make_layer(dropout_rate=0.5, deterministic=False, keep_rngs=False)
  assert layer.rngs is None
  with pytest.raises(ValueError, match="keep_rngs=False"):
    layer(x)
  kept = make_layer(dropout_rate=0.5, deterministic=False)
  np.testing.assert_array_equal(layer(x, rngs=nnx.Rngs(dropout=1)),
                                kept(x, rngs=nnx.Rngs(dropout=1)))
  np.testing.assert_array_equal(layer(x, deterministic=True), make_layer()(x))
  make_layer(dropout_rate=0.5, rngs=nnx.Rngs(params=0), keep_rngs=False)
  with pytest.raises(ValueError, match="keep_rngs"):
    make_layer(keep_rngs=None)


def test_attention_fn_decodes_in_nnx_multi_head_attention():
  """nnx.MultiHeadAttention(decode=True) passes its whole cache and a cache mask: with a pattern
  that shows every key to every query, token steps give causal full attention, as Flax's own
  attention does; a dilated pattern is refused, pointing at the layer."""
  x = inputs()
  mha = nnx.MultiHeadAttention(H, F, num_kv_heads=HKV, attention_fn=dilated_attention_fn(FULL),
                               decode=True, rngs=nnx.Rngs(0))
  flax_mha = nnx.MultiHeadAttention(H, F, num_kv_heads=HKV, decode=True, rngs=nnx.Rngs(0))
  mha.init_cache(x.shape)
  flax_mha.init_cache(x.shape)
  ys = jnp.concatenate([mha(x[:, t:t + 1]) for t in range(N)], axis=1)
  causal = DilatedPattern((N,), (1,), causal=True)
  np.testing.assert_allclose(ys, forward_np(params(mha), x, causal), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ys, jnp.concatenate([flax_mha(x[:, t:t + 1]) for t in range(N)],
                                                 axis=1), rtol=1e-5, atol=1e-5)
  dilated = nnx.MultiHeadAttention(H, F, num_kv_heads=HKV,
                                   attention_fn=dilated_attention_fn(CAUSAL), decode=True,
                                   rngs=nnx.Rngs(0))
  dilated.init_cache(x.shape)
  with pytest.raises(ValueError, match=r"DilatedMultiHeadAttention\(decode=True\)"):
    dilated(x[:, :1])


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
    (dict(use_bias=1), "use_bias=1"),
    (dict(normalize_qk="yes"), "normalize_qk='yes'"),
    (dict(broadcast_dropout=None), "broadcast_dropout=None"),
    (dict(deterministic="no"), "deterministic='no'"),
    (dict(kernel_init=None), "kernel_init=None"),
    (dict(out_bias_init=0.0), "out_bias_init=0.0"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_layer(**kwargs)
  linen_kwargs = dict(dict(num_heads=H, num_kv_heads=HKV, pattern=PATTERN), **kwargs)
  with pytest.raises(ValueError, match=match):
    linen.DilatedMultiHeadAttention(**linen_kwargs).init(jax.random.PRNGKey(0), inputs())


def test_linen_with_a_permutation_hashes():
  """A Linen layer built with a permutation array hashes and compares (a static argument
  of jit), and computes what the same layer with the permutation as a tuple does."""
  kwargs = dict(num_heads=H, num_kv_heads=HKV, pattern=PATTERN)
  m = linen.DilatedMultiHeadAttention(**kwargs, ordering=np.array(RANDOM_PERM))
  twin = linen.DilatedMultiHeadAttention(**kwargs, ordering=np.array(RANDOM_PERM))
  assert hash(m) == hash(twin) and m == twin
  x = inputs()
  params = m.init(jax.random.PRNGKey(0), x)
  y = jax.jit(lambda mod, p, x: mod.apply(p, x), static_argnums=0)(m, params, x)
  as_tuple = linen.DilatedMultiHeadAttention(**kwargs,
                                             ordering=tuple(int(i) for i in RANDOM_PERM))
  np.testing.assert_allclose(y, as_tuple.apply(params, x), rtol=1e-6, atol=1e-6)


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
    (dict(kernel_metadata=("data",)), "kernel_metadata"),
    (dict(key_ln_scale_metadata=None), "key_ln_scale_metadata"),
])
def test_layer_argument_types(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_layer(**kwargs)


@pytest.mark.parametrize("name", ["kernel_init", "out_kernel_init", "bias_init"])
def test_initializers_of_the_wrong_shape(name):
  """An initializer returning another shape is refused naming it, in both layers (Flax would
  reshape one of the same size silently, or fail with a reshape TypeError)."""
  wrong = lambda key, shape, dtype=jnp.float32: jnp.ones((3, 3), dtype)
  same_size = lambda key, shape, dtype=jnp.float32: jnp.ones((1, *shape), dtype)
  for init in (wrong, same_size):
    with pytest.raises(ValueError, match=f"{name} returned an array of shape"):
      make_layer(**{name: init})
    with pytest.raises(ValueError, match=f"{name} returned an array of shape"):
      linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN,
                                      **{name: init}).init(jax.random.PRNGKey(0), inputs())


def test_mesh_needs_seq_axis():
  mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  layer = make_layer(mesh=mesh)
  with pytest.raises(ValueError, match="seq_axis"):
    layer(inputs())


# (`batch_axis` with `-m slow`, ~15 s: the layers pass it through as they pass `heads_axis`;
# test_ring.py runs data x sequence rings.)
@pytest.mark.parametrize("axes", [pytest.param({"batch_axis": "data"}, marks=pytest.mark.slow),
                                  {"heads_axis": "model"}], ids=["data", "heads"])
def test_layers_with_a_second_mesh_axis(axes):
  """NNX and Linen layers on a (data=2, seq=4) mesh, or with the heads split over "model"
  (tensor x sequence parallelism: 2 heads a shard, rates 1 and 2, shards alike as the ring
  needs), equal the single-device layer, hidden keys too."""
  (kind, name), = axes.items()
  mesh = jax.make_mesh((2, 4), (name, "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = inputs()
  sharded = make_layer(mesh=mesh, seq_axis="seq", **axes)
  np.testing.assert_allclose(jax.jit(lambda x: sharded(x))(x), make_layer()(x), rtol=1e-5,
                             atol=1e-5)
  mask = key_mask_np()[:, None, None, :]  # hidden keys through the ring
  np.testing.assert_allclose(jax.jit(lambda x: sharded(x, mask=mask))(x),
                             make_layer()(x, mask=mask), rtol=1e-5, atol=1e-5)
  module = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN,
                                           mesh=mesh, seq_axis="seq", **axes)
  plain = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN)
  params = plain.init(jax.random.PRNGKey(0), x)
  np.testing.assert_allclose(jax.jit(module.apply)(params, x), plain.apply(params, x),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=kind):
    make_layer(**axes)


def test_key_mask_with_explicit_mesh_axes():
  """Hidden keys through the ring with the batch and sequence sharded over Explicit axes."""
  mesh = jax.make_mesh((2, 4), ("data", "seq"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  x, mask = inputs(), key_mask_np()[:, None, None, :]
  expected = make_layer()(x, mask=mask)
  with jax.set_mesh(mesh):
    layer = make_layer(mesh=mesh, seq_axis="seq", batch_axis="data")
    y = nnx.jit(lambda m, x, mask: m(x, mask=mask))(
        layer, jax.device_put(x, jax.P("data", "seq")),
        jax.device_put(mask, jax.P("data", None, None, "seq")))
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


FULL = DilatedPattern((N,), (1,))  # one segment of all N tokens at rate 1: full attention
CUSTOM_INITS = dict(kernel_init=nnx.initializers.normal(0.5),
                    bias_init=nnx.initializers.normal(0.2),
                    out_kernel_init=nnx.initializers.normal(0.1),
                    out_bias_init=nnx.initializers.constant(0.3))


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(normalize_qk=True),
    dict(use_bias=False),
    CUSTOM_INITS,
    dict(kernel_init=nnx.initializers.normal(0.5), bias_init=nnx.initializers.normal(0.2)),
    dict(precision=jax.lax.Precision.HIGHEST, normalize_qk=True, use_bias=False,
         qkv_features=24, out_features=12),
], ids=["defaults", "normalize_qk", "no_bias", "inits", "qkv_inits", "mixed"])
def test_matches_nnx_multi_head_attention(kwargs):
  """Same options and seed as nnx.MultiHeadAttention: same parameters, same outputs."""
  kwargs = dict(num_heads=H, in_features=F, num_kv_heads=HKV, **kwargs)
  layer = DilatedMultiHeadAttention(pattern=FULL, rngs=nnx.Rngs(0), **kwargs)
  mha = nnx.MultiHeadAttention(decode=False, rngs=nnx.Rngs(0), **kwargs)
  p, mha_p = params(layer), params(mha)
  assert jax.tree.structure(p) == jax.tree.structure(mha_p)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(mha_p)):
    np.testing.assert_array_equal(a, b)
  for name in ("query", "key", "value", "out"):
    sub, mha_sub = getattr(layer, name), getattr(mha, name)
    assert (sub.precision, sub.use_bias) == (mha_sub.precision, mha_sub.use_bias)
  x = inputs()
  np.testing.assert_allclose(layer(x), mha(x), rtol=1e-5, atol=1e-6)
  # Each option has an effect: on the parameter tree, the parameters or the outputs.
  if kwargs.keys() - {"num_heads", "in_features", "num_kv_heads", "precision"}:
    default = DilatedMultiHeadAttention(pattern=FULL, rngs=nnx.Rngs(0), num_heads=H,
                                        in_features=F, num_kv_heads=HKV,
                                        qkv_features=kwargs.get("qkv_features"),
                                        out_features=kwargs.get("out_features"))
    same_tree = jax.tree.structure(params(default)) == jax.tree.structure(p)
    assert not same_tree or not np.allclose(default(x), layer(x), atol=1e-3)


def test_option_effects():
  """What each option does to the parameter tree, the initial values and the outputs."""
  x = inputs()
  layer = make_layer(FULL, normalize_qk=True, use_bias=False)
  p = params(layer)
  assert set(p) == {"query", "key", "value", "out", "query_ln", "key_ln"}
  assert all(set(p[n]) == {"kernel"} for n in ("query", "key", "value", "out"))
  assert p["query_ln"]["scale"].shape == p["key_ln"]["scale"].shape == (F // H,)
  # The norm acts per head on q and k: scaling the q/k projections changes nothing.
  scaled = make_layer(FULL, normalize_qk=True, use_bias=False)
  nnx.update(scaled, nnx.state(layer, nnx.Param))
  scaled.query.kernel[...] = 3.0 * scaled.query.kernel[...]
  scaled.key.kernel[...] = 0.5 * scaled.key.kernel[...]
  np.testing.assert_allclose(scaled(x), layer(x), rtol=1e-3, atol=1e-3)  # up to the eps
  # Custom initializers: `out_*` override the others for `out` only.
  inits = params(make_layer(FULL, **CUSTOM_INITS))
  assert 0.4 < float(jnp.std(inits["query"]["kernel"])) < 0.6
  assert 0.05 < float(jnp.std(inits["out"]["kernel"])) < 0.15
  assert 0.1 < float(jnp.std(inits["value"]["bias"])) < 0.3
  np.testing.assert_array_equal(inits["out"]["bias"], np.float32(0.3))
  inherited = params(make_layer(FULL, kernel_init=nnx.initializers.zeros_init(),
                                bias_init=nnx.initializers.ones_init()))
  np.testing.assert_array_equal(inherited["out"]["kernel"], 0.0)
  np.testing.assert_array_equal(inherited["out"]["bias"], 1.0)
  # Linen twin: the same options give the same parameter tree and outputs.
  module = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=FULL,
                                           normalize_qk=True, use_bias=False)
  shapes = lambda tree: jax.tree.map(jnp.shape, tree)
  assert shapes(dict(module.init(jax.random.PRNGKey(0), x)["params"])) == shapes(p)
  np.testing.assert_allclose(module.apply({"params": p}, x), layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(normalize_qk=True, use_bias=False, qkv_features=24, out_features=12),
    dict(kernel_init=jax.nn.initializers.normal(0.5), bias_init=jax.nn.initializers.normal(0.2),
         out_kernel_init=jax.nn.initializers.normal(0.1),
         out_bias_init=jax.nn.initializers.constant(0.3), precision="highest"),
], ids=["defaults", "normalize_qk", "inits"])
def test_linen_matches_multi_head_dot_product_attention(kwargs):
  """Same attributes and key as flax.linen.MultiHeadDotProductAttention: same variables, outputs."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  x = inputs()
  module = linen.DilatedMultiHeadAttention(num_heads=H, pattern=FULL, **kwargs)
  flax_module = nn.MultiHeadDotProductAttention(num_heads=H, **kwargs)
  variables = module.init(jax.random.PRNGKey(3), x)
  flax_variables = flax_module.init(jax.random.PRNGKey(3), x)
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(flax_variables), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(module.apply(variables, x), flax_module.apply(variables, x),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_type", [None, "Explicit"])
def test_broadcast_dropout(axis_type):
  """The mask is shared across the batch by default (as in nnx), drawn per example if not;
  on a (data, seq) mesh too, where the mask must not be sharded like the batch."""
  mesh = None if axis_type is None else jax.make_mesh(
      (2, 4), ("data", "seq"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
  axes = dict(mesh=mesh, seq_axis="seq", batch_axis="data") if mesh else {}
  x = jnp.broadcast_to(inputs()[:1], (B, N, F))  # identical examples
  expected = make_layer()(x)
  for broadcast in (True, False):
    layer = make_layer(dropout_rate=0.5, deterministic=False, broadcast_dropout=broadcast, **axes)
    module = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN,
                                             dropout_rate=0.5, broadcast_dropout=broadcast,
                                             **axes)
    apply = lambda x, det: module.apply({"params": params(layer)}, x, deterministic=det,
                                        rngs={"dropout": jax.random.PRNGKey(0)})
    with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
      if mesh:
        x = jax.device_put(x, jax.P("data", "seq"))
      ys = layer(x), apply(x, False)
      np.testing.assert_allclose(apply(x, True), expected, rtol=1e-5, atol=1e-5)
    for y in map(np.asarray, ys):
      assert np.array_equal(y[0], y[1]) == broadcast
      assert not np.allclose(y, expected, atol=1e-3)


def test_deterministic_none():
  """As nnx.MultiHeadAttention: None by default, and needed only with dropout."""
  x = inputs()
  assert make_layer().deterministic is None
  make_layer()(x)  # no dropout: nothing to decide
  layer = make_layer(dropout_rate=0.5)
  mha = nnx.MultiHeadAttention(H, F, dropout_rate=0.5, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="deterministic"):
    layer(x)
  with pytest.raises(ValueError, match="deterministic"):
    mha(x)
  expected = make_layer()(x)
  np.testing.assert_array_equal(layer(x, deterministic=True), expected)
  assert not np.allclose(layer(x, deterministic=False), expected)
  # The call's flag wins over the constructor's.
  np.testing.assert_array_equal(make_layer(dropout_rate=0.5, deterministic=False)(
      x, deterministic=True), expected)
  layer.eval()
  assert layer.deterministic is True
  np.testing.assert_array_equal(layer(x), expected)
  np.testing.assert_array_equal(
      nnx.view(make_layer(dropout_rate=0.5), deterministic=True)(x), expected)
  # Linen: an attribute or a call argument, as flax.linen.MultiHeadDotProductAttention.
  module = linen.DilatedMultiHeadAttention(num_heads=H, num_kv_heads=HKV, pattern=PATTERN,
                                           dropout_rate=0.5)
  variables = {"params": params(layer)}
  with pytest.raises(ValueError, match="deterministic"):
    module.apply(variables, x, rngs={"dropout": jax.random.PRNGKey(0)})
  np.testing.assert_array_equal(module.apply(variables, x, deterministic=True), expected)


def test_dropout_stream_checked_at_construction():
  with pytest.raises(ValueError, match="dropout_rate=0.1 needs a 'dropout'.*'params'"):
    make_layer(dropout_rate=0.1, rngs=nnx.Rngs(params=0))
  # With no dropout, no stream is needed; a `dropout` or `default` stream will do.
  make_layer(rngs=nnx.Rngs(params=0))
  x = inputs()
  for rngs in (nnx.Rngs(params=0, dropout=1), nnx.Rngs(0)):
    layer = make_layer(dropout_rate=0.1, deterministic=False, rngs=rngs)
    assert not np.allclose(layer(x), layer(x))
  with pytest.raises(ValueError, match="rngs must be an nnx.Rngs"):
    make_layer(rngs=0)


def test_weights_of_another_head_layout():
  """nnx.update takes any shapes; the call names the mismatch instead of failing in a reshape."""
  x = inputs()
  layer = make_layer()  # num_kv_heads=2
  nnx.update(layer, nnx.state(nnx.MultiHeadAttention(H, F, decode=False, rngs=nnx.Rngs(0)),
                              nnx.Param))
  assert layer.key.kernel.shape == (F, H, F // H)
  with pytest.raises(ValueError, match="key kernel has 4 kv heads, the layer was built with "
                                       "num_kv_heads=2"):
    layer(x)
  layer = make_layer()
  nnx.update(layer, nnx.state(nnx.MultiHeadAttention(H, F, qkv_features=8, num_kv_heads=HKV,
                                                     decode=False, rngs=nnx.Rngs(0)), nnx.Param))
  with pytest.raises(ValueError, match=r"query kernel has shape \(16, 4, 2\), the layer was "
                                       r"built for \(16, 4, 4\)"):
    layer(x)
  # Matching head counts copy across and give the same outputs (as README says).
  layer = make_layer(FULL)
  mha = nnx.MultiHeadAttention(H, F, num_kv_heads=HKV, decode=False, rngs=nnx.Rngs(5))
  nnx.update(layer, nnx.state(mha, nnx.Param))
  np.testing.assert_allclose(layer(x), mha(x), rtol=1e-5, atol=1e-6)


def test_partition_annotations():
  """`nnx.with_partitioning` and the metadata arguments annotate (and shard) the parameters."""
  mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  init = nnx.initializers.lecun_normal()
  kwargs = dict(num_heads=H, in_features=F, num_kv_heads=HKV, normalize_qk=True,
                kernel_init=nnx.with_partitioning(init, ("fsdp", "tp", None)),
                out_kernel_init=nnx.with_partitioning(init, ("tp", None, "fsdp")),
                bias_metadata={"out_sharding": ("tp", None)},
                out_bias_metadata={"out_sharding": ("fsdp",)},
                query_ln_scale_metadata={"out_sharding": ("tp",)},
                key_ln_scale_metadata={"out_sharding": (None,)})
  with jax.set_mesh(mesh):
    layer = DilatedMultiHeadAttention(pattern=PATTERN, rngs=nnx.Rngs(0), **kwargs)
    mha = nnx.MultiHeadAttention(decode=False, rngs=nnx.Rngs(0), **kwargs)
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer)))
  assert specs == nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(mha)))
  P = jax.sharding.PartitionSpec
  assert specs["query"] == specs["key"] == specs["value"] == {
      "kernel": P("fsdp", "tp", None), "bias": P("tp", None)}
  assert specs["out"] == {"kernel": P("tp", None, "fsdp"), "bias": P("fsdp")}
  assert specs["query_ln"] == {"scale": P("tp")} and specs["key_ln"] == {"scale": P(None)}
  # The parameters are placed as annotated, and the layer computes the same as unsharded.
  assert layer.query.kernel[...].sharding.spec == P("fsdp", "tp", None)
  assert layer.out.bias[...].sharding.spec == P("fsdp")
  plain = DilatedMultiHeadAttention(pattern=PATTERN, rngs=nnx.Rngs(1),
                                    **dict(kwargs, kernel_init=init, out_kernel_init=None,
                                           bias_metadata={}, out_bias_metadata={},
                                           query_ln_scale_metadata={}, key_ln_scale_metadata={}))
  nnx.update(plain, jax.device_get(nnx.state(layer, nnx.Param)))
  x = inputs()
  with jax.set_mesh(mesh):
    y = nnx.jit(lambda m, x: m(x))(layer, x)
  np.testing.assert_allclose(y, plain(x), rtol=1e-5, atol=1e-6)
  # Linen: the annotations travel with the initializers, as in MultiHeadDotProductAttention.
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  linen_kwargs = dict(num_heads=H, normalize_qk=True,
                      kernel_init=nn.with_partitioning(init, ("fsdp", "tp", None)),
                      out_kernel_init=nn.with_partitioning(init, ("tp", None, "fsdp")))
  module = linen.DilatedMultiHeadAttention(pattern=PATTERN, **linen_kwargs)
  abstract = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)
  flax_abstract = jax.eval_shape(nn.MultiHeadDotProductAttention(**linen_kwargs).init,
                                 jax.random.PRNGKey(0), x)
  assert nn.get_partition_spec(abstract) == nn.get_partition_spec(flax_abstract)
  assert nn.get_partition_spec(abstract)["params"]["out"]["kernel"] == P("tp", None, "fsdp")
