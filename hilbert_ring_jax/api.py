"""`dilated_attention`: input checks, then the backend `backends.resolve` picks."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import backends
from .backends.common import same_on_every_device, varying_axes
from .pattern import DilatedPattern


def _dtypes() -> tuple:
  """The input dtypes every backend computes in: float64 too when JAX runs with x64."""
  wide = (jnp.float64,) if jax.config.read("jax_enable_x64") else ()
  return (jnp.float32, jnp.bfloat16, jnp.float16) + wide


def check_dtype(name: str, dtype) -> jnp.dtype:
  """`dtype` as a `jnp.dtype` if every backend computes in it, else `ValueError` naming
  `name` (an array's, or a dtype argument's) and, for float64 without x64, how to cast."""
  got = name if name.endswith("dtype") else f"{name}.dtype"
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{name} must be float32, bfloat16 or float16, got {got}={dtype!r}") from e
  if not any(dtype == t for t in _dtypes()):
    hint = (" (float64 needs jax.config.update('jax_enable_x64', True); or cast, e.g. "
            "x.astype(jnp.float32))" if dtype == jnp.float64 else "")
    raise ValueError(f"{name} must be float32, bfloat16 or float16 (float64 with x64), got "
                     f"{got}={dtype}{hint}")
  return dtype


def check_inputs(q, k, v, pattern, heads_axis=None) -> None:
  """Raises `ValueError` naming the argument for anything docs/SPEC.md calls bad input
  (`heads_axis`: the heads are a shard's, checked with `on_head_shards`)."""
  if not isinstance(pattern, DilatedPattern):
    raise ValueError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise ValueError(f"{name} must be an array (jax or NumPy), got {type(x).__name__}")
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must have rank 4 [B, N, H, D], got {name}.shape={jnp.shape(x)}")
    check_dtype(name, x.dtype)
    for axis, size in enumerate(x.shape[1:], 1):  # a symbolic batch (jax.export) is fine
      if not isinstance(size, numbers.Integral):
        raise ValueError(f"{name}'s {('sequence length', 'heads', 'head dim')[axis - 1]} (axis "
                         f"{axis}) must be known when tracing: the pattern is planned on it, got "
                         f"{name}.shape={x.shape}")
    if any(isinstance(size, numbers.Integral) and size < 1 for size in x.shape):
      raise ValueError(f"{name} must have B, N, H and D >= 1, got {name}.shape={x.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {k.shape=} and {v.shape=}")
  for axis, what in ((0, "batch"), (1, "sequence length"), (3, "head dim")):
    if not q.shape[axis] == k.shape[axis]:
      raise ValueError(
          f"q and k/v must have the same {what} (axis {axis}): {q.shape=}, {k.shape=}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"the number of query heads must be a multiple of the key/value heads: "
        f"{q.shape=} has {q.shape[2]} heads, {k.shape=} has {k.shape[2]}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k and v must share a dtype, got q.dtype={q.dtype}, k.dtype={k.dtype}, "
                     f"v.dtype={v.dtype}")
  if heads_axis is None:
    pattern.head_ranges(q.shape[2])  # head_groups needs H >= number of branches


# What 64-bit ids would do, cut to 32 bits, and the ways out (`check_32_bits`).
IDS_BEYOND_32_BITS = ("merging documents: number the documents from 0 (np.unique(segment_ids, "
                      "return_inverse=True)) or enable jax_enable_x64")


def check_segment_ids(segment_ids, q):
  """`segment_ids` as an integer `[B, N]` array matching `q` (or None), else `ValueError`
  naming the argument. Any integer values are valid (checked on shapes and dtypes alone, so
  traced ids under `jit` are checked alike), but for NumPy 64-bit ids beyond 32 bits without
  64-bit mode: JAX would keep their low 32 bits. (Under `jit` JAX narrows them before this
  sees them: docs/SPEC.md, section 3.)"""
  if segment_ids is None:
    return None
  if not (hasattr(segment_ids, "shape") and hasattr(segment_ids, "dtype")):
    raise ValueError(f"segment_ids must be None or an integer array [B, N] (jax or NumPy), "
                     f"got {type(segment_ids).__name__}")
  if tuple(segment_ids.shape) != tuple(q.shape[:2]):
    raise ValueError(f"segment_ids must have shape [B, N] = {tuple(q.shape[:2])} (q's batch "
                     f"and sequence length), got segment_ids.shape={tuple(segment_ids.shape)}")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must have an integer dtype (a document id per token), got "
                     f"segment_ids.dtype={segment_ids.dtype}")
  check_32_bits("segment_ids", segment_ids, IDS_BEYOND_32_BITS)
  return jnp.asarray(segment_ids)


def check_32_bits(name: str, ints, consequence: str):
  """`ValueError` naming `name` where `ints` is a NumPy 64-bit integer array holding values
  beyond 32 bits without JAX's 64-bit mode, in which JAX would keep their low 32 bits (the
  `consequence`: what that would do, and what to do instead)."""
  if (isinstance(ints, np.ndarray) and ints.dtype.itemsize == 8 and ints.size
      and jnp.issubdtype(ints.dtype, jnp.integer) and not jax.config.jax_enable_x64):
    narrow = np.iinfo(np.int32 if ints.dtype.kind == "i" else np.uint32)
    low, high = ints.min(), ints.max()
    if low < narrow.min or high > narrow.max:
      raise ValueError(f"{name} holds values beyond 32 bits (from {low} to {high}), which JAX "
                       f"without 64-bit mode keeps the low 32 bits of, {consequence}")


def check_flag(name: str, value) -> bool:
  """`value` as a bool (Python's, or NumPy's as configs give them), else `ValueError`."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {name}={value!r}")
  return bool(value)


def check_layout_name(layout) -> str:
  """`layout`, the order of a sequence's shards over a mesh: "natural" or "zigzag"."""
  if layout not in ("natural", "zigzag"):
    raise ValueError(f'layout must be "natural" or "zigzag", got layout={layout!r}')
  return layout


def check_scale(scale, head_dim: int) -> float:
  """`scale` as a float: None (`head_dim ** -0.5`), a number or a concrete 0-d array; a
  static argument, so a traced one is refused (`ValueError`)."""
  if scale is None:
    return head_dim ** -0.5
  if isinstance(scale, jax.core.Tracer):
    raise ValueError(f"scale must be static: a Python number or a concrete scalar, not "
                     f"traced (got {scale=!r}; pass it as a static argument of jit)")
  if isinstance(scale, (jax.Array, np.ndarray, np.generic)) and scale.shape == () and (
      jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
    scale = scale.item()
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
    raise ValueError(f"scale must be a finite number or None, got {scale=!r}")
  return float(scale)


def _head_shards(pattern: DilatedPattern, heads_axis, q, k):
  """The pattern of each shard of the heads over mesh axis `heads_axis` (a tensor-parallel
  `shard_map`; shard `s` holds heads `s H, ..., (s + 1) H - 1` of `H P`), or None without
  `heads_axis`. `ValueError` naming the argument where it cannot be so."""
  if heads_axis is None:
    return None
  if not isinstance(heads_axis, str):
    raise ValueError(f"heads_axis must be None or a mesh axis name, got "
                     f"heads_axis={heads_axis!r}")
  if pattern.head_offset or pattern.total_heads is not None:
    raise ValueError(f"heads_axis={heads_axis!r} sets each shard's head_offset and total_heads: "
                     f"give a pattern without them, got head_offset={pattern.head_offset}, "
                     f"total_heads={pattern.total_heads}")
  try:
    shards = jax.lax.axis_size(heads_axis)
  except NameError as e:
    raise ValueError(f"heads_axis={heads_axis!r} is not bound here: call inside jax.shard_map "
                     f"over a mesh with that axis, splitting the heads over it") from e
  if same_on_every_device(q, heads_axis):  # all heads, not a slice of them
    raise ValueError(f"q is the same on every device of heads_axis={heads_axis!r}: split its "
                     f"heads over it (shard_map's in_specs P(batch, sequence, {heads_axis!r}))")
  if (k.shape[2] > 1 and heads_axis in varying_axes(q)
      and heads_axis not in varying_axes(k)):
    raise ValueError(f"k and v must split their heads over heads_axis={heads_axis!r} as q does "
                     f"(here q varies over it and k does not): with {k.shape[2]} key/value "
                     f"heads whole beside a slice of the query heads, the query heads would "
                     f"read others than in the whole call")
  h = q.shape[2]
  shards = tuple(dataclasses.replace(pattern, head_offset=s * h, total_heads=h * shards)
                 for s in range(shards))
  shards[0].head_ranges(h)  # head_groups needs a head per branch, of all heads
  return shards


def head_shard_kind(index, heads_axis):
  """This device's kind of head shard (traced): `index[s]` for shard `s` of `heads_axis`
  (`on_head_shards`)."""
  return jnp.asarray(index, jnp.int32)[jax.lax.axis_index(heads_axis)]


def on_head_shards(pattern, heads_axis, call, q, k, v, ids, switched=None):
  """`call(pattern, q, k, v, ids)`; with `heads_axis`, with this device's pattern of its
  shard of the heads (`_head_shards`): the shards whose heads compute alike share one
  program; where they differ, `lax.switch` on the device's index along `heads_axis` picks its
  program.

  A call with collectives cannot sit in a `lax.switch` (every device must meet the same
  collectives): it passes `switched(patterns, index)`, a call like `call`'s that switches
  around its kernels itself, `patterns[index[s]]` shard `s`'s pattern (shards that differ in
  residues, or with `head_groups` in the branches they cover)."""
  patterns = _head_shards(pattern, heads_axis, q, k)
  if patterns is None:
    return call(pattern, q, k, v, ids)
  num_heads, distinct, index = q.shape[2], {}, []
  for p in patterns:
    index.append(distinct.setdefault(p.shard_key(num_heads), (len(distinct), p))[0])
  kinds = tuple(p for _, p in distinct.values())
  if len(kinds) == 1:
    return call(kinds[0], q, k, v, ids)
  if switched is not None:
    return switched(kinds, tuple(index))(q, k, v, ids)
  return jax.lax.switch(head_shard_kind(index, heads_axis),
                        [functools.partial(call, p) for p in kinds], q, k, v, ids)


@dataclasses.dataclass(frozen=True)
class _Dispatch:
  """The kernel contract of one `dilated_attention` call: backends resolved, config bound;
  `branches`: those covering some of the call's heads (None: all)."""

  pattern: DilatedPattern
  scale: float
  forward_backend: str
  backward_backend: str
  config: object = None
  branches: tuple[int, ...] | None = None

  def forward(self, q, k, v, **ids):
    backend = backends.load(self.forward_backend)
    return backend.forward(q, k, v, self.pattern, self.scale, out_dtype=q.dtype,
                           branches=self.branches,
                           config=backends.config_for(backend, self.config), **ids)

  def differentiable(self):
    """This call by the "xla" backend, whose code JAX differentiates (`backends.Kernel`), or
    None where it runs there already."""
    if self.forward_backend == self.backward_backend == "xla":
      return None
    return dataclasses.replace(self, forward_backend="xla", backward_backend="xla")

  def backward(self, q, k, v, dout, lse, delta, **ids):
    backend = backends.load(self.backward_backend)
    return backend.backward(q, k, v, dout, lse, delta, self.pattern, self.scale,
                            branches=self.branches,
                            config=backends.config_for(backend, self.config),
                            grad_dtype=q.dtype, **ids)


# Compiled as one program even when called eagerly; inlined under an outer jit.
_attention_jit = jax.jit(backends.attention, static_argnums=3)


def explicit_spec(x) -> tuple | None:
  """`(mesh, spec, axes)` of an array split over explicit mesh axes (`AxisType.Explicit`;
  `axes`: the mesh's explicit ones, `spec` as long as `x`'s rank), else None (unsplit, `Auto`
  axes, manual ones inside a `shard_map`). The mesh of a concrete array is its own (eager
  calls need no `jax.set_mesh` for it), a traced one's the abstract mesh of its type."""
  concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
  sharding = x.sharding if concrete else getattr(jax.typeof(x), "sharding", None)
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None or not any(spec):
    return None
  axes = frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                   if kind == jax.sharding.AxisType.Explicit)
  used = {name for entry in spec if entry is not None
          for name in ((entry,) if isinstance(entry, str) else entry)}
  spec = tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))
  return (mesh, spec, axes) if used & axes else None


@dataclasses.dataclass(frozen=True)
class ExplicitShards:
  """How a call on arrays split over explicit mesh axes runs a shard at a time: `specs` of
  `(q, k, v, segment_ids, lse)`, `heads` the axis splitting the heads (None if none does)."""

  mesh: object
  specs: tuple
  heads: str | None
  axes: frozenset  # the mesh's explicit axes: the shard_map's manual ones (Auto ones stay)

  def run(self, fn, args, in_specs, out_specs):
    """`fn(*args)` inside a `shard_map` over the explicit axes, `args` first split as
    `in_specs` say (those given whole are cut, locally)."""
    args = jax.tree.map(lambda x, s: jax.reshard(x, jax.NamedSharding(self.mesh, s)), args,
                        in_specs)
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=self.axes)(*args)


def on_explicit_shards(q, k, v, segment_ids) -> ExplicitShards | None:
  """Where `q` (or `k`, `v`, `segment_ids`) is split over explicit mesh axes (data or tensor
  parallelism without a `shard_map`: `jax.sharding.AxisType.Explicit`), how the call runs a
  shard at a time (`ExplicitShards`); else None. `k`, `v` and `segment_ids` must be split like
  `q` (or not at all: they are then split like it); neither the sequence nor the head dim may
  be split (`ValueError`: the sequence's split is the ring's), nor the kv heads unevenly."""
  found = {name: explicit_spec(x) for name, x in (("q", q), ("k", k), ("v", v),
                                                  ("segment_ids", segment_ids))
           if x is not None}
  if not any(found.values()):
    return None
  mesh, _, axes = next(got for got in found.values() if got)
  spec = found["q"][1] if found["q"] else (None,) * 4
  batch, heads = spec[0], spec[2]
  for axis, what in ((1, "sequence (axis 1): split it with sharded_dilated_attention or "
                         "ring_dilated_attention"), (3, "head dim (axis 3)")):
    for name, got in found.items():
      if got is not None and axis < len(got[1]) and got[1][axis] is not None:  # ids: [B, N]
        raise ValueError(f"{name} is split over explicit mesh axes along its {what}; got "
                         f"{name} sharded as {jax.P(*got[1])}")
  if heads is not None and not isinstance(heads, str):
    if len(heads) != 1:
      raise ValueError(f"q's heads may be split over one mesh axis (tensor parallelism), got q "
                       f"sharded as {jax.P(*spec)}")
    heads = heads[0]
  kv_heads = heads if k.shape[2] > 1 else None  # one kv head: every shard reads it
  if kv_heads is not None and k.shape[2] % mesh.shape[heads]:
    raise ValueError(f"k and v's {k.shape[2]} heads must split over {heads!r} as q's do, in "
                     f"{mesh.shape[heads]} (or be one head), got {k.shape=}")
  want = {"q": spec, "k": (batch, None, kv_heads, None), "v": (batch, None, kv_heads, None),
          "segment_ids": (batch, None)}
  for name, got in found.items():
    if got is not None and got[1] != want[name]:
      raise ValueError(f"{name} must be split over the mesh as q is ({jax.P(*want[name])}) or "
                       f"not at all, got {name} sharded as {jax.P(*got[1])}")
  specs = tuple(jax.P(*want[n]) for n in ("q", "k", "v", "segment_ids"))
  return ExplicitShards(mesh, specs + (jax.P(batch, None, heads),), heads, axes)


def dilated_attention(q, k, v, pattern: DilatedPattern, *, segment_ids=None,
                      scale: float | None = None, return_lse: bool = False,
                      implementation: str | Sequence[str] | None = None, config=None,
                      heads_axis: str | None = None):
  """LongNet dilated attention: every branch of `pattern`, merged by softmax denominators.

  Computes the function of docs/SPEC.md: for query `i` and head `h`, a softmax over the keys
  each branch makes visible (counted once per branch that sees them), in float32.

  Args:
    q: `[B, N, H, D]` queries, in processing order (serialize first for a Hilbert order).
    k, v: `[B, N, Hkv, D]` with `H % Hkv == 0`; query head `h` reads `h // (H // Hkv)`.
    pattern: a `DilatedPattern`.
    segment_ids: None, or an integer `[B, N]` array: the document of each token of rows that
      pack several (packed sequences). Query `i` then sees key `j` only where the pattern
      makes it visible and `segment_ids[b, i] == segment_ids[b, j]`; the pattern's segments
      stay on global positions (docs/SPEC.md, section 3). Every backend runs them. Without
      64-bit mode, ids must fit in 32 bits: JAX keeps the low 32 bits of int64 ids (checked
      on NumPy ids; an argument of `jax.jit` is narrowed before the check can see it).
    scale: score scale, default `D ** -0.5`.
    return_lse: also return the float32 `[B, N, H]` log of the softmax denominator
      (`-inf` where a query sees no key).
    implementation: None (the fastest for the platform), a backend name ("mosaic",
      "triton", "pallas", "xla") or a sequence: the first that supports the configuration
      runs, forward and backward. "xla" supports every valid configuration.
    config: a backend's `Config` (e.g. `hilbert_ring_jax.backends.triton.Config(...)`) to
      run that backend with instead of its tuned defaults; other backends ignore it.
    heads_axis: inside a `jax.shard_map` that splits the heads over this mesh axis (tensor
      parallelism; `k`, `v` split alike): each device computes its heads as the call on all
      heads does. Without it heads are numbered from 0 on each device, which changes what a
      pattern with `offsets="head"` or `head_groups` computes.

  Returns:
    `out` with q's shape and dtype, or `(out, lse)`. Differentiable (exact gradients, with
    memory linear in N), and usable under `jit` and `vmap`. Inputs split over explicit mesh
    axes (batch, heads) run a shard at a time, `out` split like `q` (docs/SPEC.md, section 8).

  Raises:
    ValueError: bad input (docs/SPEC.md, section 9), naming the argument.
    NotImplementedError: no candidate backend runs the configuration (`NoBackendError`,
      with each backend's reason).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from hilbert_ring_jax import DilatedPattern, dilated_attention
    >>> q = k = v = jnp.ones((1, 64, 4, 16))
    >>> p = DilatedPattern(segment_lengths=(16, 32), dilation_rates=(1, 2))
    >>> dilated_attention(q, k, v, p).shape
    (1, 64, 4, 16)
    >>> docs = jnp.repeat(jnp.arange(4), 16)[None]  # four documents of 16 tokens in one row
    >>> dilated_attention(q, k, v, p, segment_ids=docs).shape
    (1, 64, 4, 16)
  """
  check_inputs(q, k, v, pattern, heads_axis)
  scale = check_scale(scale, q.shape[-1])
  check_flag("return_lse", return_lse)
  segment_ids = check_segment_ids(segment_ids, q)
  names = backends.candidates(implementation)
  backends.check_config(config)
  explicit = on_explicit_shards(q, k, v, segment_ids)
  if explicit is not None:  # a shard at a time, as inside the user's own shard_map
    if explicit.heads is not None and heads_axis is not None:
      raise ValueError(f"q's heads are split over the explicit mesh axis {explicit.heads!r}: "
                       f"give no heads_axis (got heads_axis={heads_axis!r})")
    local = lambda q, k, v, *ids: dilated_attention(
        q, k, v, pattern, segment_ids=ids[0] if ids else None, scale=scale, return_lse=True,
        implementation=names, config=config, heads_axis=explicit.heads or heads_axis)
    inputs = (q, k, v) + (() if segment_ids is None else (segment_ids,))
    out, lse = explicit.run(local, inputs, explicit.specs[:len(inputs)],
                            (explicit.specs[0], explicit.specs[4]))
    return (out, lse) if return_lse else out

  def call(pattern, q, k, v, ids):
    branches = pattern.covering(q.shape[2])
    problem = dataclasses.replace(backends.Problem.of(q, k, pattern, branches),
                                  segment_ids=ids is not None, config=config)
    forward = backends.resolve(names, problem)
    backward = backends.resolve(names, dataclasses.replace(problem, backward=True))
    return _attention_jit(q, k, v, _Dispatch(pattern, scale, forward, backward, config,
                                             branches), ids)

  ids = None if segment_ids is None else (segment_ids, segment_ids)
  out, lse = on_head_shards(pattern, heads_axis, call, q, k, v, ids)
  return (out, lse) if return_lse else out
