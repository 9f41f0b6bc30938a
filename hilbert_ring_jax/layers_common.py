"""What the NNX layer (`nn.py`) and its Linen twin (`linen.py`) share, framework-free: token
orders, argument checks, rotary positions, dropout, and `attend`, the attention call with
hidden keys, keys of another length and a mesh, with the weights a layer sows.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .api import (IDS_BEYOND_32_BITS, check_32_bits, check_flag, check_layout_name, check_scale,
                  dilated_attention)
from .decode import KVCache, dilated_attention_prefill, dilated_attention_step, document_starts
from .ordering import (check_perm, hilbert_permutation, hilbert_permutation_per_segment,
                       inverse_permutation, serialize, unserialize)
from .pattern import DilatedPattern, heads_per_kv
from .reference import same_document, visibility_counts

ORDERINGS = ("hilbert", "hilbert_per_segment")
# A hidden key scores this far below its logit (`hide_keys`).
HIDE = 2.0 ** 24


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
    perm = check_perm(ordering, name="ordering").astype(np.int64)
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
  check_features(num_heads=num_heads, qkv_features=qkv_features, num_kv_heads=num_kv_heads)
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


def check_options(**options) -> None:
  """Flags must be bools (`deterministic` may be None), initializers callables or None."""
  for name, val in options.items():
    if name.endswith("_init"):
      if not (callable(val) or (val is None and name.startswith("out_"))):
        raise ValueError(f"{name} must be an initializer (a callable), got {name}={val!r}")
    elif not (val is None and name == "deterministic"):
      check_flag(name, val)


def checked_init(name: str, init):
  """`init` that raises `ValueError` naming `name` when it returns an array of another shape
  than the parameter's (Flax would reshape one of the same size silently, or fail with a
  reshape TypeError)."""
  def wrapped(key, shape, dtype=jnp.float32, *args, **kwargs):
    x = init(key, shape, dtype, *args, **kwargs)
    # The array inside sharding annotations (nnx.with_partitioning, nn.with_partitioning).
    value = x.unbox() if hasattr(x, "unbox") else getattr(x, "raw_value", x)
    if tuple(jnp.shape(value)) != tuple(shape):
      raise ValueError(f"{name} returned an array of shape {tuple(jnp.shape(value))}; the "
                       f"parameter needs shape {tuple(shape)}")
    return x
  return wrapped


def resolve_deterministic(deterministic, default) -> bool:
  """The call's `deterministic`, else the layer's; `ValueError` when neither says."""
  for val in (deterministic, default):
    if val is not None:
      if not isinstance(val, (bool, np.bool_)):
        raise ValueError(f"deterministic must be a bool or None, got deterministic={val!r}")
      return bool(val)
  raise ValueError("deterministic is needed with dropout_rate > 0: pass deterministic=True/False "
                   "to the call or the constructor, or use model.eval() / model.train() or "
                   "nnx.view(model, deterministic=...)")


def check_decodable(order: TokenOrder, pattern: DilatedPattern, mesh) -> None:
  """`ValueError` naming the argument that rules out cached decoding in a layer."""
  if order.kind is not None:
    what = "an explicit permutation" if order.kind == "explicit" else repr(order.kind)
    raise ValueError(f"decode needs ordering=None, got ordering={what}: a token order "
                     f"permutes the whole sequence, and decoding sees it one token at a time")
  if not pattern.causal:
    raise ValueError(f"decode needs a causal pattern, got {pattern=}")
  if mesh is not None:
    raise ValueError("decode runs on one device's view of the sequence: build the decoding "
                     f"layer with mesh=None (the weights copy across), got {mesh=}")


def check_rotary_base(rotary_base, head_dim: int):
  """`rotary_base` (None, or a finite number > 1) as a float or None; the head dim must be even."""
  if rotary_base is None:
    return None
  if (isinstance(rotary_base, bool) or not isinstance(rotary_base, numbers.Real)
      or not np.isfinite(rotary_base) or rotary_base <= 1):
    raise ValueError(f"rotary_base must be None or a finite number > 1 (e.g. 10000.0), got "
                     f"rotary_base={rotary_base!r}")
  if head_dim % 2:
    raise ValueError(f"rotary_base needs an even head dim, got {head_dim}")
  return float(rotary_base)


def rotate(q, k, rotary_base, positions):
  """Rotary position embedding of `q [B, N, H, D]` and `k [B, N, Hkv, D]` (None: unchanged).

  Feature `i < D/2` and `i + D/2` of the token at `positions[j]` (the tokens' places in the
  caller's order: decoding offsets them by the tokens cached; `[N]`, or `[B, N]` per row,
  e.g. restarting at each packed document) turn by the angle
  `positions[j] * rotary_base ** (-2 i / D)`, computed in float32, so that a score depends
  on the positions only through their difference.
  """
  if rotary_base is None:
    return q, k
  half = q.shape[-1] // 2
  freq = rotary_base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = jnp.asarray(positions, jnp.float32)[..., None] * freq  # [(B,) N, D/2]
  cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]  # [(B,) N, 1, D/2]

  def turn(x):
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)

  return turn(q), turn(k)


def decode_positions(cache: KVCache, steps: int, *, prefill: bool, segment_ids=None):
  """The rotary positions of a decoding call's `steps` tokens: from 0 for a prefill (from
  the start of each run of equal ids with `segment_ids`), after the cached tokens for a step;
  in a packed cache (`cache.start`) counted from the start of each row's last run (`[B, T]`),
  as `positions` restarting at each run of ids number them."""
  if prefill:
    return jnp.arange(steps) if segment_ids is None else (
        jnp.arange(steps) - document_starts(segment_ids))
  if cache.start is None:
    return cache.length + jnp.arange(steps)
  return cache.length - cache.start[:, None] + jnp.arange(steps)


def decode_attend(q, k, v, cache: KVCache, pattern, *, prefill: bool, implementation=None,
                  segment_ids=None):
  """One decoding call of a layer: `(y, cache)` for new tokens `q, k, v`.

  `prefill`: the tokens are a prompt at position 0 (the regular kernels, the cache refilled);
  else a step of `T >= 1` tokens after the cached ones. q, k, v are cast to the cache's dtype
  (`init_cache`'s `dtype`); `y` comes back in q's dtype. A packed cache (`cache.start`, from
  `init_cache(..., packed=True)`) takes a prefill's `segment_ids` (none: one document a row)
  and keeps `start` and `first` through the steps; any other cache refuses them.
  """
  if segment_ids is not None and cache.start is None:
    raise ValueError("segment_ids in decoding need a packed cache: init_cache(input_shape, "
                     "packed=True) (Linen: init with segment_ids)")
  dtype = cache.k[0].dtype
  q_dtype = q.dtype
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  if prefill:
    y, cache = dilated_attention_prefill(q, k, v, pattern, cache=cache,
                                         segment_ids=segment_ids,
                                         implementation=implementation)
  else:
    y, cache = dilated_attention_step(q, k, v, cache, pattern, implementation=implementation)
  return y.astype(q_dtype), cache


def check_input_shape(input_shape, in_features) -> int:
  """The batch size of `init_cache`'s `input_shape` `(batch..., N, in_features)`: the product
  of the batch dims, 1 for none, as the layers' calls flatten them (N is unused)."""
  shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else None
  if shape is None or len(shape) < 2 or any(
      isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in shape) \
      or shape[-1] != in_features:
    raise ValueError(f"input_shape must be (batch..., length, in_features={in_features}) of "
                     f"positive ints, got {input_shape=!r}")
  return int(np.prod(shape[:-2], dtype=np.int64))


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
  x = x if mesh is None else whole_sequence(x, mesh)
  return unserialize(x, perm) if inverse else serialize(x, perm)


def whole_sequence(x, mesh=None):
  """`x [B, N, ...]` with its sequence axis gathered where explicit mesh axes split it (on
  `mesh`, else the one in context), for what JAX will not compute on a split sequence there:
  the permutations, and products over all `N x N` pairs."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  if spec is None or len(spec) < 2 or spec[1] is None:
    return x
  whole = jax.P(spec[0], None, *spec[2:])
  return jax.sharding.reshard(x, whole if mesh is None else jax.NamedSharding(mesh, whole))


def apply_dropout(y, key, rate: float, broadcast: bool):
  """Dropout on the attention output `y [B, N, H, D]`; `broadcast` shares the mask over B.

  The mask takes `y`'s sharding (without the batch axes when broadcast): `nnx.Dropout` would
  give a `[1, N, H, D]` mask the batch sharding, and `nn.Dropout` none, which explicit mesh
  axes refuse.
  """
  sharding = jax.typeof(y).sharding
  spec = getattr(sharding, "spec", None)
  shape = y.shape
  if broadcast:
    shape = (1,) + shape[1:]
    if spec:
      sharding = jax.NamedSharding(sharding.mesh, jax.P(None, *spec[1:]))
  keep = jax.random.bernoulli(key, 1.0 - rate, shape, out_sharding=sharding)
  return jnp.where(keep, y / (1.0 - rate), jnp.zeros_like(y))


def layer_inputs(inputs_q, inputs_k, inputs_v, in_features: int, in_kv_features=None):
  """A layer call's inputs with Flax's defaults (keys from `inputs_q` unless `inputs_k`, values
  from the keys' inputs unless `inputs_v`), as `(batch, xq, xk, xv)`: the batch dims and
  `[B, N, F]` arrays, B the product of the batch dims (1 for none); one input passed twice is
  flattened once. `ValueError` naming an input that does not fit (`in_kv_features` None: the
  keys' and values' features are free)."""
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError("inputs_v needs inputs_k (keys default to inputs_q, values to the keys' "
                       "inputs): pass inputs_k too, or inputs_k alone for both")
    inputs_k = inputs_q
  inputs_v = inputs_k if inputs_v is None else inputs_v
  batch = tuple(jnp.shape(inputs_q))[:-2]
  flat = {}
  for name, x, features, what in (("inputs_q", inputs_q, in_features, "in_features"),
                                  ("inputs_k", inputs_k, in_kv_features, "in_kv_features"),
                                  ("inputs_v", inputs_v, in_kv_features, "in_kv_features")):
    shape = tuple(jnp.shape(x))
    if len(shape) < 2 or (features is not None and shape[-1] != features):
      raise ValueError(f"{name} must be [batch..., N, {what}={features or 'F'}], got "
                       f"{name}.shape={shape}")
    if shape[:-2] != batch:
      raise ValueError(f"{name} must have the batch dims of inputs_q {batch}, got "
                       f"{name}.shape={shape}")
    if id(x) not in flat:
      flat[id(x)] = jnp.reshape(x, (math.prod(batch),) + shape[-2:])  # (symbolic: export)
  if jnp.shape(inputs_v)[-2] != jnp.shape(inputs_k)[-2]:
    raise ValueError(f"inputs_k and inputs_v must have the same length, got "
                     f"{jnp.shape(inputs_k)=} and {jnp.shape(inputs_v)=}")
  return batch, flat[id(inputs_q)], flat[id(inputs_k)], flat[id(inputs_v)]


def token_ids_of(name: str, ids, batch: tuple, n: int):
  """A layer's per-token integers (`segment_ids`, `positions`): `[batch..., N]` as `[B, N]`,
  B the product of the batch dims (None: None); `ValueError` naming `name` otherwise."""
  if ids is None:
    return None
  want = batch + (n,)
  if not (hasattr(ids, "shape") and hasattr(ids, "dtype")) or tuple(ids.shape) != want or \
      not jnp.issubdtype(ids.dtype, jnp.integer):
    got = (f"{name}.shape={tuple(ids.shape)}, {name}.dtype={ids.dtype}" if hasattr(ids, "shape")
           and hasattr(ids, "dtype") else type(ids).__name__)
    raise ValueError(f"{name} must be an integer array of shape {want} = [batch..., N], got "
                     f"{got}")
  # Before the ordering's gather turns NumPy ids into JAX's (narrowed to 32 bits).
  check_32_bits(name, ids, IDS_BEYOND_32_BITS if name == "segment_ids" else
                "wrapping them: pass int32 ones or enable jax_enable_x64")
  return jnp.reshape(ids, (-1, n))


def key_mask_of(mask, batch: tuple, n_k: int):
  """Flax's `mask` (`[batch..., heads, Nq, Nk]` or broadcasting to it; True or nonzero: attend)
  as a `[B, Nk]` bool key mask, B the product of the batch dims (None: None).

  Only a mask that hides keys fits the dilated pattern, which decides what each query sees: one
  of size 1 along heads and queries, such as a padding mask `key_valid[..., None, None, :]` or
  `nnx.MultiHeadAttention`'s decode cache mask. Any other raises `ValueError`.
  """
  if mask is None:
    return None
  shape = tuple(jnp.shape(mask))
  want = (*batch, 1, 1, n_k)
  try:
    fits = len(shape) <= len(want) and jnp.broadcast_shapes(shape, want) == want
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"mask must hide keys only, of shape {want} = [batch..., 1, 1, Nk] or "
                     f"broadcasting to it (True: attend), e.g. key_valid[..., None, None, :]; "
                     f"got mask.shape={shape}. The dilated pattern decides which keys each query "
                     f"sees: a mask that varies over queries or heads is not supported")
  return jnp.broadcast_to(jnp.asarray(mask), want).reshape(-1, n_k).astype(bool)


def check_position_free(pattern: DilatedPattern, n_q: int, n_k: int) -> None:
  """`ValueError` unless `pattern` shows every key to every query whatever their positions (not
  causal, every rate 1, every segment covering both lengths): the one kind of pattern for which
  queries and keys of different lengths (`n_q`, `n_k`) have a meaning."""
  n = max(n_q, n_k)
  if pattern.causal or any(r != 1 or w < n for w, r in pattern.branches):
    raise ValueError(f"queries and keys of different lengths ({n_q} and {n_k}) need a pattern "
                     f"under which every query sees every key (not causal, every dilation rate "
                     f"1, every segment length >= {n}), got {pattern=}: a dilated pattern places "
                     f"queries and keys on one sequence. For cached decoding with a dilated "
                     f"pattern, use DilatedMultiHeadAttention(decode=True)")


def hide_keys(attention, q, k, v, key_mask, scale: float):
  """`attention(q, k, v, scale=scale, return_lse=True)` with the keys where `key_mask [B, N]` is
  False hidden: `(out, lse)` of the pattern's attention with those keys removed from every
  query's view; a row left with no visible key gets `out = 0`, `lse = -inf` and no gradient.

  Every backend computes it as it is: q, k and v get one more feature, 1 in queries, 0 in
  values, and in keys 0 (visible) or `-HIDE / scale` (hidden), so a hidden key scores `HIDE`
  below its logit. While logits stay within `HIDE / 4` in magnitude, `exp` of a hidden key's
  score is exactly 0 in a row that sees a visible key, and a row of hidden keys alone has
  `lse < -HIDE / 2`: it is then set to 0 and `-inf`. `HIDE` keeps the scores within every
  backend's exact range (the mosaic forward's: `|s| log2 e < 2**27`). float16 cannot hold the
  feature: float16 inputs run in float32. The extra feature usually makes a head dim that the GPU
  kernels decline (they take powers of two), so the "xla" backend runs there.
  """
  if not abs(scale) >= 2.0 ** -64:
    raise ValueError(f"a mask hides keys through the scores: it needs |scale| >= 2**-64, got "
                     f"{scale=}")
  dtype = q.dtype
  wide = jnp.float32 if dtype == jnp.float16 else dtype

  def extend(x, feature):
    x = x.astype(wide)
    # Built from x, so that it takes x's sharding (concatenate wants the same on a mesh).
    return jnp.concatenate([x, jnp.zeros_like(x[..., :1]) + feature], axis=-1)

  bias = jnp.where(key_mask, 0.0, -HIDE / scale)[:, :, None, None]
  out, lse = attention(extend(q, 1.0), extend(k, bias), extend(v, 0.0), scale=scale,
                       return_lse=True)
  seen = lse > -HIDE / 2
  return (jnp.where(seen[..., None], out[..., :-1], 0.0).astype(dtype),
          jnp.where(seen, lse, -jnp.inf))


def check_mesh_axes(mesh, seq_axis, batch_axis, heads_axis) -> None:
  """The layers' mesh axes are only used with a mesh: `ValueError` naming them otherwise."""
  if mesh is None and (seq_axis, batch_axis, heads_axis) != (None, None, None):
    raise ValueError(f"seq_axis, batch_axis and heads_axis are only used with a mesh, got "
                     f"{seq_axis=}, {batch_axis=}, {heads_axis=} and mesh=None")


def attend(q, k, v, pattern, *, key_mask=None, segment_ids=None, scale=None, return_lse=False,
           implementation=None, mesh=None, seq_axis=None, batch_axis=None, heads_axis=None,
           layout="natural"):
  """`dilated_attention`, or the ring version sharded over `seq_axis` (and the batch over
  `batch_axis`, the heads over `heads_axis`) of `mesh`, with hidden keys and keys of another
  length than the queries.

  Args:
    q, k, v: `[B, Nq, H, D]` queries, `[B, Nk, Hkv, D]` keys and values, in processing order.
    key_mask: None, or `[B, Nk]` bool: False hides that key from every query (`hide_keys`).
    segment_ids, scale, return_lse, implementation: as in `dilated_attention`.
    mesh, seq_axis, batch_axis, heads_axis, layout: as in `sharded_dilated_attention` (None:
      one device).

  Keys of another length (`Nk != Nq`) need a pattern that shows every key to every query
  (`check_position_free`): the shorter side is padded, queries with rows dropped after and keys
  hidden, which changes nothing there.

  Returns:
    `out [B, Nq, H, D]`, or `(out, lse)`.
  """
  if mesh is None:
    check_mesh_axes(mesh, seq_axis, batch_axis, heads_axis)
    run = functools.partial(dilated_attention, pattern=pattern, segment_ids=segment_ids,
                            implementation=implementation)
  else:
    if seq_axis is None:
      raise ValueError(f"a mesh needs seq_axis, the mesh axis that shards the sequence (one of "
                       f"{tuple(mesh.shape)}), got seq_axis=None")
    try:
      from .ring import sharded_dilated_attention  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise NotImplementedError(
          f"mesh= needs hilbert_ring_jax.ring.sharded_dilated_attention, unavailable here: {e}"
      ) from e
    run = functools.partial(sharded_dilated_attention, pattern=pattern, mesh=mesh,
                            axis_name=seq_axis, batch_axis=batch_axis, heads_axis=heads_axis,
                            segment_ids=segment_ids, implementation=implementation,
                            layout=layout)
  n_q, n_k = q.shape[1], k.shape[1]
  if n_q != n_k:
    if segment_ids is not None:
      raise ValueError("segment_ids mark the documents of one packed sequence: keys of "
                       "another length than the queries take none")
    check_position_free(pattern, n_q, n_k)
    n = max(n_q, n_k)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    if n_k < n:
      key_mask = pad(jnp.ones(k.shape[:2], bool) if key_mask is None else key_mask)
    q, k, v = pad(q), pad(k), pad(v)
  if key_mask is None:
    out, lse = run(q, k, v, scale=scale, return_lse=True)
  else:
    out, lse = hide_keys(run, q, k, v, key_mask, check_scale(scale, q.shape[-1]))
  out, lse = out[:, :n_q], lse[:, :n_q]
  return (out, lse) if return_lse else out


def attention_weights(q, k, lse, pattern, *, key_mask=None, segment_ids=None, scale=None):
  """The attention probabilities `[B, H, Nq, Nk]` behind `attend`'s `(out, lse)`:
  `m exp(s - lse)` (docs/SPEC.md, section 5), 0 where a query does not see a key (hidden keys
  included). Dense, `O(Nq Nk)` memory: what `sow_weights` records, in float32."""
  q, k, lse, key_mask, segment_ids = (x if x is None else whole_sequence(x)
                                      for x in (q, k, lse, key_mask, segment_ids))
  n_q, n_k, h = q.shape[1], k.shape[1], q.shape[2]
  counts = visibility_counts(pattern, max(n_q, n_k), h)[:, :n_q, :n_k]
  kh = jnp.repeat(k, heads_per_kv(h, k.shape[2]), axis=2)
  s = check_scale(scale, q.shape[-1]) * jnp.einsum(
      "bihd,bjhd->bhij", q, kh, precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32)
  seen = counts > 0 if key_mask is None else (counts > 0) & key_mask[:, None, None, :]
  if segment_ids is not None:
    seen = seen & same_document(segment_ids)
  lse = jnp.moveaxis(jnp.where(jnp.isfinite(lse), lse, 0.0), 1, 2)[..., None]
  return jnp.where(seen, counts * jnp.exp(s - lse), 0.0)


def serialize_inputs(perm, mesh, *xs):
  """`permute` each of `xs` (`[B, N, ...]` arrays or None) into processing order; an array
  passed several times (self-attention's one input) is permuted once."""
  done = {}
  for x in xs:
    if x is not None and id(x) not in done:
      done[id(x)] = permute(x, perm, mesh=mesh)
  return tuple(None if x is None else done[id(x)] for x in xs)


def check_layout(layout, mesh, order: TokenOrder) -> str:
  """A layer's `layout`: "natural", or "zigzag" (the sequence in zigzag order over the mesh's
  `seq_axis`, as `ring.sharded_dilated_attention` takes it), which needs a mesh and takes the
  tokens as given (no ordering)."""
  if check_layout_name(layout) == "zigzag" and mesh is None:
    raise ValueError('layout="zigzag" is the order of the shards of a mesh: it needs mesh=')
  if layout == "zigzag" and order.kind is not None:
    raise ValueError(f'layout="zigzag" takes the tokens in zigzag order as they are: it needs '
                     f"ordering=None, got ordering {order.kind!r}")
  return layout


def layout_positions(layout, mesh, seq_axis, n: int):
  """The positions of a sequence's `n` rows in `layout` (`ring.zigzag_positions` over the
  mesh's `seq_axis`), or None in natural order."""
  if layout == "natural" or seq_axis not in mesh.shape:  # (no such axis: `attend` says so)
    return None
  from .ring import zigzag_positions  # pylint: disable=import-outside-toplevel
  shards = mesh.shape[seq_axis]
  if n % (2 * shards):
    raise ValueError(f'layout="zigzag" cuts the sequence into two chunks a device of mesh axis '
                     f"seq_axis={seq_axis!r}: its {n} tokens must be divisible by {2 * shards}")
  return zigzag_positions(n, shards)


def default_positions(n: int, perm, rows):
  """A call's rotary positions where none are given: those its `n` rows hold, by the layer's
  ordering (`perm`) or a zigzag layout (`rows`, `layout_positions`; the two exclude each
  other), else `0 .. n - 1`."""
  held = perm if rows is None else rows
  return jnp.arange(n) if held is None else jnp.asarray(held)


def sown_weights(q, k, lse, pattern, perm, batch: tuple, *, key_mask=None, segment_ids=None,
                 rows=None):
  """What a layer sows: `attention_weights` in the caller's token order (`perm`: the layer's
  ordering, or None) and batch dims. `rows`: the positions the caller's rows hold (a zigzag
  layout, `layout_positions`), or None: the weights are computed in natural order, then put
  in the caller's."""
  if rows is not None:
    perm = inverse_permutation(rows)  # natural position j is the caller's row perm[j]
    q, k, lse, key_mask, segment_ids = (None if x is None else whole_sequence(x)[:, perm]
                                        for x in (q, k, lse, key_mask, segment_ids))
  weights = attention_weights(q, k, lse, pattern, key_mask=key_mask, segment_ids=segment_ids)
  return caller_weights(weights, perm, batch)


def caller_weights(weights, perm, batch: tuple):
  """`attention_weights` `[B, H, N, Nk]` in the caller's token order (both axes) and batch
  dims: what a layer sows."""
  if perm is not None:
    inv = inverse_permutation(perm)
    weights = weights[:, :, inv][:, :, :, inv]
  return weights.reshape(batch + weights.shape[1:])


def check_call(*, decode: bool, prefill, sow_weights, cross: bool, key_mask, rotary_base,
               order: TokenOrder, pattern: DilatedPattern, mesh, segment_ids=None,
               positions=None) -> None:
  """`ValueError` for a layer call's flags that do not go together."""
  check_flag("sow_weights", sow_weights)
  if check_flag("prefill", prefill) and not decode:
    raise ValueError("prefill=True fills the decoding cache: it needs decode=True")
  if cross and rotary_base is not None:
    raise ValueError("rotary_base turns queries and keys by their positions on one sequence: "
                     "keys of another length than the queries have none")
  if positions is not None and rotary_base is None:
    raise ValueError("positions set the rotary embedding's positions: they need rotary_base")
  if decode:
    check_decodable(order, pattern, mesh)
    for what, bad in (("keys of another length than the queries", cross),
                      ("mask (the cache hides what was not written yet)", key_mask is not None),
                      ("segment_ids but with prefill=True (the steps continue the last "
                       "document of the prefill)", segment_ids is not None and not prefill),
                      ("positions (decoding counts them from the cache, and from the start "
                       "of each run of ids in a packed cache)", positions is not None),
                      ("sow_weights", sow_weights)):
      if bad:
        raise ValueError(f"decode takes no {what}")
