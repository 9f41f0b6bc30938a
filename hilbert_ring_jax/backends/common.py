"""Array plumbing the backends and the ring share: float32 products in full (`einsum`), the
float16-safe operands of the `ds` products, transposes of linear layout maps, mesh-axes typing
inside `shard_map`, `vmap` of kernel calls by folding into the batch, kernels' entry points
under JAX's 64-bit mode, and packed rows' document ids and windows. Neutral: no backend's
choices live here."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# An empty window's start (its end is -1): past any position, with room to add to it in int32.
FAR = int(np.iinfo(np.int32).max // 2)


def einsum(spec, a, b, **kwargs):
  """`jnp.einsum(spec, a, b, **kwargs)`, multiplied in full where both operands are float32
  (or float64), as the kernels do float32 inputs: XLA's default on GPUs rounds them to TF32
  (errors ~1e-3). A 16-bit operand keeps the default: TF32 holds its values exactly, and
  rounds the other (float32 scaled queries) by less than the 16-bit inputs were rounded."""
  full = all(x.dtype in (jnp.float32, jnp.float64) for x in (a, b))
  return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST if full else None, **kwargs)


def ds_operands(ds, x):
  """`(ds, x)` for the products `ds @ k` and `ds^T @ q`: in x's dtype, except float16, whose
  range `ds = p (dp - delta)` can exceed where the gradients themselves fit: float32 there."""
  if x.dtype == jnp.float16:
    return ds.astype(jnp.float32), x.astype(jnp.float32)
  return ds.astype(x.dtype), x


def transpose(fn, y, like):
  """`fn^T(y)` for a linear `fn` of arrays shaped like `like` (an unfold for a fold).

  Built with `jax.vjp` at `zeros_like(like)` rather than `jax.linear_transpose`, so the
  result keeps `like`'s varying-mesh-axes type inside `shard_map`.
  """
  return jax.vjp(fn, jnp.zeros_like(like, dtype=y.dtype))[1](y)[0]


def vary_like(xs, *refs):
  """`xs` (an array or a tuple of them) typed to vary over every mesh axis any of `refs`
  varies over.

  Inside `jax.shard_map(check_vma=True)` an array built from shapes alone (`jnp.zeros`) is
  device-invariant, while results computed from the inputs vary over the mesh axes the inputs
  vary over; `lax.scan` and `lax.cond` need the two to agree. Adding a zero that varies like
  each of `refs` gives `xs` their type; outside `shard_map` it is a no-op (exact for every
  value, -inf included). Also restores the type of kernel calls (jax_triton's) that return
  device-invariant results inside `shard_map`.
  """
  def one(x):
    for r in refs:
      x = x + jnp.zeros_like(r, shape=(), dtype=x.dtype)
    return x

  return tuple(one(x) for x in xs) if isinstance(xs, tuple) else one(xs)


def varying_axes(x) -> frozenset:
  """The mesh axes `x` varies over inside `jax.shard_map(check_vma=True)`; empty elsewhere."""
  kind = jax.typeof(x)
  axes = getattr(getattr(kind, "manual_axis_type", None), "varying", None)
  return frozenset(getattr(kind, "vma", ()) if axes is None else axes)


def same_on_every_device(x, axis_name) -> bool:
  """Whether `x` is known to be the same on every device of mesh axis `axis_name` (of more
  than one device): only inside a `shard_map` that tracks what varies (`check_vma`), which
  the axis' own index shows; False elsewhere, where it cannot be known."""
  return (jax.lax.axis_size(axis_name) > 1
          and axis_name in varying_axes(jax.lax.axis_index(axis_name))
          and axis_name not in varying_axes(x))


def vary_alike(*xs):
  """`xs` each typed to vary over every mesh axis any of them varies over (as a kernel call
  needs its operands), unchanged where they already agree (no extra operation)."""
  axes = frozenset().union(*(varying_axes(x) for x in xs))
  return tuple(x if varying_axes(x) == axes else vary_like(x, *xs) for x in xs)


def cotangent_like(g, x):
  """The cotangent `g` typed like its primal `x`: summed (in float32 at least) over the mesh
  axes `g` varies over and `x` does not (the transpose of the broadcast `vary_alike` made),
  and varying over those `x` varies over and `g` does not (kernel calls whose results do not
  say so)."""
  extra = varying_axes(g) - varying_axes(x)
  if extra:
    g = jax.lax.psum(g.astype(jnp.promote_types(g.dtype, jnp.float32)), tuple(sorted(extra)))
  return vary_like(g, x) if varying_axes(x) - varying_axes(g) else g


def batched(fn):
  """`fn(*arrays)` that `vmap` maps by folding the mapped axis into the batch axis 0.

  Kernel calls (`triton_call`, Mosaic GPU kernels) have no batching rule; all arrays here
  lead with the batch axis, so a mapped axis (moved to the front) merges with it and splits
  off again afterwards.
  """
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, *args):
    args = [x if mapped else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, mapped in zip(args, in_batched)]
    outs = wrapped(*(x.reshape((-1,) + x.shape[2:]) for x in args))
    outs = jax.tree.map(lambda y: y.reshape((axis_size, -1) + y.shape[1:]), outs)
    return outs, jax.tree.map(lambda _: True, outs)

  return wrapped


def in_32_bits(entry):
  """A kernel backend's entry point (`forward`, `backward`, ...) traced as without JAX's
  64-bit mode, also where `jax_enable_x64` is on: there Python ints and `jnp.arange` would be
  64-bit, which the kernels' 32-bit index arithmetic (`lax.div`, int32 tables) does not mix
  with. Its `segment_ids`, when given, arrive as int32 (`int32_ids`); its other inputs are
  the contract's (16- and 32-bit floats, int32 positions) and its results float32 or the
  inputs' dtype, the same in either mode."""

  @functools.wraps(entry)
  def wrapped(*args, segment_ids=None, **kwargs):
    if segment_ids is not None:  # passed only when set, as the contract says
      kwargs["segment_ids"] = int32_ids(segment_ids)
    if not jax.config.jax_enable_x64:
      return entry(*args, **kwargs)
    with jax.enable_x64(False):
      return entry(*args, **kwargs)

  return wrapped


def int32_ids(segment_ids):
  """The contract's document ids `(q_ids, kv_ids)` (any integer dtype, the same for both) as
  int32, equal exactly where they are equal, as the kernels compare them. Ids of at most 32
  bits are converted (uint32's wrap around: one to one); 64-bit ids, which only JAX's 64-bit
  mode keeps, are numbered by their rank among the call's queries' and keys' ids together (a
  sort of them), so that ids apart beyond 32 bits stay apart."""
  if all(jnp.dtype(x.dtype).itemsize <= 4 for x in segment_ids):
    return tuple(x.astype(jnp.int32) for x in segment_ids)
  wide = [x.astype(jnp.int64) for x in segment_ids]  # uint64's wrap around: one to one
  order = jnp.sort(jnp.concatenate([x.ravel() for x in wide]))
  return tuple(jnp.searchsorted(order, x).astype(jnp.int32) for x in wide)


def id_windows(q_ids, k_ids):
  """Per query, from the document ids of the queries and the keys (int32 `[..., N]` each,
  the same leading axes): `(u0, u1)`, the first and last key position whose id equals the
  query's modulo N (`u0 > u1` where none does), and `(r0, r1)`, the run of equal key ids
  around the query's own position where that key has its id (else `r0 > r1`): every key of
  `[r0, r1]` is in the query's document, and no key outside `[u0, u1]` is. `[4, ..., N]`
  int32. Ids are compared, never ordered, so any ids work: a window only grows where a
  document's tokens are scattered, or where two documents' ids are equal modulo N (then each
  window spans both: more blocks visited and masked, the same result).

  A table of N slots, the keys' first and last positions scattered into it by id modulo N
  (one update a run of equal ids: one a key contended for a few slots, 24 us at N = 32K on an
  H200), then read at the queries' ids: a handful of XLA kernels, no sort (a sort and a
  search were a dozen launches, which the kernels waited for in a lone call). The packed
  kernels skip the key blocks outside a tile's windows (mosaic's also run those inside one
  run unmasked)."""
  lead, n = k_ids.shape[:-1], k_ids.shape[-1]

  def one(qi, ki):
    pos = jnp.arange(n, dtype=jnp.int32)
    change = ki[1:] != ki[:-1]
    first = jnp.concatenate([jnp.array([True]), change])  # a run of equal ids starts
    last = jnp.concatenate([change, jnp.array([True])])  # a run ends
    # An id's first key starts a run and its last ends one: only those are scattered (the
    # other updates go out of bounds and are dropped).
    slot = lambda edge: jnp.where(edge, ki % n, n)
    u0 = jnp.full((n,), FAR, jnp.int32).at[slot(first)].min(pos, mode="drop")[qi % n]
    u1 = jnp.full((n,), -1, jnp.int32).at[slot(last)].max(pos, mode="drop")[qi % n]
    r0 = lax.cummax(jnp.where(first, pos, 0))
    r1 = lax.cummin(jnp.where(last, pos, n), reverse=True)
    mine = ki == qi
    return jnp.stack([u0, u1, jnp.where(mine, r0, FAR), jnp.where(mine, r1, -1)])

  flat = jax.vmap(one)(q_ids.reshape(-1, n), k_ids.reshape(-1, n))  # [M, 4, N]
  return flat.transpose(1, 0, 2).reshape(4, *lead, n)


def reduce_windows(windows, axis: int) -> list:
  """`id_windows`' `(u0, u1, r0, r1)` (four arrays) over `axis` of each: the union of the
  windows `[min u0, max u1]` and the intersection of the runs `[max r0, min r1]`, what a tile
  of rows may reach and what all of it surely shares (the caller fills rows to leave out)."""
  u0, u1, r0, r1 = windows
  return [u0.min(axis), u1.max(axis), r0.max(axis), r1.min(axis)]


def contract_windows(segment_ids, keys: bool = False):
  """`id_windows` of the backend contract's ids `(q_ids, kv_ids)` (int32, `int32_ids`: `[B,
  N]`, or per head `[B, N, H]` and `[B, N, Hkv]`), laid out `[4, B, N, X]`: X = 1 where every
  head shares the ids, else a column per query head. `keys`: the keys' windows over the
  queries (a key's, per query head reading it), as the dk/dv side walks them."""
  q_ids, k_ids = ((x if x.ndim == 3 else x[:, :, None]) for x in segment_ids)
  k_ids = jnp.repeat(k_ids, q_ids.shape[-1] // k_ids.shape[-1], axis=-1)
  a, b = (k_ids, q_ids) if keys else (q_ids, k_ids)
  return jnp.swapaxes(id_windows(jnp.swapaxes(a, 1, 2), jnp.swapaxes(b, 1, 2)), 2, 3)
