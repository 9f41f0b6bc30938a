"""The plan of the "mosaic" kernels: launch choices, launches, work items and their blocks.

Host-side where it is static per shape, traced where it is per work item:
- `Config` (the launch choices) and the shared-memory budgets they are checked against
  (`smem_bytes`; the backward's in `Config.backward_for`);
- `launches`: the branches of each launch (`schedule.launches` in rows of at least
  `ROW_BLOCK`), and `geometry_problem`, whether their rows fit the kernels' blocks and grid;
- `Work`: a launch's work items and which program walks which (persistent programs, the
  host's list scheduling under a causal mask); `Program`: one item, decoded in the kernel
  from the schedule's row table;
- `Ranges`: the blocks of an item's pieces that a kernel walks (the producer's, the
  consumers', the host's cost estimate), and the per-row masks of the blocks at a piece's
  edges (`key_limit`, `query_bounds`);
- `strided_view` and `out_length`: the views the kernels address and the outputs' extent.

Work items are program blocks of rows (`2 * block_q` positions of one row, period and batch
element). The kernels run persistent (`Config.persistent`): one program per SM walks a run of
the items, the producer streaming the next item's blocks while the consumers finish the last
one, and the forward loading the next item's queries into a second tile (measured faster on
LongNet than a program per item, the same on full attention). Without a causal mask every
item costs the same and program `p` takes items `p, p + #SMs, ...`. Under one, items differ
in cost, and that static split left the SMs idle for part of the launch (ncu, LongNet causal
D = 64); so the host estimates each item's cost (the blocks it walks, by the producer's own
ranges) and list-schedules the items in launch order (each to the program that frees first:
what the GPU's own block scheduler does, decided ahead, which keeps the programs in flight
on neighbouring keys, in L2; packed rows' causal launches number their items block-major,
the heads' rows side by side: `Work.of`). The default does so where items walk at most
`_SHORT_ITEMS` blocks on average (against a program per item: causal LongNet's forward
measured faster and its forward+backward the same, that 8K LongNet's forward+backward
faster); longer items (full causal attention) have little fixed cost to hide, and an A/B
measured its list-scheduled backward slower, so each item is a program there. In packed rows
the ids, on the device, decide those long items' costs: there the persistent programs of the
forward and the dk/dv kernel take the next item from a counter in global memory each time
they free up (dynamic work: the GPU scheduler's order, with the next item's queries, or keys
and values, loaded early), measured faster than a program per item; the dq kernel's keep a
program per item, and so do dense rows' long causal items, where dynamic work measured slower.
(The figures behind these choices: docs/performance.md.)
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..pattern import DilatedPattern
from . import schedule
from .hopper import REGISTERS_MOVE, SMEM_BYTES, Zeroed, aligned, ceil_div, fetch_add, sm_count

# Barriers beside the tiles (no reduction scratch: `hopper.run`'s kernels reduce within warps
# only), and the alignment of every buffer.
_SMEM_SLACK = 1024
_SMEM_ALIGNMENT = 1024
_LONG_BLOCK_K = 192  # the forward's key block in long unmasked rows (`long_key_rows`)
_MAX_ITEMS = 2 ** 31 - 1  # work items of a launch, numbered in int32 (and CUDA's grid x)
# Causal work items are walked by persistent programs (`Config.persistent=None`) where they
# walk at most this many blocks on average (estimated): there an item's fixed cost (its
# queries' load, the ring's refill, the output's store) matters and persistence hides it.
# Longer items hide it anyway, and the GPU's own scheduler balances their real costs, not our
# estimate (full causal attention: the list-scheduled backward measured slower in one A/B;
# docs/performance.md).
_SHORT_ITEMS = 64
# A strided launch's backward adds dq inside its dk/dv kernel (`Config.backward_for`) where its
# queries read at least this many keys a head on average (`keys_per_query`), and its two
# float32 dq accumulators take at most `_FUSED_STRIDED_BYTES`. On one H200 (bf16, H = 16,
# forward+backward, JAX 0.11.2), fused against split: 0.89-0.97x the time from 1,984 keys
# (causal LongNet: 0.99x at 32K, marginal; 0.96x at 128K) to 10,240 (LongNet 8K to 128K,
# two-branch patterns, one branch of rate 4), but 1.42x at 128 (one launch) and 1.20-1.22x for
# calls of launches of 640 and 32 keys (causal: 320 and 16; (512, 2048, 8192) x (1, 4, 16),
# offsets "head"), where the accumulators' zeroing and sum outweigh the dq kernel's recomputed
# products; nothing between 640 and 1,984 was measured, and the threshold sits just below the
# least count measured faster. Beyond the bytes, the split kernels' bf16 gradients are what let the
# longest sequences fit (docs/performance.md). Only where `setmaxnreg` moves the registers
# (`REGISTERS_MOVE`): it was not measured with JAX 0.12's spills without
# tools/no_nvjitlink.c.
_FUSED_STRIDED_KEYS = 1900
_FUSED_STRIDED_BYTES = 4 << 30
# An unstrided launch's backward (one float32 dq accumulator) fuses where its queries read at
# least this many keys a head. On one H200 (as above, 5 interleaved rounds), fused against
# split: 1.12x the time at 256 keys (causal segments of 512, H = 16 at 32K, and the LM's
# local model: B = 8, N = 8192, 6 heads over 2), 1.07-1.08x at 512, 0.99-1.01x at 1,024
# (causal segments of 2,048; segments of 1,024), 0.96-0.98x at 2,048 and 0.91x at 4,096 (full
# causal attention at 8K); full attention's thousands of keys fuse as before.
_FUSED_UNSTRIDED_KEYS = 1024
ITEM_SLOTS = 2  # dynamic work: the items the producer has claimed ahead of the consumers


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Launch choices of the "mosaic" kernels (keyword-only; None: tuned defaults).

  Attributes:
    block_q: forward: query rows per consumer warpgroup (64 or 128; a program takes twice
      as many; 128 measured 2.5-2.7x slower on packed rows at head dim 128:
      docs/performance.md).
    block_k: forward: keys per pipeline step (64, 128 or 192). None: 192 in launches of
      long unmasked rows where `setmaxnreg` moves the registers (`hopper.REGISTERS_MOVE`: JAX
      < 0.12, or 0.12 with tools/no_nvjitlink.c; see `resolved`), else 128 (64 at head dim
      256).
    stages: forward: key/value blocks in flight (2..4).
    backward_stages: backward: blocks in flight (2..4; blocks of 64 queries and keys).
    fused_backward: backward: dq inside the dk/dv kernel (TMA reduce-add stores into a
      float32 accumulator), else a dq kernel of its own. None: fused in launches that read
      their rows unstrided (full attention, stride-1 branches) where their queries read at
      least 1,024 keys a head on average (not segments of 512 or causal ones of 1,024), and in
      strided ones whose queries read at least 1,900 (LongNet; a second float32 accumulator
      serves the strided view) while both accumulators take at most 4 GiB (not on JAX 0.12
      without tools/no_nvjitlink.c, where the kernels spill, nor with `backward_stages`
      given); split in the others (`backward_for`). Keys are counted on the pattern: in
      packed rows, documents shorter than the segments cut what a query reads, and `False`
      may be faster where they are much shorter than 2K (a full causal 32K row of 2K documents,
      whose queries read 1,024 keys, measured 4-5% slower split: docs/performance.md). The
      fused kernel's gradients pass through float32 buffers; where the gradients are final
      (bf16) the split kernels write bf16 directly: `False` halves that memory at extreme
      lengths.
    persistent: one program per SM, each walking a run of the launch's work items (program
      blocks of rows), so that the producer streams the next item's blocks while the
      consumers finish the last one (and the forward loads the next item's queries into a
      second tile, where it fits), instead of one program per item. Under a causal mask the
      host list-schedules the items over the programs by their estimated cost (host work
      when a launch first traces, cached per shape; its cost: docs/performance.md). None:
      persistent, but for causal items that walk more than `_SHORT_ITEMS` blocks on
      average (full causal attention), where a program per item measured as fast; the
      forward's and dk/dv kernel's there in packed rows, whose costs the ids decide (on the
      device), persistent programs that take their items as they free up (`Work.mine`,
      dynamic work).
    interpret: run in Mosaic GPU interpret mode (CPU, JAX >= 0.11; slow: for tests).
  """

  block_q: int | None = None
  block_k: int | None = None
  stages: int | None = None
  backward_stages: int | None = None
  fused_backward: bool | None = None
  persistent: bool | None = None
  interpret: bool = False

  def __post_init__(self):
    for name, allowed in (("block_q", (64, 128)), ("block_k", (64, 128, 192)),
                          ("stages", (2, 3, 4)), ("backward_stages", (2, 3, 4))):
      value = getattr(self, name)
      if value is not None and (type(value) is not int or value not in allowed):
        raise ValueError(f"{name} must be None or one of {allowed} (an int), got "
                         f"{name}={value!r}")
    for name in ("fused_backward", "persistent"):
      if not isinstance(getattr(self, name), (bool, type(None))):
        raise ValueError(f"{name} must be None or a bool, got {name}={getattr(self, name)!r}")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"interpret must be a bool, got interpret={self.interpret!r}")

  def resolved(self, head_dim: int, itemsize: int = 2, out_itemsize: int = 2,
               long_keys: bool = False, packed: bool = False) -> Config:
    """This config with the forward's tuned defaults filled in: the first of the preferred
    tiles whose buffers fit in shared memory (float32 outputs take a tile of their own).
    `long_keys` (a launch whose rows are unmasked and read unstrided, its pieces whole blocks
    of 192 keys to within 1%: `long_key_rows`) puts blocks of 192 keys first at head dim 128
    (full attention's forward measured faster than with 128; LongNet's pieces of a few blocks
    and the causal diagonal slower: docs/performance.md). `ValueError` if the chosen forward
    tiles do not fit; `packed`: with the document ids' buffers too. (The backward's are per
    launch: `backward_for`.) Where `setmaxnreg` leaves the consumers at 168 registers
    (`REGISTERS_MOVE`, JAX 0.12), blocks of 192 keys spill and were 2.6x slower than
    128: `long_keys` then changes nothing."""
    preferred = [(64, 128 if head_dim <= 128 else 64, 2), (64, 64, 3), (64, 64, 2)]
    if long_keys and head_dim == 128 and REGISTERS_MOVE:
      preferred.insert(0, (64, _LONG_BLOCK_K, 2))
    for bq, bk, fwd_stages in preferred:
      config = dataclasses.replace(self, block_q=self.block_q or bq, block_k=self.block_k or bk,
                                   stages=self.stages or fwd_stages)
      if smem_bytes(config, head_dim, itemsize, out_itemsize, packed=packed) <= SMEM_BYTES:
        return config
    raise ValueError(
        f"block_q={config.block_q}, block_k={config.block_k}, stages={config.stages} need "
        f"{smem_bytes(config, head_dim, itemsize, out_itemsize, packed=packed)} bytes of "
        f"shared memory at head dim {head_dim} ({SMEM_BYTES} available): choose smaller "
        f"blocks or fewer stages")

  def backward_for(self, stride: int, head_dim: int, itemsize: int = 2, packed: bool = False,
                   *, keys: int, accumulator_bytes: int | None = None) -> Config:
    """The backward's choices for a launch of row stride `stride` whose queries read `keys`
    keys a head on average (`keys_per_query`) and whose fused kernel's float32 dq
    accumulators would take `accumulator_bytes` (None: unknown): fused (2 stages) where
    unstrided with at least `_FUSED_UNSTRIDED_KEYS` keys, or strided with at least
    `_FUSED_STRIDED_KEYS` keys and at most `_FUSED_STRIDED_BYTES`, where `setmaxnreg` moves
    the registers (`REGISTERS_MOVE`) and no stages are asked for (the fused kernel's buffers
    take more shared memory); split with the most stages that fit (up to 3; `packed`: with
    the document ids' buffers); unless `fused_backward` says. Explicit backward stages that
    do not fit fail when the kernel lowers."""
    fused = self.fused_backward
    if fused is None:
      fused = keys >= _FUSED_UNSTRIDED_KEYS if stride == 1 else (
          REGISTERS_MOVE and self.backward_stages is None and keys >= _FUSED_STRIDED_KEYS
          and accumulator_bytes is not None and accumulator_bytes <= _FUSED_STRIDED_BYTES)
    stages = self.backward_stages or (2 if fused else max(
        [s for s in (2, 3) if _backward_smem_bytes(s, head_dim, itemsize, packed) <= SMEM_BYTES]
        or [2]))
    return dataclasses.replace(self, backward_stages=stages, fused_backward=fused)


def smem_bytes(config: Config, head_dim: int, itemsize: int, out_itemsize: int,
               q_buffers: int = 1, packed: bool = False) -> int:
  """The forward's shared memory; `packed`: with its document ids (a ring of key blocks'
  ids beside the keys', and the queries' ids beside each query tile) and the slots of the
  items its programs may take dynamically (`Work.claim_buffers`)."""
  bq, bk = config.block_q, config.block_k
  buffers = [2 * q_buffers * bq * head_dim * itemsize,  # query tiles
             *(config.stages * bk * head_dim * itemsize,) * 2,  # rings of key, value blocks
             2 * bq * 4]  # lse tiles
  if out_itemsize != itemsize:
    buffers.append(2 * bq * head_dim * out_itemsize)
  if packed:
    buffers += [2 * q_buffers * bq * 4, config.stages * bk * 4, ITEM_SLOTS * 4]
  return sum(_footprint(b) for b in buffers) + _SMEM_SLACK


def _footprint(nbytes: int) -> int:
  """A shared-memory buffer's footprint: Pallas places each at a multiple of 1 KiB."""
  return -(-nbytes // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT


BWD_BLOCK = 64  # queries and keys per backward block (a program: two blocks of a row)
# The shortest row of a launch of several branches: a backward program's, and a forward one's
# at the default block_q. One value for both passes, so that they make the same launches.
ROW_BLOCK = 2 * BWD_BLOCK


def _backward_smem_bytes(stages: int, head_dim: int, itemsize: int,
                         packed: bool = False) -> int:
  """Both split backward kernels hold, per consumer, two resident tiles (q and dout, or k
  and v) and a float32 output tile, and a ring of two streamed tiles (k and v, or q and
  dout) and two row statistics; `packed`: the resident rows' and the streamed blocks'
  document ids too."""
  tile = BWD_BLOCK * head_dim
  resident = 2 * 2 * tile * itemsize + 2 * tile * 4
  ring = stages * (2 * tile * itemsize + (2 + packed) * BWD_BLOCK * 4)
  return resident + ring + (2 + packed) * 2 * BWD_BLOCK * 4 + _SMEM_SLACK


def launches(pattern: DilatedPattern, n: int, num_heads: int, branches):
  """The branches of each launch: `schedule.launches` in rows of at least `ROW_BLOCK`."""
  return schedule.launches(pattern, n, num_heads, branches, min_row=ROW_BLOCK)


def keys_per_query(pattern: DilatedPattern, n: int, num_heads: int, fused) -> int:
  """The keys a query reads a head on average in the launch of branches `fused`: the pairs
  its branches make visible (`visible_pairs`: per head, at its residues; causal: the past
  only; with multiplicity) over `n` queries and `num_heads` heads (`Config.backward_for`).
  Counted on the pattern: packed rows' documents may cut it."""
  return pattern.visible_pairs(n, num_heads, branches=fused) // (n * num_heads)


def geometry_problem(pattern: DilatedPattern, n: int, num_heads: int, num_kv_heads: int,
                     branches, config: Config, batch: int = 1) -> str | None:
  """Why the schedule of this problem does not fit the kernels' blocks or grid, or None.

  A launch's rows come in whole program blocks (a program's boxes never reach into the next
  row's positions), except in a launch of one segment (every branch's segment covers all N:
  full attention, a ring step), whose rows all end at the sequence's end: there a partial
  last block reads zeros past N, masks those keys and writes into the outputs' padding
  (`out_length`), so any N runs."""
  rows = math.lcm(2 * config.block_q, 2 * BWD_BLOCK)  # a forward and a backward program
  for fused in launches(pattern, n, num_heads, branches):
    s = schedule.build(pattern, n, num_heads, num_kv_heads, fused, False)
    one_segment = all(br.w == n for br in pattern.layout(n, num_heads, fused))
    if s.period % s.stride or (
        not one_segment and np.any(s.rows[:, schedule.ROW_LENGTH] % rows)):
      return (f"the mosaic backend needs query rows of whole blocks of {rows} positions "
              f"(per launch, the shortest segment over the rates' lcm a multiple of {rows}, "
              f"or one segment over all N); got rows of "
              f"{sorted(set(s.rows[:, schedule.ROW_LENGTH].tolist()))} for branches {fused}")
    if (items := math.prod(s.grid(batch, 2 * BWD_BLOCK))) > _MAX_ITEMS:
      return f"the mosaic backend numbers a launch's blocks in int32; got {items}"
  return None


def long_key_rows(sched: schedule.Schedule, causal: bool) -> bool:
  """Whether a launch's rows read unmasked, unstrided pieces that blocks of 192 keys
  cover with at most 1% to spare (full attention from ~19K keys)."""
  lengths = sched.pieces[:, schedule.PIECE_LENGTH]
  covered = -(-lengths // _LONG_BLOCK_K) * _LONG_BLOCK_K
  return (not causal and sched.stride == 1 and len(lengths) > 0
          and covered.sum() <= 1.01 * lengths.sum())


def _cut(first, count, stride, base, n, L):
  """`count` positions `first, first + stride, ...` of the period at `base`, cut at n."""
  return jnp.minimum(count,
                     _div_stride(jnp.maximum(n - base - first + stride - 1, 0), stride, L))


def _div_stride(x, stride, L, bound=0):
  """`floor(x / stride)` for `x >= -bound` (scalars, or a tile's per-row vectors), where
  `stride` is 1 or the launch's `L` (the schedule's strides; `Work.of` checks): a division
  by a constant (by a runtime divisor it took ~20 instructions, and the LM's launches walk a
  piece or two per block), and no select (Mosaic GPU wants a select's predicate broadcast)."""
  if L == 1:
    return x
  off = (bound // L + 1) * L if bound else 0
  quotient = lax.div(x + off, L) - off // L
  if isinstance(stride, int):
    return quotient
  return x + (stride != 1).astype(jnp.int32) * (quotient - x)


@dataclasses.dataclass(frozen=True)
class Program:
  """One work item of a launch (traced): batch `b`, the period's first position `base`, the
  row's head, first position and length (cut at n), its pieces `[p0, p1)` (none when the
  item is past the row's end: `busy` false), its row `row0` and class `cls` in the strided
  view, and the item's first position `start` in the row (`block_rows` positions per
  item)."""
  b: jax.Array
  base: jax.Array
  head: jax.Array
  first: jax.Array
  nrows: jax.Array
  p0: jax.Array
  p1: jax.Array
  row0: jax.Array
  cls: jax.Array
  start: jax.Array
  busy: jax.Array

  def rows(self, wg, size: int):
    """Consumer `wg`'s `size` rows of the item, in the strided view."""
    return pl.ds(aligned(self.row0 + self.start + wg * size), size)

  def ends(self, wg, size: int, stride: int):
    """The positions of consumer `wg`'s first and last row (`size` rows of the row's
    `stride`; the last cut at the row's end): a consumer's `rows` for `Ranges` (`wg` 0 and
    the item's rows: the item's own ends)."""
    start = self.start + wg * size
    return (self.first + stride * start,
            self.first + stride * (jnp.minimum(start + size, self.nrows) - 1))

  @classmethod
  def decode(cls, rows_ref, sched: schedule.Schedule, block_rows: int, n: int, item,
             reverse: bool, interleaved: bool = False):
    """Item `item` of the launch: `(batch, period)`-major, then rows, then the row's blocks
    (from its last block if `reverse`: under a causal mask the heaviest first); or, where
    `interleaved`, block-major: block `i` of every row, then block `i + 1` of every row."""
    row_blocks, rc = sched.row_blocks(block_rows), schedule.ROW_COLUMNS
    per_bp = len(sched.rows) * row_blocks
    bp, pid = lax.div(item, per_bp), lax.rem(item, per_bp)
    if interleaved:
      blk, r = lax.div(pid, len(sched.rows)), lax.rem(pid, len(sched.rows))
    else:
      r, blk = lax.div(pid, row_blocks), lax.rem(pid, row_blocks)
    if reverse:
      blk = row_blocks - 1 - blk
    base = lax.rem(bp, sched.periods) * sched.period
    first = rows_ref[r * rc + schedule.ROW_FIRST]
    nrows = _cut(first, rows_ref[r * rc + schedule.ROW_LENGTH], sched.stride, base, n,
                 sched.stride)
    start = blk * block_rows
    p0 = rows_ref[r * rc + schedule.ROW_PIECE0]
    busy = start < nrows
    return cls(b=lax.div(bp, sched.periods), base=base, head=rows_ref[r * rc + schedule.ROW_HEAD],
               first=first, nrows=nrows, p0=p0,
               p1=jnp.where(busy, rows_ref[r * rc + schedule.ROW_PIECE1], p0),
               row0=lax.div(base + first, sched.stride), cls=lax.rem(base + first, sched.stride),
               start=start, busy=busy)


def list_schedule(costs: np.ndarray, programs: int) -> np.ndarray:
  """List scheduling, decided on the host: the items in launch order (row by row, which
  keeps the programs in flight on neighbouring keys; block-major in packed rows' causal
  launches: `Work.interleaved`), each to the program that frees first by its estimated cost
  (`costs`, one per item): what the GPU's block scheduler does with a program per item.
  Returns int32 `[programs + 1 + items]`: program `p`'s items are
  `order[offsets[p]:offsets[p + 1]]`, in launch order, `offsets` first."""
  free = [(0, p) for p in range(programs)]
  owner = np.empty(len(costs), np.int32)
  for item, c in enumerate(costs.tolist()):
    t, p = heapq.heappop(free)
    owner[item] = p
    heapq.heappush(free, (t + c, p))
  order = np.argsort(owner, kind="stable")
  offsets = np.searchsorted(owner[order], np.arange(programs + 1))
  return np.concatenate([offsets, order]).astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Work:
  """A launch's work items (`sched.grid`'s programs, flattened) over `programs` programs
  (`persistent`: one program per SM; else one per item). Program `p` takes items
  `p, p + programs, ...`, or under a causal mask, where items differ in cost, the items
  `plan` gives it: offsets `[programs + 1]`, then the items grouped by program, appended
  to the rows table (`table`); or (`dynamic`: packed rows' forward and dk/dv kernels) item
  `p`, then each next item not yet taken, from a counter in global memory (`mine`). Items
  are numbered row by row, or block by block (`interleaved`: packed rows' causal launches;
  `Program.decode`)."""
  sched: schedule.Schedule
  block_rows: int
  n: int
  items: int
  programs: int
  persistent: bool
  reverse: bool
  plan: np.ndarray | None = None
  dynamic: bool = False
  interleaved: bool = False

  @classmethod
  @functools.lru_cache(maxsize=256)
  def of(cls, sched: schedule.Schedule, batch: int, config: Config, reverse: bool,
         ranges: Ranges, packed: bool = False, claims: bool = False):
    """The work of a launch whose items walk `ranges` (which holds the launch's `n`, causal
    mask and program block; the items' costs are what `plan` balances). Cached (the plan is
    host work: a model's layers share it).

    `packed` (packed rows): the ids decide the items' costs, which under a causal mask no
    longer fall along a row as the mask alone makes them; causal launches then number their
    items block-major (`interleaved`: the heads' rows side by side), so that the last ones
    taken are every head's last blocks (with `reverse`, its first), not the last head's
    whole row, whose long documents' items kept some SMs busy after the others ran out of
    work (docs/performance.md, "Packed sequences"; not causal: row-major as before,
    block-major there not measured). `claims` (a kernel that can take its items dynamically: the
    forward and dk/dv kernels): where a program per item is the default, packed rows'
    persistent programs take their items dynamically instead (dense rows' measured slower)."""
    strides = np.asarray(sched.pieces)[:, schedule.PIECE_STRIDE]
    assert np.isin(strides, (1, sched.stride)).all(), "strides 1 or L (_div_stride)"
    rows, bps = sched.grid(batch, ranges.block_rows)
    items = rows * bps
    persistent = True if config.persistent is None else config.persistent
    # Interpret mode: one program walks all items (one launch: persistent programs in
    # several interpreted launches hung under jit, nondeterministically, on JAX 0.11.2).
    programs = min(items, 1 if config.interpret else sm_count())
    work = cls(sched, ranges.block_rows, ranges.n, items, programs, persistent, reverse,
               interleaved=packed and ranges.causal)
    if not (persistent and ranges.causal):
      return work if persistent else dataclasses.replace(work, programs=items)
    costs = work.costs(batch, ranges)
    if config.persistent is None and costs.mean() > _SHORT_ITEMS:
      return dataclasses.replace(work, dynamic=True) if packed and claims else (
          dataclasses.replace(work, programs=items, persistent=False))
    # A static split (`p, p + programs, ...`) of LongNet's causal items left the SMs idle for
    # part of the launch, its busiest program well above the mean; the list schedule's is
    # near it (ncu and the estimate: docs/performance.md).
    return dataclasses.replace(work, plan=list_schedule(costs, programs))

  def costs(self, batch: int, ranges) -> np.ndarray:
    """Each item's estimated cost: the blocks it walks (by the producer's own `ranges`,
    evaluated here on the host), plus one for the item itself."""
    per_batch = self.items // batch  # items of one batch element (the same costs in each)
    try:
      host = jax.local_devices(backend="cpu")[0]  # this process's (several processes)
    except RuntimeError:  # no CPU backend configured: the default device then
      host = None
    with jax.ensure_compile_time_eval(), jax.default_device(host):
      rows, pieces, bias = self.sched.arrays()
      rows = rows.reshape(-1)

      def cost(item):
        prog = Program.decode(rows, self.sched, self.block_rows, self.n, item, self.reverse,
                              self.interleaved)
        blocks = ranges(prog, pieces.reshape(-1), bias)

        def add(p, total):
          _, lo, hi = blocks(p)
          return total + jnp.maximum(hi - lo, 0)

        return lax.fori_loop(prog.p0, prog.p1, add, jnp.int32(1))

      return np.tile(np.asarray(jax.vmap(cost)(jnp.arange(per_batch))), batch)

  @property
  def grid(self):
    return self.programs, 1

  def table(self, rows):
    """The rows table as the kernels read it: flat, the plan appended."""
    rows = rows.reshape(-1)
    return rows if self.plan is None else jnp.concatenate([rows, jnp.asarray(self.plan)])

  def mine(self, origin_ref, rows_ref, claims=None, producer: bool = False):
    """This program's `(first, loop)`: its first item and `loop(body, carry)`, which runs
    `carry = body(i, prog, has_next, next_prog, carry)` over its items (`next_prog()`: the
    next item, where `has_next`: the consumers load its rows early). Dynamic work takes its
    items as the program frees up (`claimed`; `claims`: its buffers, `producer`: which
    side)."""
    if self.dynamic:
      return self._claimed(origin_ref, rows_ref, claims, producer)
    pid = lax.axis_index("row") + origin_ref[0]
    if self.plan is None:
      count = ceil_div(self.items - pid, self.programs)
      item = lambda i: pid + i * self.programs
    else:
      at = self.sched.rows.size
      first = rows_ref[at + pid]
      count = rows_ref[at + pid + 1] - first
      item = lambda i: rows_ref[at + self.programs + 1 + first + i]

    def prog(i):
      return Program.decode(rows_ref, self.sched, self.block_rows, self.n, item(i),
                            self.reverse, self.interleaved)

    def loop(body, carry):
      return lax.fori_loop(
          0, count, lambda i, c: body(i, prog(i), i + 1 < count, lambda: prog(i + 1), c), carry)

    return prog(0), loop

  def claim_buffers(self):
    """Dynamic work's shared memory and barriers (`mine`): the ring of item slots, its full
    barriers and its free ones (both consumers release a slot); None for static work."""
    if not self.dynamic:
      return None
    return (plgpu.SMEM((ITEM_SLOTS,), jnp.int32), plgpu.Barrier(num_barriers=ITEM_SLOTS),
            plgpu.Barrier(num_arrivals=2, num_barriers=ITEM_SLOTS))

  def counter(self):
    """Dynamic work's input, after the kernel's fixed ones: `(counter,)`, an int32 `[1]` of
    zeros that the programs take their items from (`claimed`); else `()`."""
    return (Zeroed((1,), jnp.int32),) if self.dynamic else ()

  def _claimed(self, origin_ref, rows_ref, claims, producer: bool):
    """`mine` of dynamic work (`dynamic`): program `p` walks item `p`, then takes the next
    unclaimed item from a counter in global memory (`counter`) each time it frees up, as the
    GPU's own scheduler hands out a program per item, in launch order. The producer claims
    (one item ahead, so that the consumers can load the next item's rows early) and passes
    each item to the consumers through a ring of shared-memory slots. `claims`: `(counter,
    slots [S] int32, full barriers [S], free barriers [S] of two arrivals, interpret)`
    (`claim_buffers`)."""
    counter, slots, full, free, interpret = claims
    size = slots.shape[0]
    pid = lax.axis_index("row") + origin_ref[0]
    prog = lambda item: Program.decode(rows_ref, self.sched, self.block_rows, self.n, item,
                                       self.reverse, self.interleaved)

    def publish(m):  # the program's item m (>= 1) into slot m % size
      slot = lax.rem(m, size)
      pl.when(m > size)(lambda: plgpu.barrier_wait(free.at[slot]))
      # (items 0 .. programs - 1 are the programs' first ones)
      fetch_add(counter, slots.at[pl.ds(slot, 1)], self.programs, interpret)
      plgpu.barrier_arrive(full.at[slot])

    def take(m):  # the consumers' read of item m
      slot = lax.rem(m, size)
      plgpu.barrier_wait(full.at[slot])
      item = slots[slot]
      plgpu.barrier_arrive(free.at[slot])
      return item

    def loop(body, carry):
      if producer:
        publish(jnp.int32(1))

      def step(state):
        i, item, carry = state
        if producer:
          carry = body(i, prog(item), None, None, carry)
          following = slots[lax.rem(i + 1, size)]
          pl.when(following < self.items)(lambda: publish(i + 2))
        else:
          following = take(i + 1)
          carry = body(i, prog(item), following < self.items, lambda: prog(following), carry)
        return i + 1, following, carry

      count, _, carry = lax.while_loop(lambda state: state[1] < self.items, step,
                                       (jnp.int32(0), pid, carry))
      if producer:  # observe the consumers' last reads (every barrier phase; interpret mode)
        for back in range(size):
          pl.when(count - back >= 1)(
              lambda: plgpu.barrier_wait(free.at[lax.rem(count - back, size)]))
      return carry

    return prog(pid), loop


@dataclasses.dataclass(frozen=True)
class _Piece:
  """Piece `p` of the row (traced): the other side's head, first position, stride, length
  (cut at n) and `log2 m`."""
  head: jax.Array
  first: jax.Array
  stride: jax.Array
  count: jax.Array
  bias: jax.Array

  @classmethod
  def decode(cls, pieces_ref, bias_ref, p, base, n, L):
    pc = schedule.PIECE_COLUMNS
    first = pieces_ref[p * pc + schedule.PIECE_FIRST]
    stride = pieces_ref[p * pc + schedule.PIECE_STRIDE]
    return cls(head=pieces_ref[p * pc + schedule.PIECE_HEAD], first=first, stride=stride,
               count=_cut(first, pieces_ref[p * pc + schedule.PIECE_LENGTH], stride, base, n,
                          L),
               bias=bias_ref[p])


def key_limit(piece, key0, q_pos, causal, L, n):
  """The masks of the forward and dq kernels: per query row (`q_pos`, its positions), the
  last key of `piece` it sees counted from the block's first key `key0`; the row sees the
  block's column `c` iff `c <= limit` (one comparison a score). Not causal: a scalar."""
  last = piece.count - 1 - key0
  if not causal:
    return last
  return jnp.minimum(_div_stride(q_pos - piece.first, piece.stride, L, n) - key0, last)


def query_bounds(piece, query0, k_pos, causal, L, n):
  """The masks of the dk/dv kernel: per key row (`k_pos`, its positions), the queries of
  `piece` that see it counted from the block's first query `query0`: columns `lo <= c <
  hi` (`lo` None when not causal; `hi` a scalar)."""
  hi = piece.count - query0
  if not causal:
    return None, hi
  return -_div_stride(piece.first - k_pos, piece.stride, L, n) - query0, hi


def _window_keys(piece, at, w0, w1, L, n):
  """`[i0, i1)`: the keys `i` of `piece` (at positions `at + stride * i`) whose positions lie
  in `[w0, w1]` (any int32 bounds; empty when `w0 > w1`)."""
  lo, hi = jnp.clip(w0 - at, 0, n), jnp.clip(w1 - at + 1, 0, n)
  up = lambda x: _div_stride(x + piece.stride - 1, piece.stride, L)  # ceil(x / stride)
  return up(lo), jnp.maximum(up(lo), up(hi))


def _windowed(piece, base, window, bounds):
  """`bounds(piece, window)`, the piece's blocks cut by an item's `window` (None: none), as
  `_key_ranges` and `_query_ranges` work them out; or `bounds(piece, None)` where every
  position of the piece lies in the run `window[2:4]` common to the item's rows (a row of one
  document; a long document's segments), which no window then cuts: a branch that skips
  their arithmetic, which a piece's first products wait for (LongNet walks pieces of a block
  or two: with every id equal its kernels took 8-11% longer than without ids before;
  docs/performance.md, "Measurements behind design choices")."""
  if window is None:
    return bounds(piece, None)
  at = base + piece.first
  inside = (window[2] <= at) & (at + piece.stride * (piece.count - 1) <= window[3])
  return lax.cond(inside, lambda: bounds(piece, None), lambda: bounds(piece, window))


def _in_order(lo, s0, a, b, s1, hi):
  """A consumer's `(lo, s0, a, b, s1, hi)` in `walk`'s order: the blocks it cannot see,
  `[lo, s0)` and `[s1, hi)`, cut where they would meet its unmasked blocks `[a, b)`; an empty
  `[a, b)` (no block all of whose pairs it sees) moved between them, so that it cuts
  neither."""
  s0 = jnp.clip(s0, lo, hi)
  s1 = jnp.clip(s1, s0, hi)
  empty = b <= a
  a = jnp.where(empty, jnp.clip(a, s0, s1), a)
  b = jnp.where(empty, a, b)
  return lo, jnp.minimum(s0, a), a, b, jnp.maximum(s1, b), hi


def _key_ranges(prog, pieces_ref, bias_ref, n, L, causal, block_rows, bk, rows=None,
                window=None):
  """Key pieces of a query row (forward, dq): with `rows` None, `(piece, lo, hi)` for the
  producer, where `[lo, hi)` covers the keys any query of the program sees; with `rows`, a
  consumer's first and last query positions, `(piece, lo, s0, a, b, s1, hi, x0, x1)` for it
  (`walk`): blocks `[a, b)` hold keys that exist and (causal) precede its first query, the
  keys `[x0, x1)` of the piece are the only ones its queries may see (causal: none past its
  last query), and the blocks of `[lo, s0)` and `[s1, hi)` hold none of them.

  `window` (packed rows): the positions `(u0, u1)` of the keys that may share a document
  with a query of the program and `(c0, c1)`, a run of keys all in the one document of every
  query of the program (`IdTiles.window` of both tiles), for the producer; for a consumer
  also its own `(v0, v1)` and `(r0, r1)`, a run of keys all in the one document of each of
  its queries (`r0 > r1`: none). Blocks outside `[u0, u1]` are not walked, by the producer
  and both consumers alike; blocks outside `[v0, v1]` hold no key of the consumer's
  documents; blocks inside `[r0, r1]` need no document mask; every other block is masked
  (`walk`'s masked blocks compare ids). A piece inside `[c0, c1]` is cut by none of them:
  its blocks are worked out as without ids (`_windowed`)."""
  _, hi_q = prog.ends(0, block_rows, L)  # the item's last query

  def seen(piece, pos):  # keys of the piece at or before position `pos`
    if not causal:
      return piece.count
    return jnp.where(pos >= piece.first,
                     jnp.minimum(piece.count,
                                 _div_stride(pos - piece.first, piece.stride, L) + 1), 0)

  def bounds(piece, window):
    blocks = ceil_div(seen(piece, hi_q), bk)
    lo = jnp.int32(0)
    if window is not None:
      at = prog.base + piece.first
      i0, i1 = _window_keys(piece, at, window[0], window[1], L, n)
      lo, blocks = jnp.minimum(lax.div(i0, bk), blocks), jnp.minimum(ceil_div(i1, bk), blocks)
      blocks = jnp.maximum(lo, blocks)
    if rows is None:
      return lo, blocks
    a, b = lo, jnp.clip(lax.div(seen(piece, rows[0]), bk), lo, blocks)
    x0, x1 = jnp.int32(0), seen(piece, rows[1])
    if window is not None:
      i0, i1 = _window_keys(piece, at, window[6], window[7], L, n)
      a = jnp.clip(ceil_div(i0, bk), lo, blocks)
      b = jnp.clip(jnp.minimum(lax.div(i1, bk), b), a, blocks)
      i0, i1 = _window_keys(piece, at, window[4], window[5], L, n)
      x0, x1 = i0, jnp.minimum(x1, i1)
    return (*_in_order(lo, lax.div(x0, bk), a, b, ceil_div(x1, bk), blocks), x0, x1)

  def ranges(p):
    piece = _Piece.decode(pieces_ref, bias_ref, p, prog.base, n, L)
    return (piece, *_windowed(piece, prog.base, window, bounds))

  return ranges


def _query_ranges(prog, pieces_ref, bias_ref, n, L, causal, bq, rows=None, window=None):
  """Query pieces of a key row (dk/dv): with `rows` None, `(piece, lo, hi)` for the
  producer, where `[lo, hi)` covers the queries that see any key of the program (causal: at
  or after its first key); with `rows`, a consumer's first and last key positions,
  `(piece, lo, s0, a, b, s1, hi, x0, x1)` for it (`walk`): blocks `[a, b)` hold queries that
  exist and see every key up to its last, the queries `[x0, x1)` of the piece are the only
  ones that may see one of its keys (causal: none before its first key), and the blocks of
  `[lo, s0)` and `[s1, hi)` hold none of them (`[x0, x1)` for the host's checks: the dk/dv
  kernel does not halve its blocks). `window`: as `_key_ranges`', the roles of queries and keys
  swapped."""
  k_first, _ = prog.ends(0, bq, L)  # the item's first key

  def before(piece, pos):  # queries of the piece before position `pos`
    if not causal:
      return jnp.int32(0)
    return jnp.where(pos > piece.first,
                     jnp.minimum(piece.count,
                                 _div_stride(pos - piece.first + piece.stride - 1,
                                             piece.stride, L)), 0)

  def bounds(piece, window):
    lo, hi = lax.div(before(piece, k_first), bq), ceil_div(piece.count, bq)
    if window is not None:
      at = prog.base + piece.first
      i0, i1 = _window_keys(piece, at, window[0], window[1], L, n)
      lo = jnp.maximum(lo, lax.div(i0, bq))
      hi = jnp.maximum(lo, jnp.minimum(hi, ceil_div(i1, bq)))
    if rows is None:
      return lo, hi
    a = jnp.clip(ceil_div(before(piece, rows[1]), bq), lo, hi)
    b = jnp.clip(lax.div(piece.count, bq), a, hi)
    x0, x1 = before(piece, rows[0]), piece.count
    if window is not None:
      i0, i1 = _window_keys(piece, at, window[6], window[7], L, n)
      a = jnp.clip(ceil_div(i0, bq), a, hi)
      b = jnp.clip(jnp.minimum(b, lax.div(i1, bq)), a, hi)
      i0, i1 = _window_keys(piece, at, window[4], window[5], L, n)
      x0, x1 = jnp.maximum(x0, i0), jnp.minimum(x1, i1)
    return (*_in_order(lo, lax.div(x0, bq), a, b, ceil_div(x1, bq), hi), x0, x1)

  def ranges(p):
    piece = _Piece.decode(pieces_ref, bias_ref, p, prog.base, n, L)
    return (piece, *_windowed(piece, prog.base, window, bounds))

  return ranges


@dataclasses.dataclass(frozen=True)
class Ranges:
  """The blocks of an item's pieces, as one kernel walks them: `_key_ranges` (`keys`: the
  forward and dq) or `_query_ranges` (dk/dv), `block` positions a block, items of
  `block_rows` positions. One object for the producer, the consumers (with their `rows`:
  the positions of their first and last query or key), the launch's work (`Work.of`, cached
  by it) and the host's cost estimate."""
  keys: bool
  n: int
  L: int
  causal: bool
  block_rows: int
  block: int

  def __call__(self, prog, pieces_ref, bias_ref, rows=None, window=None):
    if self.keys:
      return _key_ranges(prog, pieces_ref, bias_ref, self.n, self.L, self.causal,
                         self.block_rows, self.block, rows, window)
    return _query_ranges(prog, pieces_ref, bias_ref, self.n, self.L, self.causal, self.block,
                         rows, window)


def strided_view(x, stride: int):
  """The free view `[B, N/L, L, ...]` of `x [B, N, ...]`: row `p // L`, class `p % L`."""
  return x.reshape(x.shape[0], x.shape[1] // stride, stride, *x.shape[2:])


def out_length(sched: schedule.Schedule, n_pad: int, block_rows: int) -> int:
  """Outputs cover whole periods and every program's boxes (`block_rows` positions of a row;
  a one-segment launch's last block may be partial): TMA stores that run past the end of an
  array are not clipped reliably on the GPU (measured: rows of the last, partial period
  landed at the start), so none is issued."""
  L = sched.stride
  covered = max(sched.periods * sched.period, sched.row_blocks(block_rows) * block_rows * L)
  return max(n_pad, -(-covered // (8 * L)) * 8 * L)
