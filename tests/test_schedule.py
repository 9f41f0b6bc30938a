"""The triton backend's block schedule, replayed on the host the way its kernels walk it,
must reproduce SPEC's multiplicities m(i, j, h) exactly (CPU: no Triton needed)."""

import numpy as np
import pytest

import reference_np
from hilbert_ring_jax import DilatedPattern
from hilbert_ring_jax.backends import schedule

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
]


def replay(pattern, n, h, hkv, branches, row_block, entry_block, transposed):
  """`m[h, i, j]` as the kernels accumulate it, checking that unmasked entries need no mask."""
  m = np.zeros((h, n, n))
  group = h // hkv
  for s in schedule.schedules(pattern, n, h, hkv, branches, row_block, entry_block, transposed):
    for p in range(s.periods):
      base = p * s.period
      partial = base + s.period > n
      for r, (head, first, count, f0, f1, t0, t1) in enumerate(s.rows):
        count = min(count, max(0, -(-(n - base - first) // s.stride)))
        for rb in range(-(-count // row_block)):
          pos = base + first + s.stride * np.arange(rb * row_block,
                                                    min(rb * row_block + row_block, count))
          c_full, c_any, c_t = s.counts[r, rb]
          picks = [(e, False) for e in range(f0, f0 + c_full)]
          picks += [(e, True) for e in range(f0 + c_full, f0 + c_any)]
          picks += [(e, True) for e in range(t0, t0 + c_t)]
          for e, masked in picks:
            other, efirst, length = s.entries[e]
            mult = 2.0 ** s.bias[e]
            epos = base + efirst + s.stride * np.arange(length)
            ok = np.broadcast_to(epos[None, :] < n, (len(pos), length)).copy()
            if pattern.causal:
              ok &= (epos[None, :] >= pos[:, None]) if transposed else (
                  epos[None, :] <= pos[:, None])
            if not masked and not partial:
              assert ok.all(), "an unmasked entry needs a mask"
              assert length == entry_block
            qh, kh = (other, head) if transposed else (head, head // group)
            qpos, kpos = (epos, pos) if transposed else (pos, epos)
            ok = ok.T if transposed else ok
            assert kh == qh // group
            clip = lambda x: np.minimum(x, n - 1)  # positions >= n are masked (ok is False)
            np.add.at(m[qh], (clip(qpos)[:, None], clip(kpos)[None, :]), mult * ok)
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


def test_grouping():
  together = lambda *a: len(schedule.schedules(*a, 16, 16, False)) == 1
  assert together(DilatedPattern((64, 128, 256), (1, 2, 4)), 300, 4, 4, None)
  assert together(DilatedPattern((64, 200), (2, 4)), 200, 2, 2, None)
  assert not together(DilatedPattern((12, 20), (3, 4)), 45, 2, 2, None)  # not nested
  assert not together(DilatedPattern((16, 32), (1, 2)), 45, 2, 2, None)  # rows of 8


def test_subset_of_branches():
  pattern = DilatedPattern((16, 32, 64), (1, 2, 4), causal=True)
  ref = reference_np.multiplicity(80, 4, (32,), (2,), True, "head")
  np.testing.assert_allclose(replay(pattern, 80, 4, 4, (1,), 16, 16, False), ref, atol=1e-5)


def test_longnet_scores_each_pair_once():
  """LongNet's pattern: 1.375 scored keys per query instead of 1.75 branch by branch."""
  pattern = DilatedPattern((2048, 4096, 8192), (1, 2, 4))
  (s,) = schedule.schedules(pattern, 8192, 4, 4, None, 128, 128, False)
  scored = sum(int(s.entries[f0:t1, 2].sum()) * count
               for _, _, count, f0, _, _, t1 in s.rows)
  assert scored == 8192 * 4 * 2048 * 1.375
  assert s.stride == 4 and s.period == 8192 and len(s.rows) == 4 * 4 * 4
