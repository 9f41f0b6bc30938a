"""Block schedule of the "triton" backend: which keys each query row visits, and with which
multiplicity (NumPy, built on the host once per shape and cached).

docs/SPEC.md counts a key once per branch that sees it: `den = sum_j m(i, j, h) exp(s(i, j))`. A key
seen by several branches need not be scored several times: it is scored once with the bias
`log m`. For LongNet's pattern `w = (2048, 4096, 8192), r = (1, 2, 4)` with
`offsets="head"` this scores 1.375 instead of 1.75 keys per query and segment position (-21%
work), and a query block gets its final output in one program: no per-branch partial results.

Geometry. The sequence is cut into periods of `P` tokens (a common multiple of the branch
segment lengths, or all of N), each period into intervals of `W0` tokens (the shortest
segment), each interval into `L` strided rows (`L` the lcm of the dilation rates; row `a` of
an interval holds its positions `a, a + L, ...`). A query row shares a segment and a residue
with every one of its positions in every branch, so the multiplicity of a key depends only
on the key's interval and class `(p % W0) % L`. A row visits *pieces*: runs
`first, first + s, ...` (`s` is 1 or `L`) of keys sharing one multiplicity `m > 0`, as few
and as long as the pattern allows (full attention: one piece per row); `bias` holds each
piece's `log2 m`. The kernels walk each piece in blocks with plain strided addressing, and
work out under a causal mask which blocks need masking. For dk/dv the roles swap: key rows (per
key/value head) and query pieces (from each query head that reads the row's kv head).

Branches are scheduled together when their segments nest (every `w` a multiple of the
shortest), their rows are long enough (`min_row`: 16 positions, or a backend's block) and a
period holds few intervals. `launches` cuts the branches, in order, greedily into the
longest runs that qualify (a single branch always does: one schedule per run, merged by the
caller): all at once where that qualifies, else e.g. the LM pattern
`w = (512, 2048, 8192), r = (1, 4, 16)` in blocks of 128 as {512/1, 2048/4} (rows of 128)
and {8192/16} (rows of 512).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from ..pattern import DilatedPattern, heads_per_kv
from .common import FAR, reduce_windows

_MIN_UNION_ROW = 16  # shortest strided row for which branches are scheduled together
_MAX_INTERVALS = 64  # most shortest-segments per period (the host tables grow with its square)

# Columns of the tables, shared with the kernels (`_triton_kernels.py`).
# rows: the row's head (query head; key/value head when transposed), its first position, its
# length in a whole period, and its pieces [first, end).
ROW_HEAD, ROW_FIRST, ROW_LENGTH, ROW_PIECE0, ROW_PIECE1, ROW_COLUMNS = range(6)
# pieces: the head of the other side, first position, stride, length.
PIECE_HEAD, PIECE_FIRST, PIECE_STRIDE, PIECE_LENGTH, PIECE_COLUMNS = range(5)


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """One launch's schedule. Positions are relative to the start of a period.

  rows: int32 `[R, ROW_COLUMNS]`; pieces: int32 `[E, PIECE_COLUMNS]` (the column names
    above); bias: float32 `[E]`: `log2 m` of each piece.

  Launch geometry: a program per (row block, row) on the grid's first axis, row-major
  (`row * row_blocks + block`), and per (batch, period) on the second (`b * periods + p`);
  `_triton_kernels._program` decodes the same (mosaic's packed causal launches number theirs
  block-major: `mosaic_plan.Work.interleaved`).
  """
  period: int
  periods: int
  stride: int
  longest_row: int
  rows: np.ndarray
  pieces: np.ndarray
  bias: np.ndarray

  def row_blocks(self, block: int) -> int:
    """Blocks of `block` positions in the longest row (every row gets as many programs)."""
    return -(-self.longest_row // block)

  def grid(self, batch: int, block: int) -> tuple[int, int]:
    return len(self.rows) * self.row_blocks(block), self.periods * batch

  def block_windows(self, windows, n: int, block: int, groups: int = 1):
    """The document windows and runs `(u0, u1, r0, r1)` of `common.contract_windows`
    (`[4, B, N, X]`) over each program's block of `block` positions of its row (the rows cut
    at `n`): the union of the block's windows and the intersection of its runs, int32 `[B,
    periods, R, row_blocks, groups, 4]` (flat; lo > hi where no window, r0 > r1 where no
    run), in the grid's order, as `_triton_kernels._block_window` reads them. The column of
    the row's head where X > 1 (per query head; a key row's: each of the `groups` query heads
    reading its key/value head), else X's only one.

    Reduced on the device before a launch rather than by each program: gathering its rows'
    windows made a program's start wait (design table of docs/performance.md)."""
    blocks, stride = self.row_blocks(block), self.stride
    # Rows of one first position, length and column (every head's, where X is 1) share their
    # blocks' windows: each is reduced once.
    heads = self.rows[:, ROW_HEAD] if windows.shape[-1] > 1 else np.zeros_like(self.rows[:, 0])
    rows, which = np.unique(np.stack([self.rows[:, ROW_FIRST], self.rows[:, ROW_LENGTH], heads],
                                     axis=1), axis=0, return_inverse=True)
    base = jnp.arange(self.periods, dtype=jnp.int32)[:, None, None] * self.period
    first = jnp.asarray(rows[:, 0])[None, :, None]
    count = jnp.minimum(jnp.asarray(rows[:, 1])[None, :, None],
                        jnp.maximum(n - base - first + stride - 1, 0) // stride)
    i = jnp.arange(blocks * block, dtype=jnp.int32)
    shape = (self.periods, len(rows), blocks, block, 1)
    positions = jnp.minimum(base + first + stride * i, n - 1).reshape(shape)
    valid = (i < count).reshape(shape)
    columns = rows[:, 2:] * groups + np.arange(groups) if windows.shape[-1] > 1 else rows[:, 2:]
    w = windows[:, :, positions, jnp.asarray(columns)[None, :, None, None, :]]
    w = [jnp.where(valid, x, fill) for x, fill in zip(w, (FAR, -1, -1, FAR))]
    reduced = [x[:, :, which.reshape(-1)] for x in reduce_windows(w, axis=-2)]
    return jnp.stack(reduced, axis=-1).reshape(-1)  # [B, P, R, RB, G, 4]

  def arrays(self):
    """(rows, pieces, bias) as device arrays (one never-read piece when there are none)."""
    pieces = self.pieces if len(self.pieces) else np.zeros((1, PIECE_COLUMNS), np.int32)
    return tuple(jnp.asarray(x) for x in (self.rows, pieces, self.bias))


def launches(pattern: DilatedPattern, n: int, num_heads: int, branches=None, *,
             min_row: int = _MIN_UNION_ROW) -> list[tuple[int, ...]]:
  """The branches of each launch (the caller merges the launches' results): consecutive
  branches, in layout order, grouped greedily, each group the longest run from where the
  last one ended that `_fits` (a single branch always does). `min_row`: the shortest strided
  row of a group of several branches (a backend whose programs take rows in blocks passes
  its block)."""
  layout = pattern.layout(n, num_heads, branches)
  groups, start = [], 0
  while start < len(layout):
    end = next(e for e in range(len(layout), start, -1)
               if e - start == 1 or _fits(layout[start:e], n, min_row))
    groups.append(tuple(br.index for br in layout[start:end]))
    start = end
  return groups


def _fits(layout, n: int, min_row: int) -> bool:
  """Whether these branches can be scheduled together: their segments nest, their strided
  rows are at least `min_row` long, and a period holds at most `_MAX_INTERVALS` intervals."""
  w0, stride, period = _geometry(layout)
  nested = all(br.w % w0 == 0 or br.w == n for br in layout) and w0 % stride == 0
  return nested and w0 // stride >= min_row and period // w0 <= _MAX_INTERVALS


def _geometry(layout):
  """(interval length w0, row stride L, period P) of branches scheduled together."""
  n, ws = layout[0].n, [br.w for br in layout]
  period = n if n in ws else min(math.lcm(*ws), n)
  return min(ws), math.lcm(*(br.r for br in layout)), period


@functools.lru_cache(maxsize=64)
def build(pattern: DilatedPattern, n: int, num_heads: int, num_kv_heads: int, fused,
          transposed: bool) -> Schedule:
  """The schedule of the branches `fused` (a tuple from `launches`).

  Forward and dq schedules (`transposed=False`) have query rows and key pieces; dk/dv
  schedules have key rows (per key/value head) and query pieces (from each query head that
  reads the row's key/value head).
  """
  layout = pattern.layout(n, num_heads, fused)
  w0, stride, period = _geometry(layout)
  intervals = -(-period // w0)
  starts = np.arange(intervals) * w0
  lengths = np.minimum(starts + w0, period) - starts
  # row_len[j, a]: positions of class a (offset a from the interval start) in interval j.
  row_len = np.maximum((lengths[:, None] - np.arange(stride)[None, :] + stride - 1) // stride, 0)

  # mult[h, i, a, j, c]: branches in which (interval i, class a) and (interval j, class c)
  # see each other for query head h. Classes are positions mod L, and r divides L, so a
  # class's residue in a branch is its class mod r.
  classes = np.arange(stride)
  mult = np.zeros((num_heads, intervals, stride, intervals, stride), np.int32)
  for br in layout:
    seg = starts // br.w
    same_seg = seg[:, None] == seg[None, :]
    same_res = (classes[:, None] % br.r) == (classes[None, :] % br.r)
    for h in br.heads:
      res_ok = np.isin(classes % br.r, br.residues(h))
      vis = same_res & res_ok[:, None] & res_ok[None, :]
      mult[h] += same_seg[:, None, :, None] & vis[None, :, None, :]

  per_kv = heads_per_kv(num_heads, num_kv_heads)
  rows, pieces = [], []
  for head in range(num_kv_heads if transposed else num_heads):
    others = range(head * per_kv, (head + 1) * per_kv) if transposed else [head]
    for i in range(intervals):
      for a in range(stride):
        count = int(row_len[i, a])
        if count == 0:
          continue
        p0 = len(pieces)
        for h in others:
          m = mult[h, :, :, i, a] if transposed else mult[h, i, a]  # [interval, class]
          # (head, first, stride, length: the PIECE_* columns in order, then m)
          pieces += [(h, *run) for run in _runs(m, starts, lengths, w0)]
        row = [0] * ROW_COLUMNS
        row[ROW_HEAD], row[ROW_FIRST], row[ROW_LENGTH] = head, int(starts[i]) + a, count
        row[ROW_PIECE0], row[ROW_PIECE1] = p0, len(pieces)
        rows.append(row)
  return Schedule(
      period=period, periods=-(-n // period), stride=stride, longest_row=int(row_len.max()),
      rows=np.array(rows, np.int32).reshape(-1, ROW_COLUMNS),
      pieces=np.array([p[:PIECE_COLUMNS] for p in pieces], np.int32).reshape(-1, PIECE_COLUMNS),
      bias=np.log2(np.array([p[PIECE_COLUMNS] for p in pieces] or [1], np.float32)))


def _runs(m, starts, lengths, w0):
  """(first, stride, length, m) runs covering the positions where `m [interval, class] > 0`.

  In each interval the visible classes form one run of stride 1 when all are visible with
  one multiplicity, else one run of stride `L` per class (the kernels compile these two
  strides as constants); a run continues into the next interval when that has the same
  class with the same multiplicity.
  """
  stride = m.shape[1]
  done, open_ = [], {}
  for j in range(len(starts)):
    s = 1 if (m[j] == m[j, 0]).all() else stride
    runs = {(s, c, int(m[j, c])) for c in range(s) if m[j, c] > 0}
    for key in list(open_):
      if key not in runs or w0 % key[0]:
        done.append((key, open_.pop(key)))
    for key in sorted(runs):
      s, c, mult = key
      length = max(0, -(-(int(lengths[j]) - c) // s))
      if not length:
        continue
      first, total = open_.get(key, (int(starts[j]) + c, 0))
      open_[key] = (first, total + length)
  return [(first, s, length, mult)
          for (s, _, mult), (first, length) in done + list(open_.items())]
