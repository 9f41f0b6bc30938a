"""Flax NNX layer for dilated attention, and an `attention_fn` for `nnx.MultiHeadAttention`.

`DilatedMultiHeadAttention` projects tokens to queries, keys and values, optionally puts them
in a Hilbert (or any other) order, runs `dilated_attention` (or the ring version over a mesh)
and brings the result back to the caller's order. `dilated_attention_fn` plugs the same
function into Flax's own `nnx.MultiHeadAttention`. The Linen twin is in `linen.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .api import dilated_attention
from .ordering import hilbert_permutation, hilbert_permutation_per_segment, serialize, unserialize
from .pattern import DilatedPattern

ORDERINGS = ("hilbert", "hilbert_per_segment")


@functools.lru_cache(maxsize=32)
def _per_segment(n: int, w: int) -> np.ndarray:
  return hilbert_permutation_per_segment(n, w)


@dataclasses.dataclass(frozen=True)
class TokenOrder:
  """A static, hashable token order: what a layer's `ordering=` argument resolves to.

  Hashable so it can sit in a module's static structure (and in `jax.jit` cache keys); an
  explicit permutation is compared by a digest of its contents.
  """

  kind: str | None  # None, "hilbert", "hilbert_per_segment" or "explicit"
  key: tuple = ()  # the grid shape, or (length, digest) of an explicit permutation
  perm: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

  @classmethod
  def make(cls, ordering, grid_shape=None) -> TokenOrder:
    """Validates `ordering` (None, a name in `ORDERINGS` or a permutation) and `grid_shape`."""
    if isinstance(ordering, TokenOrder):
      return ordering
    if ordering is None or isinstance(ordering, str):
      if ordering is not None and ordering not in ORDERINGS:
        raise ValueError(f"ordering must be None, one of {ORDERINGS} or a permutation of "
                         f"0..N-1, got {ordering=}")
      if ordering == "hilbert":
        if grid_shape is None:
          raise ValueError('ordering="hilbert" needs grid_shape, e.g. grid_shape=(32, 32)')
        perm = hilbert_permutation(grid_shape)
        return cls("hilbert", tuple(int(d) for d in grid_shape), perm)
      if grid_shape is not None:
        raise ValueError(f'grid_shape is only used with ordering="hilbert", got {grid_shape=} '
                         f"and {ordering=}")
      return cls(ordering)
    if grid_shape is not None:
      raise ValueError(f'grid_shape is only used with ordering="hilbert", got {grid_shape=} '
                       f"with an explicit permutation")
    perm = np.asarray(ordering)
    if perm.ndim != 1 or not np.issubdtype(perm.dtype, np.integer) or not np.array_equal(
        np.sort(perm), np.arange(len(perm))):
      raise ValueError(f"ordering must be a 1-D integer permutation of 0..N-1, got an array of "
                       f"dtype {perm.dtype} and shape {perm.shape} that is not one")
    perm = perm.astype(np.int64)
    perm.flags.writeable = False
    return cls("explicit", (len(perm), hashlib.sha1(perm.tobytes()).hexdigest()), perm)

  def permutation(self, n: int, pattern: DilatedPattern) -> np.ndarray | None:
    """The permutation for `n` tokens (None for the identity); `ValueError` on a size mismatch."""
    if self.kind is None:
      return None
    if self.kind == "hilbert_per_segment":
      return _per_segment(n, pattern.segment_lengths[0])
    if len(self.perm) != n:
      what = f"grid_shape={self.key} has" if self.kind == "hilbert" else "ordering has"
      raise ValueError(f"{what} {len(self.perm)} tokens but the input has N={n}")
    return self.perm


def check_heads(num_heads, qkv_features, num_kv_heads, pattern) -> tuple[int, int]:
  """Validates the head layout; returns `(num_kv_heads, head_dim)`."""
  if not isinstance(pattern, DilatedPattern):
    raise ValueError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
  for name, val in (("num_heads", num_heads), ("qkv_features", qkv_features),
                    ("num_kv_heads", num_kv_heads)):
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
      raise ValueError(f"{name} must be a positive int, got {name}={val!r}")
  if qkv_features % num_heads:
    raise ValueError(f"{qkv_features=} must be divisible by {num_heads=}")
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_kv_heads=} must divide {num_heads=}")
  pattern.head_ranges(num_heads)  # head_groups needs a head per branch
  return num_kv_heads, qkv_features // num_heads


def check_dropout_rate(dropout_rate) -> float:
  if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, numbers.Real) or \
      not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate must be a number in [0, 1), got {dropout_rate=!r}")
  return float(dropout_rate)


def check_features(**features) -> None:
  for name, val in features.items():
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
      raise ValueError(f"{name} must be a positive int, got {name}={val!r}")


def static_implementation(implementation):
  """Lists become tuples, so the choice is hashable (static structure, jit cache keys)."""
  if implementation is None or isinstance(implementation, str):
    return implementation
  return tuple(implementation)


def permute(x, perm, *, inverse=False, mesh=None):
  """`serialize` (or `unserialize`) along axis 1, gathering that axis first if a mesh shards it.

  A permutation moves tokens across shards, and an explicit-axes mesh refuses the implicit
  all-gather; a model that serializes once at its input and unserializes at its output avoids
  the gather in every layer.
  """
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  if mesh is not None and spec is not None and len(spec) > 1 and spec[1] is not None:
    x = jax.sharding.reshard(x, jax.NamedSharding(mesh, jax.P(spec[0], None, *spec[2:])))
  return unserialize(x, perm) if inverse else serialize(x, perm)


def attend(q, k, v, pattern, *, implementation=None, mesh=None, seq_axis=None,
           batch_axis=None):
  """`dilated_attention`, or the ring version sharded over `seq_axis` (and the batch over
  `batch_axis`) of `mesh`."""
  if mesh is None:
    if seq_axis is not None or batch_axis is not None:
      raise ValueError(f"seq_axis and batch_axis are only used with a mesh, got {seq_axis=}, "
                       f"{batch_axis=} and mesh=None")
    return dilated_attention(q, k, v, pattern, implementation=implementation)
  if seq_axis is None:
    raise ValueError(f"a mesh needs seq_axis, the mesh axis that shards the sequence (one of "
                     f"{tuple(mesh.shape)}), got seq_axis=None")
  try:
    from .ring import sharded_dilated_attention  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise NotImplementedError(
        f"mesh= needs hilbert_ring_jax.ring.sharded_dilated_attention, unavailable here: {e}"
    ) from e
  return sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name=seq_axis,
                                   batch_axis=batch_axis,
                                   implementation=implementation)


class DilatedMultiHeadAttention(nnx.Module):
  """Multi-head self-attention with a LongNet dilated pattern and an optional token order.

  `x [B, N, in_features]` -> (serialize) -> q `[B, N, H, D]`, k, v `[B, N, Hkv, D]` ->
  `dilated_attention` -> dropout -> output projection -> (unserialize) -> `[B, N, out_features]`.
  With an ordering, the pattern's segments, dilation and causality act on positions in that
  order, and outputs come back in the caller's order: a caller never sees the processing order.

  Dropout is applied to the attention *output* (per head, before the output projection), not
  to the attention probabilities, which `dilated_attention` never materializes.

  Parameters are `query`, `key`, `value` and `out`, each an `nnx.LinearGeneral` with `kernel`
  and `bias` laid out exactly as in `nnx.MultiHeadAttention`, so weights can be copied between
  the two (and to the Linen twin, `hilbert_ring_jax.linen.DilatedMultiHeadAttention`).

  Args:
    num_heads: query heads `H`.
    in_features: input features.
    qkv_features: total query features `H * D` (default `in_features`); `D` per head.
    out_features: output features (default `in_features`).
    num_kv_heads: key/value heads `Hkv` (default `H`); fewer gives GQA/MQA.
    pattern: the `DilatedPattern` (its `causal` flag makes the layer causal).
    ordering: None (tokens as given), `"hilbert"` (tokens are the row-major cells of a grid of
      `grid_shape`, processed along a Hilbert curve), `"hilbert_per_segment"` (a Hilbert order
      inside each segment of `pattern.segment_lengths[0]` tokens, built for the `N` of the input),
      or an explicit permutation: a 1-D int array, `x_serial[:, j] = x[:, perm[j]]`.
    grid_shape: the grid for `ordering="hilbert"`; its size must be `N`.
    dropout_rate: dropout on the attention output (see above).
    deterministic: default for `__call__`; True disables dropout (`model.eval()` sets it).
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype.
    implementation: backend choice passed to `dilated_attention`.
    mesh, seq_axis: shard the sequence over axis `seq_axis` of `mesh` with ring attention
      (`hilbert_ring_jax.ring.sharded_dilated_attention`); with explicit mesh axes, trace
      under `jax.set_mesh(mesh)`. An ordering then gathers the sequence axis for its
      permutations: serializing once at the model's input is cheaper.
    batch_axis: with `mesh`, the mesh axis (or axes) the batch is split over: data x
      sequence parallelism.
    rngs: `nnx.Rngs` for parameter init (and the `dropout` stream if `dropout_rate > 0`).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern
    >>> layer = DilatedMultiHeadAttention(
    ...     num_heads=4, in_features=32, pattern=DilatedPattern((16, 64), (1, 4)),
    ...     ordering="hilbert", grid_shape=(8, 8), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 64, 32))).shape
    (2, 64, 32)
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None, *,
               pattern: DilatedPattern, ordering=None, grid_shape=None,
               dropout_rate: float = 0.0, deterministic: bool = False, dtype=None,
               param_dtype=jnp.float32, implementation=None, mesh=None, seq_axis=None,
               batch_axis=None,
               rngs: nnx.Rngs):
    check_features(in_features=in_features)
    qkv_features = in_features if qkv_features is None else qkv_features
    out_features = in_features if out_features is None else out_features
    check_features(out_features=out_features)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    num_kv_heads, head_dim = check_heads(num_heads, qkv_features, num_kv_heads, pattern)
    if mesh is None and (seq_axis is not None or batch_axis is not None):
      raise ValueError(f"seq_axis and batch_axis are only used with a mesh, got {seq_axis=}, "
                       f"{batch_axis=} and mesh=None")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.in_features, self.out_features = in_features, out_features
    self.pattern = pattern
    self.order = TokenOrder.make(ordering, grid_shape)
    self.dropout_rate = check_dropout_rate(dropout_rate)
    self.deterministic = deterministic
    self.implementation = static_implementation(implementation)
    self.mesh, self.seq_axis, self.batch_axis = mesh, seq_axis, batch_axis
    linear = functools.partial(nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype,
                               rngs=rngs)
    self.query = linear(in_features, (num_heads, head_dim))
    self.key = linear(in_features, (num_kv_heads, head_dim))
    self.value = linear(in_features, (num_kv_heads, head_dim))
    self.out = linear((num_heads, head_dim), out_features, axis=(-2, -1))
    self.dropout = nnx.Dropout(self.dropout_rate, rngs=rngs if self.dropout_rate else None)

  def __call__(self, x, *, deterministic: bool | None = None, rngs: nnx.Rngs | None = None):
    """`[B, N, in_features]` -> `[B, N, out_features]`, in the caller's token order.

    Args:
      x: the tokens, in the caller's order (row-major grid cells for `ordering="hilbert"`).
      deterministic: overrides the constructor's flag; True disables dropout.
      rngs: optional `nnx.Rngs` for dropout, instead of the stream given at construction.
    """
    if jnp.ndim(x) != 3 or x.shape[-1] != self.in_features:
      raise ValueError(f"x must be [B, N, in_features={self.in_features}], got {x.shape=}")
    perm = self.order.permutation(x.shape[1], self.pattern)
    if perm is not None:
      x = permute(x, perm, mesh=self.mesh)
    q, k, v = self.query(x), self.key(x), self.value(x)
    # [B, N, H, D]
    y = attend(q, k, v, self.pattern, implementation=self.implementation, mesh=self.mesh,
               seq_axis=self.seq_axis, batch_axis=self.batch_axis)
    deterministic = self.deterministic if deterministic is None else deterministic
    y = self.dropout(y, deterministic=deterministic, rngs=rngs)
    # [B, N, out_features]
    y = self.out(y)
    return y if perm is None else permute(y, perm, inverse=True, mesh=self.mesh)


def dilated_attention_fn(pattern: DilatedPattern, *, scale: float | None = None,
                         implementation=None):
  """`dilated_attention` with `pattern`, shaped as the `attention_fn` of Flax attention modules.

  The returned function takes `(query, key, value, bias=None, mask=None, ...)` like
  `flax.nnx.dot_product_attention`, with `[batch..., N, H, D]` queries and `[batch..., N, Hkv, D]`
  keys and values (GQA works). The pattern alone defines which keys a query sees, so a `mask`
  or `bias` raises `ValueError`, as does `is_causal=True` with a non-causal pattern. Dropout
  (`dropout_rate > 0` and not `deterministic`) is applied to the attention output, not to the
  attention probabilities, which are never materialized; `precision` is ignored and
  `sow_weights` (a `module` argument) is refused.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from hilbert_ring_jax import DilatedPattern, dilated_attention_fn
    >>> fn = dilated_attention_fn(DilatedPattern((16, 64), (1, 4), causal=True))
    >>> mha = nnx.MultiHeadAttention(4, 32, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
    >>> mha(jnp.ones((2, 64, 32))).shape
    (2, 64, 32)
  """
  if not isinstance(pattern, DilatedPattern):
    raise ValueError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
  implementation = static_implementation(implementation)

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, is_causal=False, **unused):
    del precision, unused
    if mask is not None or bias is not None:
      raise ValueError("dilated attention takes no mask or bias: the pattern defines which keys "
                       f"are visible; got mask={mask is not None}, bias={bias is not None} "
                       "(nnx.MultiHeadAttention(decode=True) passes a cache mask: cached "
                       "decoding is not supported through attention_fn)")
    if is_causal and not pattern.causal:
      raise ValueError(f"is_causal=True needs a causal pattern, got {pattern=}")
    if module is not None:
      raise ValueError("sow_weights is not supported: attention weights are never materialized")
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    batch = query.shape[:-3]
    # [B, N, H, D] with the batch dims flattened (none gives B = 1)
    q, k, v = (jnp.asarray(x, dtype).reshape((-1,) + x.shape[-3:]) for x in (query, key, value))
    out = dilated_attention(q, k, v, pattern, scale=scale, implementation=implementation)
    out = out.reshape(batch + out.shape[1:])
    if dropout_rate > 0.0 and not deterministic:
      if dropout_rng is None:
        raise ValueError(f"{dropout_rate=} with deterministic=False needs a dropout_rng")
      shape = (1,) * len(batch) + out.shape[len(batch):] if broadcast_dropout else out.shape
      keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, shape)
      out = jnp.where(keep, out / (1.0 - dropout_rate), 0).astype(out.dtype)
    return out

  return attention_fn

