"""Ring dilated attention: the sequence sharded over a mesh axis; keys and values travel.

Shard `p` of `P` holds positions `[p * n, (p + 1) * n)` of processing order (`n = N / P`).
Each branch `(w, r)` of the pattern runs in one of three ways, chosen on the host:

- local (`n % w == 0`): every segment lies inside a shard; no communication at all;
- ring (`w % n == 0`, `n % r == 0`): a segment spans `g = w / n` consecutive shards. Keys and
  values rotate in sub-rings of `g` devices. A step against another shard of the segment is
  plain (non-causal) attention of the local queries to the visiting keys, the shard being one
  segment; the step against the own shard is the branch itself. With `offsets="head"`
  (and fewer query heads per key/value head than `r`), only each head's residue rows, `1/r`
  of the keys and values, are compacted and sent. For causal patterns, steps whose keys lie in
  the future are skipped, and the forward's shifts leave out the pairs nobody needs;
- gather (any other shape): the branch runs on all-gathered inputs (exact, not fast).

Every step is a call to a single-device backend with the global `lse` (the kernel contract),
combined with the one `merge`; the backward rotates `(k, v, dk, dv)` together and keeps `dq`
local, so gradients are exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import backends
from .api import check_inputs, check_scale, implementation_names
from .backends.xla import transpose
from .merge import merge
from .pattern import DilatedPattern


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How branch `index` runs on `shards` shards of `n` tokens (see the module docstring)."""

  index: int
  kind: str         # "local" | "ring" | "gather"
  n: int
  shards: int
  group: int = 1    # ring: shards per segment
  compact: bool = False  # ring: only each head's residue rows travel


def _plans(pattern: DilatedPattern, n: int, shards: int, kv_group: int):
  for b, (w, r) in enumerate(pattern.branches):
    w = min(w, n * shards)
    if n % w == 0:
      yield _Plan(b, "local", n, shards)
    elif w % n == 0 and n % r == 0:
      compact = pattern.offsets == "head" and 1 < r and kv_group < r
      yield _Plan(b, "ring", n, shards, w // n, compact)
    else:
      yield _Plan(b, "gather", n, shards)


def _rotation(plan: _Plan, hop: int, causal_forward: bool = False):
  """`ppermute` pairs moving buffers one place on in every sub-ring, for step `hop`.

  A sub-ring of `size` devices (the last may be short) rotates for its first `size` hops, so
  buffers are home after `size` hops, and holds still afterwards. A causal forward only
  shifts, without wrapping: a device only needs keys from earlier shards, so the pairs that
  would deliver later ones are left out.
  """
  pairs = []
  for base in range(0, plan.shards, plan.group):
    size = min(plan.group, plan.shards - base)
    for j in range(size):
      if causal_forward:
        if j >= max(hop, 1):
          pairs.append((base + j - 1, base + j))
      else:
        pairs.append((base + j, base + ((j + 1) % size if hop <= size else j)))
  return pairs


def _heads(pattern, num_heads, b):
  h0, h1 = pattern.head_ranges(num_heads)[b]
  return range(h0, h1)


def _compact(x, r, heads, head_of):
  """`[B, n, X, ...]` -> `[B, n / r, E, ...]`: head `h` keeps the rows of residue `h % r`."""
  x = x.reshape(x.shape[0], x.shape[1] // r, r, *x.shape[2:])
  return jnp.stack([x[:, :, h % r, head_of(h)] for h in heads], axis=2)


class _Step:
  """One branch's arrays and backend call, in the layout its steps use (compact or not)."""

  def __init__(self, plan, pattern, scale, names, q, k):
    self.plan, self.scale, self.names = plan, scale, names
    num_heads, kv_group = q.shape[2], q.shape[2] // k.shape[2]
    w, r = pattern.branches[plan.index]
    self.r = r
    self.heads = _heads(pattern, num_heads, plan.index)
    self.kv_group = kv_group
    if plan.kind == "ring" and plan.compact:
      # The shard is one segment of n / r compact rows, undilated, one key head per query head.
      self.pattern = lambda causal: DilatedPattern((plan.n // r,), (1,), causal=causal)
      self.branches = None
    elif plan.kind == "ring":
      segs = tuple(plan.n if i == plan.index else s for i, s in enumerate(pattern.segment_lengths))
      self.pattern = lambda causal: dataclasses.replace(pattern, segment_lengths=segs,
                                                        causal=causal)
      self.branches = (plan.index,)
    else:
      self.pattern = lambda causal: dataclasses.replace(pattern, causal=causal)
      self.branches = (plan.index,)
    self.causal = pattern.causal

  # Layout: compaction for the "compact" ring, identity otherwise.
  def query(self, x):
    if not self.plan.compact:
      return x
    return _compact(x, self.r, self.heads, lambda h: h)

  def key(self, x):
    if not self.plan.compact:
      return x
    return _compact(x, self.r, self.heads, lambda h: h // self.kv_group)

  def unquery(self, x, like):
    return transpose(self.query, x, like) if self.plan.compact else x

  def unkey(self, x, like):
    return transpose(self.key, x, like) if self.plan.compact else x

  def covered(self, n, num_heads):
    """`[n, H]`: the rows a compact branch computes (its heads, each at its residue)."""
    pos, head = jnp.arange(n)[:, None], jnp.arange(num_heads)[None, :]
    inside = (head >= self.heads.start) & (head < self.heads.stop)
    return inside & (pos % self.r == head % self.r)

  def backend(self, q, k, v, causal):
    return backends.load(backends.select(self.names, q, k, v, self.pattern(causal), self.scale,
                                         self.branches))

  def forward(self, q, k, v, causal):
    return self.backend(q, k, v, causal).forward(q, k, v, self.pattern(causal), self.scale,
                                                 self.branches)

  def backward(self, q, k, v, dout, lse, delta, causal):
    return self.backend(q, k, v, causal).backward(q, k, v, dout, lse, delta, self.pattern(causal),
                                                  self.scale, self.branches)


def _varying(x, axis_name):
  """Marks a device-invariant value (zeros) as varying over the ring axis, for `lax.cond`."""
  return jax.lax.pcast(x, (axis_name,), to="varying")


def _step_position(plan, axis_name):
  """(this device's place in its sub-ring, the sub-ring's size), as traced values."""
  p = jax.lax.axis_index(axis_name)
  full = (plan.shards // plan.group) * plan.group
  return p % plan.group, jnp.where(p >= full, plan.shards - full, plan.group)


def _visible(plan, causal, step, axis_name):
  """Whether the keys visiting at `step` (from `step` places back) are visible here."""
  place, size = _step_position(plan, axis_name)
  return step <= place if causal else step < size


def _ring_forward(st, q, k, v, axis_name):
  """`(o, lse)` of a ring branch on the local queries, in the step layout."""
  plan = st.plan
  qs, kv = st.query(q), (st.key(k), st.key(v))
  acc = st.forward(qs, *kv, st.causal)
  zeros = lambda: (_varying(jnp.zeros(acc[0].shape, acc[0].dtype), axis_name),
                   _varying(jnp.full(acc[1].shape, -jnp.inf, acc[1].dtype), axis_name))
  for step in range(1, plan.group):
    # Issued before the previous step's compute is consumed, so XLA overlaps the two.
    kv = jax.lax.ppermute(kv, axis_name, _rotation(plan, step, causal_forward=st.causal))
    part = jax.lax.cond(_visible(plan, st.causal, step, axis_name),
                        lambda kv: st.forward(qs, *kv, False), lambda kv: zeros(), kv)
    acc = merge([acc[0], part[0]], [acc[1], part[1]])
  return acc


def _ring_backward(st, q, k, v, dout, lse, delta, axis_name):
  """`(dq, dk, dv)` of a ring branch, in the step layout; dk and dv travel home with k, v."""
  plan = st.plan
  qs, dos, lses, deltas = (st.query(x) for x in (q, dout, lse[..., None], delta[..., None]))
  lses, deltas = lses[..., 0], deltas[..., 0]
  kv = (st.key(k), st.key(v))
  dq, dk, dv = st.backward(qs, *kv, dos, lses, deltas, st.causal)
  zeros = lambda: tuple(_varying(jnp.zeros(x.shape, x.dtype), axis_name) for x in (dq, dk, dv))
  for step in range(1, plan.group + 1):
    perm = _rotation(plan, step)
    if step < plan.group:
      kv = jax.lax.ppermute(kv, axis_name, perm)
    dk, dv = jax.lax.ppermute((dk, dv), axis_name, perm)
    if step == plan.group:
      break
    part = jax.lax.cond(_visible(plan, st.causal, step, axis_name),
                        lambda kv: st.backward(qs, *kv, dos, lses, deltas, False),
                        lambda kv: zeros(), kv)
    dq, dk, dv = dq + part[0], dk + part[1], dv + part[2]
  return dq, dk, dv


def _gather(x, axis_name):
  return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)


def _local_rows(x, axis_name, n):
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * n, n, axis=1)


def _forward(q, k, v, pattern, scale, axis_name, names):
  shards = jax.lax.axis_size(axis_name)
  n, num_heads = q.shape[1], q.shape[2]
  outs, lses = [], []
  for plan in _plans(pattern, n, shards, num_heads // k.shape[2]):
    st = _Step(plan, pattern, scale, names, q, k)
    if plan.kind == "local":
      o, lse = st.forward(q, k, v, pattern.causal)
    elif plan.kind == "gather":
      o, lse = st.forward(*(_gather(x, axis_name) for x in (q, k, v)), pattern.causal)
      o, lse = _local_rows(o, axis_name, n), _local_rows(lse, axis_name, n)
    else:
      o, lse = _ring_forward(st, q, k, v, axis_name)
      if plan.compact:  # a compact row sees at least itself, so its lse is finite
        o = st.unquery(o, q)
        lse = jnp.where(st.covered(n, num_heads), st.unquery(lse[..., None], q[..., :1])[..., 0],
                        -jnp.inf)
    outs.append(o)
    lses.append(lse)
  return merge(outs, lses)


def _backward(q, k, v, dout, lse, delta, pattern, scale, axis_name, names):
  shards = jax.lax.axis_size(axis_name)
  n, num_heads = q.shape[1], q.shape[2]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  dq, dk, dv = (jnp.zeros(x.shape, acc) for x in (q, k, v))
  for plan in _plans(pattern, n, shards, num_heads // k.shape[2]):
    st = _Step(plan, pattern, scale, names, q, k)
    if plan.kind == "local":
      g = st.backward(q, k, v, dout, lse, delta, pattern.causal)
    elif plan.kind == "gather":
      full = [_gather(x, axis_name) for x in (q, k, v, dout, lse, delta)]
      g = [_local_rows(x, axis_name, n) for x in st.backward(*full, pattern.causal)]
    else:
      gq, gk, gv = _ring_backward(st, q, k, v, dout, lse, delta, axis_name)
      g = (st.unquery(gq, q), st.unkey(gk, k), st.unkey(gv, v))
    dq, dk, dv = dq + g[0], dk + g[1], dv + g[2]
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ring(q, k, v, pattern, scale, axis_name, names):
  out, lse = _forward(q, k, v, pattern, scale, axis_name, names)
  return out.astype(q.dtype), lse.astype(jnp.float32)


def _ring_fwd(q, k, v, pattern, scale, axis_name, names):
  out, lse = _ring(q, k, v, pattern, scale, axis_name, names)
  return (out, lse), (q, k, v, out, lse)


def _ring_bwd(pattern, scale, axis_name, names, res, cotangents):
  q, k, v, out, lse = res
  dout, dlse = cotangents
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = delta - dlse.astype(jnp.float32)
  grads = _backward(q, k, v, dout, lse, delta, pattern, scale, axis_name, names)
  return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_dilated_attention(q, k, v, pattern: DilatedPattern, *, axis_name, scale=None,
                           return_lse=False, implementation=None):
  """`dilated_attention` on sequence shards, called inside `jax.shard_map`.

  Each device passes its shard `[B, N / P, H, D]` of `q` and `[B, N / P, Hkv, D]` of `k`, `v`
  (shard `p` holds positions `[p * N / P, (p + 1) * N / P)` of processing order) and gets its
  shard of the output of `dilated_attention` on the whole sequence, with exact gradients.
  Queries and outputs never leave their device; keys and values travel only for branches
  whose segments span shards (see the module docstring). Each step uses the backend
  `dilated_attention` would pick (`implementation` as there).

  Example:
    >>> mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda q, k, v: ring_dilated_attention(q, k, v, pattern,
    ...                   axis_name="seq"), mesh=mesh, in_specs=jax.P(None, "seq"),
    ...                   out_specs=jax.P(None, "seq"))  # doctest: +SKIP
  """
  check_inputs(q, k, v, pattern)
  scale = check_scale(scale, q.shape[-1])
  out, lse = _ring(q, k, v, pattern, scale, axis_name, implementation_names(implementation))
  return (out, lse) if return_lse else out


def sharded_dilated_attention(q, k, v, pattern: DilatedPattern, *, mesh, axis_name,
                              batch_axis=None, scale=None, return_lse=False,
                              implementation=None):
  """`dilated_attention` with the sequence axis sharded over `mesh.shape[axis_name]` devices.

  Does the `jax.shard_map` for the caller: `q`, `k`, `v` are global `[B, N, H(kv), D]` arrays
  (sharded or not); the result is sharded like `P(batch_axis, axis_name)`. Works the same
  in one process or under `jax.distributed.initialize()` with one process per GPU.

  Example:
    >>> mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,))
    >>> out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq")  # doctest: +SKIP
  """
  check_inputs(q, k, v, pattern)
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  shards = mesh.shape[axis_name]
  if q.shape[1] % shards:
    raise ValueError(f"the sequence length {q.shape[1]} must be divisible by the size "
                     f"{shards} of mesh axis axis_name={axis_name!r}")
  spec = jax.P(batch_axis, axis_name)
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    q, k, v = (jax.reshard(x, jax.NamedSharding(mesh, spec)) for x in (q, k, v))
  fn = functools.partial(ring_dilated_attention, pattern=pattern, axis_name=axis_name,
                         scale=scale, return_lse=True, implementation=implementation)
  out, lse = jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec),
                           check_vma=True)(q, k, v)
  return (out, lse) if return_lse else out
