"""The triton backend's block schedule, replayed on the host the way its kernels walk it,
must reproduce SPEC's multiplicities m(i, j, h) exactly, and each program's packed-row window
its rows' (CPU: no Triton needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_np

from hilbert_ring_jax import DilatedPattern
from hilbert_ring_jax.backends import common, schedule

CASES = [  # n, H, Hkv, segments, rates, offsets, head_groups
    (64, 2, 2, (64,), (1,), "head", False),
    (80, 4, 2, (16, 32, 64), (1, 2, 4), "head", False),
    (100, 4, 4, (16, 32, 64), (1, 2, 4), "all", False),  # ragged periods
    (45, 4, 4, (12, 20), (3, 4), "all", False),  # not nested: branch by branch
    (40, 5, 5, (8, 16, 32), (1, 2, 4), "head", True),
    (48, 6, 2, (8, 48), (2, 3), "head", True),
    (40, 4, 2, (16, 32), (2, 4), "head", False),
    (70, 2, 1, (9, 70), (2, 1), "all", False),  # w % r != 0
    (300, 4, 2, (64, 128, 256), (1, 2, 4), "head", False),  # scheduled together
    (300, 2, 2, (64, 128, 192), (1, 2, 4), "all", False),  # period 384 > n
    (200, 2, 1, (64, 200), (2, 4), "head", True),  # together, w == n
    (128, 4, 2, (32, 64, 128), (1, 2, 8), "head", False),  # launches (0, 1) and (2,)
]


def block_ranges(first, stride, count, lo, hi, block, causal, transposed):
  """The kernels' `_ranges`: blocks of a piece, masked `[a, b)` and `[c, d)`, unmasked `[b, c)`,
  for a row block spanning positions `lo..hi`."""
  cdiv = lambda x, y: -(-x // y)
  if not transposed:
    n_vis = n_full = count
    if causal:  # keys at or before the queries
      n_vis = min(count, (hi - first) // stride + 1) if hi >= first else 0
      n_full = min(count, (lo - first) // stride + 1) if lo >= first else 0
    return 0, 0, n_full // block, cdiv(n_vis, block)
  s_any = s_full = 0
  if causal:  # queries at or after the keys
    s_any = min(count, cdiv(lo - first, stride)) if lo > first else 0
    s_full = min(count, cdiv(hi - first, stride)) if hi > first else 0
  mid = cdiv(s_full, block)
  return s_any // block, mid, max(count // block, mid), cdiv(count, block)


def replay(pattern, n, h, hkv, branches, row_block, block, transposed, **launches):
  """`m[h, i, j]` as the kernels accumulate it, checking that unmasked blocks need no mask."""
  m = np.zeros((h, n, n))
  group = h // hkv
  clip = lambda x: np.minimum(x, n - 1)  # positions >= n are masked (ok is False)
  for fused in schedule.launches(pattern, n, h, branches, **launches):
    s = schedule.build(pattern, n, h, hkv, fused, transposed)
    for p in range(s.periods):
      base = p * s.period
      cut = lambda first, count, stride: min(count, max(0, -(-(n - base - first) // stride)))
      for head, first, count, p0, p1 in s.rows:
        count = cut(first, count, s.stride)
        for start in range(0, count, row_block):
          pos = first + s.stride * np.arange(start, min(start + row_block, count))
          for (other, pf, ps, pc), bias in zip(s.pieces[p0:p1], s.bias[p0:p1]):
            pc = cut(pf, pc, ps)
            a, b, c, d = block_ranges(pf, ps, pc, pos[0], pos[-1], block, pattern.causal,
                                      transposed)
            for j in list(range(a, b)) + list(range(b, c)) + list(range(c, d)):
              masked = not b <= j < c
              epos = pf + ps * np.arange(j * block, j * block + block)
              ok = np.broadcast_to(np.arange(j * block, j * block + block) < pc,
                                   (len(pos), block)).copy()
              if pattern.causal:
                ok &= (epos[None, :] >= pos[:, None]) if transposed else (
                    epos[None, :] <= pos[:, None])
              if not masked:
                assert ok.all(), "an unmasked block needs a mask"
              mult = 2.0 ** bias
              qh, kh = (other, head) if transposed else (head, head // group)
              assert kh == qh // group
              qpos, kpos = (epos, pos) if transposed else (pos, epos)
              ok = ok.T if transposed else ok
              np.add.at(m[qh], (clip(base + qpos)[:, None], clip(base + kpos)[None, :]),
                        mult * ok)
  return m


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transposed", [False, True])
def test_schedule_reproduces_multiplicity(case, causal, transposed):
  n, h, hkv, segs, rates, offsets, groups = case
  pattern = DilatedPattern(segs, rates, causal=causal, offsets=offsets, head_groups=groups)
  ref = reference_np.multiplicity(n, h, segs, rates, causal, offsets, groups)
  got = replay(pattern, n, h, hkv, None, 16, 8, transposed)
  np.testing.assert_allclose(got, ref, atol=1e-5)


def test_launches():
  together = lambda p, n: len(schedule.launches(p, n, 4, None)) == 1
  assert together(DilatedPattern((64, 128, 256), (1, 2, 4)), 300)
  assert together(DilatedPattern((64, 200), (2, 4)), 200)
  assert not together(DilatedPattern((12, 20), (3, 4)), 45)  # not nested
  assert not together(DilatedPattern((16, 32), (1, 2)), 45)  # rows of 8
  assert not together(DilatedPattern((64, 1 << 20), (1, 2)), 1 << 20)  # 16384 intervals


def test_launches_group_greedily():
  """Consecutive branches, each launch as many as qualify: the first LM preset of
  examples/lm_real.py in the mosaic backend's blocks of 128 (rows 512 / 4 = 128, then
  8192 / 16 = 512; all three together would have rows of 512 / 16 = 32)."""
  launches = lambda p, n, **kw: schedule.launches(p, n, 6, None, **kw)
  lm = DilatedPattern((512, 2048, 8192), (1, 4, 16), causal=True)
  assert launches(lm, 8192, min_row=128) == [(0, 1), (2,)]
  assert launches(lm, 8192) == [(0, 1, 2)]  # rows of 32 are long enough by default
  longnet = DilatedPattern((2048, 4096, 8192), (1, 2, 4))
  assert launches(longnet, 8192, min_row=128) == launches(longnet, 8192) == [(0, 1, 2)]
  assert launches(DilatedPattern((12, 20), (3, 4)), 45) == [(0,), (1,)]  # not nested
  # Rows of 4 for all three; the first two together (rows of 16), or none in blocks of 32.
  three = DilatedPattern((32, 64, 128), (1, 2, 8))
  assert launches(three, 128) == [(0, 1), (2,)]
  assert launches(three, 128, min_row=32) == [(0,), (1,), (2,)]
  # The longest run is taken even where a shorter one does not qualify: 96 and 160 do not
  # nest, with 32 they do.
  assert launches(DilatedPattern((96, 160, 32), (1, 1, 1)), 480) == [(0, 1, 2)]
  assert launches(DilatedPattern((48, 160, 32), (1, 1, 1)), 480) == [(0,), (1, 2)]


@pytest.mark.parametrize("transposed", [False, True])
def test_lm_like_launches_reproduce_multiplicity(transposed):
  """The first LM preset's shape at a 16th of its size, in rows of 8: launches (0, 1) and (2,)
  (the grouping the mosaic backend gets for the full size) sum to SPEC's multiplicities."""
  segs, rates = (32, 128, 512), (1, 4, 16)
  pattern = DilatedPattern(segs, rates, causal=True)
  assert schedule.launches(pattern, 512, 2, min_row=8) == [(0, 1), (2,)]
  ref = reference_np.multiplicity(512, 2, segs, rates, True, "head")
  got = replay(pattern, 512, 2, 1, None, 8, 8, transposed, min_row=8)
  np.testing.assert_allclose(got, ref, atol=1e-5)


def test_subset_of_branches():
  pattern = DilatedPattern((16, 32, 64), (1, 2, 4), causal=True)
  ref = reference_np.multiplicity(80, 4, (32,), (2,), True, "head")
  np.testing.assert_allclose(replay(pattern, 80, 4, 4, (1,), 16, 16, False), ref, atol=1e-5)


def test_longnet_scores_each_pair_once():
  """LongNet's pattern: 1.375 scored keys per query instead of 1.75 branch by branch."""
  pattern = DilatedPattern((2048, 4096, 8192), (1, 2, 4))
  (fused,) = schedule.launches(pattern, 8192, 4)
  s = schedule.build(pattern, 8192, 4, 4, fused, False)
  scored = sum(int(s.pieces[p0:p1, 3].sum()) * count for _, _, count, p0, p1 in s.rows)
  assert scored == 8192 * 4 * 2048 * 1.375
  assert s.stride == 4 and s.period == 8192 and len(s.rows) == 4 * 4 * 4
  # Rows walk few pieces of one multiplicity each: the first row (all three branches) takes
  # its own class in its own interval (m = 3) and the next (m = 2), then in the other half
  # of its 8192-segment (m = 1); the other classes of its own interval, and class 2 in the
  # next interval. Rows that see only the first branch take their interval in one piece.
  assert sorted(set(np.diff(s.rows[:, 3:], axis=1).ravel())) == [1, 6, 7]
  first = slice(s.rows[0, 3], s.rows[0, 4])
  np.testing.assert_array_equal(
      sorted(map(tuple, np.c_[s.pieces[first, 1:4], 2.0 ** s.bias[first]])),
      [(0, 4, 512, 3), (1, 4, 512, 1), (2, 4, 512, 2), (3, 4, 512, 1), (2048, 4, 512, 2),
       (2050, 4, 512, 1), (4096, 4, 1024, 1)])
  full = schedule.build(DilatedPattern((8192,), (1,)), 8192, 4, 4, (0,), False)
  np.testing.assert_array_equal(full.pieces[:, 1:], [[0, 1, 8192]] * 4)  # one per row


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5], CASES[9]])
def test_block_windows_reduce_each_programs_rows(case, transposed, per_head):
  """`Schedule.block_windows` (the triton kernels' per-program document windows and runs)
  against each program's rows replayed on the host: the union of their windows and the
  intersection of their runs, in the column of the row's head (a key row's: of each query
  head reading it) where the ids are per head; blocks past a row's end hold no window."""
  n, h, hkv, segs, rates, offsets, groups = case
  pattern = DilatedPattern(segs, rates, offsets=offsets, head_groups=groups)
  rng = np.random.default_rng(n + h)
  b, block = 2, 8
  # Documents in pieces (some scattered: ids that come back later in the row).
  kv = rng.integers(0, 3, (b, n, hkv) if per_head else (b, n)).cumsum(1) % 5
  q = np.repeat(kv, h // hkv, axis=2) if per_head else kv
  windows = np.asarray(jax.jit(common.contract_windows, static_argnums=1)(
      (jnp.asarray(q), jnp.asarray(kv)), transposed))  # [4, B, N, X]
  g = h // hkv if transposed and per_head else 1
  for fused in schedule.launches(pattern, n, h, None):
    s = schedule.build(pattern, n, h, hkv, fused, transposed)
    got = np.asarray(jax.jit(s.block_windows, static_argnums=(1, 2, 3))(
        jnp.asarray(windows), n, block, g)).reshape(b, s.periods, len(s.rows),
                                                    s.row_blocks(block), g, 4)
    for p in range(s.periods):
      base = p * s.period
      for r, (head, first, count, _, _) in enumerate(s.rows):
        count = min(count, max(0, -(-(n - base - first) // s.stride)))
        for blk in range(s.row_blocks(block)):
          pos = base + first + s.stride * np.arange(blk * block, min(blk * block + block, count))
          for j in range(g):
            column = (head * g + j) if per_head else 0
            w = windows[:, :, pos, column]  # [4, B, rows]
            want = np.stack([w[0].min(1), w[1].max(1), w[2].max(1), w[3].min(1)], -1) if len(
                pos) else np.broadcast_to([common.FAR, -1, -1, common.FAR], (b, 4))
            np.testing.assert_array_equal(got[:, p, r, blk, j], want)
