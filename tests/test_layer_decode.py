"""Decoding through the Flax layers: chunks of calls equal the non-decoding layer."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern, init_kv_cache, linen

B, N, F = 2, 23, 24
PATTERN = DilatedPattern((4, 10), (1, 4), causal=True)  # r=4 over 4 heads
GROUPED = DilatedPattern((6, 9), (2, 3), causal=True, offsets="all", head_groups=True)
CHUNKS = (1, 4)


@pytest.fixture(autouse=True)
def _full_precision():
  with jax.default_matmul_precision("highest"):
    yield


def inputs(seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, N, F)), jnp.float32)


def chunks(start, sizes=CHUNKS):
  """`(i, j)` bounds of chunks cycling through `sizes` from `start` to N."""
  i = start
  for t in itertools.cycle(sizes):
    if i >= N:
      return
    yield i, min(i + t, N)
    i += t


CONFIGS = {
    # GQA, biases, rotary positions, prefill of 5 tokens then steps; decode set at
    # construction.
    "gqa_prefill": (dict(num_heads=4, num_kv_heads=2, pattern=PATTERN, decode=True,
                         rotary_base=100.0), 5, "init"),
    # normalize_qk, no bias, offsets="all" with head groups, dropout off by eval(); decode
    # given at the call, starting from an empty cache.
    "options": (dict(num_heads=4, num_kv_heads=1, qkv_features=16, out_features=12,
                     pattern=GROUPED, normalize_qk=True, use_bias=False, dropout_rate=0.5),
                0, "call"),
    # MHA, nnx.view(layer, decode=True), a bfloat16 cache for the float32 layer; token by token.
    "view_bf16": (dict(num_heads=2, pattern=PATTERN), 0, "view"),
}


# ("options", ~16 s, with `-m slow`: its head groups and offsets "all" decode in test_decode.py,
# normalize_qk in the Linen test below.)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow)
                                  if name == "options" else name for name in CONFIGS])
def test_nnx_decoding_matches_the_layer(name):
  kwargs, prefill, how = CONFIGS[name]
  layer = DilatedMultiHeadAttention(in_features=F, rngs=nnx.Rngs(0), **kwargs)
  layer.eval()
  x = inputs()
  expected = layer(x, decode=False)
  assert layer.cache_index is None  # no cache until init_cache
  dtype = jnp.bfloat16 if name.endswith("bf16") else jnp.float32
  layer.init_cache(x.shape, dtype=dtype)
  empty = jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(layer, nnx.Cache))
  step = {"init": nnx.jit(lambda m, x: m(x)),
          "call": nnx.jit(lambda m, x: m(x, decode=True)),
          "view": nnx.jit(lambda m, x: nnx.view(m, decode=True)(x))}[how]
  ys = []
  fill = nnx.jit(lambda m, x: m(x, decode=True, prefill=True))
  if prefill:
    ys.append(fill(layer, x[:, :prefill]))
  for i, j in chunks(prefill, (1,) if how == "view" else CHUNKS):
    ys.append(step(layer, x[:, i:j]))
    assert int(layer.cache_index[...]) == j
    assert jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(layer, nnx.Cache)) == empty
  y = jnp.concatenate(ys, axis=1)
  assert y.dtype == jnp.float32
  tol = 1e-5 if dtype == jnp.float32 else 3e-2  # a bfloat16 cache: q, k, v in bfloat16
  np.testing.assert_allclose(y, expected, rtol=tol, atol=tol)
  # The cache is the compressed one of init_kv_cache, in nnx.Cache variables.
  ref = init_kv_cache(layer.pattern, batch=B, num_heads=layer.num_heads,
                      num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, dtype=dtype)
  assert [(x.shape, x.dtype) for x in layer.cached_value] == [(x.shape, x.dtype) for x in ref.v]
  # A prefill refills the cache whatever it held: the same tokens again give the same rows.
  if prefill:
    np.testing.assert_allclose(fill(layer, x[:, :prefill]), ys[0], rtol=1e-6, atol=1e-6)
    assert int(layer.cache_index[...]) == prefill
  # Dropout acts in decode as without it: deterministic=False draws a mask.
  if layer.dropout_rate:
    other = nnx.clone(layer)
    kept, dropped = step(layer, x[:, :1]), nnx.jit(
        lambda m, x: m(x, decode=True, deterministic=False))(other, x[:, :1])
    assert not np.allclose(dropped, kept, atol=1e-3)
    np.testing.assert_array_equal(other.cache_index[...], layer.cache_index[...])


def test_nnx_decode_errors():
  x = inputs()
  make = lambda **kw: DilatedMultiHeadAttention(
      2, F, **dict(dict(pattern=PATTERN, rngs=nnx.Rngs(0)), **kw))
  for kw in (dict(ordering="hilbert_per_segment"), dict(ordering=np.arange(N)[::-1].copy())):
    with pytest.raises(ValueError, match="ordering"):
      make(decode=True, **kw)
    layer = make(**kw)
    with pytest.raises(ValueError, match="ordering"):
      layer.init_cache(x.shape)
    with pytest.raises(ValueError, match="ordering"):
      layer(x, decode=True)
    with pytest.raises(ValueError, match="ordering"):
      nnx.view(layer, decode=True)
  loose = DilatedPattern((4, 8), (1, 2))
  with pytest.raises(ValueError, match="pattern"):
    make(pattern=loose, decode=True)
  with pytest.raises(ValueError, match="pattern"):
    make(pattern=loose).init_cache(x.shape)
  with pytest.raises(ValueError, match="decode"):
    make(decode="yes")
  layer = make()
  with pytest.raises(ValueError, match="init_cache"):
    layer(x, decode=True)
  with pytest.raises(ValueError, match="prefill"):
    layer(x, prefill=True)
  for shape in ((F,), (B, N, F + 1), (0, N, F), (B, N, 2.0)):
    with pytest.raises(ValueError, match="input_shape"):
      layer.init_cache(shape)
  layer.init_cache((3, 1, F))
  with pytest.raises(ValueError, match="cache"):  # built for a batch of 3
    layer(x[:, :1], decode=True)
  layer.init_cache(x.shape)
  for kwargs, match in ((dict(mask=np.ones((B, 1, 1, 1), bool)), "decode takes no mask"),
                        (dict(sow_weights=True), "decode takes no sow_weights"),
                        (dict(inputs_k=x[:, :2]), "decode takes no keys of another length")):
    with pytest.raises(ValueError, match=match):
      layer(x[:, :1], decode=True, **kwargs)
  mesh = jax.make_mesh((2,), ("seq",), devices=jax.devices("cpu")[:2])  # any 2 devices
  with pytest.raises(ValueError, match="mesh"):
    make(mesh=mesh, seq_axis="seq", decode=True)


@pytest.mark.slow  # ~17 s: the layers flatten batch dims as they do without decoding
def test_decoding_with_other_batch_dims():
  """Inputs without batch dims (`[N, F]`) or with several decode as the flattened batch:
  `init_cache` takes their shape, and the steps equal the layer on the whole sequence."""
  layer = DilatedMultiHeadAttention(4, F, num_kv_heads=2, pattern=PATTERN, rngs=nnx.Rngs(0))
  for x in (inputs()[0], inputs().reshape(2, 1, N, F)):
    expected = layer(x)
    layer.init_cache(x.shape)
    assert layer.cached_key[0].shape[0] == x[..., 0, 0].size
    ys = [layer(x[..., :5, :], decode=True, prefill=True)]
    ys += [layer(x[..., t:t + 1, :], decode=True) for t in range(5, 9)]
    np.testing.assert_allclose(jnp.concatenate(ys, axis=-2), expected[..., :9, :], rtol=1e-5,
                               atol=1e-5)


def test_linen_decoding_matches_the_module():
  kwargs = dict(num_heads=4, num_kv_heads=2, pattern=PATTERN, normalize_qk=True,
                rotary_base=100.0)
  module = linen.DilatedMultiHeadAttention(decode=True, **kwargs)
  plain = linen.DilatedMultiHeadAttention(**kwargs)
  x = inputs()
  y_init, variables = module.init_with_output(jax.random.PRNGKey(0), x)
  params = plain.init(jax.random.PRNGKey(0), x)["params"]
  for a, b in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(a, b)
  ref = init_kv_cache(PATTERN, batch=B, num_heads=4, num_kv_heads=2, head_dim=F // 4)
  cache = variables["cache"]
  assert int(cache["cache_index"]) == 0
  assert [c.shape for c in cache["cached_key"]] == [c.shape for c in ref.k]
  expected = plain.apply({"params": params}, x)
  np.testing.assert_array_equal(y_init, expected)  # init computes as without decode
  step = jax.jit(lambda v, x: module.apply(v, x, mutable=["cache"]))
  prefill = jax.jit(lambda v, x: module.apply(v, x, prefill=True, mutable=["cache"]))
  y, mutated = prefill(variables, x[:, :6])
  ys = [y]
  for i, j in chunks(6):
    y, mutated = step({"params": variables["params"], **mutated}, x[:, i:j])
    ys.append(y)
    assert int(mutated["cache"]["cache_index"]) == j
  np.testing.assert_allclose(jnp.concatenate(ys, axis=1), expected, rtol=1e-5, atol=1e-5)
  assert jax.tree.map(jnp.shape, mutated["cache"]) == jax.tree.map(jnp.shape, cache)
  with pytest.raises(ValueError, match="ordering"):
    linen.DilatedMultiHeadAttention(decode=True, ordering="hilbert_per_segment",
                                    **kwargs).init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="pattern"):
    linen.DilatedMultiHeadAttention(num_heads=2, pattern=DilatedPattern((4,), (1,)),
                                    decode=True).init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="prefill"):
    plain.apply({"params": params}, x, prefill=True)
