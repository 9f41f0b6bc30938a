"""Triton kernels of the "triton" backend (Triton only: no JAX calls, so they can also run
in Triton's interpreter).

Layout: q, out `[B, N, H, D]`, k, v `[B, N, HKV, D]`, lse and delta `[B, N, H]`, contiguous.
Each kernel walks a schedule (`schedule.py`): a program takes one block of a strided *row*
(positions `first, first + L, ...` of one period) and visits the row's *pieces*, strided runs
of the other side, block by block, adding `log2` of the piece's multiplicity to the scores.
Rows and pieces are read through block pointers with row strides of whole
tokens: dilation is strided addressing, never a copy, and inner-loop addresses are plain
arithmetic, so loads pipeline. Blocks that are fully visible run without masks; ragged
blocks and the causal diagonal are masked. Query head `h` reads key/value head
`h // (H // HKV)` (GQA without copies).

Softmax statistics are float32 and kept in base 2 (`exp2`), with the scale folded in.
float32 inputs use IEEE products (`PRECISION="ieee"`), not tf32, so they stay exact.

Packed rows (PACKED): `QID [B, N, H]` and `KID [B, N, HKV]` hold each query's and key's document
id, and `WIN` each program's block of rows' document window and run (the union of its rows'
windows and the intersection of their runs, `common.id_windows` reduced on the device before the
launch: `schedule.Schedule.block_windows`; per query head of the piece in the dk/dv kernel): the
positions of the other side that may share the rows' ids, and a run of positions that surely do.
A program cuts every piece to the blocks the window reaches; those inside the run go as without
ids, the others are masked, comparing ids.
"""

import triton
import triton.language as tl

from . import schedule

LOG2E = 1.4426950408889634
# The schedule's table columns (see schedule.py), as compile-time constants.
ROW_HEAD = tl.constexpr(schedule.ROW_HEAD)
ROW_FIRST = tl.constexpr(schedule.ROW_FIRST)
ROW_LENGTH = tl.constexpr(schedule.ROW_LENGTH)
ROW_PIECE0 = tl.constexpr(schedule.ROW_PIECE0)
ROW_PIECE1 = tl.constexpr(schedule.ROW_PIECE1)
ROW_COLUMNS = tl.constexpr(schedule.ROW_COLUMNS)
PIECE_HEAD = tl.constexpr(schedule.PIECE_HEAD)
PIECE_FIRST = tl.constexpr(schedule.PIECE_FIRST)
PIECE_STRIDE = tl.constexpr(schedule.PIECE_STRIDE)
PIECE_LENGTH = tl.constexpr(schedule.PIECE_LENGTH)
PIECE_COLUMNS = tl.constexpr(schedule.PIECE_COLUMNS)


@triton.jit
def _rows_ptr(base, rows, row_stride, start, BLOCK: tl.constexpr, D: tl.constexpr):
  """Block pointer to `[BLOCK, D]` of a strided row (positions `start ...` of `rows`)."""
  return tl.make_block_ptr(base, (rows, D), (row_stride, 1), (start, 0), (BLOCK, D), (1, 0))


@triton.jit
def _load(ptr, MASKED: tl.constexpr):
  """A block-pointer load: bounds-checked (zero padding) when MASKED."""
  if MASKED:
    return tl.load(ptr, boundary_check=(0,), padding_option="zero")
  return tl.load(ptr)


@triton.jit
def _key_rows(K, V, kv0, kf, ks, kc, n0, HKV: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr):
  """Block pointers to keys and values `n0 ...` of the piece `(kf, ks, kc)`.

  `ks` is a compile-time 1 when the launch's pieces all have stride 1 (then addresses are a
  base plus constant offsets), else the piece's runtime stride.
  """
  off = kv0 + kf.to(tl.int64) * (HKV * D)
  return (_rows_ptr(K + off, kc, ks * (HKV * D), n0, BLOCK_N, D),
          _rows_ptr(V + off, kc, ks * (HKV * D), n0, BLOCK_N, D))


@triton.jit
def _key_visible(qpos, kf, ks, kc, n0, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
  """`[BLOCK_M, BLOCK_N]`: which keys `n0 ...` of the piece exist and (causal) are visible."""
  offs_n = n0 + tl.arange(0, BLOCK_N)
  kpos = kf + ks * offs_n
  visible = offs_n[None, :] < kc
  if CAUSAL:
    visible = visible & (kpos[None, :] <= qpos[:, None])
  return visible


@triton.jit
def _same_document(qid, KID, kid0, kf, ks, kc, n0, HKV: tl.constexpr, BLOCK_N: tl.constexpr):
  """`[BLOCK_M, BLOCK_N]`: which keys `n0 ...` of the piece `(kf, ks, kc)` (their ids at
  `KID + kid0`) are in the rows' documents (`qid`)."""
  offs_n = n0 + tl.arange(0, BLOCK_N)
  kid = tl.load(KID + kid0 + (kf + ks * offs_n).to(tl.int64) * HKV, mask=offs_n < kc, other=0)
  return qid[:, None] == kid[None, :]


@triton.jit
def _cut(first, count, stride, base, N: tl.constexpr):
  """`count` positions `first, first + stride, ...` of the period at `base`, cut at N."""
  return tl.minimum(count, tl.maximum(N - base - first + stride - 1, 0) // stride).to(tl.int32)


@triton.jit
def _block_window(WIN, at):
  """The document window `[lo, hi]` (lo > hi when there is none) and the run `[r0, r1]` (r0 >
  r1 when there is none) of a block of rows, entry `at` of `WIN`."""
  at = at.to(tl.int64) * 4
  return tl.load(WIN + at), tl.load(WIN + at + 1), tl.load(WIN + at + 2), tl.load(WIN + at + 3)


@triton.jit
def _indices(lo, hi, base, first, stride):
  """`[i0, i1)`: the indices of the piece `(first, stride)` of the period at `base` whose
  positions lie in `[lo, hi]`."""
  lo, hi = (lo - base - first).to(tl.int32), (hi - base - first).to(tl.int32)  # in the piece
  i0 = (tl.maximum(lo, 0) + stride - 1) // stride  # the first index at or after lo
  i1 = tl.where(hi >= 0, hi // stride + 1, 0)  # past the last index at or before hi
  return i0, i1


@triton.jit
def _documents(lo, hi, r0, r1, base, first, stride, ja, jb, jc, jd, BLOCK: tl.constexpr):
  """A piece's blocks (masked `[ja, jb)`, `[jc, jd)`, unmasked `[jb, jc)`) cut to the rows'
  documents: `[ja, jd)` to the blocks holding a position of the window `[lo, hi]`, `[jb, jc)`
  to those whose positions all lie in the run `[r0, r1]` (both `ja` when none does: then
  every block of `[ja, jd)` is masked)."""
  i0, i1 = _indices(lo, hi, base, first, stride)
  ja, jd = tl.maximum(ja, i0 // BLOCK), tl.minimum(jd, (i1 + BLOCK - 1) // BLOCK)
  i0, i1 = _indices(r0, r1, base, first, stride)
  b = tl.maximum(jb, (i0 + BLOCK - 1) // BLOCK)
  c = tl.minimum(jc, i1 // BLOCK)
  return ja, tl.where(c > b, b, ja), tl.where(c > b, c, ja), jd


@triton.jit
def _program(ROWS, N: tl.constexpr, L: tl.constexpr, PERIOD: tl.constexpr,
             PERIODS: tl.constexpr, ROW_BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
             REVERSE: tl.constexpr):
  """This program's block of a row: (batch, period start, head, first, rows (cut at N),
  first row of the block, pieces `[p0, p1)`, the block's index in the grid's order, as
  `schedule.Schedule.block_windows` lays the blocks out). REVERSE runs a row's blocks
  last-first. Decodes the grid of `schedule.Schedule.grid`."""
  pid = tl.program_id(0)
  r = pid // ROW_BLOCKS
  blk = pid % ROW_BLOCKS
  if REVERSE:
    blk = ROW_BLOCKS - 1 - blk
  b = (tl.program_id(1) // PERIODS).to(tl.int64)
  base = (tl.program_id(1) % PERIODS).to(tl.int64) * PERIOD
  row = ROWS + r * ROW_COLUMNS
  first = tl.load(row + ROW_FIRST)
  rows = _cut(first, tl.load(row + ROW_LENGTH), L, base, N)
  slot = tl.program_id(1) * tl.num_programs(0) + r * ROW_BLOCKS + blk
  return (b, base, tl.load(row + ROW_HEAD), first, rows, blk * BLOCK, tl.load(row + ROW_PIECE0),
          tl.load(row + ROW_PIECE1), slot)


@triton.jit
def _piece(PIECES, BIAS, p, base, lo, hi, N: tl.constexpr, BLOCK: tl.constexpr,
           CAUSAL: tl.constexpr, TRANSPOSED: tl.constexpr):
  """Piece `p` for a row block spanning positions `lo..hi`: (head, first, stride, length,
  log2 m, and its blocks: masked `[a, b)` and `[c, d)`, unmasked `[b, c)`)."""
  piece = PIECES + p * PIECE_COLUMNS
  first = tl.load(piece + PIECE_FIRST)
  stride = tl.load(piece + PIECE_STRIDE)
  count = _cut(first, tl.load(piece + PIECE_LENGTH), stride, base, N)
  if TRANSPOSED:  # query pieces of a key row: queries at or after the keys
    s_any = 0
    s_full = 0
    if CAUSAL:
      s_any = tl.where(lo > first, tl.minimum(count, (lo - first + stride - 1) // stride), 0)
      s_full = tl.where(hi > first, tl.minimum(count, (hi - first + stride - 1) // stride), 0)
    mid = (s_full + BLOCK - 1) // BLOCK
    a, b, c, d = s_any // BLOCK, mid, tl.maximum(count // BLOCK, mid), (count + BLOCK - 1) // BLOCK
  else:  # key pieces of a query row: keys at or before the queries
    n_vis = count
    n_full = count
    if CAUSAL:
      n_vis = tl.where(hi >= first, tl.minimum(count, (hi - first) // stride + 1), 0)
      n_full = tl.where(lo >= first, tl.minimum(count, (lo - first) // stride + 1), 0)
    a, b, c, d = 0, 0, n_full // BLOCK, (n_vis + BLOCK - 1) // BLOCK
  return tl.load(piece + PIECE_HEAD), first, stride, count, tl.load(BIAS + p), a, b, c, d


@triton.jit
def _attend(acc, l_i, m_i, q, qpos, K, V, kv0, kf, ks, kc, bias, n0,
            HKV: tl.constexpr, D: tl.constexpr,
            BLOCK_N: tl.constexpr, QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr,
            MASKED: tl.constexpr, PRECISION: tl.constexpr, qid, KID, kid0,
            PACKED: tl.constexpr):
  """Online softmax (base 2) over keys `n0 ...` of the piece `(kf, ks, kc)`."""
  k_ptr, v_ptr = _key_rows(K, V, kv0, kf, ks, kc, n0, HKV, D, BLOCK_N)
  k = _load(k_ptr, MASKED)
  qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * QK_SCALE + bias
  if MASKED:
    visible = _key_visible(qpos, kf, ks, kc, n0, BLOCK_N, CAUSAL)
    if PACKED:
      visible = visible & _same_document(qid, KID, kid0, kf, ks, kc, n0, HKV, BLOCK_N)
    qk = tl.where(visible, qk, float("-inf"))
  m_new = tl.maximum(m_i, tl.max(qk, 1))
  if MASKED:
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
  else:
    m_use = m_new
  p = tl.math.exp2(qk - m_use[:, None])
  alpha = tl.math.exp2(m_i - m_use)
  l_i = l_i * alpha + tl.sum(p, 1)
  v = _load(v_ptr, MASKED)
  acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
  return acc, l_i, m_new


@triton.jit
def _forward_walk(acc, l_i, m_i, q, qpos, K, V, kv0, kf, ks, kc, bias, ja, jb, jc, jd,
                  HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                  qid, KID, kid0, PACKED: tl.constexpr):
  """The blocks of one piece: unmasked `[jb, jc)`, then masked `[ja, jb)` and `[jc, jd)`
  (PACKED: comparing ids too)."""
  for j in range(jb, jc):
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, qpos, K, V, kv0, kf, ks, kc, bias, j * BLOCK_N,
                            HKV, D, BLOCK_N, QK_SCALE, CAUSAL, False,
                            PRECISION, 0, K, 0, False)
  for i in tl.range(ja, jb + jd - jc, num_stages=1):  # few: not worth pipeline buffers
    j = tl.where(i < jb, i, i - jb + jc)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, qpos, K, V, kv0, kf, ks, kc, bias, j * BLOCK_N,
                            HKV, D, BLOCK_N, QK_SCALE, CAUSAL, True,
                            PRECISION, qid, KID, kid0, PACKED)
  return acc, l_i, m_i


@triton.jit
def forward_kernel(Q, K, V, ROWS, PIECES, BIAS, QID, KID, WIN, OUT, LSE,
                   N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   L: tl.constexpr, PERIOD: tl.constexpr,
                   PERIODS: tl.constexpr, ROW_BLOCKS: tl.constexpr, CAUSAL: tl.constexpr,
                   QK_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr):
  """`out` (input dtype) and float32 `lse` of a block of one query row."""
  b, base, h, first, rows, start_m, p0, p1, slot = _program(
      ROWS, N, L, PERIOD, PERIODS, ROW_BLOCKS, BLOCK_M, CAUSAL)
  if start_m < rows:
    tok0 = b * N + base + first  # the row's first token, batch included
    q_ptr = _rows_ptr(Q + (tok0 * H + h) * D, rows, L * H * D, start_m, BLOCK_M, D)
    q = tl.load(q_ptr, boundary_check=(0,), padding_option="zero")
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qpos = first + L * offs_m
    qlo = first + L * start_m
    qhi = first + L * (tl.minimum(start_m + BLOCK_M, rows) - 1)
    kv0 = ((b * N + base) * HKV + h // (H // HKV)) * D
    stat = (tok0 + offs_m.to(tl.int64) * L) * H + h
    qid = 0
    kid0 = 0
    if PACKED:
      qid = tl.load(QID + stat, mask=offs_m < rows, other=0)
      lo, hi, r0, r1 = _block_window(WIN, slot)
      kid0 = (b * N + base) * HKV + h // (H // HKV)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for p in range(p0, p1):
      _, kf, ks, kc, bias, ja, jb, jc, jd = _piece(PIECES, BIAS, p, base, qlo, qhi, N, BLOCK_N,
                                                   CAUSAL, False)
      if PACKED:  # the blocks the rows' documents reach; unmasked only inside their run
        ja, jb, jc, jd = _documents(lo, hi, r0, r1, base, kf, ks, ja, jb, jc, jd, BLOCK_N)
      acc, l_i, m_i = _forward_walk(acc, l_i, m_i, q, qpos, K, V, kv0, kf,
                                    1 if L == 1 else ks, kc, bias, ja, jb, jc, jd, HKV, D,
                                    BLOCK_N, QK_SCALE, CAUSAL, PRECISION, qid, KID, kid0,
                                    PACKED)
    l_safe = tl.where(l_i != 0, l_i, 1.0)  # (a NaN row stays NaN)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i != 0, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + stat, lse, mask=offs_m < rows)
    o_ptr = _rows_ptr(OUT + (tok0 * H + h) * D, rows, L * H * D, start_m, BLOCK_M, D)
    tl.store(o_ptr, o.to(o_ptr.dtype.element_ty), boundary_check=(0,))


@triton.jit
def _query_rows(Q, DO, LSE, DELTA, tok0, h, stride, rows, start_m,
                H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr):
  """What a backward step needs of a block of query rows: q, dout, lse (base 2) and delta.

  lse is +inf on padding and on rows that see nothing, so p = 0 there. Unless MASKED, all
  `BLOCK_M` rows exist and are read without bounds checks.
  """
  q_base = (tok0 * H + h) * D
  q_ptr = _rows_ptr(Q + q_base, rows, stride * (H * D), start_m, BLOCK_M, D)
  do_ptr = _rows_ptr(DO + q_base, rows, stride * (H * D), start_m, BLOCK_M, D)
  offs_m = start_m + tl.arange(0, BLOCK_M)
  stat = (tok0 + offs_m.to(tl.int64) * stride) * H + h
  q = _load(q_ptr, MASKED)
  do = _load(do_ptr, MASKED)
  if MASKED:
    lse = tl.load(LSE + stat, mask=offs_m < rows, other=float("inf"))
    delta = tl.load(DELTA + stat, mask=offs_m < rows, other=0.0)
  else:
    lse = tl.load(LSE + stat)
    delta = tl.load(DELTA + stat)
  lse = lse * 1.4426950408889634
  return q, do, lse, delta


@triton.jit
def _probs(qk, lse):
  """`p = exp2(qk - lse)` (base 2), clipped at its exact bound 1: with huge logits
  (|s| ~ 1e9) float32 rounding of the recomputed s - lse would overflow exp2."""
  return tl.math.exp2(tl.minimum(qk - lse, 0.0))


@triton.jit
def _ds_dot(ds, x, PRECISION: tl.constexpr):
  """`ds @ x`: in x's dtype, except float16, whose range ds can exceed (float32 there)."""
  if x.dtype == tl.float16:
    return tl.dot(ds, x.to(tl.float32), input_precision=PRECISION)
  return tl.dot(ds.to(x.dtype), x, input_precision=PRECISION)


@triton.jit
def _dq_step(dq, q, do, lse, delta, qpos, K, V, kv0, kf, ks, kc, bias, n0,
             HKV: tl.constexpr, D: tl.constexpr,
             BLOCK_N: tl.constexpr, QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr,
             MASKED: tl.constexpr, PRECISION: tl.constexpr, qid, KID, kid0,
             PACKED: tl.constexpr):
  k_ptr, v_ptr = _key_rows(K, V, kv0, kf, ks, kc, n0, HKV, D, BLOCK_N)
  k = _load(k_ptr, MASKED)
  v = _load(v_ptr, MASKED)
  qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * QK_SCALE + bias
  p = _probs(qk, lse[:, None])
  if MASKED:
    visible = _key_visible(qpos, kf, ks, kc, n0, BLOCK_N, CAUSAL)
    if PACKED:
      visible = visible & _same_document(qid, KID, kid0, kf, ks, kc, n0, HKV, BLOCK_N)
    p = tl.where(visible, p, 0.0)
  dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
  ds = p * (dp - delta[:, None])
  return dq + _ds_dot(ds, k, PRECISION)


@triton.jit
def _dq_walk(dq, q, do, lse, delta, qpos, K, V, kv0, kf, ks, kc, bias, ja, jb, jc, jd,
             HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
             QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
             qid, KID, kid0, PACKED: tl.constexpr):
  """As `_forward_walk`, for dq."""
  for j in range(jb, jc):
    dq = _dq_step(dq, q, do, lse, delta, qpos, K, V, kv0, kf, ks, kc, bias, j * BLOCK_N,
                  HKV, D, BLOCK_N, QK_SCALE, CAUSAL, False, PRECISION, 0, K, 0, False)
  for i in tl.range(ja, jb + jd - jc, num_stages=1):  # few: not worth pipeline buffers
    j = tl.where(i < jb, i, i - jb + jc)
    dq = _dq_step(dq, q, do, lse, delta, qpos, K, V, kv0, kf, ks, kc, bias, j * BLOCK_N,
                  HKV, D, BLOCK_N, QK_SCALE, CAUSAL, True, PRECISION, qid, KID, kid0, PACKED)
  return dq


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, ROWS, PIECES, BIAS, QID, KID, WIN, DQ_IN, DQ,
              N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
              L: tl.constexpr, PERIOD: tl.constexpr, PERIODS: tl.constexpr,
              ROW_BLOCKS: tl.constexpr, CAUSAL: tl.constexpr,
              SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr):
  """float32 dq of a block of one query row (added to DQ_IN when ACCUMULATE)."""
  b, base, h, first, rows, start_m, p0, p1, slot = _program(
      ROWS, N, L, PERIOD, PERIODS, ROW_BLOCKS, BLOCK_M, CAUSAL)
  if start_m < rows:
    tok0 = b * N + base + first
    q, do, lse, delta = _query_rows(Q, DO, LSE, DELTA, tok0, h, L, rows, start_m, H, D,
                                    BLOCK_M, True)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qpos = first + L * offs_m
    qlo = first + L * start_m
    qhi = first + L * (tl.minimum(start_m + BLOCK_M, rows) - 1)
    kv0 = ((b * N + base) * HKV + h // (H // HKV)) * D
    qid = 0
    kid0 = 0
    if PACKED:
      stat = (tok0 + offs_m.to(tl.int64) * L) * H + h
      qid = tl.load(QID + stat, mask=offs_m < rows, other=0)
      lo, hi, r0, r1 = _block_window(WIN, slot)
      kid0 = (b * N + base) * HKV + h // (H // HKV)
    QK_SCALE: tl.constexpr = SCALE * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for p in range(p0, p1):
      _, kf, ks, kc, bias, ja, jb, jc, jd = _piece(PIECES, BIAS, p, base, qlo, qhi, N, BLOCK_N,
                                                   CAUSAL, False)
      if PACKED:  # the blocks the rows' documents reach; unmasked only inside their run
        ja, jb, jc, jd = _documents(lo, hi, r0, r1, base, kf, ks, ja, jb, jc, jd, BLOCK_N)
      dq = _dq_walk(dq, q, do, lse, delta, qpos, K, V, kv0, kf, 1 if L == 1 else ks, kc,
                    bias, ja, jb, jc, jd, HKV, D, BLOCK_N, QK_SCALE, CAUSAL, PRECISION, qid,
                    KID, kid0, PACKED)
    dq = dq * SCALE
    ptr = (tok0 * H + h) * D
    if ACCUMULATE:
      dq += tl.load(_rows_ptr(DQ_IN + ptr, rows, L * H * D, start_m, BLOCK_M, D),
                    boundary_check=(0,), padding_option="zero")
    tl.store(_rows_ptr(DQ + ptr, rows, L * H * D, start_m, BLOCK_M, D), dq,
             boundary_check=(0,))


@triton.jit
def _dkdv_step(dk, dv, k, v, kpos, Q, DO, LSE, DELTA, qtok, h, qf, qs, qc, bias, m0,
               H: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, PRECISION: tl.constexpr, kid, QID,
               PACKED: tl.constexpr):
  q, do, lse, delta = _query_rows(Q, DO, LSE, DELTA, qtok, h, qs, qc, m0, H, D, BLOCK_M, MASKED)
  qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * QK_SCALE + bias
  p_t = _probs(qk_t, lse[None, :])  # [BLOCK_N, BLOCK_M]; 0 on padded queries
  if MASKED and CAUSAL:
    qpos = qf + qs * (m0 + tl.arange(0, BLOCK_M))
    p_t = tl.where(kpos[:, None] <= qpos[None, :], p_t, 0.0)
  if PACKED:  # the keys' ids against the queries' (at QID, query head h)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qid = tl.load(QID + (qtok + offs_m.to(tl.int64) * qs) * H + h, mask=offs_m < qc, other=0)
    p_t = tl.where(kid[:, None] == qid[None, :], p_t, 0.0)
  dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
  dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
  ds_t = p_t * (dp_t - delta[None, :])
  dk += _ds_dot(ds_t, q, PRECISION)
  return dk, dv


@triton.jit
def _dkdv_walk(dk, dv, k, v, kpos, Q, DO, LSE, DELTA, qtok, h, qf, qs, qc, bias, ja, jb, jc,
               jd, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
               kid, QID, PACKED: tl.constexpr):
  """As `_forward_walk`, for dk and dv over query blocks."""
  for j in range(jb, jc):
    dk, dv = _dkdv_step(dk, dv, k, v, kpos, Q, DO, LSE, DELTA, qtok, h, qf, qs, qc, bias,
                        j * BLOCK_M, H, D, BLOCK_M, QK_SCALE, CAUSAL, False,
                        PRECISION, 0, Q, False)
  for i in tl.range(ja, jb + jd - jc, num_stages=1):  # few: not worth pipeline buffers
    j = tl.where(i < jb, i, i - jb + jc)
    dk, dv = _dkdv_step(dk, dv, k, v, kpos, Q, DO, LSE, DELTA, qtok, h, qf, qs, qc, bias,
                        j * BLOCK_M, H, D, BLOCK_M, QK_SCALE, CAUSAL, True,
                        PRECISION, kid, QID, PACKED)
  return dk, dv


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, ROWS, PIECES, BIAS, QID, KID, WIN, DK_IN,
                DV_IN, DK, DV, N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                L: tl.constexpr, PERIOD: tl.constexpr,
                PERIODS: tl.constexpr, ROW_BLOCKS: tl.constexpr, CAUSAL: tl.constexpr,
                SCALE: tl.constexpr, ACCUMULATE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                PACKED: tl.constexpr, GROUPS: tl.constexpr = 1):
  """float32 dk, dv of a block of one key row of key/value head `g`, summed over the query
  pieces (of the query heads reading `g`) the row lists (added to DK_IN, DV_IN when
  ACCUMULATE). PACKED: `WIN` holds the keys' windows and runs over the queries, GROUPS to a
  block (each query head reading `g` where the ids are per head, else 1)."""
  b, base, g, first, rows, start_n, p0, p1, slot = _program(
      ROWS, N, L, PERIOD, PERIODS, ROW_BLOCKS, BLOCK_N, False)
  if start_n < rows:
    kv_base = ((b * N + base + first) * HKV + g) * D
    k = tl.load(_rows_ptr(K + kv_base, rows, L * HKV * D, start_n, BLOCK_N, D),
                boundary_check=(0,), padding_option="zero")
    v = tl.load(_rows_ptr(V + kv_base, rows, L * HKV * D, start_n, BLOCK_N, D),
                boundary_check=(0,), padding_option="zero")
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kpos = first + L * offs_n
    klo = first + L * start_n
    khi = first + L * (tl.minimum(start_n + BLOCK_N, rows) - 1)
    kid = 0
    if PACKED:
      ktok = b * N + base + kpos.to(tl.int64)
      kid = tl.load(KID + ktok * HKV + g, mask=offs_n < rows, other=0)
    QK_SCALE: tl.constexpr = SCALE * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for p in range(p0, p1):
      h, qf, qs, qc, bias, ja, jb, jc, jd = _piece(PIECES, BIAS, p, base, klo, khi, N, BLOCK_M,
                                                   CAUSAL, True)
      qtok = b * N + base + qf
      if PACKED:  # the query blocks the keys' documents reach (for head h); unmasked only
        # inside the run common to the keys' documents
        lo, hi, r0, r1 = _block_window(WIN, slot * GROUPS + h % GROUPS)
        ja, jb, jc, jd = _documents(lo, hi, r0, r1, base, qf, qs, ja, jb, jc, jd, BLOCK_M)
      dk, dv = _dkdv_walk(dk, dv, k, v, kpos, Q, DO, LSE, DELTA, qtok, h, qf,
                          1 if L == 1 else qs, qc, bias, ja, jb, jc, jd, H, D, BLOCK_M,
                          QK_SCALE, CAUSAL, PRECISION, kid, QID, PACKED)
    dk = dk * SCALE
    k_out = _rows_ptr(DK + kv_base, rows, L * HKV * D, start_n, BLOCK_N, D)
    v_out = _rows_ptr(DV + kv_base, rows, L * HKV * D, start_n, BLOCK_N, D)
    if ACCUMULATE:
      dk += tl.load(_rows_ptr(DK_IN + kv_base, rows, L * HKV * D, start_n, BLOCK_N, D),
                    boundary_check=(0,), padding_option="zero")
      dv += tl.load(_rows_ptr(DV_IN + kv_base, rows, L * HKV * D, start_n, BLOCK_N, D),
                    boundary_check=(0,), padding_option="zero")
    tl.store(k_out, dk, boundary_check=(0,))
    tl.store(v_out, dv, boundary_check=(0,))
