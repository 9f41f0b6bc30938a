"""The "mosaic" backend: Pallas Mosaic GPU kernels for Hopper (sm_90), forward and backward.

The forward walks the same host block schedule as the "triton" backend (`schedule.py`): the
branches whose segments nest run in one launch, each (query, key) pair scored once with the
bias `log m` of its multiplicity, causal blocks past the diagonal skipped, GQA by reading the
shared key/value head. Launches group branches whose rows are at least one program block
long (`_ROW_BLOCK`, 128 positions), so a pattern whose rows would be short all together runs
as a few launches: LongNet at 8K as examples/lm_real.py first trained it, `w = (512, 2048,
8192), r = (1, 4, 16)` (rows of 32 all together), as {512/1, 2048/4} (rows of 128) and
{8192/16} (rows of 512).
Each launch after the first merges the earlier launches' output and lse (in the output's
dtype, float32 when none is asked for) into its own in its items' epilogues (`_merge_prior`),
so the output is written once per launch and never merged apart; in the backward, each
launch's kernels add the earlier launches' dq, dk, dv to their own likewise (`_add_prior`).
What changes is the engine, built from Hopper's own parts:

- a program owns `2 * block_q` positions of one strided query row and runs three warpgroups:
  two consumers (`block_q` query rows each) and one producer that issues the TMA copies of
  the row's key/value blocks into a ring of `stages` shared-memory buffers (full and free
  barriers per buffer), walking the row's pieces in the same order as the consumers;
- dilation is TMA addressing, never a gather: a row of stride `L` is a `[rows, D]` box of
  the free view `[B, N/L, L, H, D]` (row index `p // L`, class `p % L`), a stride-1 key
  piece a box of `[B, N, Hkv, D]`; the tiles land in 128-byte-swizzled shared memory;
- both products are wgmma (QK^T from shared memory, PV with P from registers), with an
  online base-2 softmax in float32 (one fused multiply-add per score: the piece's `log2 m`
  rides in the running maximum, taken before scaling); the two consumers take turns on the
  tensor cores, so one's softmax overlaps the other's matrix products; blocks inside a piece
  and before every query of a consumer run without a mask, and a masked block compares each
  score's column with a per-row limit (the last key its query sees, worked out once per
  row: `_key_limit`), one comparison a score (the key's position worked out per score made
  masked blocks cost far more instructions than unmasked ones, and most of the LM's are
  masked: docs/performance.md).

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
on neighbouring keys, in L2). The default does so where items walk at most `_SHORT_ITEMS`
blocks on average (against a program per item: causal LongNet's forward measured faster and
its forward+backward the same, that 8K LongNet's forward+backward faster); longer items (full
causal attention) have little fixed cost to hide, and an A/B measured its list-scheduled
backward slower, so each item is a program there. (The figures behind these choices:
docs/performance.md.)

The output goes back through shared memory with TMA stores; lse is written as
`[B, H, L, N/L]` (contiguous per row, so TMA can store it) and transposed outside.
Boxes past the end of an input read zeros (the kernel masks keys past each piece's end);
outputs are allocated in whole periods, so that no store runs past their end, and sliced.
Each launch's rows must come in whole program blocks (`2 * block_q` positions per row and
period, and the backward's 128), else `supports` declines, except in a launch of one segment
over all N (full attention, a ring step), whose rows all end at N: there a partial last block
reads zeros past N and writes into the outputs' padding, so any N runs. A length that `8 * L`
does not divide is zero-padded (a copy, only then: the views' row axes must be whole tiles
of 8).

The backward has two kernels built the same way (producer and consumer warpgroups, TMA
rings, the same block walk), without the turn-taking, which measured slower there:
- dq over query rows (the forward's schedule): per key block, s = q k^T and dp = dout v^T
  (shared-memory wgmmas issued together), p = exp2(s c + log2 m - lse2), ds = p (dp - delta),
  dq += ds k (registers times shared memory);
- dk/dv over key rows of each key/value head (the transposed schedule): the consumers keep
  their k and v tiles; the producer streams the query pieces of every query head reading that
  head (q, dout, lse, delta: a stride-1 piece from `[B, N, H, ...]`, a strided one from the
  view), s^T = k q^T, dp^T = v dout^T, dv += p^T dout, dk += ds^T q.
Both load the next item's resident rows when a walk ends, while the item's results store.
In launches whose rows are unstrided (full attention, stride-1 branches; `Config.backward_for`)
dq moves into the dk/dv kernel: both consumers put their ds^T tiles in shared memory, one of
them (taking turns) computes the query block's dq = ds_0 k_0 + ds_1 k_1 and adds it into a
zeroed float32 accumulator with a TMA reduce-add store: five products per block pair instead
of seven (measured faster on full attention: docs/performance.md).
Strided launches keep the two kernels (a fused one would need a second float32 accumulator
in the strided view, and measured no faster there). The consumers index their resident
tiles through `opaque` inside the walk, so that each tile's wgmma descriptors are computed
per block rather than hoisted and held in registers across the walk: held, they made the
fused kernel spill at head dim 128 (ptxas's counts: docs/performance.md).
All write through shared memory: float32, or bf16 from the split kernels where the gradients
are final; several launches add up in float32. Head dim 256 does not fit (its tiles exceed
shared memory): `supports` declines that backward, and dispatch gives it to the next
candidate ("triton" where it runs), as any backward it declines.
`Config(interpret=True)` runs the kernels in Mosaic GPU interpret mode on a CPU (JAX >= 0.11),
which is how the test suite checks them without a GPU.
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

from ..pattern import DilatedPattern, heads_per_kv
from . import schedule
from .base import YES, Problem, Support, no
from .common import batched
from .hopper import (LN2, LOG2E, REGISTERS, SMEM_BYTES, accumulate, aligned, ceil_div, is_hopper,
                     opaque, products, run, sm_count, swizzled, turns)

# Barriers and alignment beside the tiles (no reduction scratch: `run`'s kernels reduce
# within warps only).
_SMEM_SLACK = 1024
_LONG_BLOCK_K = 192  # the forward's key block in long unmasked rows (`_long_keys`)
_MAX_ITEMS = 2 ** 31 - 1  # work items of a launch, numbered in int32 (and CUDA's grid x)
# Causal work items are walked by persistent programs (`Config.persistent=None`) where they
# walk at most this many blocks on average (estimated): there an item's fixed cost (its
# queries' load, the ring's refill, the output's store) matters and persistence hides it.
# Longer items hide it anyway, and the GPU's own scheduler balances their real costs, not our
# estimate (full causal attention: the list-scheduled backward measured slower in one A/B;
# docs/performance.md).
_SHORT_ITEMS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Launch choices of the "mosaic" kernels (keyword-only; None: tuned defaults).

  Attributes:
    block_q: forward: query rows per consumer warpgroup (64 or 128; a program takes twice
      as many).
    block_k: forward: keys per pipeline step (64, 128 or 192). None: 192 in launches of
      long unmasked rows (see `resolved`), else 128 (64 at head dim 256).
    stages: forward: key/value blocks in flight (2..4).
    backward_stages: backward: blocks in flight (2..4; blocks of 64 queries and keys).
    fused_backward: backward: dq inside the dk/dv kernel (TMA reduce-add stores into a
      float32 accumulator), else a dq kernel of its own. None: fused in launches that read
      their rows unstrided (full attention, stride-1 branches), split in strided ones (a
      second float32 dq accumulator would be needed there for the strided view). The fused
      kernel's gradients pass through float32 buffers; where the gradients are final (bf16)
      the split kernels write bf16 directly: `False` halves that memory at extreme lengths.
    persistent: one program per SM, each walking a run of the launch's work items (program
      blocks of rows), so that the producer streams the next item's blocks while the
      consumers finish the last one (and the forward loads the next item's queries into a
      second tile, where it fits), instead of one program per item. Under a causal mask the
      host list-schedules the items over the programs by their estimated cost (host work
      when a launch first traces, cached per shape; its cost: docs/performance.md). None:
      persistent, but for causal items that walk more than `_SHORT_ITEMS` blocks on
      average (full causal attention), where a program per item measured as fast.
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
      if value is not None and (isinstance(value, bool) or value not in allowed):
        raise ValueError(f"{name} must be None or one of {allowed}, got {name}={value!r}")
    for name in ("fused_backward", "persistent"):
      if not isinstance(getattr(self, name), (bool, type(None))):
        raise ValueError(f"{name} must be None or a bool, got {name}={getattr(self, name)!r}")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"interpret must be a bool, got interpret={self.interpret!r}")

  def resolved(self, head_dim: int, itemsize: int = 2, out_itemsize: int = 2,
               long_keys: bool = False) -> Config:
    """This config with the forward's tuned defaults filled in: the first of the preferred
    tiles whose buffers fit in shared memory (float32 outputs take a tile of their own).
    `long_keys` (a launch whose rows are unmasked and read unstrided, its pieces whole blocks
    of 192 keys to within 1%: `_long_keys`) puts blocks of 192 keys first at head dim 128
    (full attention's forward measured faster than with 128; LongNet's pieces of a few blocks
    and the causal diagonal slower: docs/performance.md). `ValueError` if the chosen forward
    tiles do not fit. (The backward's are per launch: `backward_for`.)"""
    preferred = [(64, 128 if head_dim <= 128 else 64, 2), (64, 64, 3), (64, 64, 2)]
    if long_keys and head_dim == 128:
      preferred.insert(0, (64, _LONG_BLOCK_K, 2))
    for bq, bk, fwd_stages in preferred:
      config = dataclasses.replace(self, block_q=self.block_q or bq, block_k=self.block_k or bk,
                                   stages=self.stages or fwd_stages)
      if _smem_bytes(config, head_dim, itemsize, out_itemsize) <= SMEM_BYTES:
        return config
    raise ValueError(
        f"block_q={config.block_q}, block_k={config.block_k}, stages={config.stages} need "
        f"{_smem_bytes(config, head_dim, itemsize, out_itemsize)} bytes of shared memory at "
        f"head dim {head_dim} ({SMEM_BYTES} available): choose smaller blocks or fewer stages")

  def backward_for(self, stride: int, head_dim: int, itemsize: int = 2) -> Config:
    """The backward's choices for a launch of row stride `stride`: fused where unstrided
    (unless `fused_backward` says), with 2 stages; split with the most stages that fit (up
    to 3). Explicit backward stages that do not fit fail when the kernel lowers."""
    fused = stride == 1 if self.fused_backward is None else self.fused_backward
    stages = self.backward_stages or (2 if fused else max(
        [s for s in (2, 3) if _backward_smem_bytes(s, head_dim, itemsize) <= SMEM_BYTES]
        or [2]))
    return dataclasses.replace(self, backward_stages=stages, fused_backward=fused)


def _smem_bytes(config: Config, head_dim: int, itemsize: int, out_itemsize: int,
                q_buffers: int = 1) -> int:
  q = 2 * q_buffers * config.block_q * head_dim * itemsize
  kv = 2 * config.stages * config.block_k * head_dim * itemsize
  out = 0 if out_itemsize == itemsize else 2 * config.block_q * head_dim * out_itemsize
  return q + kv + out + 2 * config.block_q * 4 + _SMEM_SLACK  # + lse tiles


_BWD_BLOCK = 64  # queries and keys per backward block (a program: two blocks of a row)
# The shortest row of a launch of several branches: a backward program's, and a forward one's
# at the default block_q. One value for both passes, so that they make the same launches.
_ROW_BLOCK = 2 * _BWD_BLOCK


def _backward_smem_bytes(stages: int, head_dim: int, itemsize: int) -> int:
  """Both split backward kernels hold, per consumer, two resident tiles (q and dout, or k
  and v) and a float32 output tile, and a ring of two streamed tiles (k and v, or q and
  dout) and two row statistics."""
  tile = _BWD_BLOCK * head_dim
  resident = 2 * 2 * tile * itemsize + 2 * tile * 4
  ring = stages * (2 * tile * itemsize + 2 * _BWD_BLOCK * 4)
  return resident + ring + 2 * 2 * _BWD_BLOCK * 4 + _SMEM_SLACK


def _launches(pattern: DilatedPattern, n: int, num_heads: int, branches):
  """The branches of each launch: `schedule.launches` in rows of at least `_ROW_BLOCK`."""
  return schedule.launches(pattern, n, num_heads, branches, min_row=_ROW_BLOCK)


def geometry_problem(pattern: DilatedPattern, n: int, num_heads: int, num_kv_heads: int,
                     branches, config: Config, batch: int = 1) -> str | None:
  """Why the schedule of this problem does not fit the kernels' blocks or grid, or None.

  A launch's rows come in whole program blocks (a program's boxes never reach into the next
  row's positions), except in a launch of one segment (every branch's segment covers all N:
  full attention, a ring step), whose rows all end at the sequence's end: there a partial
  last block reads zeros past N, masks those keys and writes into the outputs' padding
  (`_n_out`), so any N runs."""
  rows = math.lcm(2 * config.block_q, 2 * _BWD_BLOCK)  # a forward and a backward program
  for fused in _launches(pattern, n, num_heads, branches):
    s = schedule.build(pattern, n, num_heads, num_kv_heads, fused, False)
    one_segment = all(br.w == n for br in pattern.layout(n, num_heads, fused))
    if s.period % s.stride or (
        not one_segment and np.any(s.rows[:, schedule.ROW_LENGTH] % rows)):
      return (f"the mosaic backend needs query rows of whole blocks of {rows} positions "
              f"(per launch, the shortest segment over the rates' lcm a multiple of {rows}, "
              f"or one segment over all N); got rows of "
              f"{sorted(set(s.rows[:, schedule.ROW_LENGTH].tolist()))} for branches {fused}")
    if (items := math.prod(s.grid(batch, 2 * _BWD_BLOCK))) > _MAX_ITEMS:
      return f"the mosaic backend numbers a launch's blocks in int32; got {items}"
  return None


def supports(problem: Problem) -> Support:
  """Hopper GPUs (sm_90); bf16 and f16; head dims 64 and 128, and 256 for a forward whose
  output is final (one launch, no ring step); rows of whole blocks, or one segment of any
  length."""
  if problem.platform != "gpu" or not is_hopper():
    return no("the mosaic backend runs on Hopper GPUs (sm_90) only")
  if jax.__version_info__ < (0, 11):
    return no(f"the mosaic backend needs JAX >= 0.11 (its kernels lower with 0.11's Mosaic "
              f"GPU); this is {jax.__version__}")
  if not any(problem.dtype == t for t in (jnp.bfloat16, jnp.float16)):
    return no(f"the mosaic backend runs bf16 and f16, got {problem.dtype}")
  d = problem.head_dim
  if d not in (64, 128, 256):
    return no(f"the mosaic backend needs a head dim of 64, 128 or 256; got {d}")
  b, n, h, _ = problem.q_shape
  if d == 256 and problem.backward:
    return no("the mosaic backend's backward runs head dims 64 and 128: at 256 its tiles "
              "exceed shared memory")
  launches = _launches(problem.pattern, n, h, problem.branches)
  if d == 256 and (problem.varying or len(launches) > 1):
    return no("the mosaic backend writes float32 partials (ring steps, several launches) "
              "only up to head dim 128: at 256 their tiles exceed shared memory")
  if why := geometry_problem(problem.pattern, n, h, problem.kv_shape[2], problem.branches,
                             Config().resolved(d), b):
    return no(why)
  return YES


def _cut(first, count, stride, base, n, L):
  """`count` positions `first, first + stride, ...` of the period at `base`, cut at n."""
  return jnp.minimum(count,
                     _div_stride(jnp.maximum(n - base - first + stride - 1, 0), stride, L))


def _div_stride(x, stride, L, bound=0):
  """`floor(x / stride)` for `x >= -bound` (scalars, or a tile's per-row vectors), where
  `stride` is 1 or the launch's `L` (the schedule's strides; `_Work.of` checks): a division
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
class _Program:
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

  @classmethod
  def decode(cls, rows_ref, sched: schedule.Schedule, block_rows: int, n: int, item,
             reverse: bool):
    """Item `item` of the launch: `(batch, period)`-major, then rows, then the row's blocks
    (from its last block if `reverse`: under a causal mask the heaviest first)."""
    row_blocks, rc = sched.row_blocks(block_rows), schedule.ROW_COLUMNS
    per_bp = len(sched.rows) * row_blocks
    bp, pid = lax.div(item, per_bp), lax.rem(item, per_bp)
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


@dataclasses.dataclass(frozen=True, eq=False)
class _Work:
  """A launch's work items (`sched.grid`'s programs, flattened) over `programs` programs
  (`persistent`: one program per SM; else one per item). Program `p` takes items
  `p, p + programs, ...`, or under a causal mask, where items differ in cost, the items
  `plan` gives it: offsets `[programs + 1]`, then the items grouped by program, appended
  to the rows table (`table`)."""
  sched: schedule.Schedule
  block_rows: int
  n: int
  items: int
  programs: int
  persistent: bool
  reverse: bool
  plan: np.ndarray | None = None

  @classmethod
  @functools.lru_cache(maxsize=256)
  def of(cls, sched: schedule.Schedule, batch: int, config: Config, reverse: bool,
         ranges: _Ranges):
    """The work of a launch whose items walk `ranges` (which holds the launch's `n`, causal
    mask and program block; the items' costs are what `plan` balances). Cached (the plan is
    host work: a model's layers share it)."""
    strides = np.asarray(sched.pieces)[:, schedule.PIECE_STRIDE]
    assert np.isin(strides, (1, sched.stride)).all(), "strides 1 or L (_div_stride)"
    rows, bps = sched.grid(batch, ranges.block_rows)
    items = rows * bps
    persistent = True if config.persistent is None else config.persistent
    # Interpret mode: one program walks all items (one launch: persistent programs in
    # several interpreted launches hung under jit, nondeterministically, on JAX 0.11.2).
    programs = min(items, 1 if config.interpret else sm_count())
    work = cls(sched, ranges.block_rows, ranges.n, items, programs, persistent, reverse)
    if not (persistent and ranges.causal):
      return work if persistent else dataclasses.replace(work, programs=items)
    costs = work._costs(batch, ranges)
    if config.persistent is None and costs.mean() > _SHORT_ITEMS:
      return dataclasses.replace(work, programs=items, persistent=False)
    return dataclasses.replace(work, plan=work._plan(costs))

  def _costs(self, batch: int, ranges) -> np.ndarray:
    """Each item's estimated cost: the blocks it walks (by the producer's own `ranges`,
    evaluated here on the host), plus one for the item itself."""
    per_batch = self.items // batch  # items of one batch element (the same costs in each)
    try:
      host = jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend configured: the default device then
      host = None
    with jax.ensure_compile_time_eval(), jax.default_device(host):
      rows, pieces, bias = self.sched.arrays()
      rows = rows.reshape(-1)

      def cost(item):
        prog = _Program.decode(rows, self.sched, self.block_rows, self.n, item, self.reverse)
        blocks = ranges(prog, pieces.reshape(-1), bias)

        def add(p, total):
          _, lo, hi = blocks(p)
          return total + jnp.maximum(hi - lo, 0)

        return lax.fori_loop(prog.p0, prog.p1, add, jnp.int32(1))

      return np.tile(np.asarray(jax.vmap(cost)(jnp.arange(per_batch))), batch)

  def _plan(self, costs: np.ndarray) -> np.ndarray:
    """List scheduling, decided on the host: the items in launch order (row by row, which
    keeps the programs in flight on neighbouring keys), each to the program that frees
    first by its estimated cost: what the GPU's block scheduler does with a program per
    item. A static split (`p, p + programs, ...`) of LongNet's causal items left the SMs
    idle for part of the launch, its busiest program well above the mean; the plan's is
    near it (ncu and the estimate: docs/performance.md)."""
    free = [(0, p) for p in range(self.programs)]
    owner = np.empty(self.items, np.int32)
    for item, c in enumerate(costs.tolist()):
      t, p = heapq.heappop(free)
      owner[item] = p
      heapq.heappush(free, (t + c, p))
    order = np.argsort(owner, kind="stable")
    offsets = np.searchsorted(owner[order], np.arange(self.programs + 1))
    return np.concatenate([offsets, order]).astype(np.int32)

  @property
  def grid(self):
    return self.programs, 1

  def table(self, rows):
    """The rows table as the kernels read it: flat, the plan appended."""
    rows = rows.reshape(-1)
    return rows if self.plan is None else jnp.concatenate([rows, jnp.asarray(self.plan)])

  def mine(self, origin_ref, rows_ref):
    """This program's `(count, prog, loop)`: its number of items, `prog(i)` its i-th item
    and `loop(body, carry)`, which runs `carry = body(i, prog(i), carry)` over them."""
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
      return _Program.decode(rows_ref, self.sched, self.block_rows, self.n, item(i),
                             self.reverse)

    def loop(body, carry):
      return lax.fori_loop(0, count, lambda i, c: body(i, prog(i), c), carry)

    return count, prog, loop


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


def _at_rows(src, strided_src, at, n0, size, stride, L, index, use):
  """`use(box)` on the box of positions `at + stride * (n0 + i)`, i < size: of `src`
  (`[B, N, ...]`) when the stride is 1, else of its strided view `strided_src`
  (`[B, N/L, L, ...]`). `index(rows, cls)` makes the ref index (`cls` None for `src`)."""

  def unit():
    use(src.at[index(pl.ds(aligned(at + n0), size), None)])

  def strided():
    use(strided_src.at[index(pl.ds(aligned(lax.div(at, L) + n0), size), lax.rem(at, L))])

  if L == 1:
    unit()
  else:
    pl.when(stride == 1)(unit)
    pl.when(stride != 1)(strided)


def _add_rows(add_at, value, tile, bar, interpret: bool):
  """`box += value` (float32 `[rows, D]`) through the shared-memory `tile`, where
  `add_at(use)` calls `use(box)` (`_at_rows`): the value goes to `tile` once (after the
  previous store from it has read it), then a TMA reduce-add store. Interpret mode has no
  reduction stores: it reads, adds and writes back (each consumer into its own
  accumulator)."""
  if interpret:
    def read_add_write(box):
      plgpu.copy_gmem_to_smem(box, tile, bar)
      plgpu.barrier_wait(bar)
      tile[...] = tile[...] + value
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, box)
      plgpu.wait_smem_to_gmem(0)
    add_at(read_add_write)
    return
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  tile[...] = value
  plgpu.commit_smem()
  add_at(lambda box: plgpu.copy_smem_to_gmem(tile, box, reduction_op="add"))


def _produce(prog: _Program, blocks, streams, stages: int, step):
  """The producer's part of one item: for each piece `p` of the row and block `j` in
  `blocks(p) = (piece, lo, hi)`, for each stream `(free, load)`: wait until the slot is free
  (after the first round), then `load(piece, j, slot)`, which issues the stream's TMA copies.
  The consumers walk the same blocks in the same order (`_walk`) and arrive on `free` (two
  arrivals) when done with a buffer. `step`: blocks loaded before (the ring's position);
  returns it after."""

  def per_piece(p, step):
    piece, lo, hi = blocks(p)

    def per_block(j, step):
      slot = lax.rem(step, stages)
      for free, load in streams:
        @pl.when(step >= stages)
        def _():
          plgpu.barrier_wait(free.at[slot])

        load(piece, j, slot)
      return step + 1

    return lax.fori_loop(lo, hi, per_block, step)

  return lax.fori_loop(prog.p0, prog.p1, per_piece, step)


def _producer(work: _Work, origin_ref, rows_ref, item, frees, stages: int):
  """The producer warpgroup: `step = item(prog, step)` (a `_produce`) over the program's
  items, then it waits for the consumers to release the last buffers of each ring in
  `frees`: every phase of a barrier is observed before the block exits (needed by interpret
  mode, free on the GPU)."""
  plgpu.set_max_registers(REGISTERS[0], action="decrease")
  _, _, loop = work.mine(origin_ref, rows_ref)
  steps = loop(lambda i, prog, step: item(prog, step), jnp.int32(0))
  for i in range(stages):
    step = steps - stages + i

    @pl.when(step >= 0)
    def _():
      for free in frees:
        plgpu.barrier_wait(free.at[lax.rem(step, stages)])


def _kv_producer(work: _Work, origin_ref, rows_ref, per_kv: int, k, v, ranges, L: int,
                 bk: int, stages: int):
  """The producer of the forward and dq kernels: the key and value blocks of each item's
  key pieces (`ranges(prog)`), read from the key/value head of its query head. `k`, `v`:
  (the `[B, N, Hkv, D]` input, its strided view, the shared-memory ring, its full and its
  free barriers)."""

  def stream(prog, src4, src5, smem, bar, free):
    kv_head = lax.div(prog.head, per_kv)

    def load(piece, j, slot):
      _at_rows(src4, src5, prog.base + piece.first, j * bk, bk, piece.stride, L,
               lambda rows, c: (prog.b, rows, kv_head) if c is None else
               (prog.b, rows, c, kv_head),
               lambda box: plgpu.copy_gmem_to_smem(box, smem.at[slot], bar.at[slot]))
    return free, load

  def item(prog, step):
    return _produce(prog, ranges(prog), [stream(prog, *k), stream(prog, *v)], stages, step)

  _producer(work, origin_ref, rows_ref, item, [k[-1], v[-1]], stages)


def _walk(prog: _Program, ranges, block, carry):
  """A consumer's pass over the blocks `_produce` loads: `ranges(p) = (piece, lo, a, b, hi)`,
  blocks `[a, b)` unmasked, the rest of `[lo, hi)` masked; `block(carry, piece, j, masked)`."""

  def per_piece(p, carry):
    piece, lo, a, b, hi = ranges(p)
    for begin, end, masked in ((lo, a, True), (a, b, False), (b, hi, True)):
      carry = lax.fori_loop(begin, end, functools.partial(
          lambda masked, j, c: block(c, piece, j, masked), masked), carry)
    return carry

  return lax.fori_loop(prog.p0, prog.p1, per_piece, carry)


def _key_limit(piece, key0, q_pos, causal, L, n):
  """The masks of the forward and dq kernels: per query row (`q_pos`, its positions), the
  last key of `piece` it sees counted from the block's first key `key0`; the row sees the
  block's column `c` iff `c <= limit` (one comparison a score). Not causal: a scalar."""
  last = piece.count - 1 - key0
  if not causal:
    return last
  return jnp.minimum(_div_stride(q_pos - piece.first, piece.stride, L, n) - key0, last)


def _query_bounds(piece, query0, k_pos, causal, L, n):
  """The masks of the dk/dv kernel: per key row (`k_pos`, its positions), the queries of
  `piece` that see it counted from the block's first query `query0`: columns `lo <= c <
  hi` (`lo` None when not causal; `hi` a scalar)."""
  hi = piece.count - query0
  if not causal:
    return None, hi
  return -_div_stride(piece.first - k_pos, piece.stride, L, n) - query0, hi


def _key_ranges(prog, pieces_ref, bias_ref, n, L, causal, block_rows, bk, q_first=None):
  """Key pieces of a query row (forward, dq): `(piece, 0, 0, unmasked, blocks)` where
  `blocks` covers the keys any query of the program sees and the first `unmasked` blocks
  hold keys that exist and (causal) precede `q_first`, a consumer's first query; with
  `q_first` None, `(piece, lo, hi)` for the producer."""
  hi_q = prog.first + L * (jnp.minimum(prog.start + block_rows, prog.nrows) - 1)

  def seen(piece, pos):  # keys of the piece at or before position `pos`
    if not causal:
      return piece.count
    return jnp.where(pos >= piece.first,
                     jnp.minimum(piece.count,
                                 _div_stride(pos - piece.first, piece.stride, L) + 1), 0)

  def ranges(p):
    piece = _Piece.decode(pieces_ref, bias_ref, p, prog.base, n, L)
    blocks = ceil_div(seen(piece, hi_q), bk)
    if q_first is None:
      return piece, 0, blocks
    unmasked = jnp.minimum(lax.div(seen(piece, q_first), bk), blocks)
    return piece, 0, 0, unmasked, blocks

  return ranges


def _query_ranges(prog, pieces_ref, bias_ref, n, L, causal, bq, k_last=None):
  """Query pieces of a key row (dk/dv): `(piece, lo, a, b, hi)` where `[lo, hi)` covers the
  queries that see any key of the program (causal: at or after its first key), `[a, b)` the
  blocks of queries that exist and see every key up to `k_last`, a consumer's last key;
  with `k_last` None, `(piece, lo, hi)` for the producer."""
  k_first = prog.first + L * prog.start

  def before(piece, pos):  # queries of the piece before position `pos`
    if not causal:
      return jnp.int32(0)
    return jnp.where(pos > piece.first,
                     jnp.minimum(piece.count,
                                 _div_stride(pos - piece.first + piece.stride - 1,
                                             piece.stride, L)), 0)

  def ranges(p):
    piece = _Piece.decode(pieces_ref, bias_ref, p, prog.base, n, L)
    lo, hi = lax.div(before(piece, k_first), bq), ceil_div(piece.count, bq)
    if k_last is None:
      return piece, lo, hi
    a = jnp.maximum(lo, ceil_div(before(piece, k_last), bq))
    return piece, lo, a, jnp.maximum(a, lax.div(piece.count, bq)), hi

  return ranges


@dataclasses.dataclass(frozen=True)
class _Ranges:
  """The blocks of an item's pieces, as one kernel walks them: `_key_ranges` (`keys`: the
  forward and dq) or `_query_ranges` (dk/dv), `block` positions a block, items of
  `block_rows` positions. One object for the producer, the consumers (with their `bound`:
  first query or last key), the launch's work (`_Work.of`, cached by it) and the host's cost
  estimate."""
  keys: bool
  n: int
  L: int
  causal: bool
  block_rows: int
  block: int

  def __call__(self, prog, pieces_ref, bias_ref, bound=None):
    if self.keys:
      return _key_ranges(prog, pieces_ref, bias_ref, self.n, self.L, self.causal,
                         self.block_rows, self.block, bound)
    return _query_ranges(prog, pieces_ref, bias_ref, self.n, self.L, self.causal, self.block,
                         bound)


def _strided_view(x, stride: int):
  """The free view `[B, N/L, L, ...]` of `x [B, N, ...]`: row `p // L`, class `p % L`."""
  return x.reshape(x.shape[0], x.shape[1] // stride, stride, *x.shape[2:])


def _n_out(sched: schedule.Schedule, n_pad: int, block_rows: int) -> int:
  """Outputs cover whole periods and every program's boxes (`block_rows` positions of a row;
  a one-segment launch's last block may be partial): TMA stores that run past the end of an
  array are not clipped reliably on the GPU (measured: rows of the last, partial period
  landed at the start), so none is issued."""
  L = sched.stride
  covered = max(sched.periods * sched.period, sched.row_blocks(block_rows) * block_rows * L)
  return max(n_pad, -(-covered // (8 * L)) * 8 * L)


def _merge_prior(prior_refs, prog, rows, o_tile, lse_tile, bars, acc, m_i, l_i, rows_of,
                 row_stat):
  """An item's epilogue merging its partial (`acc` unnormalized, base-2 running max `m_i`,
  sum `l_i`) with the earlier launches' `(out, lse)` of its rows (`prior_refs`, loaded into
  the output's tiles): `lse = log(e^lse_p + e^lse_i)`, `out = (e^lse_p o_p + acc e^m_i) /
  e^lse` in base 2, a row neither has seen 0 with lse -inf; written into the same tiles."""
  out_p, lse_p = prior_refs
  plgpu.copy_gmem_to_smem(out_p.at[prog.b, rows, prog.cls, prog.head], o_tile, bars[0])
  plgpu.copy_gmem_to_smem(lse_p.at[prog.b, prog.head, prog.cls, rows], lse_tile, bars[1])
  for bar in bars:
    plgpu.barrier_wait(bar)
  a = plgpu.load(lse_tile, layout=row_stat) * LOG2E  # prior, base 2
  b = jnp.where(l_i > 0, m_i + jnp.log2(jnp.where(l_i > 0, l_i, 1.0)), -jnp.inf)
  top = jnp.maximum(a, b)
  top = jnp.where(top == -jnp.inf, 0.0, top)
  w_p, w_i = jnp.exp2(a - top), jnp.exp2(m_i - top)  # 0 where unseen (-inf)
  den = w_p + w_i * l_i
  seen = den > 0
  inv = 1.0 / jnp.where(seen, den, 1.0)
  o_p = plgpu.load(o_tile, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  out = o_p * rows_of(w_p * inv, acc.shape) + acc * rows_of(w_i * inv, acc.shape)
  o_tile[...] = out.astype(o_tile.dtype)
  lse_tile[...] = jnp.where(seen, (top + jnp.log2(jnp.where(seen, den, 1.0))) * LN2, -jnp.inf)


def _add_prior(prior_refs, b, rows, cls, head, tiles, bars, wg, grads):
  """An item's epilogue adding the earlier launches' gradients of its rows (`prior_refs`,
  None: none; loaded into the output's `tiles`, whose stores before have read them) to its
  float32 `grads` (a list, updated)."""
  if prior_refs[0] is None:
    return
  for i, (ref, tile) in enumerate(zip(prior_refs, tiles)):
    plgpu.copy_gmem_to_smem(ref.at[b, rows, cls, head], tile, bars[i].at[wg])
  for i, tile in enumerate(tiles):
    plgpu.barrier_wait(bars[i].at[wg])
    grads[i] = grads[i] + plgpu.load(tile, layout=plgpu.Layout.WGMMA).astype(jnp.float32)


def _forward_launch(q, k, v, tables, sched: schedule.Schedule, n: int, causal: bool,
                    scale: float, out_dtype, config: Config, prior=None):
  """One launch over the padded `q, k, v [B, Np, H(kv), D]`: (out [B, No, H, D], lse
  [B, No, H]), `No >= Np` (whole periods). `prior`: the `(out, lse)` of earlier launches
  (`[B, No, H, D]` in `out_dtype`, `[B, No, H]`), merged into this launch's result in each
  item's epilogue (its tile loaded into the output's tile once the walk is done): one pass
  over the output instead of a partial written and merged apart."""
  batch, n_pad, num_heads, d = q.shape
  dtype = q.dtype
  L = sched.stride
  bq, bk, stages = config.block_q, config.block_k, config.stages
  block_rows = 2 * bq
  n_out = _n_out(sched, n_pad, block_rows)
  span = 2 * n_out  # exceeds any difference of two positions in a period
  per_kv = heads_per_kv(num_heads, k.shape[2])
  qk_scale = scale * LOG2E
  # Masked scores lie past every score in the order the row maximum is taken in (the
  # minimum for a negative scale), so that `s c` is -inf either way; a zero scale scores
  # every visible key 0 (`block`), with c = 1.
  scale_sign = -1.0 if qk_scale < 0 else 1.0
  scale_c = qk_scale or 1.0
  hidden = -scale_sign * jnp.inf
  interpret = config.interpret
  key_ranges = _Ranges(True, n, L, causal, block_rows, bk)
  work = _Work.of(sched, batch, config, causal, key_ranges)
  out_dtype = jnp.dtype(out_dtype)
  same = out_dtype == dtype  # then the output tile reuses the query tile
  out_itemsize = out_dtype.itemsize
  # Query tiles per consumer: two when persistent and they fit, so that the next item's
  # queries load while this one runs.
  buffers = 2 if work.persistent and _smem_bytes(
      config, d, dtype.itemsize, out_itemsize, 2) <= SMEM_BYTES else 1

  def kernel(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref,
             v5_ref, prior_refs, out_ref, lse_ref, smem, bars, free):
    q_smem, k_smem, v_smem, o_smem, lse_smem = smem
    q_bar, k_bar, v_bar, prior_bars = bars
    (k_free, v_free), turn = free
    wg = lax.axis_index("wg")

    def producer():
      _kv_producer(work, origin_ref, rows_ref, per_kv, (k4_ref, k5_ref, k_smem, k_bar, k_free),
                   (v4_ref, v5_ref, v_smem, v_bar, v_free),
                   lambda prog: key_ranges(prog, pieces_ref, bias_ref), L, bk, stages)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      count, prog_of, loop = work.mine(origin_ref, rows_ref)
      cols_iota = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
      row_stat = plgpu.Layout.WGMMA.reduce(1)
      if causal:  # (a row iota nothing reads fails Mosaic GPU's layout inference)
        row_iota = plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_stat)
      rows_of = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
      take_turn, give_turn, start_turns, end_turns = turns(turn, wg)

      def tile(i):  # this consumer's query tile for its i-th item
        return lax.rem(i, buffers) * 2 + wg

      q_rows = lambda prog: prog.rows(wg, bq)

      def load_q(i, prog):
        pl.when(prog.busy)(lambda: plgpu.copy_gmem_to_smem(
            q_ref.at[prog.b, q_rows(prog), prog.cls, prog.head], q_smem.at[tile(i)],
            q_bar.at[tile(i)]))

      if buffers == 2:
        load_q(0, prog_of(0))

      def item(i, prog, step):
        # The stores of the item before have read their tiles (the output's may be the query
        # tile the next item's queries load into).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if buffers == 2:
          pl.when(i + 1 < count)(lambda: load_q(i + 1, prog_of(i + 1)))
        else:
          load_q(i, prog)
        q_tile = q_smem.at[tile(i)]
        pl.when(prog.busy)(lambda: plgpu.barrier_wait(q_bar.at[tile(i)]))
        q_first = prog.first + L * (prog.start + wg * bq)  # this warpgroup's first query
        q_pos = q_first + L * row_iota if causal else None  # this warpgroup's query positions

        def block(carry, piece, j, masked: bool):
          """One key block: scores, online softmax (base 2; `m` includes the piece's
          `log2 m` bias, so p is one fused multiply-add and an exp2 per score), P @ V.
          Unmasked blocks (all keys exist and precede every query) skip the mask.

          The row maximum is taken before scaling (the largest score, or the smallest
          for a negative scale), so each exponent is one rounding of `s c - m`: exact while
          it stays in exp2's range, i.e. for |s c| < 2^27 (docs/SPEC.md, "Numerical
          range"); a maximum taken over the scaled scores, exact for any logits, costs an
          instruction per score (measured slower on full attention's forward:
          docs/performance.md)."""
          acc, m_i, l_i, step = carry
          slot = lax.rem(step, stages)
          plgpu.barrier_wait(k_bar.at[slot])
          s, = products([(q_tile, k_smem.at[slot].T)], (bq, bk), take_turn)
          plgpu.barrier_arrive(k_free.at[slot])
          if qk_scale == 0:  # every visible score is 0 (and -inf * 0 would be NaN)
            s = jnp.zeros_like(s)
          if masked:
            limit = _key_limit(piece, j * bk, q_pos, causal, L, span)
            s = jnp.where(cols_iota <= (rows_of(limit, s.shape) if causal else limit), s,
                          hidden)
          bias = piece.bias
          top = s.max(axis=1) if scale_sign > 0 else s.min(axis=1)
          m_new = jnp.maximum(m_i, top * scale_c + bias)
          # Rows that have seen nothing yet (masked blocks only) subtract 0, not -inf.
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
          alpha = jnp.exp2(m_i - m_use)
          p_ = jnp.exp2(s * scale_c - rows_of(m_use - bias, s.shape))
          acc = acc * rows_of(alpha, acc.shape)
          l_i = l_i * alpha + p_.sum(axis=1)
          p16 = p_.astype(dtype)
          give_turn(lambda: plgpu.barrier_wait(v_bar.at[slot]))
          acc, = accumulate([acc], [(p16, v_smem.at[slot])], interpret)
          plgpu.barrier_arrive(v_free.at[slot])
          return acc, m_new, l_i, step + 1

        acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_stat)
        l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_stat)
        pl.when(prog.busy)(start_turns)  # one consumer's softmax beside the other's wgmmas
        ranges = key_ranges(prog, pieces_ref, bias_ref, q_first)
        acc, m_i, l_i, step = _walk(prog, ranges, block, (acc, m_i, l_i, step))

        @pl.when(prog.busy)
        def _():
          end_turns()
          o_tile = q_tile if same else o_smem.at[wg]
          if prior_refs is None:
            seen = l_i > 0
            l_safe = jnp.where(seen, l_i, 1.0)
            o_tile[...] = (acc / rows_of(l_safe, acc.shape)).astype(o_tile.dtype)
            lse_smem.at[wg][...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
          else:
            _merge_prior(prior_refs, prog, q_rows(prog), o_tile, lse_smem.at[wg],
                         [bar.at[wg] for bar in prior_bars], acc, m_i, l_i, rows_of, row_stat)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_tile, out_ref.at[prog.b, q_rows(prog), prog.cls, prog.head])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                  lse_ref.at[prog.b, prog.head, prog.cls, q_rows(prog)])

        return step

      loop(item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    pl.when(wg < 2)(consumer)
    pl.when(wg == 2)(producer)

  def entry(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref, v5_ref,
            *refs):
    prior_refs, (out_ref, lse_ref) = (None, refs) if prior is None else (refs[:2], refs[2:])
    tiles = swizzled(dtype)
    smem = [plgpu.SMEM((2 * buffers, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq), jnp.float32)]
    if not same:
      smem.append(plgpu.SMEM((2, bq, d), out_dtype, transforms=swizzled(out_dtype)))

    def scoped(smem, bars, free):
      q_smem, k_smem, v_smem, lse_smem = smem[:4]
      o_smem = None if same else smem[4]
      kernel(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref, v5_ref,
             prior_refs, out_ref, lse_ref, (q_smem, k_smem, v_smem, o_smem, lse_smem), bars,
             free)

    pl.run_scoped(
        scoped, smem,
        (plgpu.Barrier(num_barriers=2 * buffers), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages),
         None if prior is None else (plgpu.Barrier(num_barriers=2),) * 2),
        ((plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
         plgpu.Barrier(num_arrivals=2)),
        collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((batch, n_out // L, L, num_heads, d), out_dtype),
              jax.ShapeDtypeStruct((batch, num_heads, L, n_out // L), jnp.float32))
  rows, pieces, bias = tables
  view = functools.partial(_strided_view, stride=L)
  args = (work.table(rows), pieces.reshape(-1), bias, view(q), k, view(k), v, view(v))
  if prior is not None:
    out_p, lse_p = prior
    args += (view(out_p), lse_p.reshape(batch, n_out // L, L, num_heads).transpose(0, 3, 2, 1))
  out, lse = run(entry, out_type, work.grid, args, interpret)
  lse = lse.transpose(0, 3, 2, 1).reshape(batch, n_out, num_heads)
  return out.reshape(batch, n_out, num_heads, d), lse


def _dq_launch(q, k, v, dout, lse2, delta, tables, sched: schedule.Schedule, n: int,
               causal: bool, scale: float, config: Config, out_dtype=jnp.float32, prior=None):
  """dq of one launch over the padded `[B, Np, ...]` inputs (lse2, delta `[B, H, L, Np/L]`,
  lse2 in base 2, +inf where no key is seen): `[B, No, H, D]` in `out_dtype`, plus `prior`
  (the earlier launches' dq, `[B, No, H, D]` in `out_dtype`), added in the epilogues."""
  batch, n_pad, num_heads, d = q.shape
  dtype = q.dtype
  L = sched.stride
  bq, bk, stages = _BWD_BLOCK, _BWD_BLOCK, config.backward_stages
  block_rows = 2 * bq
  n_out = _n_out(sched, n_pad, block_rows)
  span = 2 * n_out  # exceeds any difference of two positions in a period
  per_kv = heads_per_kv(num_heads, k.shape[2])
  qk_scale = scale * LOG2E
  interpret = config.interpret
  key_ranges = _Ranges(True, n, L, causal, block_rows, bk)
  work = _Work.of(sched, batch, config, causal, key_ranges)

  def kernel(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, do_ref, lse_ref, delta_ref,
             k4_ref, k5_ref, v4_ref, v5_ref, prior_ref, dq_ref, smem, bars, free):
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, o_smem = smem
    row_bars, k_bar, v_bar, prior_bar = bars
    k_free, v_free = free
    wg = lax.axis_index("wg")

    def producer():
      _kv_producer(work, origin_ref, rows_ref, per_kv, (k4_ref, k5_ref, k_smem, k_bar, k_free),
                   (v4_ref, v5_ref, v_smem, v_bar, v_free),
                   lambda prog: key_ranges(prog, pieces_ref, bias_ref), L, bk, stages)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      count, prog_of, loop = work.mine(origin_ref, rows_ref)
      q_tile, do_tile, o_tile = q_smem.at[wg], do_smem.at[wg], o_smem.at[wg]
      row_stat = plgpu.Layout.WGMMA.reduce(1)
      cols_iota = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
      if causal:
        row_iota = plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_stat)
      rows_of = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])

      def load_rows(prog):
        """This consumer's query rows of item `prog`: q, dout, lse2, delta."""
        b, head, cls, q_rows = prog.b, prog.head, prog.cls, prog.rows(wg, bq)

        @pl.when(prog.busy)
        def _():
          for src, dst, bar in ((q_ref.at[b, q_rows, cls, head], q_tile, row_bars[0]),
                                (do_ref.at[b, q_rows, cls, head], do_tile, row_bars[1]),
                                (lse_ref.at[b, head, cls, q_rows], lse_smem.at[wg], row_bars[2]),
                                (delta_ref.at[b, head, cls, q_rows], delta_smem.at[wg],
                                 row_bars[3])):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])

      load_rows(prog_of(0))

      def item(i, prog, step):
        b, head, cls = prog.b, prog.head, prog.cls
        q_start = prog.start + wg * bq
        q_rows = prog.rows(wg, bq)

        @pl.when(prog.busy)
        def _():
          for bar in row_bars:
            plgpu.barrier_wait(bar.at[wg])

        lse2 = plgpu.load(lse_smem.at[wg], layout=row_stat)
        delta_i = plgpu.load(delta_smem.at[wg], layout=row_stat)
        q_first = prog.first + L * q_start
        q_pos = q_first + L * row_iota if causal else None

        def block(carry, piece, j, masked: bool):
          """One key block: s = q k^T and dp = dout v^T, p = exp2(s c + log2 m - lse2),
          ds = p (dp - delta), dq += ds k."""
          dq, step = carry
          slot = lax.rem(step, stages)
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.barrier_wait(v_bar.at[slot])
          me = opaque(wg)  # q_tile, do_tile, indexed per block (`opaque`)
          s, dp = products([(q_smem.at[me], k_smem.at[slot].T),
                             (do_smem.at[me], v_smem.at[slot].T)], (bq, bk))
          plgpu.barrier_arrive(v_free.at[slot])
          p = jnp.exp2(jnp.minimum(s * qk_scale - rows_of(lse2 - piece.bias), 0.0))
          if masked:
            limit = _key_limit(piece, j * bk, q_pos, causal, L, span)
            p = jnp.where(cols_iota <= (rows_of(limit) if causal else limit), p, 0.0)
          ds = p * (dp - rows_of(delta_i))
          dq, = accumulate([dq], [(ds.astype(dtype), k_smem.at[slot])], interpret)
          plgpu.barrier_arrive(k_free.at[slot])
          return dq, step + 1

        dq = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
        ranges = key_ranges(prog, pieces_ref, bias_ref, q_first)
        dq, step = _walk(prog, ranges, block, (dq, step))
        # The next item's rows load during this one's store.
        pl.when(i + 1 < count)(lambda: load_rows(prog_of(i + 1)))

        @pl.when(prog.busy)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the item before's store
          grad = [dq * scale]
          _add_prior([prior_ref], b, q_rows, cls, head, [o_tile], prior_bar, wg, grad)
          o_tile[...] = grad[0].astype(o_tile.dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_tile, dq_ref.at[b, q_rows, cls, head])

        return step

      loop(item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    pl.when(wg < 2)(consumer)
    pl.when(wg == 2)(producer)

  def entry(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, do_ref, lse_ref, delta_ref,
            k4_ref, k5_ref, v4_ref, v5_ref, *refs):
    prior_ref, dq_ref = refs if prior is not None else (None, *refs)
    tiles = swizzled(dtype)
    smem = [plgpu.SMEM((2, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq), jnp.float32), plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq, d), out_dtype, transforms=swizzled(out_dtype))]
    pl.run_scoped(
        lambda smem, bars, free: kernel(
            origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, do_ref, lse_ref, delta_ref,
            k4_ref, k5_ref, v4_ref, v5_ref, prior_ref, dq_ref, smem, bars, free),
        smem,
        ((plgpu.Barrier(num_barriers=2),) * 4, plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages),
         None if prior is None else (plgpu.Barrier(num_barriers=2),)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((batch, n_out // L, L, num_heads, d), out_dtype),)
  rows, pieces, bias = tables
  view = functools.partial(_strided_view, stride=L)
  args = (work.table(rows), pieces.reshape(-1), bias, view(q), view(dout), lse2, delta,
          k, view(k), v, view(v), *([] if prior is None else [view(prior)]))
  dq, = run(entry, out_type, work.grid, args, interpret)
  return dq.reshape(batch, n_out, num_heads, d)


def _dkdv_launch(q, k, v, dout, stats, tables, sched: schedule.Schedule, n: int,
                 causal: bool, scale: float, config: Config, dq_accs=None,
                 out_dtype=jnp.float32, prior=None):
  """dk, dv of one launch (the transposed schedule: key rows of each key/value head, query
  pieces of the query heads reading it) over the padded `[B, Np, ...]` inputs (`stats`:
  lse2 and delta as `[B, H, Np]` and `[B, H, L, Np/L]`): `[B, No, Hkv, D]` each, in
  `out_dtype` (float32 when fused: the output tile stages dq too), plus `prior` (the
  earlier launches' `(dk, dv)`, `[B, No, Hkv, D]` in `out_dtype`), added in the epilogues.

  With `dq_accs` (float32 refs `[C B, Na, H, D]` and, for L > 1, `[C B, Na/L, L, H, D]`,
  C = 2 in interpret mode, else 1) the kernel also adds dq into them: each step both
  consumers put their ds^T in shared memory, and one of them (taking turns) computes the
  dq of the query block from both halves (dq = ds_0 k_0 + ds_1 k_1) and adds it with a TMA
  reduce-add store."""
  batch, n_pad, num_heads, d = q.shape
  num_kv = k.shape[2]
  dtype = q.dtype
  L = sched.stride
  bq, bk, stages = _BWD_BLOCK, _BWD_BLOCK, config.backward_stages
  block_rows = 2 * bk
  n_out = _n_out(sched, n_pad, block_rows)
  span = 2 * n_out  # exceeds any difference of two positions in a period
  qk_scale = scale * LOG2E
  interpret = config.interpret
  fused = dq_accs is not None
  query_ranges = _Ranges(False, n, L, causal, block_rows, bq)
  work = _Work.of(sched, batch, config, False, query_ranges)  # causal: heaviest first
  assert not fused or out_dtype == jnp.float32, "the fused kernel stages dq in float32"
  # 16-bit outputs: dk and dv in tiles of their own, in the bytes of two float32 tiles.
  two_tiles = jnp.dtype(out_dtype).itemsize == 2

  def kernel(origin_ref, rows_ref, pieces_ref, bias_ref, k_ref, v_ref, q4_ref, q5_ref,
             do4_ref, do5_ref, lse4_ref, lse5_ref, delta4_ref, delta5_ref, dq_refs, prior_refs,
             dk_ref, dv_ref, smem, bars, free):
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, o_smem = smem[:7]
    row_bars, q_bar, do_bar, lse_bar, delta_bar, prior_bars = bars[:6]
    ds_smem, ds_bars = (smem[7], bars[6]) if fused else (None, None)
    q_free, do_free, stat_free = free
    wg = lax.axis_index("wg")

    def stream(prog, src4, src5, smem, bar, stat=False):
      b = prog.b

      def load(piece, j, slot):
        h = piece.head  # the query head (lse, delta: [B, H, N] and [B, H, L, N/L])
        index = ((lambda rows, c: (b, h, rows) if c is None else (b, h, c, rows)) if stat else
                 (lambda rows, c: (b, rows, h) if c is None else (b, rows, c, h)))
        _at_rows(src4, src5, prog.base + piece.first, j * bq, bq, piece.stride, L, index,
                 lambda box: plgpu.copy_gmem_to_smem(box, smem.at[slot], bar.at[slot]))
      return load

    def loads(*streams):
      def load(piece, j, slot):
        for s in streams:
          s(piece, j, slot)
      return load

    def producer():
      def item(prog, step):
        return _produce(
            prog, query_ranges(prog, pieces_ref, bias_ref),
            [(q_free, stream(prog, q4_ref, q5_ref, q_smem, q_bar)),
             (stat_free, loads(stream(prog, lse4_ref, lse5_ref, lse_smem, lse_bar, True),
                               stream(prog, delta4_ref, delta5_ref, delta_smem, delta_bar,
                                      True))),
             (do_free, stream(prog, do4_ref, do5_ref, do_smem, do_bar))], stages, step)

      _producer(work, origin_ref, rows_ref, item, [q_free, stat_free, do_free], stages)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      count, prog_of, loop = work.mine(origin_ref, rows_ref)
      k_tile, v_tile, o_tile = k_smem.at[wg], v_smem.at[wg], o_smem.at[wg]
      col_stat = plgpu.Layout.WGMMA.reduce(0)
      cols_iota = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 1, layout=plgpu.Layout.WGMMA)
      if causal:
        row_iota = plgpu.broadcasted_iota(jnp.int32, (bk,), 0,
                                          layout=plgpu.Layout.WGMMA.reduce(1))
      cols_of = lambda x: lax.broadcast_in_dim(x, (bk, bq), [1])

      def settle(owed):
        """Observe the other consumer's last turn (`owed`: it took the step before and this
        one has not awaited its `read` since): before overwriting the ds^T or k tile its
        products read."""
        pl.when(owed != 0)(lambda: plgpu.barrier_wait(ds_bars[1].at[1 - wg]))

      def put_ds(ds16, step, owed):
        """Both consumers put ds^T in shared memory (for `add_dq`). `ready[c]`: both tiles
        written for consumer c's turn; `read[c]`: c's products have read them (and the k
        tiles: awaited by the other consumer before it overwrites its tiles)."""
        ready = ds_bars[0]
        settle(owed)
        ds_smem.at[wg][...] = ds16
        plgpu.commit_smem()
        plgpu.barrier_arrive(ready.at[lax.rem(step, 2)])

      def add_dq(prog, piece, j, step):
        """The consumer whose turn it is adds dq = ds_0 k_0 + ds_1 k_1 of the query block."""
        ready, read, acc_bar = ds_bars

        @pl.when(lax.rem(step, 2) == wg)
        def _():
          plgpu.barrier_wait(ready.at[wg])

          def product(acc):
            zero = opaque(jnp.int32(0))
            for i in range(2):
              plgpu.wgmma(acc, ds_smem.at[zero + i].T, k_smem.at[zero + i])
            return acc[...]

          dq = pl.run_scoped(product, plgpu.ACC((bq, d), jnp.float32))
          plgpu.barrier_arrive(read.at[wg])
          h, acc_b = piece.head, prog.b + wg * batch if interpret else prog.b
          add_at = functools.partial(
              _at_rows, *dq_refs, prog.base + piece.first, j * bq, bq, piece.stride, L,
              lambda rows, c: (acc_b, rows, h) if c is None else (acc_b, rows, c, h))
          _add_rows(add_at, dq, o_tile, acc_bar.at[wg], interpret)

      def load_rows(prog):
        """This consumer's key rows of item `prog`: k and v."""
        b, head, cls, k_rows = prog.b, prog.head, prog.cls, prog.rows(wg, bk)

        @pl.when(prog.busy)
        def _():
          plgpu.copy_gmem_to_smem(k_ref.at[b, k_rows, cls, head], k_tile, row_bars[0].at[wg])
          plgpu.copy_gmem_to_smem(v_ref.at[b, k_rows, cls, head], v_tile, row_bars[1].at[wg])

      # Split kernel: the next item's rows load during this one's stores. (The fused one's k
      # tiles are read by the other consumer's dq products until it settles: loaded late.)
      early = not fused
      if early:
        load_rows(prog_of(0))

      def item(i, prog, carry):
        step, owed = carry
        b, head, cls = prog.b, prog.head, prog.cls  # head: the key/value head
        k_start = prog.start + wg * bk
        k_rows = prog.rows(wg, bk)

        @pl.when(prog.busy)
        def _():
          if fused:
            settle(owed)
          if not early:
            load_rows(prog)
          plgpu.barrier_wait(row_bars[0].at[wg])
          plgpu.barrier_wait(row_bars[1].at[wg])

        k_pos = prog.first + L * (k_start + row_iota) if causal else None
        k_last = prog.first + L * (jnp.minimum(k_start + bk, prog.nrows) - 1)

        def block(carry, piece, j, masked: bool):
          """One query block: s^T = k q^T and dp^T = v dout^T, p^T = exp2(s^T c + log2 m -
          lse2), dv += p^T dout, ds^T = p^T (dp^T - delta), dk += ds^T q (and dq)."""
          dk, dv, step, owed = carry
          slot = lax.rem(step, stages)
          plgpu.barrier_wait(q_bar.at[slot])
          plgpu.barrier_wait(do_bar.at[slot])
          me = opaque(wg)  # k_tile, v_tile, indexed per block (`opaque`)
          s_t, dp_t = products([(k_smem.at[me], q_smem.at[slot].T),
                                 (v_smem.at[me], do_smem.at[slot].T)], (bk, bq))
          plgpu.barrier_wait(lse_bar.at[slot])
          plgpu.barrier_wait(delta_bar.at[slot])
          lse2 = plgpu.load(lse_smem.at[slot], layout=col_stat)
          delta_j = plgpu.load(delta_smem.at[slot], layout=col_stat)
          plgpu.barrier_arrive(stat_free.at[slot])
          p_t = jnp.exp2(jnp.minimum(s_t * qk_scale - cols_of(lse2 - piece.bias), 0.0))
          if masked:
            lo, hi = _query_bounds(piece, j * bq, k_pos, causal, L, span)
            visible = cols_iota < hi
            if causal:
              visible = visible & (cols_iota >= lax.broadcast_in_dim(lo, (bk, bq), [0]))
            p_t = jnp.where(visible, p_t, 0.0)
          ds16 = (p_t * (dp_t - cols_of(delta_j))).astype(dtype)
          if fused:
            put_ds(ds16, step, owed)
          dv, dk = accumulate([dv, dk], [(p_t.astype(dtype), do_smem.at[slot]),
                                           (ds16, q_smem.at[slot])], interpret)
          plgpu.barrier_arrive(do_free.at[slot])
          plgpu.barrier_arrive(q_free.at[slot])
          if fused:
            add_dq(prog, piece, j, step)
          return dk, dv, step + 1, (lax.rem(step, 2) != wg).astype(jnp.int32)

        zeros = plgpu.layout_cast(jnp.zeros((bk, d), jnp.float32), plgpu.Layout.WGMMA)
        ranges = query_ranges(prog, pieces_ref, bias_ref, k_last)
        owed = jnp.where(prog.busy, 0, owed)  # settled above
        dk, dv, step, owed = _walk(prog, ranges, block, (zeros, zeros, step, owed))
        if early:
          pl.when(i + 1 < count)(lambda: load_rows(prog_of(i + 1)))

        @pl.when(prog.busy)
        def _():
          if two_tiles:  # dk and dv each in a tile of its own: one wait, two stores
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            grads, tiles = [dk * scale, dv], [o_smem.at[wg + 2 * t] for t in range(2)]
            _add_prior(prior_refs, b, k_rows, cls, head, tiles, prior_bars, wg, grads)
            for tile, grad in zip(tiles, grads):
              tile[...] = grad.astype(o_tile.dtype)
            plgpu.commit_smem()
            for tile, out_ref in zip(tiles, (dk_ref, dv_ref)):
              plgpu.copy_smem_to_gmem(tile, out_ref.at[b, k_rows, cls, head])
            return
          for t, (grad, out_ref) in enumerate(((dk * scale, dk_ref), (dv, dv_ref))):
            # The store before (the item before's dv, dk, a dq block) has read the tile.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            grad = [grad]
            _add_prior(prior_refs[t:t + 1], b, k_rows, cls, head, [o_tile],
                       prior_bars[t:t + 1], wg, grad)
            o_tile[...] = grad[0].astype(o_tile.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_tile, out_ref.at[b, k_rows, cls, head])

        return step, owed

      _, owed = loop(item, (jnp.int32(0), jnp.int32(0)))
      if fused:  # observe the last turn's release (interpret mode checks every phase)
        settle(owed)
      plgpu.wait_smem_to_gmem(0)

    pl.when(wg < 2)(consumer)
    pl.when(wg == 2)(producer)

  def entry(origin_ref, rows_ref, pieces_ref, bias_ref, k_ref, v_ref, q4_ref, q5_ref, do4_ref,
            do5_ref, lse4_ref, lse5_ref, delta4_ref, delta5_ref, *refs):
    split = len(refs) - 2 - (prior is not None) * 2
    dq_refs, prior_refs, (dk_ref, dv_ref) = refs[:split], refs[split:-2], refs[-2:]
    prior_refs = prior_refs or (None, None)
    if L == 1 and fused:
      dq_refs = (*dq_refs, None)
    tiles = swizzled(dtype)
    smem = [plgpu.SMEM((2, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((4 if two_tiles else 2, bk, d), out_dtype,
                       transforms=swizzled(out_dtype))]
    bars = [(plgpu.Barrier(num_barriers=2),) * 2, *(plgpu.Barrier(num_barriers=stages),) * 4,
            (None, None) if prior is None else (plgpu.Barrier(num_barriers=2),) * 2]
    if fused:
      smem.append(plgpu.SMEM((2, bk, bq), dtype, transforms=tiles))
      bars.append((plgpu.Barrier(num_arrivals=2, num_barriers=2),
                   plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)))
    pl.run_scoped(
        lambda smem, bars, free: kernel(
            origin_ref, rows_ref, pieces_ref, bias_ref, k_ref, v_ref, q4_ref, q5_ref, do4_ref,
            do5_ref, lse4_ref, lse5_ref, delta4_ref, delta5_ref, dq_refs, prior_refs, dk_ref,
            dv_ref, smem, bars, free),
        smem, bars,
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 3,
        collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((batch, n_out // L, L, num_kv, d), out_dtype),) * 2
  rows, pieces, bias = tables
  view = functools.partial(_strided_view, stride=L)
  args = (work.table(rows), pieces.reshape(-1), bias, view(k), view(v), q, view(q), dout,
          view(dout), *stats, *(dq_accs or ()), *map(view, prior or ()))
  dk, dv = run(entry, out_type, work.grid, args, interpret)
  return tuple(x.reshape(batch, n_out, num_kv, d) for x in (dk, dv))


def forward(q, k, v, pattern: DilatedPattern, scale: float, *, branches=None, config=None,
            out_dtype=None):
  """`(out, lse)` of `branches` (all if None): `out` in float32, or in `out_dtype` when
  given. Several launches chain: each merges the result so far (in `out_dtype`: the earlier
  launches' output rounded once more, at 16 bits about the output's own rounding) into its
  own in float32 registers, in its epilogues (measured on that 8K LongNet's two launches with
  the merge apart: 16-bit partials made the forward faster than float32 ones, the output
  tile taking the query tile's place, so the next item's queries load during this one;
  docs/performance.md)."""
  config = config or Config()  # resolved per launch (`_forward`)
  fn = lambda q, k, v: _forward(q, k, v, pattern, scale, branches, config, out_dtype)
  return batched(fn)(q, k, v)


def _itemsize(out_dtype) -> int:
  return 4 if out_dtype is None else jnp.dtype(out_dtype).itemsize


def _long_keys(sched: schedule.Schedule, causal: bool) -> bool:
  """Whether a launch's rows read unmasked, unstrided pieces that blocks of 192 keys
  cover with at most 1% to spare (full attention from ~19K keys)."""
  lengths = sched.pieces[:, schedule.PIECE_LENGTH]
  covered = -(-lengths // _LONG_BLOCK_K) * _LONG_BLOCK_K
  return (not causal and sched.stride == 1 and len(lengths) > 0
          and covered.sum() <= 1.01 * lengths.sum())


def _padded(n, sched):
  """`(Np, pad)`: `pad(x, value, axis)` fills `x`'s position axis up to `Np`, a multiple of
  `8 L` (TMA into tiled shared memory needs the views' row axes in whole tiles of 8); no
  copy when `Np = N`."""
  n_pad = -(-n // (8 * sched.stride)) * 8 * sched.stride

  def pad(x, value=0.0, axis=1):
    if n_pad == n:
      return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n_pad - n)
    return jnp.pad(x, widths, constant_values=value)

  return n_pad, pad


def _to_rows(arrays, rows: int, fills):
  """The earlier launches' results `[B, N', ...]` cut or padded (with `fills`) to a launch's
  `rows`, for its epilogues to merge or add."""
  return tuple(jnp.pad(x[:, :rows], [(0, 0), (0, rows - min(rows, x.shape[1]))]
                       + [(0, 0)] * (x.ndim - 2), constant_values=fill)
               for x, fill in zip(arrays, fills))


def _forward(q, k, v, pattern, scale, branches, config, out_dtype):
  batch, n, num_heads, d = q.shape
  resolved = functools.partial(config.resolved, d, q.dtype.itemsize, _itemsize(out_dtype))
  if why := geometry_problem(pattern, n, num_heads, k.shape[2], branches, resolved(), batch):
    raise NotImplementedError(why)
  launches = _launches(pattern, n, num_heads, branches)
  result = None
  for fused in launches:
    sched = schedule.build(pattern, n, num_heads, k.shape[2], fused, False)
    n_pad, pad = _padded(n, sched)
    launch_config = resolved(_long_keys(sched, pattern.causal))
    if result is not None:  # merged in this launch's epilogues
      result = _to_rows(result, _n_out(sched, n_pad, 2 * launch_config.block_q),
                        (0.0, -jnp.inf))
    result = _forward_launch(pad(q), pad(k), pad(v), sched.arrays(), sched, n, pattern.causal,
                             scale, out_dtype or jnp.float32, launch_config, result)
  return result[0][:, :n], result[1][:, :n]


def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, *,
             branches=None, config=None, grad_dtype=None):
  """float32 `(dq, dk, dv)` of `branches` from the global `lse` and `delta`: a dk/dv kernel
  over key rows (the transposed schedule) that also adds dq (`Config.fused_backward`), or
  with a dq kernel over query rows (the forward's schedule); each launch's kernels add the
  earlier launches' gradients to their own in their epilogues (fused: dk, dv; dq added to
  the float32 accumulators' sum). With `grad_dtype` bfloat16 the separate kernels write the
  gradients in bfloat16 (no float32 copy; the earlier launches' read in bfloat16 and added
  in float32). Head dims 64 and 128 (`supports`)."""
  config = (config or Config()).resolved(q.shape[-1], q.dtype.itemsize)
  final = grad_dtype is not None and jnp.dtype(grad_dtype) == jnp.bfloat16
  fn = lambda *a: _backward(*a, pattern, scale, branches, config, final)
  return batched(fn)(q, k, v, dout, lse, delta)


def _backward(q, k, v, dout, lse, delta, pattern, scale, branches, config, final):
  batch, n, num_heads, _ = q.shape
  num_kv = k.shape[2]
  if why := geometry_problem(pattern, n, num_heads, num_kv, branches, config, batch):
    raise NotImplementedError(why)
  dout = dout.astype(q.dtype)
  # lse in base 2, +inf where a query sees no key (p = 0 there); [B, H, N] like delta.
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32)) * LOG2E
  lse2, delta = lse2.transpose(0, 2, 1), delta.astype(jnp.float32).transpose(0, 2, 1)
  launches = _launches(pattern, n, num_heads, branches)
  out_dtype = jnp.bfloat16 if final else jnp.float32
  grads = None  # the launches' so far, added in the next one's epilogues
  for fused in launches:
    sched = schedule.build(pattern, n, num_heads, num_kv, fused, False)
    n_pad, pad = _padded(n, sched)
    L = sched.stride
    x = [pad(t) for t in (q, k, v, dout)]
    flat = (pad(lse2, jnp.inf, 2), pad(delta, 0.0, 2))
    strided = [t.reshape(batch, num_heads, n_pad // L, L).transpose(0, 1, 3, 2) for t in flat]
    transposed = schedule.build(pattern, n, num_heads, num_kv, fused, True)
    stats = (flat[0], strided[0], flat[1], strided[1])
    cfg = config.backward_for(L, q.shape[-1], q.dtype.itemsize)
    if grads is not None:  # in the dtype of this launch's outputs (float32 when fused)
      dtype = jnp.float32 if cfg.fused_backward else out_dtype
      grads = tuple(g.astype(dtype)
                    for g in _to_rows(grads, _n_out(sched, n_pad, _ROW_BLOCK), (0.0,) * 3))
    if cfg.fused_backward:
      dq, dk, dv = _fused_backward(x, stats, transposed, n, pattern.causal, scale, cfg,
                                   grads)
    else:
      dq = _dq_launch(*x, *strided, sched.arrays(), sched, n, pattern.causal, scale, cfg,
                      out_dtype, None if grads is None else grads[0])
      dk, dv = _dkdv_launch(*x, stats, transposed.arrays(), transposed, n, pattern.causal,
                            scale, cfg, out_dtype=out_dtype,
                            prior=None if grads is None else grads[1:])
    grads = dq, dk, dv
  return tuple(g[:, :n] for g in grads)


def _fused_backward(x, stats, transposed: schedule.Schedule, n, causal, scale, config,
                    prior=None):
  """dq, dk, dv of one launch from the dk/dv kernel alone: dq added into zeroed float32
  accumulators (a second one in the strided view when L > 1: TMA cannot address one array
  through both; one per consumer in interpret mode), summed here; plus `prior` (float32
  `(dq, dk, dv)` of the earlier launches, `[B, No, ...]`)."""
  batch, n_pad, num_heads, d = x[0].shape
  L = transposed.stride
  copies = 2 if config.interpret else 1
  # Query blocks round up past their piece (adding zeros there): one block of slack.
  n_acc = _n_out(transposed, n_pad, _ROW_BLOCK) + _BWD_BLOCK * L
  shapes = [(copies * batch, n_acc, num_heads, d)]
  if L > 1:
    shapes.append((copies * batch, n_acc // L, L, num_heads, d))
  accs = [jax.new_ref(jnp.zeros(shape, jnp.float32)) for shape in shapes]
  dk, dv = _dkdv_launch(*x, stats, transposed.arrays(), transposed, n, causal, scale, config,
                        dq_accs=accs, prior=None if prior is None else prior[1:])
  dq = sum(acc[...].reshape(copies, batch, n_acc, num_heads, d).sum(0) for acc in accs)
  dq = dq[:, :dk.shape[1]] * scale
  return dq if prior is None else dq + prior[0], dk, dv
