"""Linen twin of `hilbert_ring_jax.DilatedMultiHeadAttention`, for Linen codebases.

Same computation and the same parameter tree (`query`, `key`, `value`, `out`, each with
`kernel` and `bias` of the same shapes, and `query_ln`/`key_ln` scales with `normalize_qk`) as
the NNX layer and `flax.linen.MultiHeadDotProductAttention`, so weights copy across as they are:
`{"params": nnx.to_pure_dict(nnx.state(nnx_layer, nnx.Param))}`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from .api import check_flag
from .decode import KVCache, init_kv_cache
from .layers_common import (TokenOrder, apply_dropout, attend, check_call, check_dropout_rate,
                            check_heads, check_layout, check_options, check_rotary_base,
                            checked_init, decode_attend, decode_positions, default_positions,
                            key_mask_of, layer_inputs, layout_positions, permute, rotate,
                            serialize_inputs, sown_weights, static_implementation, token_ids_of)
from .pattern import DilatedPattern

DEFAULT_KERNEL_INIT = nn.initializers.lecun_normal()
DEFAULT_BIAS_INIT = nn.initializers.zeros_init()


class DilatedMultiHeadAttention(nn.Module):
  """Linen multi-head attention with a dilated pattern and an optional token order.

  Attributes are those of the NNX layer (see `hilbert_ring_jax.DilatedMultiHeadAttention`),
  with Linen's conventions, as in `flax.linen.MultiHeadDotProductAttention`: the input features
  are taken from the inputs (`inputs_q`; `inputs_k`, `inputs_v` for keys and values); there is
  no `rngs`: parameters come from the `params` collection and
  dropout (on the attention output, before the output projection) from the `dropout` rng
  collection; there are no `*_metadata` arguments: sharding annotations come with the
  initializers (`nn.with_partitioning(init, names)`, `nn.with_logical_partitioning`).
  `deterministic` is given as an attribute or a call argument, not both (needed only when
  `dropout_rate > 0`). A call takes the NNX layer's arguments (`inputs_q`, `inputs_k`,
  `inputs_v`, `mask`, `sow_weights`, `prefill`; leading batch dims) but `rngs` and `decode`;
  `sow_weights` records the "attention_weights" in the `intermediates` collection.

  Decoding the Linen way, as `nn.MultiHeadDotProductAttention(decode=True)`: `init` with
  `decode=True` makes the `cache` collection (`cached_key`, `cached_value`: a tuple of one
  array per branch, of the compressed cache of `init_kv_cache`; `cache_index`: the tokens
  seen), whose size depends on the batch of the `init` input only; `apply` with that
  collection and `mutable=["cache"]` then takes the next `T >= 1` tokens and returns what the
  non-decoding module returns at those positions. `prefill=True` at the call takes a prompt at
  position 0 through the regular kernels and refills the cache. Needs a causal pattern,
  `ordering=None` and no `mesh`. An `init` given `segment_ids` makes a packed cache (also
  `cache_start` and `cache_first`, as the NNX layer's `init_cache(..., packed=True)`):
  prefills then take `segment_ids`, and the steps continue each row's last document.

  Attributes:
    num_heads, pattern, qkv_features, out_features, num_kv_heads, ordering, grid_shape:
      as in the NNX layer.
    dropout_rate: dropout on the attention output.
    deterministic: True disables dropout; or give it to the call.
    dtype, param_dtype: computation and parameter dtypes.
    implementation, mesh, seq_axis, batch_axis, heads_axis, layout: as in the NNX layer.
    broadcast_dropout: share the dropout mask across the batch axis.
    precision: `jax.lax.Precision` of the four projections.
    kernel_init: initializer of the projection kernels (and by default the `out` kernel).
    out_kernel_init: initializer of the `out` kernel (None: `kernel_init`).
    bias_init: initializer of the biases.
    out_bias_init: initializer of the `out` bias (None: `bias_init`).
    use_bias: whether the four projections have biases.
    normalize_qk: apply `LayerNorm` (scale only) to queries and keys per head.
    rotary_base: rotary position embedding of queries and keys with this base (None: none),
      as in the NNX layer.
    decode: keep and use the `cache` collection (see above).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from hilbert_ring_jax import DilatedPattern, linen
    >>> layer = linen.DilatedMultiHeadAttention(
    ...     num_heads=4, pattern=DilatedPattern((16, 64), (1, 4)), ordering="hilbert",
    ...     grid_shape=(8, 8))
    >>> x = jnp.ones((2, 64, 32))
    >>> variables = layer.init(jax.random.PRNGKey(0), x)
    >>> layer.apply(variables, x).shape
    (2, 64, 32)

  Decoding:
    >>> causal = linen.DilatedMultiHeadAttention(
    ...     num_heads=4, pattern=DilatedPattern((16, 64), (1, 4), causal=True), decode=True)
    >>> variables = causal.init(jax.random.PRNGKey(0), x)  # params and an empty cache
    >>> y, mutated = causal.apply(variables, x[:, :7], prefill=True, mutable=["cache"])
    >>> variables = {**variables, **mutated}
    >>> y, mutated = causal.apply(variables, x[:, 7:8], mutable=["cache"])
    >>> int(mutated["cache"]["cache_index"])
    8
  """

  num_heads: int
  pattern: DilatedPattern
  qkv_features: int | None = None
  out_features: int | None = None
  num_kv_heads: int | None = None
  ordering: Any = None
  grid_shape: tuple[int, ...] | None = None
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  implementation: Any = None
  mesh: Any = None
  seq_axis: str | None = None
  batch_axis: Any = None
  heads_axis: str | None = None
  layout: str = "natural"
  # The options of nn.MultiHeadDotProductAttention, with its defaults.
  broadcast_dropout: bool = True
  precision: Any = None
  kernel_init: Any = DEFAULT_KERNEL_INIT
  out_kernel_init: Any = None
  bias_init: Any = DEFAULT_BIAS_INIT
  out_bias_init: Any = None
  use_bias: bool = True
  normalize_qk: bool = False
  decode: bool = False
  rotary_base: float | None = None

  def __post_init__(self):
    # A permutation array as a TokenOrder (hashed by a digest, as the NNX layer keeps it), so
    # that the module hashes and compares: jit's static arguments, Flax's module comparisons.
    if self.ordering is not None and not isinstance(self.ordering, (str, TokenOrder)):
      object.__setattr__(self, "ordering", TokenOrder.make(self.ordering, self.grid_shape))
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               deterministic: bool | None = None, sow_weights: bool = False,
               prefill: bool = False, segment_ids=None, positions=None):
    """`[batch..., N, F]` -> `[batch..., N, out_features or F]`, in the caller's token order.

    The arguments are those of the NNX layer's call. With `decode`, `inputs_q` holds the next
    tokens after those in the `cache` collection (a prompt at position 0 with `prefill=True`);
    the `init` call only makes the empty cache.
    """
    batch, xq, xk, xv = layer_inputs(inputs_q, inputs_k, inputs_v, None)
    cross = xk.shape[1] != xq.shape[1]
    key_mask = key_mask_of(mask, batch, xk.shape[1])
    in_features = xq.shape[-1]
    qkv_features = in_features if self.qkv_features is None else self.qkv_features
    num_kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
    num_kv_heads, head_dim = check_heads(self.num_heads, qkv_features, num_kv_heads, self.pattern)
    rotary_base = check_rotary_base(self.rotary_base, head_dim)
    rate = check_dropout_rate(self.dropout_rate)
    check_options(broadcast_dropout=self.broadcast_dropout, deterministic=self.deterministic,
                  use_bias=self.use_bias, normalize_qk=self.normalize_qk,
                  kernel_init=self.kernel_init, out_kernel_init=self.out_kernel_init,
                  bias_init=self.bias_init, out_bias_init=self.out_bias_init)
    order = TokenOrder.make(self.ordering, self.grid_shape)
    layout = check_layout(self.layout, self.mesh, order)
    segment_ids = token_ids_of("segment_ids", segment_ids, batch, xq.shape[1])
    positions = token_ids_of("positions", positions, batch, xq.shape[1])
    # An init call with decode makes the cache and runs as a prefill would.
    initializing = self.decode and not self.has_variable("cache", "cache_index")
    check_call(decode=check_flag("decode", self.decode), prefill=prefill or initializing,
               sow_weights=sow_weights, cross=cross, key_mask=key_mask, rotary_base=rotary_base,
               order=order, pattern=self.pattern, mesh=self.mesh, segment_ids=segment_ids,
               positions=positions)
    perm = None if cross else order.permutation(xq.shape[1], self.pattern)
    if perm is not None:
      xq, xk, xv, key_mask, segment_ids, positions = serialize_inputs(
          perm, self.mesh, xq, xk, xv, key_mask, segment_ids, positions)
    dense = functools.partial(nn.DenseGeneral, dtype=self.dtype, param_dtype=self.param_dtype,
                              use_bias=self.use_bias, precision=self.precision)
    qkv = functools.partial(dense, kernel_init=checked_init("kernel_init", self.kernel_init),
                            bias_init=checked_init("bias_init", self.bias_init))
    q = qkv((self.num_heads, head_dim), name="query")(xq)
    k = qkv((num_kv_heads, head_dim), name="key")(xk)
    v = qkv((num_kv_heads, head_dim), name="value")(xv)
    if self.normalize_qk:
      norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype,
                               param_dtype=self.param_dtype)
      q, k = norm(name="query_ln")(q), norm(name="key_ln")(k)
    implementation = static_implementation(self.implementation)
    decoding = self.decode and self.has_variable("cache", "cache_index")
    # The positions of the rows in a zigzag layout (keys of another length: none needed).
    rows = None if cross else layout_positions(layout, self.mesh, self.seq_axis, xq.shape[1])
    if decoding:
      cached_key = self.variable("cache", "cached_key")
      cached_value = self.variable("cache", "cached_value")
      cache_index = self.variable("cache", "cache_index")
      packed = self.has_variable("cache", "cache_start")
      cache_start, cache_first = ((self.variable("cache", "cache_start"),
                                   self.variable("cache", "cache_first")) if packed
                                  else (None, None))
      cache = KVCache(cache_index.value, tuple(cached_key.value), tuple(cached_value.value),
                      self.num_heads, self.pattern, cache_start.value if packed else None,
                      tuple(cache_first.value) if packed else None)
      positions = decode_positions(cache, xq.shape[1], prefill=prefill,
                                   segment_ids=segment_ids)
    elif positions is None:
      positions = default_positions(xq.shape[1], perm, rows)
    q, k = rotate(q, k, rotary_base, positions)
    # [B, N, H, D]
    if decoding:
      y, cache = decode_attend(q, k, v, cache, self.pattern, prefill=prefill,
                               implementation=implementation, segment_ids=segment_ids)
      cached_key.value, cached_value.value, cache_index.value = cache.k, cache.v, cache.length
      if packed:
        cache_start.value, cache_first.value = cache.start, cache.first
    else:
      if self.decode:  # initializing: an empty cache; the call runs as without decode
        empty = init_kv_cache(self.pattern, batch=xq.shape[0], num_heads=self.num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=k.dtype,
                              packed=segment_ids is not None)
        self.variable("cache", "cached_key", lambda: empty.k)
        self.variable("cache", "cached_value", lambda: empty.v)
        self.variable("cache", "cache_index", lambda: empty.length)
        if segment_ids is not None:  # a packed cache (`KVCache.start`, `KVCache.first`)
          self.variable("cache", "cache_start", lambda: empty.start)
          self.variable("cache", "cache_first", lambda: empty.first)
      y, lse = attend(q, k, v, self.pattern, key_mask=key_mask, segment_ids=segment_ids,
                      return_lse=True, implementation=implementation, mesh=self.mesh,
                      seq_axis=self.seq_axis, batch_axis=self.batch_axis,
                      heads_axis=self.heads_axis, layout=layout)
      if sow_weights:
        self.sow("intermediates", "attention_weights", sown_weights(
            q, k, lse, self.pattern, perm, batch, key_mask=key_mask, segment_ids=segment_ids,
            rows=rows))
    if rate > 0.0:
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      if not deterministic:
        y = apply_dropout(y, self.make_rng("dropout"), rate, self.broadcast_dropout)
    # [B, N, out_features]
    out_features = in_features if self.out_features is None else self.out_features
    out_kernel = ("out_kernel_init", self.out_kernel_init) if self.out_kernel_init else \
        ("kernel_init", self.kernel_init)
    out_bias = ("out_bias_init", self.out_bias_init) if self.out_bias_init else \
        ("bias_init", self.bias_init)
    y = dense(out_features, axis=(-2, -1), kernel_init=checked_init(*out_kernel),
              bias_init=checked_init(*out_bias), name="out")(y)
    y = y if perm is None else permute(y, perm, inverse=True, mesh=self.mesh)
    return y.reshape(batch + y.shape[1:])
