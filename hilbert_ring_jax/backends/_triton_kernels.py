"""Triton kernels of the "triton" backend (pure Triton: no JAX here, so they can also run
in Triton's interpreter).

Layout: q, out `[B, N, H, D]`, k, v `[B, N, HKV, D]`, lse and delta `[B, N, H]`, contiguous.
One launch computes one branch `(W, R)` of the pattern. Its work items are dilated rows: the
positions `s * W + c + m * R` (m = 0, 1, ...) of segment `s` and residue `c`, read through
block pointers with a row stride of `R` tokens: dilation is strided addressing, never a copy,
and ragged rows are bounds-checked. For `offsets="head"` (PER_HEAD) head `h` reads residue
`h % R` only. Query head `h` reads key/value head `h // (H // HKV)` (GQA without copies). Loops
visit only the key blocks the pattern makes visible: above a causal diagonal nothing is loaded.

Softmax statistics are float32 and kept in base 2 (`exp2`), with the scale folded in.
float32 inputs use IEEE products (`PRECISION="ieee"`), not tf32, so they stay exact.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _row_geometry(z, N: tl.constexpr, W: tl.constexpr, R: tl.constexpr, H0: tl.constexpr,
                  PER_HEAD: tl.constexpr):
  """Work item `z` -> (head, first token of the row, residue, rows M) of a dilated row."""
  S: tl.constexpr = (N + W - 1) // W
  C: tl.constexpr = 1 if PER_HEAD else R
  c = z % C
  s = (z // C) % S
  h = H0 + z // (C * S)
  if PER_HEAD:
    c = h % R
  seg0 = s * W
  rows = tl.maximum((tl.minimum(W, N - seg0) - c + R - 1) // R, 0)
  return h, seg0 + c, rows


@triton.jit
def _rows_ptr(base, rows, row_stride: tl.constexpr, start, BLOCK: tl.constexpr,
              D: tl.constexpr):
  """Block pointer to `[BLOCK, D]` of a dilated row (rows `start ...`)."""
  return tl.make_block_ptr(base, (rows, D), (row_stride, 1), (start, 0), (BLOCK, D), (1, 0))


@triton.jit
def _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, rows,
                  KROW: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                  MASKED: tl.constexpr, PRECISION: tl.constexpr):
  """One key block of the online softmax (base 2).

  Block pointers are made afresh per block rather than carried through the loop: Triton 3.6's
  tensor-pointer rewrite asserts on loop-carried block pointers of loops it folds away.
  """
  k_ptr = _rows_ptr(k_base, rows, KROW, start_n, BLOCK_N, D)
  v_ptr = _rows_ptr(v_base, rows, KROW, start_n, BLOCK_N, D)
  if MASKED:
    k = tl.load(k_ptr, boundary_check=(0,), padding_option="zero")
  else:
    k = tl.load(k_ptr)
  qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * QK_SCALE
  if MASKED:
    offs_n = start_n + tl.arange(0, BLOCK_N)
    visible = offs_n[None, :] < rows
    if CAUSAL:
      visible = visible & (offs_n[None, :] <= offs_m[:, None])
    qk = tl.where(visible, qk, float("-inf"))
  m_new = tl.maximum(m_i, tl.max(qk, 1))
  if MASKED:
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
  else:
    m_use = m_new
  p = tl.math.exp2(qk - m_use[:, None])
  alpha = tl.math.exp2(m_i - m_use)
  l_i = l_i * alpha + tl.sum(p, 1)
  if MASKED:
    v = tl.load(v_ptr, boundary_check=(0,), padding_option="zero")
  else:
    v = tl.load(v_ptr)
  acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
  return acc, l_i, m_new


@triton.jit
def forward_kernel(Q, K, V, FIRST, ORUN_IN, LSE_IN, ORUN, LSE, OUT,
                   N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   W: tl.constexpr, R: tl.constexpr, H0: tl.constexpr,
                   PER_HEAD: tl.constexpr, CAUSAL: tl.constexpr, CHAIN_POS: tl.constexpr,
                   HAS_PREV: tl.constexpr, LAST: tl.constexpr, QK_SCALE: tl.constexpr,
                   M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr):
  """One branch over all its dilated rows, merged into the running `(ORUN, LSE)`.

  Branches run as a chain: launch `CHAIN_POS` merges its result (in float32) into the
  running state (ORUN in the input dtype, LSE float32) of the rows an earlier launch covered (`FIRST[n, h] < CHAIN_POS`; `FIRST` holds the
  chain position of the first launch covering `(n, h)`) and stores it; the `LAST` launch,
  which covers every row, writes the final output in the input dtype instead.
  """
  pid = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  pid_m = pid % M_BLOCKS
  h, tok0, rows = _row_geometry(pid // M_BLOCKS, N, W, R, H0, PER_HEAD)
  start_m = pid_m * BLOCK_M
  if start_m < rows:
    g = h // (H // HKV)
    first = b * N + tok0  # token of the row's first position, batch included
    q_ptr = _rows_ptr(Q + (first * H + h) * D, rows, R * H * D, start_m, BLOCK_M, D)
    q = tl.load(q_ptr, boundary_check=(0,), padding_option="zero")
    k_base = K + (first * HKV + g) * D
    v_base = V + (first * HKV + g) * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if CAUSAL:
      full_end = start_m  # blocks wholly below the diagonal
      end = tl.minimum(start_m + BLOCK_M, rows)
    else:
      full_end = (rows // BLOCK_N) * BLOCK_N
      end = rows
    KROW: tl.constexpr = R * HKV * D
    for start_n in range(0, full_end, BLOCK_N):
      acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, rows,
                                    KROW, D, BLOCK_N, QK_SCALE, CAUSAL, False, PRECISION)
    for start_n in range(full_end, end, BLOCK_N):
      acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, rows,
                                    KROW, D, BLOCK_N, QK_SCALE, CAUSAL, True, PRECISION)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row_ok = offs_m < rows
    stat = (first + offs_m.to(tl.int64) * R) * H + h  # [BLOCK_M] offsets into lse
    o_ptr = _rows_ptr((OUT if LAST else ORUN) + (first * H + h) * D, rows, R * H * D, start_m,
                      BLOCK_M, D)
    if HAS_PREV:
      token = tok0 + offs_m * R
      seen = row_ok & (tl.load(FIRST + token * H + h, mask=row_ok, other=127) < CHAIN_POS)
      prev_ptr = _rows_ptr(ORUN_IN + (first * H + h) * D, rows, R * H * D, start_m, BLOCK_M, D)
      o_prev = tl.load(prev_ptr, boundary_check=(0,), padding_option="zero").to(tl.float32)
      lse_prev = tl.load(LSE_IN + stat, mask=seen, other=float("-inf"))
      top = tl.maximum(lse_prev, lse)
      top = tl.where(top == float("-inf"), 0.0, top)
      w_prev = tl.exp(lse_prev - top)  # 0 where no earlier launch wrote (o_prev ignored)
      w_new = tl.exp(lse - top)
      den = w_prev + w_new
      o_prev = tl.where(seen[:, None], o_prev, 0.0)
      o = (w_prev[:, None] * o_prev + w_new[:, None] * o) / tl.where(den > 0, den, 1.0)[:, None]
      lse = top + tl.log(den)
    tl.store(LSE + stat, lse, mask=row_ok)
    tl.store(o_ptr, o.to(o_ptr.dtype.element_ty), boundary_check=(0,))


@triton.jit
def _query_rows(Q, DO, LSE, DELTA, first, h, rows, start_m, H: tl.constexpr, R: tl.constexpr,
                D: tl.constexpr, BLOCK_M: tl.constexpr):
  """What a backward step needs of a block of query rows: q, dout, lse (base 2) and delta.

  lse is +inf on padding and on rows that see nothing, so p = 0 there.
  """
  q_base = (first * H + h) * D
  q = tl.load(_rows_ptr(Q + q_base, rows, R * H * D, start_m, BLOCK_M, D),
              boundary_check=(0,), padding_option="zero")
  do = tl.load(_rows_ptr(DO + q_base, rows, R * H * D, start_m, BLOCK_M, D),
               boundary_check=(0,), padding_option="zero")
  offs_m = start_m + tl.arange(0, BLOCK_M)
  row_ok = offs_m < rows
  stat = (first + offs_m.to(tl.int64) * R) * H + h
  lse = tl.load(LSE + stat, mask=row_ok, other=float("inf")) * 1.4426950408889634
  delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
  return q, do, lse, delta, offs_m


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ_IN, DQ,
              N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
              W: tl.constexpr, R: tl.constexpr, H0: tl.constexpr,
              PER_HEAD: tl.constexpr, CAUSAL: tl.constexpr, SCALE: tl.constexpr,
              M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              PRECISION: tl.constexpr):
  """dq of one branch for a block of queries, added to the float32 accumulator DQ."""
  pid = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  pid_m = pid % M_BLOCKS
  h, tok0, rows = _row_geometry(pid // M_BLOCKS, N, W, R, H0, PER_HEAD)
  start_m = pid_m * BLOCK_M
  if start_m < rows:
    g = h // (H // HKV)
    first = b * N + tok0
    q_base = (first * H + h) * D
    q, do, lse, delta, offs_m = _query_rows(Q, DO, LSE, DELTA, first, h, rows, start_m, H, R, D,
                                            BLOCK_M)
    k_base = K + (first * HKV + g) * D
    v_base = V + (first * HKV + g) * D
    QK_SCALE: tl.constexpr = SCALE * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    end = tl.minimum(start_m + BLOCK_M, rows) if CAUSAL else rows
    for start_n in range(0, end, BLOCK_N):
      k = tl.load(_rows_ptr(k_base, rows, R * HKV * D, start_n, BLOCK_N, D),
                  boundary_check=(0,), padding_option="zero")
      v = tl.load(_rows_ptr(v_base, rows, R * HKV * D, start_n, BLOCK_N, D),
                  boundary_check=(0,), padding_option="zero")
      qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * QK_SCALE
      offs_n = start_n + tl.arange(0, BLOCK_N)
      visible = offs_n[None, :] < rows
      if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None])
      p = tl.where(visible, tl.math.exp2(qk - lse[:, None]), 0.0)
      dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
      ds = p * (dp - delta[:, None])
      dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    prev = tl.load(_rows_ptr(DQ_IN + q_base, rows, R * H * D, start_m, BLOCK_M, D),
                   boundary_check=(0,), padding_option="zero")
    tl.store(_rows_ptr(DQ + q_base, rows, R * H * D, start_m, BLOCK_M, D), prev + dq * SCALE,
             boundary_check=(0,))


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK_IN, DV_IN, DK, DV,
                N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                W: tl.constexpr, R: tl.constexpr, H0: tl.constexpr, NH: tl.constexpr,
                PER_HEAD: tl.constexpr, CAUSAL: tl.constexpr, SCALE: tl.constexpr,
                N_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
  """dk, dv of one branch for a block of keys of one key/value head, summed over the query
  heads that read it, added to the float32 accumulators DK, DV."""
  pid = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  pid_n = pid % N_BLOCKS
  z = pid // N_BLOCKS  # (kv head, segment, residue): every residue, so all keys are written
  S: tl.constexpr = (N + W - 1) // W
  c = z % R
  seg0 = ((z // R) % S) * W
  g = z // (R * S)
  rows = tl.maximum((tl.minimum(W, N - seg0) - c + R - 1) // R, 0)
  start_n = pid_n * BLOCK_N
  if start_n < rows:
    GROUP: tl.constexpr = H // HKV
    first = b * N + seg0 + c
    kv_base = (first * HKV + g) * D
    k = tl.load(_rows_ptr(K + kv_base, rows, R * HKV * D, start_n, BLOCK_N, D),
                boundary_check=(0,), padding_option="zero")
    v = tl.load(_rows_ptr(V + kv_base, rows, R * HKV * D, start_n, BLOCK_N, D),
                boundary_check=(0,), padding_option="zero")
    offs_n = start_n + tl.arange(0, BLOCK_N)
    QK_SCALE: tl.constexpr = SCALE * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for i in range(GROUP):
      h = g * GROUP + i
      reads = (h >= H0) & (h < H0 + NH)
      if PER_HEAD:
        reads = reads & (h % R == c)
      if reads:
        for start_m in range(lo, rows, BLOCK_M):
          q, do, lse, delta, offs_m = _query_rows(Q, DO, LSE, DELTA, first, h, rows, start_m,
                                                  H, R, D, BLOCK_M)
          qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * QK_SCALE  # [BLOCK_N, BLOCK_M]
          p_t = tl.math.exp2(qk_t - lse[None, :])
          if CAUSAL:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :], p_t, 0.0)
          dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
          dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
          ds_t = p_t * (dp_t - delta[None, :])
          dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    k_out = _rows_ptr(DK + kv_base, rows, R * HKV * D, start_n, BLOCK_N, D)
    v_out = _rows_ptr(DV + kv_base, rows, R * HKV * D, start_n, BLOCK_N, D)
    dk_prev = tl.load(_rows_ptr(DK_IN + kv_base, rows, R * HKV * D, start_n, BLOCK_N, D),
                      boundary_check=(0,), padding_option="zero")
    dv_prev = tl.load(_rows_ptr(DV_IN + kv_base, rows, R * HKV * D, start_n, BLOCK_N, D),
                      boundary_check=(0,), padding_option="zero")
    tl.store(k_out, dk_prev + dk * SCALE, boundary_check=(0,))
    tl.store(v_out, dv_prev + dv, boundary_check=(0,))
