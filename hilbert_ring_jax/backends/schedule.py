"""Block schedule of the "triton" backend: which key blocks each query row visits, and with
which multiplicity (pure NumPy, built on the host once per shape and cached).

SPEC counts a key once per branch that sees it: `den = sum_j m(i, j, h) exp(s(i, j))`. A key
seen by several branches need not be scored several times: it is scored once with the bias
`log m`. For LongNet's pattern `w = (2048, 4096, 8192), r = (1, 2, 4)` with
`offsets="head"` this scores 1.375 instead of 1.75 keys per query and segment position (-21%
work), and a query block gets its final output in one program: no per-branch partial results.

Geometry. The sequence is cut into periods of `P` tokens (a common multiple of the branch
segment lengths, or all of N), each period into intervals of `w0` tokens (the shortest
segment), each interval into `L` strided rows (`L` the lcm of the dilation rates; row `a`
holds the positions `a, a + L, ...` of the interval). Within one interval, one row shares a
segment and a residue with every other position of its row in every branch, so the
multiplicity of (query row, key row) is one number. A *row* is such a strided run of queries
(or, for dk/dv, of keys). Its *entries* are blocks of `E` positions of the other side, each
with a head, a first position, a length and `log2 m`: full blocks (`E` positions) go to the F
list, sorted by position, and ragged blocks to the T list. `counts[row, block]` says, for
block `block` of the row, how many F entries are fully visible (no mask), how many are
visible at all, and how many T entries are visible (causal masking cuts these lists short;
without it they are the whole lists).

Patterns whose segments do not nest (every `w` a multiple of the shortest) or whose rows
would be short are scheduled branch by branch (one schedule per branch, merged by the
caller).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from ..pattern import DilatedPattern

_MIN_UNION_ROW = 16  # shortest strided row for which branches are scheduled together


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """One launch's block schedule. Positions are relative to the start of a period.

  rows: int32 `[R, 7]`: head (query head; key/value head when transposed), first position,
    length in a whole period, F range `[f0, f1)`, T range `[t0, t1)` in `entries`.
  entries: int32 `[E, 3]`: head (of the other side), first position, length.
  bias: float32 `[E]`: `log2 m` of the entry.
  counts: int32 `[R, row_blocks, 3]`: F entries fully visible, F entries visible, T entries
    visible, for each block of `row_block` positions of the row.
  """
  period: int
  periods: int
  stride: int
  row_blocks: int
  rows: np.ndarray
  entries: np.ndarray
  bias: np.ndarray
  counts: np.ndarray


def _groups(pattern: DilatedPattern, n: int, branches) -> list[tuple[int, ...]]:
  """The branches scheduled together: all at once when their segments nest, else one by one."""
  branches = tuple(range(pattern.num_branches)) if branches is None else tuple(branches)
  ws = [min(pattern.segment_lengths[b], n) for b in branches]
  w0 = min(ws)
  stride = math.lcm(*(pattern.dilation_rates[b] for b in branches))
  nested = all(w % w0 == 0 or w == n for w in ws) and w0 % stride == 0
  if len(branches) == 1 or (nested and w0 // stride >= _MIN_UNION_ROW):
    return [branches]
  return [(b,) for b in branches]


def schedules(pattern: DilatedPattern, n: int, num_heads: int, num_kv_heads: int, branches,
              row_block: int, entry_block: int, transposed: bool) -> list[Schedule]:
  """The schedules that together compute `branches` (all if None) of `pattern`.

  Forward and dq schedules (`transposed=False`) have query rows and key entries; dk/dv
  schedules have key rows (per key/value head) and query entries (from each query head
  that reads the row's key/value head).
  """
  return [_schedule(pattern, n, num_heads, num_kv_heads, group, row_block, entry_block,
                    transposed)
          for group in _groups(pattern, n, branches)]


@functools.lru_cache(maxsize=64)
def _schedule(pattern, n, num_heads, num_kv_heads, group, row_block, entry_block, transposed):
  ws = [min(pattern.segment_lengths[b], n) for b in group]
  rs = [pattern.dilation_rates[b] for b in group]
  ranges = pattern.head_ranges(num_heads)
  w0 = min(ws)
  stride = math.lcm(*rs)
  period = n if any(w == n for w in ws) else min(math.lcm(*ws), n)
  intervals = -(-period // w0)
  starts = np.arange(intervals) * w0
  lengths = np.minimum(starts + w0, period) - starts
  # row_len[j, a]: positions of class a (offset a from the interval start) in interval j.
  row_len = np.maximum((lengths[:, None] - np.arange(stride)[None, :] + stride - 1) // stride, 0)

  # mult[h, i, a, j, c]: branches in which (interval i, class a) and (interval j, class c)
  # see each other for query head h.
  classes = np.arange(stride)
  mult = np.zeros((num_heads, intervals, stride, intervals, stride), np.int32)
  for b, w, r in zip(group, ws, rs):
    seg = starts // w
    same_seg = seg[:, None] == seg[None, :]
    same_res = (classes[:, None] % r) == (classes[None, :] % r)
    h0, h1 = ranges[b]
    for h in range(h0, h1):
      res_ok = np.ones(stride, bool)
      if pattern.offsets == "head":
        res_ok = classes % r == h % r
      vis = same_res & res_ok[:, None] & res_ok[None, :]
      mult[h] += same_seg[:, None, :, None] & vis[None, :, None, :]

  group_size = num_heads // num_kv_heads
  rows, entries, bias, counts = [], [], [], []
  row_blocks = -(-int(row_len.max()) // row_block)
  for head in range(num_kv_heads if transposed else num_heads):
    others = range(head * group_size, (head + 1) * group_size) if transposed else [head]
    for i in range(intervals):
      for a in range(stride):
        count = int(row_len[i, a])
        if count == 0:
          continue
        first = int(starts[i]) + a
        full, ragged = [], []
        for h in others:
          m = mult[h, :, :, i, a] if transposed else mult[h, i, a]  # [interval, class]
          for c in range(stride):
            j = 0
            while j < intervals:  # maximal runs of equal multiplicity along the row
              k = j
              while k + 1 < intervals and m[k + 1, c] == m[j, c]:
                k += 1
              if m[j, c] > 0:
                first_e = int(starts[j]) + c
                length = int(row_len[j:k + 1, c].sum())
                for s in range(0, length, entry_block):
                  e = (h, first_e + s * stride, min(entry_block, length - s), math.log2(m[j, c]))
                  (full if e[2] == entry_block else ragged).append(e)
              j = k + 1
        # Sorted by when they become visible: by position, or (keys seeing later queries)
        # by minus the last position.
        last = lambda e: -(e[1] + stride * (e[2] - 1)) if transposed else e[1]
        full.sort(key=last)
        ragged.sort(key=last)
        f0 = len(entries)
        entries += full
        t0 = len(entries)
        entries += ragged
        rows.append((head, first, count, f0, t0, t0, len(entries)))
        counts.append(_visible(full, ragged, first, count, stride, row_block, row_blocks,
                               entry_block, pattern.causal, transposed))
  ents = np.array([e[:3] for e in entries], np.int32).reshape(-1, 3)
  return Schedule(period=period, periods=-(-n // period), stride=stride, row_blocks=row_blocks,
                  rows=np.array(rows, np.int32).reshape(-1, 7), entries=ents,
                  bias=np.array([e[3] for e in entries], np.float32),
                  counts=np.stack(counts).astype(np.int32))


def _visible(full, ragged, first, count, stride, row_block, row_blocks, entry_block, causal,
             transposed):
  """`[row_blocks, 3]`: F fully visible, F visible, T visible, per block of the row."""
  out = np.zeros((row_blocks, 3), np.int64)
  out[:, :2] = len(full)
  out[:, 2] = len(ragged)
  if not causal:
    return out
  blk = np.arange(row_blocks) * row_block
  lo = first + stride * blk  # first and last position of each row block
  hi = first + stride * (np.minimum(blk + row_block, count) - 1)
  f_lo = np.array([e[1] for e in full], np.int64)
  f_hi = f_lo + stride * (entry_block - 1)
  t_lo = np.array([e[1] for e in ragged], np.int64)
  if transposed:  # keys see the queries at or after them: mirror the positions
    lo, hi = -hi, -lo
    f_lo, f_hi = -f_hi, -f_lo
    t_lo = -(t_lo + stride * (np.array([e[2] for e in ragged], np.int64) - 1))
  out[:, 0] = np.searchsorted(f_hi, lo, side="right")
  out[:, 1] = np.searchsorted(f_lo, hi, side="right")
  out[:, 2] = np.searchsorted(t_lo, hi, side="right")
  return out
