"""Causal decoding with a compressed per-branch key/value cache.

For a causal pattern, branch `(w, r)` lets query `t` see only keys of its own segment of `w`
tokens, of its residue `(t % w) % r`. So each branch keeps just the current segment, and only
the residue classes that some query head of a kv head reads: the cache size is fixed by the
pattern, not by the sequence length. Branch `b` holds `k[b], v[b]` of shape
`[B, Hkv, R_b, rows_b, D]` (`rows_b = ceil(w_b / r_b)` rounded up to a multiple of 8, the
tiles the token-step kernel reads; `R_b` the most residues one kv head needs); position `p`
lives at row `(p % w) // r` of the slot that `(kv head, (p % w) % r)` maps to. A prefill
starts from zeros (and clears the rows of packed rows' earlier documents); rows left over from
earlier segments are not cleared: each query masks cached rows by position (`< length`, in its
own segment), computed from its own segment start, and the portable step does not read the
values it masks (a NaN there times 0 would be NaN).

A step of `T <= R_b` tokens (decoding: `T = 1`) reads, per branch and kv head, only the slot
of each query's residue: `rows_b` rows, whatever the sequence length. Scores and outputs are
accumulated in float32 from inputs in their own dtype: such a step weighs the values by the
float32 probabilities, longer chunks by probabilities cast to the values' dtype, as the
attention kernels do.

This module owns the cache: its layout (`_tables`), prefill and writes. The reads are a
backend's `step`, resolved like the attention's (`backends.resolve`; backends/base.py has the
contract): the portable one in backends/xla.py, the Hopper token-step kernel in
backends/mosaic_decode.py (the "mosaic" backend's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .api import (check_dtype, check_flag, check_inputs, check_scale, check_segment_ids,
                  dilated_attention, explicit_spec, on_explicit_shards)
from .backends import base
from .pattern import DilatedPattern, heads_per_kv


# The most tokens a cache counts: `length` is int32.
MAX_LENGTH = 2 ** 31 - 1


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("length", "k", "v", "start", "first"),
                   meta_fields=("num_heads", "pattern"))
@dataclasses.dataclass(frozen=True)
class KVCache:
  """The decoding state of `dilated_attention_step`: a pytree of fixed-shape arrays.

  Attributes:
    length: int32 scalar, the number of tokens seen so far (at most `MAX_LENGTH`).
    k, v: one `[B, Hkv, R_b, rows_b, D]` array per branch, in the input dtype.
    num_heads: the number of query heads it was built for (static).
    pattern: the causal `DilatedPattern` whose branches it holds (static): a step under
      another pattern would read rows laid out for this one.
    start: None, or int32 `[B]` for packed rows (a prefill with `segment_ids`): where each
      row's last run of ids starts (the steps continue that document; the layers count
      rotary positions from it).
    first: None, or (packed rows) one int32 `[B, r_b]` array per branch: the first cached
      position the steps read in each residue class of the prompt's last segment (at most
      the next segment's start: later segments read all their rows). The prefill moves the
      rows of the last document's earlier runs in reach (its id seen before `start`) to the
      rows just before its last run, so that a slot's visible rows are those from `first` on.
  """

  length: jnp.ndarray
  k: tuple
  v: tuple
  num_heads: int
  pattern: DilatedPattern
  start: jnp.ndarray | None = None
  first: tuple | None = None


@dataclasses.dataclass(frozen=True)
class _BranchTable:
  w: int
  r: int
  rows: int               # of a slot: ceil(w / r), rounded up to a multiple of 8
  slots: int              # R_b
  slot: np.ndarray        # [Hkv, r]: slot of (kv head, residue), -1 where not needed
  residue: np.ndarray     # [Hkv, R_b]: residue held by each slot, -1 for unused slots
  takes_part: np.ndarray  # [H, r] bool: query head h reads residue c in this branch
  uniform: np.ndarray | None  # [r]: the slot of residue c when all kv heads agree, else None


@functools.lru_cache(maxsize=256)
def _tables(pattern: DilatedPattern, num_heads: int, num_kv_heads: int):
  """Per-branch slot tables of (pattern, H, Hkv), on the host."""
  group = heads_per_kv(num_heads, num_kv_heads)
  # Causal: min(w_b, N) gives the same visibility as w_b at every position < N, so use w_b.
  out = []
  for br in pattern.layout(max(pattern.segment_lengths), num_heads):
    takes_part = np.zeros((num_heads, br.r), bool)
    for h in br.heads:
      takes_part[h, list(br.residues(h))] = True
    needed = takes_part.reshape(num_kv_heads, group, br.r).any(axis=1)  # [Hkv, r]
    slots = max(int(needed.sum(axis=1).max()), 1)
    slot = np.full((num_kv_heads, br.r), -1, np.int32)
    residue = np.full((num_kv_heads, slots), -1, np.int32)
    for g in range(num_kv_heads):
      for s, c in enumerate(np.flatnonzero(needed[g])):
        slot[g, c], residue[g, s] = s, c
    agree = [set(slot[needed[:, c], c]) for c in range(br.r)]
    uniform = (np.array([min(a, default=0) for a in agree], np.int32)
               if all(len(a) <= 1 for a in agree) else None)
    rows = -(-br.rows // 8) * 8  # whole tiles of 8 rows (TMA reads tiles): rows j r + c >= w
    out.append(_BranchTable(br.w, br.r, rows, slots, slot, residue, takes_part, uniform))
  return tuple(out)


def document_starts(segment_ids):
  """`[B, N]` int32: where the document of each token of `segment_ids [B, N]` starts (the
  last position at or before it where the id changes)."""
  n = segment_ids.shape[1]
  first = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                           segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return jax.lax.cummax(jnp.where(first, jnp.arange(n), 0), axis=1).astype(jnp.int32)


def _check_pattern(pattern) -> None:
  if not isinstance(pattern, DilatedPattern):
    raise ValueError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
  if not pattern.causal:
    raise ValueError(f"pattern must be causal for decoding, got {pattern=}")


def init_kv_cache(pattern: DilatedPattern, *, batch: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, dtype=jnp.float32, packed: bool = False) -> KVCache:
  """An empty decoding cache (length 0) for a causal `pattern`.

  Its size depends only on the pattern and the head layout, never on a maximum length.
  `packed=True`: a cache for packed rows (`start` and `first` set, one document a row until
  a prefill with `segment_ids` fills it).

  Example:
    >>> p = DilatedPattern((8, 16), (1, 4), causal=True)
    >>> cache = init_kv_cache(p, batch=1, num_heads=4, num_kv_heads=2, head_dim=16,
    ...                       dtype=jnp.float32)
    >>> [x.shape for x in cache.k]  # [B, Hkv, R_b, ceil(w_b / r_b) in whole 8s, D]
    [(1, 2, 1, 8, 16), (1, 2, 2, 8, 16)]
  """
  _check_pattern(pattern)
  for name, x in (("batch", batch), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                  ("head_dim", head_dim)):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
      raise ValueError(f"{name} must be an int >= 1, got {name}={x!r}")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads must divide num_heads, got {num_kv_heads=}, {num_heads=}")
  dtype = check_dtype("dtype", dtype)
  pattern.head_ranges(num_heads)  # head_groups needs H >= number of branches
  check_flag("packed", packed)
  tables = _tables(pattern, int(num_heads), int(num_kv_heads))
  shapes = [(batch, num_kv_heads, t.slots, t.rows, head_dim) for t in tables]
  zeros = tuple(jnp.zeros(s, dtype) for s in shapes)
  start, first = (None, None) if not packed else (
      jnp.zeros((batch,), jnp.int32),
      tuple(jnp.zeros((batch, t.r), jnp.int32) for t in tables))
  return KVCache(jnp.zeros((), jnp.int32), zeros, tuple(jnp.zeros(s, dtype) for s in shapes),
                 int(num_heads), pattern, start, first)


def _check_cache(cache, q, k, pattern) -> tuple:
  """`ValueError` naming `cache` unless it was built for these inputs; returns the tables."""
  if not isinstance(cache, KVCache):
    raise ValueError(f"cache must be a KVCache (from init_kv_cache), got "
                     f"{type(cache).__name__}")
  batch, steps, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  if cache.pattern != pattern:
    raise ValueError(f"cache was built for pattern={cache.pattern}, this step has "
                     f"pattern={pattern}: its rows are laid out for the other pattern's "
                     f"branches (start a new cache with init_kv_cache or a prefill)")
  if cache.num_heads != num_heads:
    raise ValueError(f"cache was built for {cache.num_heads} query heads, q has {num_heads} "
                     f"({q.shape=})")
  if len(cache.k) != pattern.num_branches or len(cache.v) != pattern.num_branches:
    raise ValueError(f"cache holds {len(cache.k)} branches, pattern has "
                     f"{pattern.num_branches}")
  tables = _tables(pattern, num_heads, num_kv_heads)
  for b, (t, kb, vb) in enumerate(zip(tables, cache.k, cache.v)):
    want = (batch, num_kv_heads, t.slots, t.rows, head_dim)
    for name, x in (("k", kb), ("v", vb)):
      if tuple(x.shape) != want:
        raise ValueError(
            f"cache.{name}[{b}] has shape {tuple(x.shape)}, but q {q.shape} and k {k.shape} "
            f"with this pattern need [B, Hkv, R, rows, D] = {want} (batch, heads or head_dim "
            f"differ from the cache's)")
      if x.dtype != q.dtype:
        raise ValueError(f"cache.{name}[{b}] has dtype {x.dtype}, inputs are {q.dtype}")
  if jnp.shape(cache.length) != () or not jnp.issubdtype(
      getattr(cache.length, "dtype", np.float32), jnp.integer):
    raise ValueError(f"cache.length must be an integer scalar array (e.g. jnp.int32(n)), got "
                     f"{cache.length!r}")
  int_array = lambda x, shape: (jnp.issubdtype(getattr(x, "dtype", np.float32), jnp.integer)
                                and tuple(x.shape) == shape)
  if cache.start is not None and not int_array(cache.start, (batch,)):
    raise ValueError(f"cache.start must be None or an integer [B] = ({batch},) array, got "
                     f"{cache.start!r}")
  if (cache.first is None) != (cache.start is None):
    raise ValueError(f"cache.first and cache.start must both be None (rows of one document) "
                     f"or both be set (packed rows), got start={cache.start!r}, "
                     f"first={cache.first!r}")
  if cache.first is not None:
    want = [(batch, t.r) for t in tables]
    if (not isinstance(cache.first, tuple) or len(cache.first) != len(want)
        or not all(int_array(x, shape) for x, shape in zip(cache.first, want))):
      raise ValueError(f"cache.first must be a tuple of integer [B, r] arrays, one a branch "
                       f"(r its dilation rate): shapes {want}, got {cache.first!r}")
  try:  # checked where it is known (outside jit); traced, it is the caller's to keep
    length = int(cache.length)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return tables
  if not 0 <= length <= MAX_LENGTH - steps:
    raise ValueError(f"cache.length must be in [0, {MAX_LENGTH} - T] (int32 positions; T = "
                     f"{steps} new tokens), got cache.length={length}")
  return tables


def _write(kb, vb, k_new, v_new, pos, keep, table: _BranchTable):
  """Stores the tokens of `k_new, v_new [B, T, Hkv, D]` at positions `pos [T]` where `keep`.

  Skipped tokens get slot `R` (out of range) and are dropped by the scatter, so the kept
  tokens, all of one segment, never share an index.
  """
  c = (pos % table.w) % table.r
  row = (pos % table.w) // table.r
  num_kv_heads = kb.shape[1]
  slot = jnp.asarray(table.slot)[:, c].T  # [T, Hkv]
  slot = jnp.where(keep[:, None] & (slot >= 0), slot, table.slots)
  g = jnp.broadcast_to(jnp.arange(num_kv_heads)[None, :], slot.shape)
  row = jnp.broadcast_to(row[:, None], slot.shape)
  kb = kb.at[:, g, slot, row].set(k_new.astype(kb.dtype), mode="drop")
  vb = vb.at[:, g, slot, row].set(v_new.astype(vb.dtype), mode="drop")
  return kb, vb


def dilated_attention_step(q, k, v, cache: KVCache, pattern: DilatedPattern, *,
                           scale: float | None = None, return_lse: bool = False,
                           implementation=None, config=None):
  """Attention of `T` new tokens to everything seen so far, and the updated cache.

  The new tokens sit at positions `cache.length .. cache.length + T - 1`; `out` equals those
  rows of `dilated_attention` over the whole sequence so far (float32 rounding). `T = 1` is
  token-by-token decoding; larger chunks may cross segment boundaries (a chunk costs
  `O(T^2)` memory per branch: for long prompts use `dilated_attention_prefill`). A token step
  reads `rows_b = ceil(w_b / r_b)` cached rows per branch and kv head. After a prefill of
  packed rows (`segment_ids`) the new tokens continue each row's last document: they see
  only its tokens (`cache.first`). Works under `jax.jit`
  with `pattern` static; the cache can be donated. Inputs whose batch is split over explicit
  mesh axes step a shard at a time, the cache split alike (docs/SPEC.md, section 8).

  The step's backend is resolved like `dilated_attention`'s (`backends.resolve`, from a
  `Problem` with `step` set): a token step (`T = 1`) on a Hopper GPU runs as one Pallas
  Mosaic GPU launch ("mosaic": all branches and query heads of a kv head together, the cached
  rows split over the GPU); chunks, and every other platform, run the portable jnp step
  ("xla").

  Args:
    q: `[B, T, H, D]` new queries.
    k, v: `[B, T, Hkv, D]` new keys and values.
    cache: a `KVCache` from `init_kv_cache` or a previous step, for the same head layout,
      head dim and dtype.
    pattern: a causal `DilatedPattern`.
    scale: score scale, default `D ** -0.5`.
    return_lse: also return the float32 `[B, T, H]` log-denominators.
    implementation: None (the platform's defaults), a backend name or a sequence of them, as
      for `dilated_attention`: "mosaic" has a token-step kernel; every other name decodes
      with the portable step ("xla"'s), which is also what chunks (`T > 1`) always run.
      `NoBackendError` if only "mosaic" is named and it cannot run this step.
    config: None, or a `hilbert_ring_jax.backends.mosaic_decode.Config` for the kernel.

  Returns:
    `(out, cache)` (or `(out, lse, cache)`), `out` in q's dtype, `cache.length` grown by T.

  Example:
    >>> p = DilatedPattern((4, 8), (1, 2), causal=True)
    >>> cache = init_kv_cache(p, batch=1, num_heads=2, num_kv_heads=1, head_dim=8,
    ...                       dtype=jnp.float32)
    >>> step = jax.jit(dilated_attention_step, static_argnums=4, donate_argnums=3)
    >>> q, kv = jnp.ones((1, 1, 2, 8)), jnp.ones((1, 1, 1, 8))
    >>> out, cache = step(q, kv, kv, cache, p)
    >>> out.shape, int(cache.length)
    ((1, 1, 2, 8), 1)
  """
  _check_pattern(pattern)
  check_inputs(q, k, v, pattern)
  scale = check_scale(scale, q.shape[-1])
  check_flag("return_lse", return_lse)
  _check_cache(cache, q, k, pattern)

  def run(q, k, v, cache):
    backend = step_backend(q, k, pattern, implementation, config,
                           packed=cache.start is not None)
    return _step(q, k, v, cache, pattern, scale, bool(return_lse), backend, config)

  return _on_batch_shards(run, q, k, v, None, cache)


def _on_batch_shards(fn, q, k, v, segment_ids, cache):
  """`fn(q, k, v, cache[, segment_ids])`, a shard of the batch at a time where the inputs are
  split over explicit mesh axes (`api.on_explicit_shards`): every array split along its
  leading (batch) axis, the cache's included (its length whole); as it is where none is. A
  cache of None (a prefill's own) is made inside, a shard's."""
  args = (q, k, v, cache) + (() if segment_ids is None else (segment_ids,))
  explicit = on_explicit_shards(q, k, v, segment_ids)
  if explicit is None:
    split = cache is not None and explicit_spec(cache.k[0])
    if split:
      raise ValueError(f"cache is split over explicit mesh axes ({jax.P(*split[1])}): split q, "
                       f"k and v's batch alike")
    return fn(*args)
  if explicit.heads is not None:
    raise ValueError(f"decoding splits only the batch over explicit mesh axes, got q's heads "
                     f"split over {explicit.heads!r} ({explicit.specs[0]})")
  spec = lambda x: jax.P() if jnp.ndim(x) == 0 else jax.P(explicit.specs[0][0])
  shapes = jax.eval_shape(fn, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                            args))
  return explicit.run(fn, args, jax.tree.map(spec, args), jax.tree.map(spec, shapes))


def step_backend(q, k, pattern: DilatedPattern, implementation=None, config=None, *,
                 packed: bool = False) -> base.Name:
  """The backend whose `step` runs `dilated_attention_step(q, k, ...)` with these arguments:
  `backends.resolve` over the `implementation` candidates for the step's `Problem` ("mosaic"
  for a token on Hopper, or in interpret mode when `config` asks; "xla" for chunks and for
  every backend without a token-step kernel; `packed`: a cache of packed rows, whose steps
  take `first`). `ValueError` for a bad `implementation` or `config`, `NoBackendError` if no
  candidate runs the step."""
  names = base.candidates(implementation)
  if config is not None:
    from .backends import mosaic_decode  # pylint: disable=g-import-not-at-top
    if not isinstance(config, mosaic_decode.Config):
      raise ValueError(f"config must be None or a mosaic_decode.Config, got {config=!r}")
  problem = dataclasses.replace(base.Problem.of(q, k, pattern), step=True,
                                interpret=config is not None and config.interpret,
                                segment_ids=packed)
  return base.resolve(names, problem)


# Jitted inside, so that calls outside jit compile once rather than op by op; under an outer
# jit (with the cache donated there) this one is inlined.
@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8))
def _step(q, k, v, cache: KVCache, pattern: DilatedPattern, scale: float, return_lse: bool,
          backend: base.Name, config):
  steps, num_heads = q.shape[1], q.shape[2]
  tables = _tables(pattern, num_heads, k.shape[2])
  length = cache.length.astype(jnp.int32)
  pos = length + jnp.arange(steps)
  step = base.load(backend).step
  if cache.first is not None:
    step = functools.partial(step, first=cache.first)
  if steps == 1:
    # Write, then read: the cache is updated in place (reading the old buffer after an
    # in-place write would make XLA copy it). The token's row sits at position `length`.
    new = [_write(kb, vb, k, v, pos, jnp.ones((1,), bool), table)
           for table, kb, vb in zip(tables, cache.k, cache.v)]
    new_k, new_v = (tuple(x) for x in zip(*new))
    out, lse = step(q, k, v, new_k, new_v, length, tables, scale, config=config)
  else:
    # A chunk's tokens of a later segment overwrite rows its earlier tokens still read; only
    # the last new token's segment stays readable (earlier segments are over).
    out, lse = step(q, k, v, cache.k, cache.v, length, tables, scale, config=config)
    new = [_write(kb, vb, k, v, pos, pos // table.w == (length + steps - 1) // table.w, table)
           for table, kb, vb in zip(tables, cache.k, cache.v)]
    new_k, new_v = (tuple(x) for x in zip(*new))
  cache = KVCache(length + steps, new_k, new_v, num_heads, pattern, cache.start, cache.first)
  out = out.astype(q.dtype)
  return (out, lse, cache) if return_lse else (out, cache)


def dilated_attention_prefill(q, k, v, pattern: DilatedPattern, *, segment_ids=None,
                              scale: float | None = None, cache: KVCache | None = None,
                              return_lse: bool = False, implementation=None):
  """Attention over a prompt at positions `0 .. T-1`, and the cache that continues from it.

  `out` comes from `dilated_attention` (the regular kernels); the cache then holds the last
  segment of each branch, with length `T`. A given `cache` (of the right layout) only lends
  its buffers: whatever it held is cleared, as if it were empty (a packed one stays packed:
  without `segment_ids`, one document a row).

  A batch split over explicit mesh axes is prefilled a shard at a time, and so is the cache
  (docs/SPEC.md, section 8).

  Args:
    q: `[B, T, H, D]` prompt queries; k, v: `[B, T, Hkv, D]`.
    pattern: a causal `DilatedPattern`.
    segment_ids: None, or an integer `[B, T]` array: the prompt's rows pack several
      documents (as in `dilated_attention`); the steps that follow continue each row's last
      document, seeing all its tokens in their segments, those of earlier runs of its id
      too (`cache.start`, `cache.first`).
    scale: score scale, default `D ** -0.5`.
    cache: None (allocate one) or a `KVCache` to reuse (e.g. donated under jit).
    return_lse: also return the float32 `[B, T, H]` log-denominators.
    implementation: the backend choice passed to `dilated_attention`.

  Returns:
    `(out, cache)` (or `(out, lse, cache)`).

  Example:
    >>> p = DilatedPattern((4, 8), (1, 2), causal=True)
    >>> q, kv = jnp.ones((1, 6, 2, 8)), jnp.ones((1, 6, 1, 8))
    >>> out, cache = dilated_attention_prefill(q, kv, kv, p)
    >>> out.shape, int(cache.length)
    ((1, 6, 2, 8), 6)
  """
  _check_pattern(pattern)
  check_inputs(q, k, v, pattern)
  scale = check_scale(scale, q.shape[-1])
  check_flag("return_lse", return_lse)
  num_heads, head_dim = q.shape[2:]
  if cache is not None:
    _check_cache(cache, q, k, pattern)
  segment_ids = check_segment_ids(segment_ids, q)

  def run(q, k, v, cache, *ids):
    ids = ids[0] if ids else None
    if cache is None:  # (a shard's, where the batch is split)
      cache = init_kv_cache(pattern, batch=q.shape[0], num_heads=num_heads,
                            num_kv_heads=k.shape[2], head_dim=head_dim, dtype=q.dtype)
    out, lse = dilated_attention(q, k, v, pattern, segment_ids=ids, scale=scale,
                                 return_lse=True, implementation=implementation)
    cache = _fill(k, v, cache, pattern, num_heads, ids)
    return (out, lse, cache) if return_lse else (out, cache)

  return _on_batch_shards(run, q, k, v, segment_ids, cache)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _fill(k, v, cache: KVCache, pattern: DilatedPattern, num_heads: int,
          segment_ids=None) -> KVCache:
  """The cache after a prompt `k, v [B, T, Hkv, D]`: each branch's last segment written in;
  packed rows (`segment_ids`) also get `start` and `first`, their last document's earlier
  rows in each slot moved next to its last run (`_gather_last_document`); a packed `cache`
  without them stays packed, one document a row."""
  steps = k.shape[1]
  new_k, new_v, firsts = [], [], []
  start = None if segment_ids is None else document_starts(segment_ids)[:, -1]
  for table, kb, vb in zip(_tables(pattern, num_heads, k.shape[2]), cache.k, cache.v):
    seg = (steps - 1) // table.w * table.w  # the last segment, static
    pos = jnp.arange(seg, steps)
    kb, vb = jnp.zeros_like(kb), jnp.zeros_like(vb)  # nothing of what the cache held
    kb, vb = _write(kb, vb, k[:, seg:], v[:, seg:], pos, jnp.ones(pos.shape, bool), table)
    if segment_ids is not None:
      kb, vb, first = _gather_last_document(kb, vb, segment_ids, start, seg, table)
      firsts.append(first)
    new_k.append(kb)
    new_v.append(vb)
  firsts = None if segment_ids is None else tuple(firsts)
  if segment_ids is None and cache.start is not None:  # every cached row read
    start = jnp.zeros(cache.start.shape, jnp.int32)
    firsts = tuple(jnp.zeros(x.shape, jnp.int32) for x in cache.first)
  return KVCache(jnp.asarray(steps, jnp.int32), tuple(new_k), tuple(new_v), num_heads,
                 pattern, start, firsts)


def _gather_last_document(kb, vb, segment_ids, start, seg: int, table: _BranchTable):
  """A branch's cache rows of the segment at `seg` (static), with each residue's rows of the
  last document before its last run (`start [B]`; the id of the row's last token seen
  earlier) moved, in order, to the rows just before that run; and `first [B, r]`, the
  position of the first of them (of the run where none; the next segment's start where the
  residue has no row left in this one). A step's keys are a set (their
  positions only decide which are visible), so from `first` on a residue's slot then holds
  exactly the rows of the last document in the segment: what `dilated_attention` lets the
  next tokens of that document see."""
  steps, r = segment_ids.shape[1], table.r
  j = np.arange(table.rows)
  c = np.arange(r)[:, None]
  pos = seg + j * r + c                                               # [r, rows], static
  real = (j * r + c < table.w) & (pos < steps)
  ids = jnp.take(segment_ids, np.minimum(pos, steps - 1).reshape(-1), axis=1)
  ids = ids.reshape(-1, *pos.shape)                                   # [B, r, rows]
  before = real & (jnp.asarray(pos)[None] < start[:, None, None])
  earlier = before & (ids == segment_ids[:, -1, None, None])
  run = jnp.sum(before, axis=-1)     # the last run starts at row `run`; the `count` earlier
  count = jnp.sum(earlier, axis=-1)  # rows of its document move to rows [run - count, run)
  order = jnp.argsort(~earlier, axis=-1, stable=True)  # the earlier rows' indices first
  into = j - (run - count)[..., None]                                 # [B, r, rows]
  moved = (into >= 0) & (into < count[..., None])
  source = jnp.where(moved, jnp.take_along_axis(order, jnp.clip(into, 0, table.rows - 1),
                                                axis=-1), j)
  source = jnp.take(source, np.maximum(table.residue, 0), axis=1)      # [B, Hkv, R_b, rows]
  kb, vb = (jnp.take_along_axis(x, source[..., None], axis=3) for x in (kb, vb))
  # At most the next segment's start (a residue with no row left in this one would point
  # into the next, hiding rows there that are all visible).
  first = jnp.minimum(seg + (run - count) * r + c[:, 0], seg + table.w)
  # Rows before `first` (earlier documents) cleared: the steps do not read them.
  keep = jnp.take(jnp.asarray(pos)[None] >= first[..., None], np.maximum(table.residue, 0),
                  axis=1)                                              # [B, Hkv, R_b, rows]
  kb, vb = (jnp.where(keep[..., None], x, 0) for x in (kb, vb))
  return kb, vb, first.astype(jnp.int32)
