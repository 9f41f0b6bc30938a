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
  zigzag: bool = False   # ring, causal: half-shard chunks dealt out in zigzag order


def _plans(pattern: DilatedPattern, n: int, shards: int, kv_group: int):
  for b, (w, r) in enumerate(pattern.branches):
    w = min(w, n * shards)
    if n % w == 0:
      yield _Plan(b, "local", n, shards)
    elif w % n == 0 and n % r == 0:
      compact = pattern.offsets == "head" and 1 < r and kv_group < r
      # Zigzag needs half-shards that keep whole residue classes: n / 2 (compact: n / 2r) rows.
      zigzag = pattern.causal and (n // r % 2 == 0 if compact else (n // 2) % r == 0)
      yield _Plan(b, "ring", n, shards, w // n, compact, zigzag and n % 2 == 0)
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


def _compact(x, r, heads, head_of):
  """`[B, n, X, ...]` -> `[B, n / r, E, ...]`: head `h` keeps the rows of residue `h % r`."""
  x = x.reshape(x.shape[0], x.shape[1] // r, r, *x.shape[2:])
  return jnp.stack([x[:, :, h % r, head_of(h)] for h in heads], axis=2)


class _Step:
  """One branch's arrays and backend call, in the layout its steps use (compact or not)."""

  def __init__(self, plan, pattern, scale, names, q, k):
    self.plan, self.scale, self.names = plan, scale, names
    num_heads, kv_group = q.shape[2], q.shape[2] // k.shape[2]
    r = pattern.dilation_rates[plan.index]
    self.r = r
    self.heads = range(*pattern.head_ranges(num_heads)[plan.index])
    self.kv_group = kv_group
    if plan.kind == "ring" and plan.compact:
      # The arrays of a step are one segment of compact rows: undilated, one key head per
      # query head.
      self.pattern = lambda causal, length: DilatedPattern((length,), (1,), causal=causal)
      self.branches = None
    elif plan.kind == "ring":
      def step_pattern(causal, length):  # the arrays of a step are one segment
        segs = list(pattern.segment_lengths)
        segs[plan.index] = length
        return dataclasses.replace(pattern, segment_lengths=tuple(segs), causal=causal)
      self.pattern = step_pattern
      self.branches = (plan.index,)
    else:
      self.pattern = lambda causal, length: dataclasses.replace(pattern, causal=causal)
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
    pattern = self.pattern(causal, q.shape[1])
    name = backends.select(self.names, q, k, v, pattern, self.scale, self.branches)
    return backends.load(name), pattern

  def forward(self, q, k, v, causal):
    backend, pattern = self.backend(q, k, v, causal)
    return _vary_like(backend.forward(q, k, v, pattern, self.scale, self.branches), q)

  def backward(self, q, k, v, dout, lse, delta, causal):
    backend, pattern = self.backend(q, k, v, causal)
    grads = backend.backward(q, k, v, dout, lse, delta, pattern, self.scale, self.branches)
    return _vary_like(grads, q)


def _vary_like(xs, ref):
  """Gives a backend's results `ref`'s varying-mesh-axes type.

  A custom kernel call (jax_triton's) inside `shard_map` returns device-invariant types;
  adding a zero that varies like `ref` restores the type the rest of the ring expects.
  """
  zero = jnp.zeros_like(ref, shape=(), dtype=jnp.float32)
  return tuple(x + zero.astype(x.dtype) for x in xs)


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


def _zigzag_pairs(plan):
  """`ppermute` pairs dealing natural half-shards out in zigzag order, in every sub-ring.

  Device `j` of a sub-ring of `size` holds chunks `2j, 2j + 1` of its segment (2 * size
  chunks); in zigzag order it holds chunks `j` and `2 size - 1 - j`, so every device has one
  early and one late chunk and causal work is the same on all of them. Returns the pairs for
  the even-numbered chunks and for the odd-numbered ones (each a permutation).
  """
  even, odd = [], []
  for base in range(0, plan.shards, plan.group):
    size = min(plan.group, plan.shards - base)
    for i in range(size):
      even.append((base + i, base + (2 * i if 2 * i < size else 2 * size - 1 - 2 * i)))
      odd.append((base + i, base + (2 * i + 1 if 2 * i + 1 < size else 2 * size - 2 - 2 * i)))
  return even, odd


def _to_zigzag(x, plan, axis_name, inverse=False):
  """`[B, L, ...]` natural halves <-> `[B, L, ...]` zigzag `(early chunk, late chunk)`."""
  even, odd = _zigzag_pairs(plan)
  if inverse:
    even, odd = [(d, s) for s, d in even], [(d, s) for s, d in odd]
  # Device j's even-numbered chunk is its early one (chunk j) when j is even.
  j_even = _step_position(plan, axis_name)[0] % 2 == 0
  half = x.shape[1] // 2
  a, b = x[:, :half], x[:, half:]
  if inverse:  # (early, late) -> (even, odd), then home
    a, b = jnp.where(j_even, a, b), jnp.where(j_even, b, a)
  a, b = jax.lax.ppermute(a, axis_name, even), jax.lax.ppermute(b, axis_name, odd)
  if not inverse:  # (even, odd) -> (early, late)
    a, b = jnp.where(j_even, a, b), jnp.where(j_even, b, a)
  return jnp.concatenate([a, b], axis=1)


def _halves(*xs):
  return [(x[:, :x.shape[1] // 2], x[:, x.shape[1] // 2:]) for x in xs]


def _masked(part, keep):
  return jnp.where(keep[..., None], part[0], 0.0), jnp.where(keep, part[1], -jnp.inf)


def _merge2(a, b):
  return merge([a[0], b[0]], [a[1], b[1]])


def _ring_forward(st, q, k, v, axis_name):
  """`(o, lse)` of a ring branch on the local queries, in the step layout."""
  plan = st.plan
  qs, kv = st.query(q), (st.key(k), st.key(v))
  if plan.zigzag:
    return _zigzag_forward(st, qs, kv, axis_name)
  acc = st.forward(qs, *kv, st.causal)
  zeros = lambda: (_varying(jnp.zeros(acc[0].shape, acc[0].dtype), axis_name),
                   _varying(jnp.full(acc[1].shape, -jnp.inf, acc[1].dtype), axis_name))
  for step in range(1, plan.group):
    # Issued before the previous step's compute is consumed, so XLA overlaps the two.
    kv = jax.lax.ppermute(kv, axis_name, _rotation(plan, step, causal_forward=st.causal))
    part = jax.lax.cond(_visible(plan, st.causal, step, axis_name),
                        lambda kv: st.forward(qs, *kv, False), lambda kv: zeros(), kv)
    acc = _merge2(acc, part)
  return acc


def _zigzag_forward(st, qs, kv, axis_name):
  """Causal ring in zigzag order: every step is two half-by-half blocks on every device."""
  plan = st.plan
  qs = _to_zigzag(qs, plan, axis_name)
  kv = tuple(_to_zigzag(x, plan, axis_name) for x in kv)
  (q0, q1), (k0, k1), (v0, v1) = _halves(qs, *kv)  # 0: early chunk, 1: late chunk
  lo = st.forward(q0, k0, v0, True)
  hi = _merge2(st.forward(q1, k0, v0, False), st.forward(q1, k1, v1, True))
  place, size = _step_position(plan, axis_name)
  for step in range(1, plan.group):
    kv = jax.lax.ppermute(kv, axis_name, _rotation(plan, step))
    (k0, k1), (v0, v1) = _halves(*kv)
    # Keys from an earlier device: both query chunks see its early chunk. From a later one
    # (wrapped): the late query chunk sees both of its chunks. Either way two blocks.
    earlier, valid = step <= place, step < size
    common = st.forward(q1, k0, v0, False)
    pick = lambda a, b: jnp.where(earlier, a, b)
    other = st.forward(pick(q0, q1), pick(k0, k1), pick(v0, v1), False)
    lo = _merge2(lo, _masked(other, earlier & valid))
    hi = _merge2(_merge2(hi, _masked(common, valid)), _masked(other, ~earlier & valid))
  o, lse = (jnp.concatenate(x, axis=1) for x in zip(lo, hi))
  return (_to_zigzag(o, plan, axis_name, inverse=True),
          _to_zigzag(lse, plan, axis_name, inverse=True))


def _backward_steps(plan, kv, grads, step_grads, axis_name):
  """Steps 1..g-1 of a ring backward, then one more hop.

  Keys and values travel with the dk, dv they accumulate, which are home again after g hops;
  dq stays. `step_grads(kv, step)` gives a step's `(dq, dk, dv)` contributions.
  """
  dq, dk, dv = grads
  for step in range(1, plan.group + 1):
    perm = _rotation(plan, step)
    if step < plan.group:
      kv = jax.lax.ppermute(kv, axis_name, perm)
    dk, dv = jax.lax.ppermute((dk, dv), axis_name, perm)
    if step < plan.group:
      part = step_grads(kv, step)
      dq, dk, dv = dq + part[0], dk + part[1], dv + part[2]
  return dq, dk, dv


def _ring_backward(st, q, k, v, dout, lse, delta, axis_name):
  """`(dq, dk, dv)` of a ring branch, in the step layout."""
  plan = st.plan
  qs, dos, lses, deltas = (st.query(x) for x in (q, dout, lse[..., None], delta[..., None]))
  rows = (qs, dos, lses[..., 0], deltas[..., 0])
  kv = (st.key(k), st.key(v))
  if plan.zigzag:
    return _zigzag_backward(st, rows, kv, axis_name)
  grads = st.backward(rows[0], *kv, *rows[1:], st.causal)
  zeros = lambda: tuple(_varying(jnp.zeros(x.shape, x.dtype), axis_name) for x in grads)

  def step_grads(kv, step):
    return jax.lax.cond(_visible(plan, st.causal, step, axis_name),
                        lambda kv: st.backward(rows[0], *kv, *rows[1:], False),
                        lambda kv: zeros(), kv)

  return _backward_steps(plan, kv, grads, step_grads, axis_name)


def _zigzag_backward(st, rows, kv, axis_name):
  """The backward of `_zigzag_forward`: the same blocks; dk, dv travel home in zigzag order."""
  plan = st.plan
  rows = [_to_zigzag(x, plan, axis_name) for x in rows]
  kv = tuple(_to_zigzag(x, plan, axis_name) for x in kv)
  (r0, r1) = zip(*_halves(*rows))  # (q, dout, lse, delta) of the early and late query chunks
  bwd = lambda r, k, v, causal: st.backward(r[0], k, v, *r[1:], causal)
  cat = lambda a, b: jnp.concatenate([a, b], axis=1)
  (k0, k1), (v0, v1) = _halves(*kv)
  a, b, c = bwd(r0, k0, v0, True), bwd(r1, k0, v0, False), bwd(r1, k1, v1, True)
  grads = cat(a[0], b[0] + c[0]), cat(a[1] + b[1], c[1]), cat(a[2] + b[2], c[2])
  place, size = _step_position(plan, axis_name)

  def step_grads(kv, step):
    (k0, k1), (v0, v1) = _halves(*kv)
    earlier, valid = step <= place, step < size  # as in _zigzag_forward
    pick = lambda a, b: jnp.where(earlier, a, b)
    common = bwd(r1, k0, v0, False)
    other = bwd([pick(x, y) for x, y in zip(r0, r1)], pick(k0, k1), pick(v0, v1), False)
    keep = lambda x, c: jnp.where(c, x, 0.0)
    mine, theirs = earlier & valid, ~earlier & valid
    dq = cat(keep(other[0], mine), keep(common[0], valid) + keep(other[0], theirs))
    dk, dv = (cat(keep(common[i], valid) + keep(other[i], mine), keep(other[i], theirs))
              for i in (1, 2))
    return dq, dk, dv

  grads = _backward_steps(plan, kv, grads, step_grads, axis_name)
  return tuple(_to_zigzag(x, plan, axis_name, inverse=True) for x in grads)


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
