"""Ring dilated attention: the sequence sharded over a mesh axis; keys and values travel.

Shard `p` of `P` holds positions `[p * n, (p + 1) * n)` of processing order (`n = N / P`), or
with `layout="zigzag"` the half-shard chunks `p` and `2P - 1 - p` (`zigzag_positions`).
Each branch `(w, r)` of the pattern runs in one of three ways, chosen on the host:

- local (`n % w == 0`): every segment lies inside a shard; no communication at all. The
  local branches run together, as one backend call on the shard (one kernel launch where
  the backend schedules them together), unless that would change a branch's backend;
- ring (`w % n == 0`, `n % r == 0`): a segment spans `g = w / n` consecutive shards. Keys and
  values rotate in sub-rings of `g` devices. A step against another shard of the segment is
  plain (non-causal) attention of the local queries to the visiting keys, the shard being one
  segment; the step against the own shard is the branch itself. With `offsets="head"`
  (and fewer query heads per key/value head than `r`), only each head's residue rows, `1/r`
  of the keys and values, are compacted and sent. For causal patterns, steps whose keys lie in
  the future are skipped, and the shifts leave out the pairs nobody needs. A
  ring over the whole axis (non-causal, or causal in zigzag order) gathers its keys at once
  instead, where that fits in `GATHER_LIMIT_BYTES`: one all-gather, its steps as one backend
  call (causal: a second for the diagonal). A ring of small steps (fewer rows a shard than
  `SMALL_STEP_ROWS`, compact rows counted) keeps natural order (on shards given in zigzag
  order a whole causal ring takes zigzag order: `_plans`): over the whole axis it gathers its
  keys, causal or not; rotating, it computes its invisible steps and drops them rather than
  branching around them;
- gather (any other shape): the branch runs on all-gathered inputs (exact, not fast).

Every step is a call to a single-device backend with the global `lse` (the kernel contract),
combined with the one `merge`; the backward moves k, v as the forward does and sends each
step's dk, dv straight back to the keys' device (a gathered ring reduce-scatters dk and dv),
keeping `dq` local, so gradients are exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import backends
from .api import (check_flag, check_inputs, check_layout_name, check_scale, check_segment_ids,
                  head_shard_kind, on_head_shards)
from .backends.common import same_on_every_device
from .merge import merge
from .pattern import Branch, DilatedPattern, heads_per_kv


# A ring over the whole axis (non-causal, causal in zigzag order, or small: see
# `SMALL_STEP_ROWS`) gathers its keys at once (one all-gather) when that takes at most this
# much extra memory per device (see `_gathers`); None: 12 GiB, or a sixth of a device's
# memory where that is less (a causal ring of 32K tokens a GPU, H = 16, D = 128, needs 8.6
# GiB, and gathered runs 8 points nearer one GPU's speed: docs/performance.md, "Causal rings
# of 32K tokens a GPU gathered"); 0: rotate keys step by step. Read when a call is traced.
GATHER_LIMIT_BYTES: int | None = None


# A ring whose steps have fewer rows a shard than this (a compact ring: residue rows) is
# small: causal, it keeps natural order instead of dealing half-shards out in zigzag order
# (but a whole ring on shards given in zigzag order, `layout="zigzag"`, takes it where its
# half-shards keep whole residue classes: nothing then moves), and
# over the whole axis gathers its keys at once (memory permitting, `GATHER_LIMIT_BYTES`).
# Zigzag order balances the causal work over the devices, but costs a transfer of the
# queries, outputs and (backward) their gradients each way, each a synchronisation of the
# devices: more than the work it saves in a small step (docs/performance.md, "Small steps").
# 0: no ring is small. Read when a call is traced.
SMALL_STEP_ROWS: int = 4096


# True: a gathered ring of plain full attention (non-causal, or causal in zigzag order; no ids),
# over every device of one process (the call's only branch), runs as one kernel that gathers its
# keys itself where the step's backend has one ("mosaic": `mosaic_gather`): each device's peers'
# keys travel while it attends to its own, instead of an all-gather before (docs/performance.md,
# "Keys gathered inside the kernel"). Its programs claim the blocks they push as they run, so it
# completes however few of them are resident (beside a collective on another stream holding SMs).
# Off by default. On JAX 0.11 only with custom calls kept out of XLA's command buffers
# (`_custom_calls_out_of_command_buffers`): captured in one beside fusions, the kernel received a
# peer's keys wrong in some calls on 2 x H200 (JAX 0.11.2), where the calls' buffers reuse memory;
# JAX 0.12 places the buffers it stores into on its peers in NCCL's symmetric memory, and its GPU
# tests pass under XLA's default command buffers. False: the all-gather, then one call. Read when a
# call is traced.
KERNEL_GATHER: bool = False


def _count(name, value):
  """`value`, the module setting `name`, checked to be an int >= 0."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"ring.{name} must be an int >= 0, got {value!r}")
  return int(value)


def _small_step_rows() -> int:
  """`SMALL_STEP_ROWS`, checked."""
  return _count("SMALL_STEP_ROWS", SMALL_STEP_ROWS)


def _kernel_gather() -> bool:
  """`KERNEL_GATHER`, checked."""
  if not isinstance(KERNEL_GATHER, bool):
    raise ValueError(f"ring.KERNEL_GATHER must be a bool, got {KERNEL_GATHER!r}")
  return KERNEL_GATHER


def _custom_calls_out_of_command_buffers() -> bool:
  """Whether XLA_FLAGS keeps custom calls out of XLA's GPU command buffers. Its last
  `--xla_gpu_enable_command_buffer=` (unset: XLA's default, which holds CUSTOM_CALL) lists
  the command types (none: off), or changes XLA's default in order (`+TYPE`, `-TYPE`)."""
  flag = "--xla_gpu_enable_command_buffer="
  values = [t[len(flag):] for t in os.environ.get("XLA_FLAGS", "").split() if t.startswith(flag)]
  if not values:
    return False
  types = [t.strip().upper() for t in values[-1].strip("'\"").split(",") if t.strip()]
  if types and all(t.startswith(("+", "-")) for t in types):  # the last change of it decides
    return [t[0] for t in types if t[1:] == "CUSTOM_CALL"][-1:] == ["-"]
  return "CUSTOM_CALL" not in [t.lstrip("+") for t in types]


def _settings() -> tuple:
  """The module settings a ring's trace depends on, checked: `(_gather_limit(),
  SMALL_STEP_ROWS, KERNEL_GATHER)`."""
  return _gather_limit(), _small_step_rows(), _kernel_gather()


def _gather_limit() -> int:
  """`GATHER_LIMIT_BYTES`, checked, its default resolved for the default backend's devices
  (this process's: another process's device reports no memory, under
  `jax.distributed.initialize()` a `JaxRuntimeError`)."""
  if GATHER_LIMIT_BYTES is not None:
    return _count("GATHER_LIMIT_BYTES", GATHER_LIMIT_BYTES)
  memory = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  return 12 << 30 if memory is None else min(12 << 30, memory // 6)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How `branch` (laid over the whole sequence) runs on `shards` shards of `n` tokens (see
  the module docstring)."""

  branch: Branch
  kind: str         # "local" | "ring" | "gather"
  n: int
  shards: int
  span: int = 1     # ring: shards per segment (a sub-ring)
  compact: bool = False  # ring: only each head's residue rows travel
  zigzag: bool = False   # ring, causal: half-shard chunks dealt out in zigzag order
  small: bool = False    # ring: steps of fewer than SMALL_STEP_ROWS rows
  # The order of the shards the plan's steps take: "natural", or "zigzag" where the call's
  # shards come in zigzag order (`layout`) and the plan runs on them as they are (`_plans`);
  # the call moves the other plans' shards into natural order and their results back.
  layout: str = "natural"

  @property
  def gatherable(self) -> bool:
    """A ring that may gather its keys at once (see `_gathers`): one over the whole axis,
    non-causal, in zigzag order, or small (natural order)."""
    return self.kind == "ring" and self.span == self.shards and (
        self.zigzag or not self.branch.causal or self.small)


def _plans(pattern: DilatedPattern, n: int, shards: int, num_heads: int, per_kv: int,
           every: bool = False, layout: str = "natural"):
  """A `_Plan` per branch that covers some of the call's heads; `every`: per branch, where
  shards of the heads cover different branches (`head_groups`: a ring's collectives are the
  same on every device, so a shard runs the plans of branches none of its heads is in too,
  their steps empty), whose rings move whole rows (compacted, their shapes would differ).

  `layout="zigzag"` (the shards hold half-shard chunks `p` and `2P - 1 - p`): a plan runs on
  them as they are where positions keep their residues in its arrays: local branches whose
  segments lie within a half-shard, and rings over the whole axis, causal ones in zigzag
  order (which such shards make free of moves, so small ones take it too) and non-causal
  ones (whose keys are all visible at every step, in any order of the shards)."""
  small_rows = _small_step_rows()
  halves = layout == "zigzag"
  for br in pattern.layout(n * shards, num_heads):
    if not (br.heads or every):  # a head group none of this call's heads is in (`head_offset`)
      continue
    if n % br.w == 0:
      direct = halves and (n // 2) % br.w == 0
      yield _Plan(br, "local", n, shards, layout="zigzag" if direct else "natural")
    elif br.w % n == 0 and n % br.r == 0:
      compact = br.per_head and per_kv < br.r and not every
      small = (n // br.r if compact else n) < small_rows
      # Zigzag order needs half-shards that keep whole residue classes (compact: n / 2r rows).
      residues = n % 2 == 0 and (n // 2) % br.r == 0
      whole = halves and residues and br.w == n * shards
      zigzag = br.causal and residues and (whole or not small)
      yield _Plan(br, "ring", n, shards, br.w // n, compact, zigzag, small,
                  "zigzag" if whole else "natural")
    else:
      yield _Plan(br, "gather", n, shards)


def _sub_rings(plan: _Plan):
  """`(first device, size)` of each sub-ring of `span` devices (the last may be short)."""
  return [(base, min(plan.span, plan.shards - base))
          for base in range(0, plan.shards, plan.span)]


def _rotation(plan: _Plan, hop: int, shift: bool = False):
  """`ppermute` pairs moving buffers one place on in every sub-ring, for step `hop`.

  A sub-ring of `size` devices (the last may be short) rotates for its first `size - 1`
  hops and holds still afterwards (its later steps see nothing new). `shift` (causal rings
  outside zigzag order): without wrapping; a device only needs keys from earlier shards, so
  the pairs that would deliver later ones are left out.
  """
  pairs = []
  for base, size in _sub_rings(plan):
    for j in range(size):
      if shift:
        if j >= max(hop, 1):
          pairs.append((base + j - 1, base + j))
      else:
        pairs.append((base + j, base + ((j + 1) % size if hop < size else j)))
  return pairs


def _together(fn, xs, plan: _Plan, join=None):
  """`fn` (a collective) over each of the arrays `xs`: `(k, v[, kv_ids])` or `(dk, dv)`. A
  compact ring (or `join`) moves the first two as one buffer, joined along the head dim: one
  collective for both instead of two, each a wait for the peers (docs/performance.md, "Keys
  and values in one buffer"). Its compaction copies them anyway, as the fusion that makes a
  zigzag ring's dk and dv does (`join`); other rings' are the inputs, whose copy would cost
  more than the collective saves."""
  if not (plan.compact if join is None else join):
    return tuple(fn(x) for x in xs)
  d = xs[0].shape[-1]
  both = fn(jnp.concatenate(xs[:2], axis=-1))
  return (both[..., :d], both[..., d:], *(fn(x) for x in xs[2:]))


def _send(xs, pairs, plan: _Plan, axis_name):
  """The arrays `xs` permuted by `pairs` (`_together`)."""
  return _together(lambda x: jax.lax.ppermute(x, axis_name, pairs), xs, plan)


def _compact(x, branch, head_of):
  """`[B, n, X, ...]` -> `[B, n / r, E, ...]`: head `h` keeps the rows of its residue class."""
  r = branch.r
  x = x.reshape(x.shape[0], x.shape[1] // r, r, *x.shape[2:])
  return jnp.stack([x[:, :, branch.residues(h)[0], head_of(h)] for h in branch.heads], axis=2)


def _uncompact(x, branch, out_heads, per_kv=1):
  """`_compact` undone (its transpose): `[B, n / r, E, ...]` -> `[B, n, out_heads, ...]`,
  head `h`'s rows added into head `h // per_kv` at the rows of its residue class, zeros on
  the others (query heads: `per_kv = 1`; key heads: `per_kv` query heads share one).

  One select per element and query head sharing an output head, which XLA fuses into what
  follows, where `jax.vjp` of `_compact` is a sum of padded strided rows over every head (slow
  on GPUs: docs/performance.md, "A model's layers")."""
  heads, r = list(branch.heads), branch.r
  terms = []
  for j in range(per_kv):
    group = [g * per_kv + j for g in range(out_heads)]  # the j-th query head of each
    source = [heads.index(h) if h in heads else 0 for h in group]
    keep = np.zeros((r, out_heads), bool)
    for g, h in enumerate(group):
      if h in heads:
        keep[branch.residues(h)[0], g] = True
    keep = keep.reshape((1, 1, r, out_heads) + (1,) * (x.ndim - 3))
    rows = x if source == list(range(x.shape[2])) else jnp.take(x, np.array(source), axis=2)
    terms.append(jnp.where(keep, rows[:, :, None], jnp.zeros((), x.dtype)))
  return sum(terms[1:], terms[0]).reshape(x.shape[0], x.shape[1] * r, out_heads, *x.shape[3:])


class _RingBranch:
  """One branch's steps: the layout they use (compact or not) and the pattern of each step.

  A step hands a backend an ordinary problem, with a pattern made for the step's arrays:
  - compact ring: the arrays are the residue rows of one segment, one key head per query
    head, so the step is plain (undilated) attention over one segment: `((length,), (1,))`;
  - ring: the arrays are one segment's worth of tokens (the step's shard or half-shard), so
    the branch's segment length becomes the step length. Residues stay right because shards
    start at multiples of `r` (the plan needs `n % r == 0`), and causal order within the
    arrays is global order; steps against another shard's keys are non-causal, the plan
    having decided which are visible at all;
  - local and gather: the arrays are whole segments at their true positions: the pattern
    itself, restricted to the branch (local: to `branches`, every local branch).

  Each step resolves its backend from its own problem (shapes, pattern, causality, pass),
  as `dilated_attention` does: a step one backend declines (a zigzag half-shard shorter than
  its blocks, say) runs on the next candidate, never raises where one device would run.
  """

  def __init__(self, plan, pattern, scale, names, config, q, k, branches=None, packed=False):
    self.plan, self.scale, self.names, self.config = plan, scale, names, config
    self.packed = packed  # steps get segment_ids
    br = plan.branch
    self.per_kv = heads_per_kv(q.shape[2], k.shape[2])
    if plan.kind == "ring" and plan.compact:
      self.pattern = lambda causal, length: DilatedPattern((length,), (1,), causal=causal)
      self.branches = None
    elif plan.kind == "ring":
      def step_pattern(causal, length):
        segs = list(pattern.segment_lengths)
        segs[br.index] = length
        return dataclasses.replace(pattern, segment_lengths=tuple(segs), causal=causal)
      self.pattern = step_pattern
      self.branches = (br.index,)
    else:
      self.pattern = lambda causal, length: dataclasses.replace(pattern, causal=causal)
      self.branches = branches or (br.index,)
    self.causal = br.causal
    self.gathers = _gathers(self, q, k)  # a ring that gathers its keys at once

  def backend(self, q, k, causal, backward=False):
    """The backend of a step on arrays shaped like `q`, `k` (inside shard_map `q` is the
    real, varying array: "pallas" declines it) and the module's config for it (a ring
    step's where keys travel beside it: not in a ring that gathers them first)."""
    problem = backends.Problem.of(q, k, self.pattern(causal, q.shape[1]), self.branches)
    backend = backends.load(backends.resolve(self.names, dataclasses.replace(
        problem, backward=backward, segment_ids=self.packed, config=self.config)))
    return backend, backends.config_for(backend, self.config,
                                        ring_step=self.plan.kind == "ring" and not self.gathers)

  def gathering_kernel(self, q, k):
    """`(backend, config)` whose kernel gathers this branch's keys itself (`KERNEL_GATHER`),
    or None: a gathered ring of plain full attention (dilation 1, every head; non-causal, or
    causal in zigzag order) over every device of the process, its step's backend one that
    has such a kernel and runs these shapes."""
    plan, br = self.plan, self.plan.branch
    if not (_kernel_gather() and self.gathers and not plan.compact
            and (plan.zigzag or not self.causal) and br.r == 1
            and len(br.heads) == q.shape[2] and not self.packed
            and plan.shards == jax.device_count() == jax.local_device_count()):
      return None
    backend, config = self.backend(q, k, self.causal)
    gathers = getattr(backend, "gathers", None)
    if gathers is None or not gathers(q.shape, k.shape, q.dtype, plan.shards, self.scale,
                                      self.causal):
      return None
    if jax.__version_info__ < (0, 12) and not _custom_calls_out_of_command_buffers():
      raise ValueError(
          "ring.KERNEL_GATHER = True needs, on JAX 0.11, custom calls kept out of XLA's "
          "command buffers (XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,"
          "CUBLASLT,CUDNN, or = for none, set before JAX starts): captured in one, the kernel "
          "that gathers the keys received wrong keys from a peer in some calls (docs/ring.md)")
    return backend, config

  # Layout: compaction for the "compact" ring, identity otherwise.
  def query(self, x):
    return _compact(x, self.plan.branch, lambda h: h) if self.plan.compact else x

  def key(self, x):
    if not self.plan.compact:
      return x
    return _compact(x, self.plan.branch, lambda h: h // self.per_kv)

  def unquery(self, x, like):
    return _uncompact(x, self.plan.branch, like.shape[2]) if self.plan.compact else x

  def unkey(self, x, like):
    if not self.plan.compact:
      return x
    return _uncompact(x, self.plan.branch, like.shape[2], self.per_kv)

  def covered(self, num_heads):
    """`[n, H]`: the local rows a compact branch computes (each head at its residue).

    A shard starts at a multiple of `n`, which `r` divides, so a local position has its
    global position's residue: the branch laid over one shard covers the same rows."""
    local = dataclasses.replace(self.plan.branch, n=self.plan.n, w=self.plan.n)
    return local.covered(num_heads, jnp)

  def forward(self, q, k, v, causal, ids=None, in_dtype=False):
    """A step's partials; `ids`: None or the step's `(q_ids, kv_ids)` in its layout
    (`[B, n, X, 1]`, see `_ids_like`). `in_dtype`: the output in q's dtype (the local
    branches' call: the whole result, or a partial rounded once more before the merge, as
    one device's chained launches round theirs), else float32."""
    acc = q.dtype if in_dtype else jnp.promote_types(q.dtype, jnp.float32)
    if not self.plan.branch.heads:  # a head group none of this shard's heads is in (`_plans`)
      return _empty_partial((*q.shape[:3], v.shape[-1]), acc, q, k, v)
    pattern = self.pattern(causal, q.shape[1])
    backend, config = self.backend(q, k, causal)
    o, lse = backend.forward(q, k, v, pattern, self.scale, branches=self.branches,
                             config=config, out_dtype=q.dtype if in_dtype else None,
                             **_step_ids(ids))
    return backends.vary_like((o.astype(acc), lse), q, k, v)

  def backward(self, q, k, v, dout, lse, delta, causal, ids=None, in_dtype=False):
    """A step's gradients, in float32; `in_dtype` (the local branches' call): in bfloat16
    where q is (float16 gradients need `attention`'s saturating cast). Every shard of a
    `_Switched` step returns the same dtypes, whether its backend takes `grad_dtype` or not."""
    wide = jnp.promote_types(q.dtype, jnp.float32)
    acc = q.dtype if in_dtype and q.dtype == jnp.bfloat16 else wide
    if not self.plan.branch.heads:  # a head group none of this shard's heads is in
      return backends.vary_like(tuple(jnp.zeros(x.shape, acc) for x in (q, k, v)), q, k, v)
    pattern = self.pattern(causal, q.shape[1])
    backend, config = self.backend(q, k, causal, backward=True)
    grads = backend.backward(q, k, v, dout, lse, delta, pattern, self.scale,
                             branches=self.branches, config=config,
                             grad_dtype=q.dtype if in_dtype and acc == q.dtype else None,
                             **_step_ids(ids))
    return backends.vary_like(tuple(g.astype(acc) for g in grads), q, k, v)


class _Switched:
  """One branch's steps where the shards of the heads differ (`heads_axis`, `offsets="head"`:
  other residues): a `_RingBranch` for each kind of shard, their plans alike but for the
  heads' residues, and this device's kind `which` (traced). Each kernel call and layout op
  is a `lax.switch` over the kinds; the collectives between them are the same on every
  device, outside any switch (a collective inside one hangs: each branch's is its own op)."""

  def __init__(self, kinds, which):
    self.kinds, self.which = kinds, which
    self.plan, self.causal, self.gathers = kinds[0].plan, kinds[0].causal, kinds[0].gathers

  def _switch(self, fn, *operands):
    return jax.lax.switch(self.which, [functools.partial(fn, st) for st in self.kinds],
                          *operands)

  def gathering_kernel(self, q, k):
    del q, k  # a kernel that gathers keys runs one branch of every head: shards alike
    return None

  def query(self, x):
    return self._switch(_RingBranch.query, x) if self.plan.compact else x

  def key(self, x):
    return self._switch(_RingBranch.key, x) if self.plan.compact else x

  def unquery(self, x, like):
    return self._switch(lambda st, x: st.unquery(x, like), x) if self.plan.compact else x

  def unkey(self, x, like):
    return self._switch(lambda st, x: st.unkey(x, like), x) if self.plan.compact else x

  def covered(self, num_heads):
    return jnp.stack([st.covered(num_heads) for st in self.kinds])[self.which]

  def forward(self, q, k, v, causal, ids=None, in_dtype=False):
    return self._switch(lambda st, *xs: st.forward(*xs[:3], causal, xs[3], in_dtype),
                        q, k, v, ids)

  def backward(self, q, k, v, dout, lse, delta, causal, ids=None, in_dtype=False):
    return self._switch(lambda st, *xs: st.backward(*xs[:6], causal, xs[6], in_dtype),
                        q, k, v, dout, lse, delta, ids)


def _ids_like(ids, x):
  """`[B, n]` document ids as `[B, n, X, 1]`, one per token and head of `x` `[B, n, X, D]`:
  the step layouts (compaction, zigzag halves, transfers) then move them as they move `x`."""
  return jnp.broadcast_to(ids[:, :, None, None], (*x.shape[:3], 1))


def _ids_per_head(ids, q, k):
  """`[B, n]` `(q_ids, kv_ids)` laid out like `q` and `k` (`_ids_like`), or None."""
  return None if ids is None else (_ids_like(ids[0], q), _ids_like(ids[1], k))


def _with_ids(st, ids, q, k, kv):
  """`(query ids, kv)`: the queries' ids in the step layout, and `kv` with the keys' ids
  appended (they travel with the keys); `(None, kv)` without ids."""
  if ids is None:
    return None, kv
  q_ids, kv_ids = _ids_per_head(ids, q, k)
  return st.query(q_ids), kv + (st.key(kv_ids),)


def _step_ids(ids) -> dict:
  """A backend's `segment_ids` keyword from a step's `(q_ids, kv_ids)` (`_ids_like`)."""
  return {} if ids is None else {"segment_ids": (ids[0][..., 0], ids[1][..., 0])}


def _pair(q_ids, kv):
  """The step's ids: the queries' and those travelling with the keys (`kv[2]`), or None."""
  return None if q_ids is None else (q_ids, kv[2])


def _step_position(plan, axis_name):
  """(this device's place in its sub-ring, the sub-ring's size), as traced values."""
  p = jax.lax.axis_index(axis_name)
  full = (plan.shards // plan.span) * plan.span
  return p % plan.span, jnp.where(p >= full, plan.shards - full, plan.span)


def _visible(plan, causal, step, axis_name):
  """Whether the keys visiting at `step` (from `step` places back) are visible here: True
  where that holds on every device (non-causal rings whose sub-rings are all whole), else a
  traced value."""
  if not causal and plan.shards % plan.span == 0:
    return True
  place, size = _step_position(plan, axis_name)
  return step <= place if causal else step < size


def _if_visible(plan, visible, compute, empty, operand):
  """`compute(operand)` where `visible`, else `empty()`; a `lax.cond` only where `visible` is
  traced and the plan's steps are not small (on GPUs a conditional reads its predicate on the
  host, a wait for the device, which keeps the next step's launches from running ahead; a
  small step is computed everywhere and selected)."""
  if visible is True:
    return compute(operand)
  if plan.small:
    return jax.tree.map(lambda a, b: jnp.where(visible, a, b), compute(operand), empty())
  return jax.lax.cond(visible, compute, lambda _: empty(), operand)


def _zigzag_pairs(plan):
  """`ppermute` pairs dealing natural half-shards out in zigzag order, in every sub-ring.

  Device `j` of a sub-ring of `size` holds chunks `2j, 2j + 1` of its segment (2 * size
  chunks); in zigzag order it holds chunks `j` and `2 size - 1 - j`, so every device has one
  early and one late chunk and causal work is the same on all of them. Returns the pairs for
  the even-numbered chunks and for the odd-numbered ones (each a permutation).
  """
  even, odd = [], []
  for base, size in _sub_rings(plan):
    for i in range(size):
      even.append((base + i, base + (2 * i if 2 * i < size else 2 * size - 1 - 2 * i)))
      odd.append((base + i, base + (2 * i + 1 if 2 * i + 1 < size else 2 * size - 2 - 2 * i)))
  return even, odd


def _permute(x, axis_name, pairs):
  """`jax.lax.ppermute`, skipped where every device keeps its own buffer."""
  return x if all(s == d for s, d in pairs) else jax.lax.ppermute(x, axis_name, pairs)


def _to_zigzag(x, plan, axis_name, inverse=False):
  """`[B, L, ...]` natural halves <-> `[B, L, ...]` zigzag `(early chunk, late chunk)`: two
  collective-permutes, one in sub-rings of 2 (whose devices keep their even chunks). Each
  array moves on its own: a call's arrays joined into one buffer were slower on 2 x H200
  (docs/performance.md, "zigzag order" in "Measurements behind design choices"). Nothing
  moves where the shards come in zigzag order already (`plan.layout`)."""
  if plan.layout == "zigzag":
    return x
  even, odd = _zigzag_pairs(plan)
  if inverse:
    even, odd = [(d, s) for s, d in even], [(d, s) for s, d in odd]
  # Device j's even-numbered chunk is its early one (chunk j) when j is even.
  j_even = _step_position(plan, axis_name)[0] % 2 == 0
  half = x.shape[1] // 2
  a, b = x[:, :half], x[:, half:]
  if inverse:  # (early, late) -> (even, odd), then home
    a, b = jnp.where(j_even, a, b), jnp.where(j_even, b, a)
  a, b = _permute(a, axis_name, even), _permute(b, axis_name, odd)
  if not inverse:  # (even, odd) -> (early, late)
    a, b = jnp.where(j_even, a, b), jnp.where(j_even, b, a)
  return jnp.concatenate([a, b], axis=1)


def _halves(*xs):
  return [(x[:, :x.shape[1] // 2], x[:, x.shape[1] // 2:]) for x in xs]


def _empty_partial(out_shape, dtype, *like):
  """The partial of queries that see no key: `out = 0` (in `dtype`), `lse = -inf` (float32),
  typed like a real step's (varying over every mesh axis `like` varies over, the data axis
  included), as `lax.cond` and `lax.switch` need."""
  return backends.vary_like((jnp.zeros(out_shape, dtype),
                             jnp.full(out_shape[:-1], -jnp.inf, jnp.float32)), *like)


def _masked(part, keep):
  return jnp.where(keep[..., None], part[0], 0.0), jnp.where(keep, part[1], -jnp.inf)


def _merge2(a, b):
  return merge([a[0], b[0]], [a[1], b[1]])


def _kernel_gathered_forward(st, kernel, q, k, v, axis_name):
  """`(o, lse, (k, v) gathered)` of a ring branch that the backend's kernel gathers itself
  (`_RingBranch.gathering_kernel`, whose `(backend, config)` is `kernel`). Causal: q, k and
  v move into zigzag order first (unless the shards come in it: `plan.layout`), so that on
  every device its own keys are `1 / P` of its work, done while the peers' arrive; o and lse
  move back, the keys gathered stay in that order (`_zigzag_calls` reads them)."""
  backend, config = kernel
  plan, causal = st.plan, st.causal
  if causal:
    q, k, v = (_to_zigzag(x, plan, axis_name) for x in (q, k, v))
  out, lse, gathered = backend.gathered_forward(q, k, v, st.scale, axis_name=axis_name,
                                                shards=plan.shards, causal=causal,
                                                config=config)
  out, lse = backends.vary_like((out, lse), q, k, v)
  if causal:
    out, lse = (_to_zigzag(x, plan, axis_name, inverse=True) for x in (out, lse))
  return out, lse, backends.vary_like(gathered, q, k, v)


def _ring_forward(st, q, k, v, axis_name, ids=None):
  """`(o, lse)` of a ring branch on the local queries, in the step layout. `ids`: None or
  the shard's `(q_ids, kv_ids)` (`[B, n]`); the keys' travel with the keys."""
  plan = st.plan
  qs = st.query(q)
  qi, kv = _with_ids(st, ids, q, k, (st.key(k), st.key(v)))
  if st.gathers:
    gathered = _gathered_zigzag_forward if plan.zigzag else _gathered_forward
    return gathered(st, qs, qi, kv, axis_name)
  if plan.zigzag:
    return _zigzag_forward(st, qs, qi, kv, axis_name)
  acc = st.forward(qs, *kv[:2], st.causal, _pair(qi, kv))
  zeros = lambda: _empty_partial(acc[0].shape, acc[0].dtype, qs)  # an empty step's result
  for step in range(1, plan.span):
    # Issued before the previous step's compute is consumed, so XLA overlaps the two.
    kv = _send(kv, _rotation(plan, step, shift=st.causal), plan, axis_name)
    part = _if_visible(plan, _visible(plan, st.causal, step, axis_name),
                       lambda kv: st.forward(qs, *kv[:2], False, _pair(qi, kv)), zeros, kv)
    acc = _merge2(acc, part)
  return acc


def _gathers(st, q, k) -> bool:
  """Whether a ring branch gathers all its keys at once instead of rotating them: a
  `gatherable` ring whose extra memory fits in `GATHER_LIMIT_BYTES` (`st`: its `_RingBranch`,
  whose layout sizes the step's arrays from the shard's `q`, `k`).

  One all-gather moves the same bytes as the rotations, over every link at once and before
  any step; the steps then run as one backend call, the shards' key blocks folded into the
  batch (causal: the own shard, or in zigzag order the two diagonal half-shards, in a second,
  causal call). Its memory, per device and in the backward (the larger): a copy of the
  queries, their cotangents and float32 gradients per block of the call, the gathered keys
  and values and their float32 gradients (zigzag: `P + 1/2` shards of query rows in the two
  calls, and `2P + 1/2` of keys: the gathered ones, then each call's own; causal in natural
  order: `P` and `2P`)."""
  plan = st.plan
  if not plan.gatherable:
    return False
  qs, ks = (jax.eval_shape(f, jax.ShapeDtypeStruct(x.shape, x.dtype))
            for f, x in ((st.query, q), (st.key, k)))
  item = jnp.dtype(qs.dtype).itemsize
  p = plan.shards
  rows, keys = ((p + 0.5, 2 * p + 0.5) if plan.zigzag else
                (p, 2 * p) if st.causal else (p, p))
  need = rows * qs.size * (2 * item + 4) + keys * 2 * ks.size * (item + 4)
  return need <= _gather_limit()


def _blocks(x, count):
  """`x` gathered over the axis, `[B, P n, ...]`, as `[B, count, P n / count, ...]`: the
  shards' blocks (`count = P`) or half-shard chunks (`2P`) in natural order."""
  return x.reshape(x.shape[0], count, x.shape[1] // count, *x.shape[2:])


def _per_block(keep, ndim: int):
  """`keep` (one flag a block) shaped to select along axis 1 of a `[B, blocks, ...]` array of
  `ndim` dims."""
  return keep.reshape((1, -1) + (1,) * (ndim - 2))


def _fold(x):
  """`[B, m, ...]` -> `[B m, ...]`: each of the `m` blocks a batch row."""
  return x.reshape(-1, *x.shape[2:])


def _repeat_rows(x, count):
  """`[B, n, ...]` -> `[B count, n, ...]`: each batch row once per key block of a call."""
  return None if x is None else jnp.repeat(x, count, axis=0)


def _home(grads, plan: _Plan, axis_name, join=None):
  """`(dk, dv)` by key block of the whole axis, `[B, blocks, n', ...]` each, added up over the
  devices, each device's own shard of them: one reduce-scatter (for both, `_together`)."""
  scatter = lambda g: jax.lax.psum_scatter(g.reshape(g.shape[0], -1, *g.shape[3:]), axis_name,
                                           scatter_dimension=1, tiled=True)
  return _together(scatter, grads, plan, join)


def _natural_blocks(st, kv, axis_name, gathered=None):
  """`(m, blocks)`: the key blocks of a gathered ring's non-causal call in natural order, each
  of `kv` gathered over the axis and its first `m` shards folded into the batch (all `P`;
  causal: the `P - 1` that come before some device's own). `gathered`: `kv` already
  gathered (`[B, P n, ...]` each), or None."""
  shards = st.plan.shards
  m = shards - 1 if st.causal else shards
  first = lambda x: _fold(_blocks(x, shards)[:, :m])
  if gathered is not None:
    return m, [first(x) for x in gathered]
  return m, _together(lambda x: first(_gather(x, axis_name)), kv, st.plan)


def _gathered_forward(st, qs, qi, kv, axis_name):
  """`_ring_forward` of a branch that `_gathers` in natural order: one all-gather, one
  non-causal call for the shards' keys folded into the batch (causal: the `P - 1` first, those
  before this one visible, and a second, causal call for the own shard's), one merge."""
  b = qs.shape[0]
  m, blocks = _natural_blocks(st, kv, axis_name)
  o, lse = st.forward(_repeat_rows(qs, m), *blocks[:2], False,
                      _pair(_repeat_rows(qi, m), blocks))
  o, lse = (x.reshape(b, m, *x.shape[1:]) for x in (o, lse))
  outs, lses = [o[:, t] for t in range(m)], [lse[:, t] for t in range(m)]
  if st.causal:
    me = jax.lax.axis_index(axis_name)
    lses = [jnp.where(t < me, x, -jnp.inf) for t, x in enumerate(lses)]
    own = st.forward(qs, *kv[:2], True, _pair(qi, kv))
    outs, lses = outs + [own[0]], lses + [own[1]]
  return merge(outs, lses)


def _gathered_backward(st, rows, qi, kv, axis_name, gathered=None):
  """The backward of `_gathered_forward` (or of `_kernel_gathered_forward`, whose
  `gathered` keys it reads instead of gathering them again): the same calls; dk and dv of
  every shard go home by one reduce-scatter."""
  b = rows[0].shape[0]
  m, blocks = _natural_blocks(st, kv, axis_name, gathered)
  rep = [_repeat_rows(x, m) for x in rows]
  grads = st.backward(rep[0], *blocks[:2], *rep[1:], False, _pair(_repeat_rows(qi, m), blocks))
  dq, dk, dv = (x.reshape(b, m, *x.shape[1:]) for x in grads)
  if st.causal:  # the visible blocks' gradients, then the own shard's added to its block
    me = jax.lax.axis_index(axis_name)
    keep = lambda x: jnp.where((jnp.arange(m) < me).reshape((1, m) + (1,) * (x.ndim - 2)),
                               x, 0.0)
    own = st.backward(rows[0], *kv[:2], *rows[1:], True, _pair(qi, kv))
    with_own = lambda x, d: jnp.concatenate([keep(x), jnp.zeros_like(x[:, :1])], axis=1).at[
        :, me].add(d)
    dq = jnp.sum(keep(dq), axis=1) + own[0]
    dk, dv = with_own(dk, own[1]), with_own(dv, own[2])
  else:
    dq = jnp.sum(dq, axis=1)
  return (dq, *_home((dk, dv), st.plan, axis_name))


def _zigzag_calls(st, rows, qi, kv, axis_name, gathered=None):
  """The two calls of a causal whole ring gathered in zigzag order, on device `j` of `P`.

  Its early query chunk `j` sees the natural key chunks `0 .. j - 1` whole, its late one
  `2P - 1 - j` sees `0 .. 2P - 2 - j`: `2P - 1` fully visible pairs on every device, folded
  into the batch for one non-causal call, and the two diagonal pairs (each query chunk
  against its own keys) for one causal call. `rows`: `(q,)` or the backward's `(q, dout,
  lse, delta)`, in the step layout; `qi`: their ids or None; `kv`: `(k, v[, kv_ids])`;
  `gathered`: None, or `(k, v)` already gathered in zigzag order (`_kernel_gathered_forward`:
  device `d`'s chunks `d, 2P - 1 - d` at blocks `2d, 2d + 1`), as the keys of shards in
  zigzag order gather (`plan.layout`). Returns `(pairs, diagonal, early)`: each call's
  `(rows[, ids], keys)`, and whether each pair's queries are the early chunk (pair `t` holds
  natural key chunk `t` if early, else `t - j`; `_by_key_chunk`)."""
  shards = st.plan.shards
  j = jax.lax.axis_index(axis_name)
  t = jnp.arange(2 * shards - 1)
  early = t < j
  index, own = jnp.where(early, t, t - j), jnp.stack([j, 2 * shards - 1 - j])
  zigzag = [_to_zigzag(x, st.plan, axis_name) for x in (*rows, qi) if x is not None]
  halves = [_halves(x)[0] for x in zigzag]  # (early, late) chunks
  if gathered is None:
    chunks = _together(lambda x: _blocks(_gather(x, axis_name), 2 * shards), kv, st.plan)
  else:
    chunks = [_blocks(x, 2 * shards) for x in gathered]
  blocks = np.argsort(zigzag_positions(2 * shards, shards))  # natural chunk c's zigzag block
  zig = lambda c: jnp.asarray(blocks)[c]
  at = zig if gathered is not None or st.plan.layout == "zigzag" else lambda c: c
  pick = lambda a, b: jnp.where(_per_block(early, a.ndim + 1), a[:, None], b[:, None])
  pairs = ([_fold(pick(a, b)) for a, b in halves],
           [_fold(jnp.take(x, at(index), axis=1)) for x in chunks])
  # The diagonal's rows are each device's two chunks, as are its keys on zigzag shards: no copy.
  diagonal = ([_fold(_blocks(x, 2)) for x in zigzag],
              [_fold(_blocks(x, 2)) for x in kv] if st.plan.layout == "zigzag" else
              [_fold(jnp.take(x, at(own), axis=1)) for x in chunks])
  return pairs, diagonal, early


def _by_key_chunk(g, plan: _Plan, axis_name, d=None):
  """dk or dv of `_zigzag_calls`' pairs call, `[B, 2P - 1, n', ...]`, added up by key chunk
  into `[B, 2P, n', ...]` in the order of the shards' keys (natural, or zigzag: `plan.layout`),
  with the diagonal call's `d` (`[B, 2, n', ...]`, this device's chunks `j` and `2P - 1 - j`)
  where given. Natural chunk `c` is the key chunk of pair `c` if `c < j` (early queries) and
  of pair `c + j` if `c + j <= 2P - 2` (late queries): each block gathers its at most two
  pairs, one elementwise pass rather than a scatter-add into zeros."""
  shards = plan.shards
  j = jax.lax.axis_index(axis_name)
  chunk = (zigzag_positions(2 * shards, shards) if plan.layout == "zigzag" else
           np.arange(2 * shards))  # each block's natural chunk, static
  last = 2 * shards - 2
  pick = lambda x, t, keep: jnp.where(_per_block(keep, g.ndim),
                                      jnp.take(x, jnp.minimum(t, last), axis=1), 0.0)
  total = pick(g, chunk, chunk < j) + pick(g, chunk + j, chunk + j <= last)
  if d is None:
    return total
  mine = (chunk == j) | (chunk == 2 * shards - 1 - j)
  return total + pick(d, jnp.where(chunk == j, 0, 1), mine)


def _folded_call(fn, rows_keys, causal, batch, has_ids):
  """`fn` (a branch's `forward` or `backward`) on one of `_zigzag_calls`' calls, its pairs
  folded into the batch; each result as `[batch, pairs, ...]`."""
  rows, keys = rows_keys
  rows, ids = (rows[:-1], rows[-1]) if has_ids else (rows, None)
  return [x.reshape(batch, -1, *x.shape[1:])
          for x in fn(rows[0], *keys[:2], *rows[1:], causal, _pair(ids, keys))]


def _gathered_zigzag_forward(st, qs, qi, kv, axis_name):
  """`_zigzag_forward` of a branch that `_gathers` (`_zigzag_calls`); each query chunk
  merges its pairs' partials (the other chunk's masked out) with its diagonal one."""
  plan, shards = st.plan, st.plan.shards
  pairs, diagonal, early = _zigzag_calls(st, (qs,), qi, kv, axis_name)
  (o, lse), (do, dlse) = (_folded_call(st.forward, x, causal, qs.shape[0], qi is not None)
                          for x, causal in ((pairs, False), (diagonal, True)))
  merged = lambda keep, i: merge(
      [o[:, t] for t in range(2 * shards - 1)] + [do[:, i]],
      [jnp.where(keep[t], lse[:, t], -jnp.inf) for t in range(2 * shards - 1)] + [dlse[:, i]])
  o, lse = (jnp.concatenate(x, axis=1) for x in zip(merged(early, 0), merged(~early, 1)))
  return (_to_zigzag(o, plan, axis_name, inverse=True),
          _to_zigzag(lse, plan, axis_name, inverse=True))


def _gathered_zigzag_backward(st, rows, qi, kv, axis_name, gathered=None):
  """The backward of `_gathered_zigzag_forward` (or of a causal `_kernel_gathered_forward`,
  whose `gathered` keys it reads): the same two calls; each query chunk sums its pairs' dq,
  and dk, dv (added up by key chunk) go home by reduce-scatter. On shards in zigzag order
  (`plan.layout`) the diagonal's keys are the device's own: its dk, dv join after the
  reduce-scatter, which then waits only for the pairs' call."""
  plan, b = st.plan, rows[0].shape[0]
  pairs, diagonal, early = _zigzag_calls(st, rows, qi, kv, axis_name, gathered)
  call = lambda x, causal: _folded_call(st.backward, x, causal, b, qi is not None)
  dq, dk, dv = call(pairs, False)
  sums = lambda ddk=None, ddv=None: (_by_key_chunk(dk, plan, axis_name, ddk),
                                      _by_key_chunk(dv, plan, axis_name, ddv))
  if plan.layout == "zigzag":
    dk, dv = _home(sums(), plan, axis_name, join=True)
    ddq, ddk, ddv = call(diagonal, True)
    dk, dv = (g + d.reshape(g.shape) for g, d in ((dk, ddk), (dv, ddv)))
  else:
    ddq, ddk, ddv = call(diagonal, True)
    dk, dv = _home(sums(ddk, ddv), plan, axis_name, join=True)
  mine = lambda keep: jnp.sum(jnp.where(_per_block(keep, dq.ndim), dq, 0.0), axis=1)
  dq = jnp.concatenate([mine(early) + ddq[:, 0], mine(~early) + ddq[:, 1]], axis=1)
  return _to_zigzag(dq, plan, axis_name, inverse=True), dk, dv


def _zigzag_forward(st, qs, qi, kv, axis_name):
  """Causal ring in zigzag order: every step is two half-by-half blocks on every device.
  `qi`: the queries' ids or None; `kv`: `(k, v)`, or `(k, v, kv_ids)`."""
  plan = st.plan
  zig = lambda x: None if x is None else _to_zigzag(x, plan, axis_name)
  qs, qi, kv = zig(qs), zig(qi), _together(zig, kv, plan)
  halves = lambda x: (None, None) if x is None else _halves(x)[0]
  split = lambda kv: tuple(zip(*_halves(*kv)))  # ((k0, v0, ...), (k1, v1, ...))
  (q0, q1), (i0, i1), (kv0, kv1) = halves(qs), halves(qi), split(kv)  # 0: early, 1: late
  fwd = lambda q, i, kv, causal: st.forward(q, *kv[:2], causal, _pair(i, kv))
  lo = fwd(q0, i0, kv0, True)
  hi = _merge2(fwd(q1, i1, kv0, False), fwd(q1, i1, kv1, True))
  place, size = _step_position(plan, axis_name)
  for step in range(1, plan.span):
    kv = _send(kv, _rotation(plan, step), plan, axis_name)
    kv0, kv1 = split(kv)
    # Keys from an earlier device: both query chunks see its early chunk. From a later one
    # (wrapped): the late query chunk sees both of its chunks. Either way two blocks.
    earlier, valid = step <= place, step < size
    common = fwd(q1, i1, kv0, False)
    pick = lambda a, b: None if a is None else jnp.where(earlier, a, b)
    other = fwd(pick(q0, q1), pick(i0, i1), tuple(map(pick, kv0, kv1)), False)
    lo = _merge2(lo, _masked(other, earlier & valid))
    hi = _merge2(_merge2(hi, _masked(common, valid)), _masked(other, ~earlier & valid))
  o, lse = (jnp.concatenate(x, axis=1) for x in zip(lo, hi))
  return (_to_zigzag(o, plan, axis_name, inverse=True),
          _to_zigzag(lse, plan, axis_name, inverse=True))


def _returns(plan, hop, shift):
  """`ppermute` pairs sending what each device computed against the keys it holds after
  `hop` hops (`_rotation`; `shift`: its causal forward's shifts) to the keys' own device."""
  pairs = []
  for base, size in _sub_rings(plan):
    for j in range(size):
      if shift and j >= hop:
        pairs.append((base + j, base + j - hop))
      elif not shift and hop < size:
        pairs.append((base + j, base + (j - hop) % size))
  return pairs


def _backward_steps(plan, kv, grads, step_grads, axis_name, shift=False):
  """Steps 1..g-1 of a ring backward.

  Keys and values travel as in the forward (`shift`: a causal forward's shifts, which
  deliver keys only where they are visible); each step's dk, dv go straight back to the keys'
  own device, while the next step runs; dq stays. `step_grads(kv, step)` gives a step's
  `(dq, dk, dv)` contributions."""
  dq, dk, dv = grads
  for step in range(1, plan.span):
    kv = _send(kv, _rotation(plan, step, shift), plan, axis_name)
    part = step_grads(kv, step)
    back = _send(part[1:], _returns(plan, step, shift), plan, axis_name)
    dq, dk, dv = dq + part[0], dk + back[0], dv + back[1]
  return dq, dk, dv


def _ring_backward(st, q, k, v, dout, lse, delta, axis_name, ids=None, gathered=None):
  """`(dq, dk, dv)` of a ring branch, in the step layout. `gathered`: the keys and values
  the forward's kernel gathered (`_kernel_gathered_forward`), or None."""
  plan = st.plan
  qs, dos, lses, deltas = (st.query(x) for x in (q, dout, lse[..., None], delta[..., None]))
  rows = (qs, dos, lses[..., 0], deltas[..., 0])
  qi, kv = _with_ids(st, ids, q, k, (st.key(k), st.key(v)))
  if st.gathers:
    if plan.zigzag:
      return _gathered_zigzag_backward(st, rows, qi, kv, axis_name, gathered)
    return _gathered_backward(st, rows, qi, kv, axis_name, gathered)
  if plan.zigzag:
    return _zigzag_backward(st, rows + (() if qi is None else (qi,)), kv, axis_name)
  grads = st.backward(rows[0], *kv[:2], *rows[1:], st.causal, _pair(qi, kv))
  zeros = lambda: backends.vary_like(tuple(jnp.zeros(x.shape, x.dtype) for x in grads),
                                     rows[0])

  def step_grads(kv, step):
    return _if_visible(plan, _visible(plan, st.causal, step, axis_name),
                       lambda kv: st.backward(rows[0], *kv[:2], *rows[1:], False,
                                              _pair(qi, kv)), zeros, kv)

  return _backward_steps(plan, kv, grads, step_grads, axis_name, shift=st.causal)


def _zigzag_backward(st, rows, kv, axis_name):
  """The backward of `_zigzag_forward`: the same blocks; each step's dk, dv go back to the
  keys' device (`_backward_steps`), then out of zigzag order.
  `rows`: `(q, dout, lse, delta)`, then the queries' ids if any; `kv`: `(k, v[, kv_ids])`."""
  plan = st.plan
  rows = [_to_zigzag(x, plan, axis_name) for x in rows]
  kv = _together(lambda x: _to_zigzag(x, plan, axis_name), kv, plan)
  (r0, r1) = zip(*_halves(*rows))  # (q, dout, lse, delta) of the early and late query chunks
  bwd = lambda r, kv, causal: st.backward(r[0], *kv[:2], *r[1:4], causal,
                                          _pair(r[4] if len(r) > 4 else None, kv))
  cat = lambda a, b: jnp.concatenate([a, b], axis=1)
  split = lambda kv: tuple(zip(*_halves(*kv)))  # ((k0, v0, ...), (k1, v1, ...))
  kv0, kv1 = split(kv)
  a, b, c = bwd(r0, kv0, True), bwd(r1, kv0, False), bwd(r1, kv1, True)
  grads = cat(a[0], b[0] + c[0]), cat(a[1] + b[1], c[1]), cat(a[2] + b[2], c[2])
  place, size = _step_position(plan, axis_name)

  def step_grads(kv, step):
    kv0, kv1 = split(kv)
    earlier, valid = step <= place, step < size  # as in _zigzag_forward
    pick = lambda a, b: jnp.where(earlier, a, b)
    common = bwd(r1, kv0, False)
    other = bwd([pick(x, y) for x, y in zip(r0, r1)], tuple(map(pick, kv0, kv1)), False)
    keep = lambda x, c: jnp.where(c, x, 0.0)
    mine, theirs = earlier & valid, ~earlier & valid
    dq = cat(keep(other[0], mine), keep(common[0], valid) + keep(other[0], theirs))
    dk, dv = (cat(keep(common[i], valid) + keep(other[i], mine), keep(other[i], theirs))
              for i in (1, 2))
    return dq, dk, dv

  dq, dk, dv = _backward_steps(plan, kv, grads, step_grads, axis_name)
  home = lambda x: _to_zigzag(x, plan, axis_name, inverse=True)
  return (home(dq), *_together(home, (dk, dv), plan))


def _zigzag_moves(axis_name, xs, to_natural: bool):
  """The call's arrays `xs` (a pytree of `[B, n, ...]` shards, None leaves kept) moved from
  zigzag order into natural order (`to_natural`), or back: `_to_zigzag` over the whole axis."""
  shards = jax.lax.axis_size(axis_name)
  whole = lambda x: _Plan(None, "ring", x.shape[1], shards, shards)  # a ring over the axis
  return jax.tree.map(lambda x: _to_zigzag(x, whole(x), axis_name, inverse=to_natural), xs)


def _gather(x, axis_name):
  return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)


def _local_rows(x, axis_name, n):
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * n, n, axis=1)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The kernel contract of a ring call (for `backends.attention`): per branch, the plan's
  steps on this device's shard, merged."""

  pattern: DilatedPattern
  scale: float
  axis_name: str
  names: tuple[str, ...]
  config: object = None
  # Shards of the heads that differ (`api.on_head_shards`' `switched`): `(heads_axis,
  # patterns, index)`, shard `s` of `heads_axis` computing `patterns[index[s]]`; `pattern`
  # is `patterns[0]`.
  head_shards: tuple | None = None
  layout: str = "natural"  # the shards' order (`ring_dilated_attention`)
  # The module settings the ring is traced under (`_settings()`): part of its hash, so that a
  # trace cached by the kernel (`backends.attention`'s forward) is one of the same settings.
  settings: tuple = dataclasses.field(default_factory=_settings)
  saves: typing.ClassVar[bool] = True  # a branch's kernel may gather keys (`KERNEL_GATHER`)

  def differentiable(self):
    """This ring with every step on the "xla" backend, whose code JAX differentiates
    (`backends.Kernel`), or None where they run only there already."""
    return None if self.names == ("xla",) else dataclasses.replace(self, names=("xla",))

  def _pairs(self, pattern, q, k, packed, merge_local=True, every=False):
    """`(plan, _RingBranch)` pairs of `pattern`, one per branch; with `merge_local`, the
    local branches as one pair (the first local plan's) where the backend each would get on
    its own runs them all."""
    shards = jax.lax.axis_size(self.axis_name)
    per_kv = heads_per_kv(q.shape[2], k.shape[2])
    plans = list(_plans(pattern, q.shape[1], shards, q.shape[2], per_kv, every, self.layout))
    make = lambda plan, branches=None: _RingBranch(plan, pattern, self.scale, self.names,
                                                   self.config, q, k, branches, packed)
    pairs = [(plan, make(plan)) for plan in plans]
    local = [(plan, st) for plan, st in pairs if plan.kind == "local"]
    if merge_local and len(local) > 1:
      # On shards in zigzag order, one call on them as they are where every branch runs so.
      layout = ("zigzag" if all(plan.layout == "zigzag" for plan, _ in local) else "natural")
      first = dataclasses.replace(local[0][0], layout=layout)
      together = make(first, tuple(plan.branch.index for plan, _ in local))
      chosen = lambda st: st.backend(q, k, st.causal)[0]
      if all(chosen(st) is chosen(together) for _, st in local):
        pairs = [(first, together)] + [(p, st) for p, st in pairs if p.kind != "local"]
    return pairs

  def _branches(self, q, k, packed):
    """`(plan, steps)` pairs, one per branch (`_pairs`); with head shards that differ,
    `steps` is a `_Switched` over each kind's `_RingBranch` (their plans alike)."""
    if self.head_shards is None:
      return self._pairs(self.pattern, q, k, packed)
    heads_axis, kinds, index = self.head_shards
    every = self.pattern.head_groups and self.pattern.num_branches > 1  # (`_plans`)
    per_kind = [self._pairs(p, q, k, packed, merge_local=not every, every=every)
                for p in kinds]
    if len({len(pairs) for pairs in per_kind}) > 1:  # local branches merged in some kinds only
      per_kind = [self._pairs(p, q, k, packed, merge_local=False, every=every) for p in kinds]
    which = head_shard_kind(index, heads_axis)
    return [(pairs[0][0], _Switched([st for _, st in pairs], which))
            for pairs in zip(*per_kind)]

  def forward(self, q, k, v, segment_ids=None, save=False):
    """`(out, lse)`, and with `save` the keys each branch's kernel gathered (None where it
    gathered none) for the backward (`saves`)."""
    n, num_heads, axis_name = q.shape[1], q.shape[2], self.axis_name
    outs, lses, saved = [], [], []
    pairs = self._branches(q, k, segment_ids is not None)
    given = (q, k, v, segment_ids)
    # Plans of natural order on shards in zigzag order: their inputs moved there once, their
    # partials merged, then moved back once.
    natural = functools.cache(lambda: _zigzag_moves(axis_name, given, to_natural=True))
    moved_outs, moved_lses = [], []
    for plan, st in pairs:
      kernel = None
      q, k, v, segment_ids = given if plan.layout == self.layout else natural()
      if plan.kind == "local":  # in q's dtype, merged or not (`_RingBranch.forward`)
        o, lse = st.forward(q, k, v, st.causal, _ids_per_head(segment_ids, q, k),
                            in_dtype=True)
      elif plan.kind == "gather":
        full = [_gather(x, axis_name) for x in (q, k, v)]
        ids = None if segment_ids is None else [_gather(x, axis_name) for x in segment_ids]
        o, lse = st.forward(*full, st.causal, _ids_per_head(ids, full[0], full[1]))
        o, lse = _local_rows(o, axis_name, n), _local_rows(lse, axis_name, n)
      elif len(pairs) == 1 and (kernel := st.gathering_kernel(q, k)):
        o, lse, gathered = _kernel_gathered_forward(st, kernel, q, k, v, axis_name)
      else:
        o, lse = _ring_forward(st, q, k, v, axis_name, segment_ids)
        if plan.compact:  # a compact row sees at least itself, so its lse is finite
          o = st.unquery(o, q)
          lse = jnp.where(st.covered(num_heads),
                          st.unquery(lse[..., None], q[..., :1])[..., 0], -jnp.inf)
      moved = plan.layout != self.layout
      (moved_outs if moved else outs).append(o)
      (moved_lses if moved else lses).append(lse)
      saved.append(gathered if kernel else None)
    if moved_outs:
      partial = merge(moved_outs, moved_lses)
      outs, lses = (x + [y] for x, y in zip(
          (outs, lses), _zigzag_moves(axis_name, partial, to_natural=False)))
    out, lse = merge(outs, lses)
    return (out, lse, tuple(saved)) if save else (out, lse)

  def backward(self, q, k, v, dout, lse, delta, segment_ids=None, saved=None):
    n, axis_name = q.shape[1], self.axis_name
    acc = jnp.promote_types(q.dtype, jnp.float32)
    grads = None
    pairs = self._branches(q, k, segment_ids is not None)
    given = (q, k, v, dout, lse, delta, segment_ids)
    natural = functools.cache(lambda: _zigzag_moves(axis_name, given, to_natural=True))
    add = lambda a, b: b if a is None else tuple(x.astype(acc) + y for x, y in zip(a, b))
    moved = None  # the gradients of the plans run in natural order, summed, then moved once
    for i, (plan, st) in enumerate(pairs):
      q, k, v, dout, lse, delta, segment_ids = (given if plan.layout == self.layout
                                                else natural())
      if plan.kind == "local":  # bf16 where q is, added to or not (`_RingBranch.backward`)
        g = st.backward(q, k, v, dout, lse, delta, st.causal, _ids_per_head(segment_ids, q, k),
                        in_dtype=True)
      elif plan.kind == "gather":
        full = [_gather(x, axis_name) for x in (q, k, v, dout, lse, delta)]
        ids = None if segment_ids is None else [_gather(x, axis_name) for x in segment_ids]
        g = [_local_rows(x, axis_name, n) for x in st.backward(
            *full, st.causal, _ids_per_head(ids, full[0], full[1]))]
      else:
        gq, gk, gv = _ring_backward(st, q, k, v, dout, lse, delta, axis_name, segment_ids,
                                    None if saved is None else saved[i])
        g = (st.unquery(gq, q), st.unkey(gk, k), st.unkey(gv, v))
      if plan.layout != self.layout:
        moved = add(moved, g)
      else:
        grads = add(grads, g)
    if moved is not None:
      grads = add(grads, _zigzag_moves(axis_name, moved, to_natural=False))
    return grads


def zigzag_positions(n: int, shards: int) -> np.ndarray:
  """The positions a sequence of `n` tokens holds row by row in zigzag order over `shards`
  shards (`layout="zigzag"`): cut into `2 * shards` chunks, shard `p` holds chunks `p` and
  `2 * shards - 1 - p`, so that each shard holds an early and a late chunk and causal work is
  the same on every device. An int32 array `[n]`.

  Put a model's inputs in this order once (`x[:, zigzag_positions(n, shards)]`, the token ids
  in the data pipeline, the positions of a rotary embedding alike) and every causal ring of
  the model skips its moves into zigzag order and back; undo it at the end with
  `inverse_permutation` of the positions (a loss over all tokens whose targets come in the
  same order needs not).

  Example:
    >>> zigzag_positions(8, 2)
    array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
  """
  for name, value in (("n", n), ("shards", shards)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
  if n % (2 * shards):
    raise ValueError(f"zigzag order cuts the sequence into 2 * shards = {2 * shards} chunks: "
                     f"n={n} must be divisible by it")
  chunks = np.arange(n, dtype=np.int32).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[p], chunks[2 * shards - 1 - p]])
                         for p in range(shards)])


def _check_layout(layout, n: int) -> str:
  """`layout` ("natural" or "zigzag") checked against the shard length `n`."""
  if check_layout_name(layout) == "zigzag" and n % 2:
    raise ValueError(f'layout="zigzag" holds two half-shards a device: the shard length {n} '
                     f"must be even")
  return layout


def ring_dilated_attention(q, k, v, pattern: DilatedPattern, *, axis_name, segment_ids=None,
                           scale=None, return_lse=False, implementation=None, config=None,
                           heads_axis=None, layout="natural"):
  """`dilated_attention` on sequence shards, called inside `jax.shard_map`.

  Each device passes its shard `[B, N / P, H, D]` of `q` and `[B, N / P, Hkv, D]` of `k`, `v`
  (shard `p` holds positions `[p * N / P, (p + 1) * N / P)` of processing order) and gets its
  shard of the output of `dilated_attention` on the whole sequence, with exact gradients.
  Keys and values travel only for branches whose segments span shards (see the module
  docstring); queries and outputs stay on their device, except that a causal zigzag branch
  trades half-shards once each way, the gather fallback all-gathers its inputs, and on
  shards in zigzag order the branches that need natural order move there and back. Each
  branch's steps use the backend `dilated_attention` would pick for them (`implementation`
  and `config` as there). `segment_ids` (packed sequences, as in `dilated_attention`): this
  shard's `[B, N / P]` document ids; the keys' ids travel with the keys. Where the
  `shard_map` also splits the heads (and `k`, `v`'s alike) over a mesh axis, name it
  `heads_axis`: without it heads are numbered from 0 on each device, and a pattern whose
  branches depend on the head (`offsets="head"`, `head_groups`) computes other attention.

  `layout` is the order of the shards' rows: "natural" as above, or "zigzag", the sequence in
  `zigzag_positions(N, P)` order (shard `p` holds chunks `p` and `2P - 1 - p` of `2P`; the
  output comes in the same order). A causal ring over the whole axis balances its work in
  zigzag order: given it, the ring skips moving the queries, keys and values there and the
  output back, each a wait on the peers (full causal attention on 2 x H200 at 8K tokens a
  GPU: docs/ring.md). Branches that need natural order (local segments longer than half a
  shard, rings over part of the axis, whole rings whose rate does not divide half a shard,
  the gather fallback) move their shards there and back, once for all of them: a pattern
  with such branches may run slower in zigzag order (causal LongNet at 8K tokens a GPU, whose
  local call holds a branch of whole shards).

  Example:
    >>> from hilbert_ring_jax import DilatedPattern, dilated_attention
    >>> pattern = DilatedPattern((16, 64), (1, 4))  # w = 64 spans the 4 shards of 16
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 4, 8))
    >>> # 4 devices (CPUs: jax.config.update("jax_num_cpu_devices", 4) before any JAX work)
    >>> mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.jit(jax.shard_map(lambda q, k, v: ring_dilated_attention(q, k, v, pattern,
    ...             axis_name="seq"), mesh=mesh, in_specs=jax.P(None, "seq"),
    ...             out_specs=jax.P(None, "seq")))
    >>> bool(jnp.allclose(f(q, k, v), dilated_attention(q, k, v, pattern), atol=1e-5))
    True
  """
  check_inputs(q, k, v, pattern, heads_axis)
  scale = check_scale(scale, q.shape[-1])
  check_flag("return_lse", return_lse)
  segment_ids = check_segment_ids(segment_ids, q)
  layout = _check_layout(layout, q.shape[1])
  try:
    jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} is not bound here: call ring_dilated_attention inside "
        f"jax.shard_map over a mesh with that axis, or use sharded_dilated_attention") from e
  for name, x in (("q", q), ("k", k), ("v", v)):  # a whole sequence, not a shard of one
    if same_on_every_device(x, axis_name):
      raise ValueError(f"{name} is the same on every device of axis_name={axis_name!r}: "
                       f"ring_dilated_attention takes each device's shard of the sequence "
                       f"(shard_map's in_specs P(batch, {axis_name!r}, ...))")
  if heads_axis is not None and heads_axis == axis_name:
    raise ValueError(f"heads_axis must be another mesh axis than axis_name, got "
                     f"heads_axis={heads_axis!r}")
  names = backends.candidates(implementation)
  backends.check_config(config)
  def call(pattern, q, k, v, ids, head_shards=None):
    return backends.attention(
        q, k, v, _Ring(pattern, scale, axis_name, names, config, head_shards, layout), ids)

  out, lse = on_head_shards(
      pattern, heads_axis, call, q, k, v,
      None if segment_ids is None else (segment_ids, segment_ids),
      switched=lambda kinds, index: functools.partial(
          call, kinds[0], head_shards=(heads_axis, kinds, index)))
  return (out, lse) if return_lse else out


def sharded_dilated_attention(q, k, v, pattern: DilatedPattern, *, mesh, axis_name,
                              batch_axis=None, heads_axis=None, segment_ids=None, scale=None,
                              return_lse=False, implementation=None, config=None,
                              layout="natural"):
  """`dilated_attention` with the sequence axis sharded over `mesh.shape[axis_name]` devices.

  Does the `jax.shard_map` for the caller: `q`, `k`, `v` are global `[B, N, H(kv), D]` arrays
  (sharded or not; arrays placed on other devices, or on the mesh's in another order, are moved
  onto `mesh`); the result is sharded like `P(batch_axis, axis_name, heads_axis)`: with
  `batch_axis` (a mesh axis, or a tuple of them) the batch is split over it too (data x
  sequence parallelism), and with `heads_axis` (a mesh axis) the heads of `q`, `k` and `v`
  (tensor parallelism: each device computes its heads, as the call on all does); other mesh
  axes of more than one device hold replicas, with a warning that says so. `segment_ids` (packed
  sequences): global `[B, N]` document ids, sharded like `q`. `layout="zigzag"`: `q`, `k`, `v`
  (and `segment_ids`) hold the sequence in `zigzag_positions(N, P)` order, and so does the
  result (`ring_dilated_attention`).
  Compiled as one program, so an eager call is as fast as a jitted one (and inlined under an
  outer `jit`). Works the same in one process or under `jax.distributed.initialize()` with
  one process per GPU.

  Example:
    >>> from hilbert_ring_jax import DilatedPattern, dilated_attention
    >>> pattern = DilatedPattern((16, 64), (1, 4))
    >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 64, 4, 8))
    >>> # 8 devices: the batch over 2, the sequence over 4
    >>> mesh = jax.make_mesh((2, 4), ("data", "seq"),
    ...                      axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    >>> out = sharded_dilated_attention(q, k, v, pattern, mesh=mesh, axis_name="seq",
    ...                                 batch_axis="data")
    >>> tuple(out.sharding.spec[:2])  # the batch and sequence axes
    ('data', 'seq')
    >>> bool(jnp.allclose(out, dilated_attention(q, k, v, pattern), atol=1e-5))
    True
  """
  check_inputs(q, k, v, pattern)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh (e.g. from jax.make_mesh), got "
                     f"mesh={mesh!r}")
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  shards = mesh.shape[axis_name]
  if q.shape[1] % shards:
    raise ValueError(f"the sequence length {q.shape[1]} must be divisible by the size "
                     f"{shards} of mesh axis axis_name={axis_name!r}")
  batch_axes = (batch_axis,) if isinstance(batch_axis, str) else batch_axis or ()
  if not isinstance(batch_axes, (tuple, list)) or not all(
      isinstance(name, str) for name in batch_axes):
    raise ValueError(f"batch_axis must be None, a mesh axis name or a tuple of them, got "
                     f"batch_axis={batch_axis!r} (mesh axes {dict(mesh.shape)})")
  batch_axes = tuple(batch_axes)
  for name in batch_axes:
    if name not in mesh.shape or name == axis_name:
      raise ValueError(f"batch_axis must be None or mesh axes other than axis_name, got "
                       f"batch_axis={batch_axis!r} (mesh axes {dict(mesh.shape)})")
  if heads_axis is not None:
    if heads_axis not in mesh.shape or heads_axis == axis_name or heads_axis in batch_axes:
      raise ValueError(f"heads_axis must be None or a mesh axis other than axis_name and "
                       f"batch_axis, got heads_axis={heads_axis!r} (mesh axes "
                       f"{dict(mesh.shape)})")
    for name, x in (("q", q), ("k", k)):
      if x.shape[2] % mesh.shape[heads_axis]:
        raise ValueError(f"{name}'s {x.shape[2]} heads must be divisible by the size "
                         f"{mesh.shape[heads_axis]} of mesh axis heads_axis={heads_axis!r}")
  unused = [name for name, size in mesh.shape.items()
            if size > 1 and name not in (axis_name, heads_axis) and name not in batch_axes]
  if unused:
    warnings.warn(f"mesh axes {unused} are used by none of axis_name={axis_name!r}, "
                  f"batch_axis={batch_axis!r} and heads_axis={heads_axis!r}: the devices along "
                  f"them all compute the same result (replicas). Pass batch_axis={unused[0]!r} "
                  f"to split the batch over it, heads_axis={unused[0]!r} the heads, or a mesh "
                  f"without it", stacklevel=2)
  replicas = math.prod(mesh.shape[name] for name in batch_axes)
  if q.shape[0] % replicas:
    raise ValueError(f"the batch size {q.shape[0]} must be divisible by the size {replicas} "
                     f"of batch_axis={batch_axis!r}")
  scale = check_scale(scale, q.shape[-1])
  check_flag("return_lse", return_lse)
  segment_ids = check_segment_ids(segment_ids, q)
  layout = _check_layout(layout, q.shape[1] // shards)
  names = backends.candidates(implementation)
  backends.check_config(config)
  fn = _sharded(pattern, mesh, axis_name, batch_axes or None, heads_axis, scale, names, config,
                segment_ids is not None, layout,
                _settings())
  specs = _specs(batch_axes or None, axis_name, heads_axis)
  arrays = (q, k, v) + (() if segment_ids is None else (segment_ids,))
  out, lse = fn(*(_onto(mesh, spec, x) for x, spec in zip(arrays, specs)))
  return (out, lse) if return_lse else out


def _onto(mesh, spec, x):
  """`x` placed as `spec` on `mesh` where it is a concrete array placed otherwise (on other
  devices, or the mesh's in another order, which `jit` refuses); else as it is."""
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return x
  want = jax.NamedSharding(mesh, spec)
  return x if x.sharding.is_equivalent_to(want, x.ndim) else jax.device_put(x, want)


def _specs(batch_axes, axis_name, heads_axis) -> tuple:
  """The `PartitionSpec`s of `(q, k, v, segment_ids)` in `sharded_dilated_attention`."""
  spec = jax.P(batch_axes, axis_name, heads_axis)
  return spec, spec, spec, jax.P(batch_axes, axis_name)


@functools.lru_cache(maxsize=64)
def _sharded(pattern, mesh, axis_name, batch_axes, heads_axis, scale, names, config, packed,
             layout, settings):
  """The jitted shard_map of one configuration (cached: eager calls reuse its compilation);
  `packed`: it takes segment ids, `(q, k, v, segment_ids)`; `settings`: the module settings
  it was traced with (`_settings()`)."""
  del settings  # a key of the cache only
  specs = _specs(batch_axes, axis_name, heads_axis)
  spec = specs[0]
  explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  inner = lambda q, k, v, *ids: ring_dilated_attention(
      q, k, v, pattern, axis_name=axis_name, segment_ids=ids[0] if ids else None, scale=scale,
      return_lse=True, implementation=names, config=config, heads_axis=heads_axis,
      layout=layout)
  in_specs = specs if packed else specs[:3]
  mapped = jax.shard_map(inner, mesh=mesh, in_specs=in_specs, out_specs=(spec, spec),
                         check_vma=True)

  def run(*arrays):
    if explicit:
      arrays = [jax.reshard(x, jax.NamedSharding(mesh, s)) for x, s in zip(arrays, in_specs)]
    return mapped(*arrays)

  return jax.jit(run)
