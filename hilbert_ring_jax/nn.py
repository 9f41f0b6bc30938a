"""Flax NNX layer for dilated attention, and an `attention_fn` for `nnx.MultiHeadAttention`.

`DilatedMultiHeadAttention` projects tokens to queries, keys and values, optionally puts them
in a Hilbert (or any other) order, runs `dilated_attention` (or the ring version over a mesh)
and brings the result back to the caller's order; with `decode` it keeps the compressed key/value
cache of `decode.py` and attends new tokens to everything seen so far. It is called as
`nnx.MultiHeadAttention` is: any leading batch dims, keys and values from other inputs, and a
`mask` that hides keys (`attend`). `dilated_attention_fn` plugs the same function into Flax's
own `nnx.MultiHeadAttention`. The Linen twin is in `linen.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
from flax import nnx

from .api import check_flag
from .decode import KVCache, init_kv_cache
from .layers_common import (TokenOrder, apply_dropout, attend, attention_weights, check_call,
                            check_decodable, check_dropout_rate, check_features, check_heads,
                            check_input_shape, check_layout, check_mesh_axes, check_options,
                            check_rotary_base, checked_init, decode_attend, decode_positions,
                            default_positions, key_mask_of, layer_inputs, layout_positions,
                            permute, resolve_deterministic, rotate, serialize_inputs,
                            sown_weights, static_implementation, token_ids_of)
from .pattern import DilatedPattern

DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


class DilatedMultiHeadAttention(nnx.Module):
  """Multi-head attention with a LongNet dilated pattern and an optional token order.

  `inputs_q [batch..., N, in_features]` -> (serialize) -> q `[B, N, H, D]`, k, v
  `[B, N, Hkv, D]` -> (`normalize_qk`) -> `dilated_attention` -> dropout -> output projection ->
  (unserialize) -> `[batch..., N, out_features]`. With an ordering, the pattern's segments,
  dilation and causality act on positions in that order, and outputs come back in the caller's
  order: a caller never sees the processing order.

  A drop-in for `flax.nnx.MultiHeadAttention`: the arguments they share mean the same and
  default the same, a call takes the same arguments (`inputs_q`, `inputs_k`, `inputs_v`,
  `mask`, ...), and the parameters (`query`, `key`, `value`, `out`, each an
  `nnx.LinearGeneral` with `kernel` and `bias`, and with `normalize_qk` the `LayerNorm`s
  `query_ln` and `key_ln`) are laid out identically, so weights copy across, to the Linen twin
  (`hilbert_ring_jax.linen.DilatedMultiHeadAttention`) too, when both were built with the same
  heads, `num_kv_heads`, features, `use_bias` and `normalize_qk`. With the same `rngs` seed the
  two initialize the same parameters. A call checks the parameter shapes, so weights of another
  head layout copied in by `nnx.update` raise `ValueError` rather than fail in a reshape.

  Dropout is applied to the attention *output* (per head, before the output projection), not
  to the attention probabilities, which `dilated_attention` never materializes.

  Decoding follows `nnx.MultiHeadAttention`: with `decode=True` (here or at the call) and a cache
  from `init_cache`, each call takes the next `T >= 1` tokens and returns exactly what the
  non-decoding layer returns at those positions of the whole sequence, attending to the
  compressed cache of `init_kv_cache` (fixed size, set by the pattern; kept in `nnx.Cache`
  variables `cached_key`, `cached_value` (one array per branch) and `cache_index`, the tokens
  seen). `prefill=True` at the call takes a prompt at position 0 through the regular kernels and
  refills the cache. Decoding needs a causal pattern, `ordering=None` and no `mesh`; dropout
  and `normalize_qk` act as in the non-decoding layer.

  Args:
    num_heads: query heads `H`.
    in_features: input features.
    qkv_features: total query features `H * D` (default `in_features`); `D` per head.
    out_features: output features (default `in_features`).
    num_kv_heads: key/value heads `Hkv` (default `H`); fewer gives GQA/MQA.
    in_kv_features: input features of the key and value projections (default `in_features`).
    pattern: the `DilatedPattern` (its `causal` flag makes the layer causal).
    ordering: None (tokens as given), `"hilbert"` (tokens are the row-major cells of a grid of
      `grid_shape`, processed along a Hilbert curve), `"hilbert_per_segment"` (a Hilbert order
      inside each segment of `pattern.segment_lengths[0]` tokens, built for the `N` of the input),
      or an explicit permutation: a 1-D int array, `x_serial[:, j] = x[:, perm[j]]`.
    grid_shape: the grid for `ordering="hilbert"`; its size must be `N`.
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype.
    broadcast_dropout: share the dropout mask across the batch axis.
    dropout_rate: dropout on the attention output (see above).
    deterministic: default for `__call__`'s flag; True disables dropout. With `dropout_rate > 0`
      one of the two must say (`model.eval()`/`model.train()` and `nnx.view` set this one).
    precision: `jax.lax.Precision` of the four projections. The attention itself runs the
      backend's kernels, which compute float32 inputs in float32.
    kernel_init: initializer of the `query`, `key`, `value` (and by default `out`) kernels.
    out_kernel_init: initializer of the `out` kernel (None: `kernel_init`).
    bias_init: initializer of the biases.
    out_bias_init: initializer of the `out` bias (None: `bias_init`).
    use_bias: whether the four projections have biases.
    normalize_qk: apply `LayerNorm` (scale only) to queries and keys per head, as in ViT-22B.
    implementation: backend choice passed to `dilated_attention`.
    mesh, seq_axis: shard the sequence over axis `seq_axis` of `mesh` with ring attention
      (`hilbert_ring_jax.ring.sharded_dilated_attention`); with explicit mesh axes, trace
      under `jax.set_mesh(mesh)`. An ordering then gathers the sequence axis for its
      permutations: serializing once at the model's input is cheaper.
    batch_axis: with `mesh`, the mesh axis (or axes) the batch is split over: data x
      sequence parallelism.
    heads_axis: with `mesh`, the mesh axis the heads are split over (tensor parallelism;
      `sharded_dilated_attention`'s `heads_axis`): each device computes its heads.
    layout: with `mesh`, the order of the sequence the layer takes and returns: "natural", or
      "zigzag" (`sharded_dilated_attention`'s `layout`: a model that keeps its tokens in
      `zigzag_positions(N, P)` order spares its causal rings over the whole axis their moves
      into it and back, while branches that need natural order move there and back;
      `rotary_base` then turns each token by its position there, and `ordering` must be None).
    rngs: `nnx.Rngs` for parameter init; with `dropout_rate > 0` (and `keep_rngs`) it must have
      a `dropout` (or `default`) stream, forked here for the calls.
    keep_rngs: keep that stream (as `self.rngs`); False: the calls that drop out pass `rngs`.
    kernel_metadata, bias_metadata: metadata of the projection `Param`s (e.g. a sharding:
      `{"out_sharding": ("embed", "heads", None)}`; or wrap the initializers in
      `nnx.with_partitioning`).
    out_kernel_metadata, out_bias_metadata: the same for `out` (empty: the values above).
    query_ln_scale_metadata, key_ln_scale_metadata: metadata of the `normalize_qk` scales.
    decode: default for `__call__`'s flag: use and update the cache (None: False).
    rotary_base: rotary position embedding of queries and keys (after `normalize_qk`) with
      this base, e.g. 10000.0, at the tokens' positions in the caller's order (None: none).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern
    >>> layer = DilatedMultiHeadAttention(
    ...     num_heads=4, in_features=32, pattern=DilatedPattern((16, 64), (1, 4)),
    ...     ordering="hilbert", grid_shape=(8, 8), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 64, 32))).shape
    (2, 64, 32)

  Decoding, as with `nnx.MultiHeadAttention`:
    >>> causal = DilatedMultiHeadAttention(
    ...     num_heads=4, in_features=32, num_kv_heads=2,
    ...     pattern=DilatedPattern((16, 64), (1, 4), causal=True), rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 10, 32))
    >>> causal.init_cache(x.shape)                     # length: any, the cache does not grow
    >>> y = causal(x[:, :7], decode=True, prefill=True)  # the prompt
    >>> y = causal(x[:, 7:8], decode=True)               # then token by token
    >>> int(causal.cache_index[...])
    8
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, pattern: DilatedPattern, ordering=None,
               grid_shape=None, dtype=None, param_dtype=jnp.float32,
               broadcast_dropout: bool = True,
               dropout_rate: float = 0.0, deterministic: bool | None = None, precision=None,
               kernel_init=DEFAULT_KERNEL_INIT, out_kernel_init=None,
               bias_init=DEFAULT_BIAS_INIT, out_bias_init=None, use_bias: bool = True,
               normalize_qk: bool = False, implementation=None, mesh=None, seq_axis=None,
               batch_axis=None, heads_axis=None, layout: str = "natural", rngs: nnx.Rngs,
               keep_rngs: bool = True,
               kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
               out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
               bias_metadata: Mapping[str, Any] = MappingProxyType({}),
               out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
               query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
               key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
               decode: bool | None = None, rotary_base: float | None = None):
    check_features(in_features=in_features)
    qkv_features = in_features if qkv_features is None else qkv_features
    out_features = in_features if out_features is None else out_features
    in_kv_features = in_features if in_kv_features is None else in_kv_features
    check_features(out_features=out_features, in_kv_features=in_kv_features)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    num_kv_heads, head_dim = check_heads(num_heads, qkv_features, num_kv_heads, pattern)
    self.rotary_base = check_rotary_base(rotary_base, head_dim)
    check_mesh_axes(mesh, seq_axis, batch_axis, heads_axis)
    check_options(broadcast_dropout=broadcast_dropout, deterministic=deterministic,
                  use_bias=use_bias, normalize_qk=normalize_qk, keep_rngs=keep_rngs,
                  kernel_init=kernel_init, out_kernel_init=out_kernel_init, bias_init=bias_init,
                  out_bias_init=out_bias_init)
    metadata = dict(kernel_metadata=kernel_metadata, out_kernel_metadata=out_kernel_metadata,
                    bias_metadata=bias_metadata, out_bias_metadata=out_bias_metadata,
                    query_ln_scale_metadata=query_ln_scale_metadata,
                    key_ln_scale_metadata=key_ln_scale_metadata)
    for name, val in metadata.items():
      if not isinstance(val, Mapping):
        raise ValueError(f"{name} must be a mapping (e.g. a dict), got {name}={val!r}")
    if not isinstance(rngs, nnx.Rngs):
      raise ValueError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
    self.dropout_rate = check_dropout_rate(dropout_rate)
    if keep_rngs and self.dropout_rate and "dropout" not in rngs and "default" not in rngs:
      # Found now rather than at the first training step.
      raise ValueError(f"{dropout_rate=} needs a 'dropout' (or 'default') stream in rngs, got "
                       f"streams {sorted(name for name, _ in rngs.items())}: e.g. "
                       f"nnx.Rngs(params=0, dropout=1)")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.in_features, self.out_features = in_features, out_features
    self.in_kv_features = in_kv_features
    self.qkv_features = qkv_features
    self.pattern = pattern
    self.order = TokenOrder.make(ordering, grid_shape)
    self.layout = check_layout(layout, mesh, self.order)
    if decode is not None and check_flag("decode", decode):
      check_decodable(self.order, pattern, mesh)
    self.decode = decode
    self.broadcast_dropout, self.deterministic = broadcast_dropout, deterministic
    self.precision, self.use_bias, self.normalize_qk = precision, use_bias, normalize_qk
    self.implementation = static_implementation(implementation)
    self.mesh, self.seq_axis, self.batch_axis = mesh, seq_axis, batch_axis
    self.heads_axis = heads_axis
    # Built in nnx.MultiHeadAttention's order, so one seed gives both the same parameters.
    linear = functools.partial(nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype,
                               use_bias=use_bias, precision=precision, rngs=rngs)
    qkv = functools.partial(linear, kernel_init=checked_init("kernel_init", kernel_init),
                            bias_init=checked_init("bias_init", bias_init),
                            kernel_metadata=kernel_metadata, bias_metadata=bias_metadata)
    self.query = qkv(in_features, (num_heads, head_dim))
    self.key = qkv(in_kv_features, (num_kv_heads, head_dim))
    self.value = qkv(in_kv_features, (num_kv_heads, head_dim))
    if normalize_qk:
      norm = functools.partial(nnx.LayerNorm, head_dim, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
      self.query_ln = norm(scale_metadata=query_ln_scale_metadata)
      self.key_ln = norm(scale_metadata=key_ln_scale_metadata)
    else:
      self.query_ln = nnx.data(None)
      self.key_ln = nnx.data(None)
    self.out = linear((num_heads, head_dim), out_features, axis=(-2, -1),
                      kernel_init=checked_init("out_kernel_init" if out_kernel_init else
                                               "kernel_init", out_kernel_init or kernel_init),
                      bias_init=checked_init("out_bias_init" if out_bias_init else "bias_init",
                                             out_bias_init or bias_init),
                      kernel_metadata=out_kernel_metadata or kernel_metadata,
                      bias_metadata=out_bias_metadata or bias_metadata)
    # The dropout stream, forked as nnx.MultiHeadAttention forks it (and under the same name).
    self.rngs = rngs["dropout"].fork() if keep_rngs and self.dropout_rate else nnx.data(None)
    # The decoding cache, as in nnx.MultiHeadAttention: set by init_cache.
    self.cached_key = nnx.data(None)
    self.cached_value = nnx.data(None)
    self.cache_index = nnx.data(None)
    self.cache_start = nnx.data(None)
    self.cache_first = nnx.data(None)

  def set_view(self, deterministic: bool | None = None, decode: bool | None = None):
    """Used by `nnx.view(model, deterministic=..., decode=...)`."""
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      if check_flag("decode", decode):
        check_decodable(self.order, self.pattern, self.mesh)
      self.decode = decode

  def init_cache(self, input_shape, dtype=jnp.float32, *, packed: bool = False) -> None:
    """Makes an empty decoding cache (`cache_index` 0) for inputs of `input_shape`.

    As in `nnx.MultiHeadAttention`, `input_shape` is that of the inputs,
    `(batch..., N, in_features)`; only the batch dims matter (flattened into one, as the calls
    flatten theirs): the cache holds each branch's current segment, whatever `N`. Keys and
    values are stored in `dtype` (q, k, v are cast to it for the attention). Calling it again
    empties the cache. `packed=True` makes a cache for packed rows (`cache_start`, where each
    row's last run of ids starts, and `cache_first`, the first position each branch's
    residues read: `KVCache`): a prefill then takes `segment_ids`, the steps continue each
    row's last document, and rotary positions count from the start of each run of ids.

    Example:
      >>> from flax import nnx
      >>> from hilbert_ring_jax import DilatedMultiHeadAttention, DilatedPattern
      >>> layer = DilatedMultiHeadAttention(
      ...     num_heads=2, in_features=8, pattern=DilatedPattern((4, 8), (1, 2), causal=True),
      ...     decode=True, rngs=nnx.Rngs(0))
      >>> layer.init_cache((1, 100, 8))
      >>> [x.shape for x in layer.cached_key]  # [B, Hkv, R_b, rows_b, head_dim]
      [(1, 2, 1, 8, 4), (1, 2, 1, 8, 4)]

    (`rows_b`: `ceil(w_b / r_b)` rounded up to a multiple of 8, docs/SPEC.md section 10.)
    """
    check_decodable(self.order, self.pattern, self.mesh)
    batch = check_input_shape(input_shape, self.in_features)
    cache = init_kv_cache(self.pattern, batch=batch, num_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype,
                          packed=packed)
    self.cached_key = nnx.List([nnx.Cache(x) for x in cache.k])
    self.cached_value = nnx.List([nnx.Cache(x) for x in cache.v])
    self.cache_index = nnx.Cache(cache.length)
    self.cache_start = nnx.Cache(cache.start) if packed else nnx.data(None)
    self.cache_first = (nnx.List([nnx.Cache(x) for x in cache.first]) if packed
                        else nnx.data(None))

  def kv_cache(self) -> KVCache:
    """The decoding state as a `KVCache` (`ValueError` before `init_cache`)."""
    if self.cache_index is None:
      raise ValueError("decoding needs a cache: call layer.init_cache(input_shape) first")
    packed = self.cache_start is not None
    return KVCache(self.cache_index[...], tuple(x[...] for x in self.cached_key),
                   tuple(x[...] for x in self.cached_value), self.num_heads, self.pattern,
                   self.cache_start[...] if packed else None,
                   tuple(x[...] for x in self.cache_first) if packed else None)

  def check_parameters(self) -> None:
    """`ValueError` unless the parameters have the shapes this layer was built for.

    `nnx.update` takes weights of any shape, e.g. those of an `nnx.MultiHeadAttention` with
    other head counts; they would otherwise fail later in a reshape, or not at all.
    """
    h, hkv, d, f = self.num_heads, self.num_kv_heads, self.head_dim, self.in_features
    f_kv = self.in_kv_features
    expected = {
        ("query", "kernel"): ((f, h, d), "(in_features, num_heads, head_dim)"),
        ("key", "kernel"): ((f_kv, hkv, d), "(in_kv_features, num_kv_heads, head_dim)"),
        ("value", "kernel"): ((f_kv, hkv, d), "(in_kv_features, num_kv_heads, head_dim)"),
        ("out", "kernel"): ((h, d, self.out_features), "(num_heads, head_dim, out_features)"),
    }
    if self.use_bias:
      expected[("query", "bias")] = ((h, d), "(num_heads, head_dim)")
      for name in ("key", "value"):
        expected[(name, "bias")] = ((hkv, d), "(num_kv_heads, head_dim)")
      expected[("out", "bias")] = ((self.out_features,), "(out_features,)")
    if self.normalize_qk:
      for name in ("query_ln", "key_ln"):
        expected[(name, "scale")] = ((d,), "(head_dim,)")
    for (module, param), (shape, layout) in expected.items():
      got = tuple(getattr(getattr(self, module), param).shape)
      if got == shape:
        continue
      if module in ("key", "value") and param == "kernel" and len(got) == 3 and got[1] != hkv:
        raise ValueError(f"{module} kernel has {got[1]} kv heads, the layer was built with "
                         f"num_kv_heads={hkv}: copy weights only between layers with the same "
                         f"head counts (its shape is {got}, expected {shape})")
      raise ValueError(f"{module} {param} has shape {got}, the layer was built for {shape} = "
                       f"{layout} with num_heads={h}, num_kv_heads={hkv}, "
                       f"in_features={f}, in_kv_features={f_kv}, "
                       f"out_features={self.out_features}")

  def dropout(self, y, rngs=None):
    """`apply_dropout` to the attention output `y`, with a key from `rngs` or the layer's."""
    rngs = self.rngs if rngs is None else rngs
    if rngs is None:
      raise ValueError("dropout needs rngs at the call: the layer was built with "
                       "keep_rngs=False (pass rngs=..., or deterministic=True)")
    if isinstance(rngs, nnx.Rngs):
      key = rngs["dropout"]()
    elif isinstance(rngs, nnx.RngStream):
      key = rngs()
    else:
      key = rngs
    return apply_dropout(y, key, self.dropout_rate, self.broadcast_dropout)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               deterministic: bool | None = None, rngs: nnx.Rngs | None = None,
               sow_weights: bool = False, decode: bool | None = None, prefill: bool = False,
               segment_ids=None, positions=None):
    """`[batch..., N, in_features]` -> `[batch..., N, out_features]`, in the caller's order.

    Called as `nnx.MultiHeadAttention` is; `layer(x)` is self-attention.

    Args:
      inputs_q: the queries' tokens `[batch..., N, in_features]`, in the caller's order
        (row-major grid cells for `ordering="hilbert"`); the batch dims, any number of them
        (none: one sequence), are flattened into one and restored. When decoding, the next `N`
        tokens after those in the cache.
      inputs_k: the keys' tokens `[batch..., Nk, in_kv_features]` (None: `inputs_q`); the
        same positions as the queries (`Nk = N`), or another length under a pattern that shows
        every key to every query (not causal, rates 1, segments covering both lengths), with
        no ordering needed and no `rotary_base`.
      inputs_v: the values' tokens (None: `inputs_k`).
      mask: hides keys: `[batch..., 1, 1, Nk]` or broadcasting to it, True (nonzero) to attend,
        e.g. a padding mask `key_valid[..., None, None, :]`. The pattern decides which keys a
        query sees; the mask removes keys from that, and a query left with none gives 0 before
        the output projection. A mask over queries or heads raises `ValueError`.
      deterministic: overrides the constructor's flag; True disables dropout.
      rngs: optional `nnx.Rngs` (or stream, or key) for dropout, instead of the stream forked
        at construction (needed with `keep_rngs=False`).
      sow_weights: record the attention probabilities `[batch..., H, N, Nk]` (dense) as the
        `nnx.Intermediate` "attention_weights", as `nnx.MultiHeadAttention` does (read them
        with `nnx.capture(layer, nnx.Intermediate)`: docs/layer.md).
      decode: overrides the constructor's flag: attend to the cache of `init_cache` and add
        the tokens to it.
      prefill: with `decode`, `inputs_q` is a prompt at position 0: the regular kernels run on
        it and the cache is refilled from it, whatever it held (fast for long prompts).
      segment_ids: packed sequences: an integer `[batch..., N]` array, the document of each
        token (in the caller's order); a query sees only keys of its document
        (`dilated_attention`'s `segment_ids`). Self-attention only; when decoding, a prefill's
        (with a cache from `init_cache(..., packed=True)`).
      positions: an integer `[batch..., N]` array, each token's position for `rotary_base`
        (default: its place in the sequence), e.g. restarting at 0 at each packed document.
        Not when decoding: positions then follow the cache (from the start of each run of
        ids in a packed cache).
    """
    batch, xq, xk, xv = layer_inputs(inputs_q, inputs_k, inputs_v, self.in_features,
                                     self.in_kv_features)
    cross = xk.shape[1] != xq.shape[1]
    key_mask = key_mask_of(mask, batch, xk.shape[1])
    if decode is None:
      decode = bool(self.decode)  # None: not decoding
    check_flag("decode", decode)
    segment_ids = token_ids_of("segment_ids", segment_ids, batch, xq.shape[1])
    positions = token_ids_of("positions", positions, batch, xq.shape[1])
    check_call(decode=decode, prefill=prefill, sow_weights=sow_weights, cross=cross,
               key_mask=key_mask, rotary_base=self.rotary_base, order=self.order,
               pattern=self.pattern, mesh=self.mesh, segment_ids=segment_ids,
               positions=positions)
    self.check_parameters()
    if self.dropout_rate > 0.0:
      # As nnx.MultiHeadAttention: the flag matters (and must be given) only with dropout.
      deterministic = resolve_deterministic(deterministic, self.deterministic)
    else:
      deterministic = True
    # Keys of another length see every query whatever the order: none is needed.
    perm = None if cross else self.order.permutation(xq.shape[1], self.pattern)
    if perm is not None:
      xq, xk, xv, key_mask, segment_ids, positions = serialize_inputs(
          perm, self.mesh, xq, xk, xv, key_mask, segment_ids, positions)
    q, k, v = self.query(xq), self.key(xk), self.value(xv)
    if self.normalize_qk:
      q, k = self.query_ln(q), self.key_ln(k)
    # [B, N, H, D]
    cache = self.kv_cache() if decode else None
    # The positions of the rows in a zigzag layout (keys of another length: none needed).
    rows = None if cross else layout_positions(self.layout, self.mesh, self.seq_axis,
                                               xq.shape[1])
    if decode:  # after the cached tokens (no ordering when decoding)
      positions = decode_positions(cache, xq.shape[1], prefill=prefill,
                                   segment_ids=segment_ids)
    elif positions is None:
      positions = default_positions(xq.shape[1], perm, rows)
    q, k = rotate(q, k, self.rotary_base, positions)
    if decode:
      y, cache = decode_attend(q, k, v, cache, self.pattern, prefill=prefill,
                               implementation=self.implementation, segment_ids=segment_ids)
      for var, val in zip((*self.cached_key, *self.cached_value), (*cache.k, *cache.v)):
        var[...] = val
      self.cache_index[...] = cache.length
      if cache.start is not None:
        self.cache_start[...] = cache.start
        for var, val in zip(self.cache_first, cache.first):
          var[...] = val
    else:
      y, lse = attend(q, k, v, self.pattern, key_mask=key_mask, segment_ids=segment_ids,
                      return_lse=True, implementation=self.implementation, mesh=self.mesh,
                      seq_axis=self.seq_axis, batch_axis=self.batch_axis,
                      heads_axis=self.heads_axis, layout=self.layout)
      if sow_weights:
        self.sow(nnx.Intermediate, "attention_weights", sown_weights(
            q, k, lse, self.pattern, perm, batch, key_mask=key_mask, segment_ids=segment_ids,
            rows=rows))
    if not deterministic:
      y = self.dropout(y, rngs)
    # [B, N, out_features]
    y = self.out(y)
    y = y if perm is None else permute(y, perm, inverse=True, mesh=self.mesh)
    return y.reshape(batch + y.shape[1:])


def dilated_attention_fn(pattern: DilatedPattern, *, scale: float | None = None,
                         implementation=None):
  """`dilated_attention` with `pattern`, shaped as the `attention_fn` of Flax attention modules.

  The returned function takes `(query, key, value, bias=None, mask=None, ...)` like
  `flax.nnx.dot_product_attention`, with `[batch..., N, H, D]` queries and `[batch..., Nk, Hkv, D]`
  keys and values (GQA works). The pattern defines which keys a query sees; a `mask` may hide
  keys from that (`[batch..., 1, 1, Nk]` or broadcasting to it, as a padding mask or
  `nnx.MultiHeadAttention`'s decode cache mask; a query left with no key gives 0), any other
  mask or a `bias` raises `ValueError`, as does `is_causal=True` with a non-causal pattern. Keys
  of another length than the queries (`nnx.MultiHeadAttention(decode=True)` passes its whole
  cache) need a pattern that shows every key to every query (not causal, rates 1, segments
  covering both lengths); cached decoding with a dilated pattern goes through
  `DilatedMultiHeadAttention(decode=True)`. Dropout (`dropout_rate > 0` and not
  `deterministic`) is applied to the attention output, not to the attention probabilities,
  which are never materialized but for `sow_weights` (a `module` argument: the dense
  probabilities `[batch..., H, N, Nk]` are sown as "attention_weights"); `precision` is
  ignored. `segment_ids` (`[batch..., N]`): packed rows, as in `dilated_attention`
  (`nnx.MultiHeadAttention` passes none: a call of its own, or `DilatedMultiHeadAttention`,
  takes them). Any other argument raises `ValueError` unless it is None (nnx's
  `input_positions` among them: no rotary embedding is applied here).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from hilbert_ring_jax import DilatedPattern, dilated_attention_fn
    >>> fn = dilated_attention_fn(DilatedPattern((16, 64), (1, 4), causal=True))
    >>> mha = nnx.MultiHeadAttention(4, 32, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
    >>> mha(jnp.ones((2, 64, 32))).shape
    (2, 64, 32)
    >>> padding = jnp.arange(64) < 50  # the last 14 keys are padding
    >>> mha(jnp.ones((2, 64, 32)), mask=padding[None, None, None, :]).shape
    (2, 64, 32)
  """
  if not isinstance(pattern, DilatedPattern):
    raise ValueError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
  implementation = static_implementation(implementation)

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, is_causal=False, segment_ids=None, **others):
    del precision
    # Flax passes what its own attention functions take (Linen only what this signature
    # names); another argument raises where it asks for something: a misspelt one, or nnx's
    # `input_positions` (rotary embeddings are the layers' `positions`, not applied here).
    asked = sorted(name for name, x in others.items() if x is not None)
    if asked:
      raise ValueError(
          f"dilated_attention_fn's attention_fn takes no {', '.join(asked)} (it takes query, "
          f"key, value, mask, bias=None, is_causal, segment_ids, and dropout, dtype, "
          f"precision and module as Flax passes them)" + (
              "; rotary embeddings restarting with `positions` are DilatedMultiHeadAttention's "
              "(rotary_base=)" if "input_positions" in asked else ""))
    if bias is not None:
      raise ValueError("dilated attention takes no bias: the pattern defines which keys are "
                       "visible (a mask may hide keys), got a bias")
    if is_causal and not pattern.causal:
      raise ValueError(f"is_causal=True needs a causal pattern, got {pattern=}")
    shapes = {name: jnp.shape(x) for name, x in (("query", query), ("key", key),
                                                 ("value", value))}
    if any(len(s) < 3 or s[:-3] != shapes["query"][:-3] for s in shapes.values()) or \
        shapes["key"] != shapes["value"]:
      raise ValueError(f"query [batch..., N, H, D] and key, value [batch..., Nk, Hkv, D] must "
                       f"share their batch dims, key and value their shapes, got {shapes}")
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    batch = query.shape[:-3]
    key_mask = key_mask_of(mask, batch, key.shape[-3])
    segment_ids = token_ids_of("segment_ids", segment_ids, batch, query.shape[-3])
    # [B, N, H, D] with the batch dims flattened (none gives B = 1)
    q, k, v = (jnp.asarray(x, dtype).reshape((-1,) + x.shape[-3:]) for x in (query, key, value))
    out, lse = attend(q, k, v, pattern, key_mask=key_mask, segment_ids=segment_ids,
                      scale=scale, return_lse=True, implementation=implementation)
    if module is not None:
      weights = attention_weights(q, k, lse, pattern, key_mask=key_mask,
                                  segment_ids=segment_ids, scale=scale)
      weights = weights.reshape(batch + weights.shape[1:])
      if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
      else:  # a Linen module
        module.sow("intermediates", "attention_weights", weights)
    if dropout_rate > 0.0 and not deterministic:
      if dropout_rng is None:
        raise ValueError(f"{dropout_rate=} with deterministic=False needs a dropout_rng")
      # On the flattened batch: broadcasting over it is broadcasting over every batch dim.
      out = apply_dropout(out, dropout_rng, dropout_rate, broadcast_dropout)
    return out.reshape(batch + out.shape[1:])

  return attention_fn
