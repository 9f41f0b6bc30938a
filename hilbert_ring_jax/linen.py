"""Linen twin of `hilbert_ring_jax.DilatedMultiHeadAttention`, for Linen codebases.

Same computation and the same parameter tree (`query`, `key`, `value`, `out`, each with
`kernel` and `bias` of the same shapes) as the NNX layer, so weights copy across as they are:
`{"params": nnx.to_pure_dict(nnx.state(nnx_layer, nnx.Param))}`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from .nn import (TokenOrder, attend, check_dropout_rate, check_heads, permute,
                 static_implementation)
from .pattern import DilatedPattern


class DilatedMultiHeadAttention(nn.Module):
  """Linen multi-head self-attention with a dilated pattern and an optional token order.

  Attributes are those of the NNX layer (see `hilbert_ring_jax.DilatedMultiHeadAttention`),
  except that `in_features` is taken from the input and there is no `rngs`: parameters come
  from the `params` collection and dropout (on the attention output, before the output
  projection) from the `dropout` rng collection. `deterministic` follows Linen's convention:
  give it as an attribute or a call argument (needed only when `dropout_rate > 0`).

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

  @nn.compact
  def __call__(self, x, *, deterministic: bool | None = None):
    """`[B, N, F]` -> `[B, N, out_features or F]`, in the caller's token order."""
    if x.ndim != 3:
      raise ValueError(f"x must be [B, N, in_features], got {x.shape=}")
    in_features = x.shape[-1]
    qkv_features = in_features if self.qkv_features is None else self.qkv_features
    num_kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
    num_kv_heads, head_dim = check_heads(self.num_heads, qkv_features, num_kv_heads, self.pattern)
    rate = check_dropout_rate(self.dropout_rate)
    perm = TokenOrder.make(self.ordering, self.grid_shape).permutation(x.shape[1], self.pattern)
    if perm is not None:
      x = permute(x, perm, mesh=self.mesh)
    dense = functools.partial(nn.DenseGeneral, dtype=self.dtype, param_dtype=self.param_dtype)
    q = dense((self.num_heads, head_dim), name="query")(x)
    k = dense((num_kv_heads, head_dim), name="key")(x)
    v = dense((num_kv_heads, head_dim), name="value")(x)
    # [B, N, H, D]
    y = attend(q, k, v, self.pattern, implementation=static_implementation(self.implementation),
               mesh=self.mesh, seq_axis=self.seq_axis, batch_axis=self.batch_axis)
    if rate > 0.0:
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      y = nn.Dropout(rate, deterministic=deterministic)(y)
    # [B, N, out_features]
    out_features = in_features if self.out_features is None else self.out_features
    y = dense(out_features, axis=(-2, -1), name="out")(y)
    return y if perm is None else permute(y, perm, inverse=True, mesh=self.mesh)
