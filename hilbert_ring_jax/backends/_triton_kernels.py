"""Triton kernels of the "triton" backend (pure Triton: no JAX here, so they can also run
in Triton's interpreter).

Layout: q, out `[B, N, H, D]`, k, v `[B, N, HKV, D]`, lse and delta `[B, N, H]`, contiguous.
One launch computes one branch `(W, R)` of the pattern. Its work items are dilated rows: the
positions `s * W + c + m * R` (m = 0, 1, ...) of segment `s` and residue `c`, addressed with a
row stride of `R` tokens: dilation is strided addressing, never a copy. For `offsets="head"`
(PER_HEAD) head `h` reads residue `h % R` only. Query head `h` reads key/value head
`h // (H // HKV)` (GQA without copies). Loops visit only the key blocks the pattern makes
visible: the blocks above a causal diagonal are never loaded.

Softmax statistics are float32 and kept in base 2 (`exp2`), with the scale folded in.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _row_geometry(z, N: tl.constexpr, H: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
                  H0: tl.constexpr, NH: tl.constexpr, PER_HEAD: tl.constexpr):
  """Work item `z` -> (head, segment start, residue, rows M) of a dilated row."""
  S: tl.constexpr = (N + W - 1) // W
  C: tl.constexpr = 1 if PER_HEAD else R
  c = z % C
  s = (z // C) % S
  h = H0 + z // (C * S)
  if PER_HEAD:
    c = h % R
  seg0 = s * W
  length = tl.minimum(W, N - seg0)
  rows = tl.maximum((length - c + R - 1) // R, 0)
  return h, seg0, c, rows


@triton.jit
def _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, rows,
                  KROW: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  QK_SCALE: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
  """One key block of the online softmax (base 2)."""
  offs_n = start_n + tl.arange(0, BLOCK_N)
  offs_d = tl.arange(0, D)
  kv_off = offs_n.to(tl.int64)[:, None] * KROW + offs_d[None, :]
  if MASKED:
    k = tl.load(k_base + kv_off, mask=offs_n[:, None] < rows, other=0.0)
  else:
    k = tl.load(k_base + kv_off)
  qk = tl.dot(q, tl.trans(k)) * QK_SCALE
  if MASKED:
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
    v = tl.load(v_base + kv_off, mask=offs_n[:, None] < rows, other=0.0)
  else:
    v = tl.load(v_base + kv_off)
  acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
  return acc, l_i, m_new


@triton.jit
def forward_kernel(Q, K, V, FIRST, ORUN_IN, LSE_IN, ORUN, LSE, OUT,
                   N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   W: tl.constexpr, R: tl.constexpr, H0: tl.constexpr, NH: tl.constexpr,
                   PER_HEAD: tl.constexpr, CAUSAL: tl.constexpr, CHAIN_POS: tl.constexpr,
                   HAS_PREV: tl.constexpr, LAST: tl.constexpr, QK_SCALE: tl.constexpr,
                   M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
  """One branch over all its dilated rows, merged into the running `(ORUN, LSE)`.

  Branches run as a chain: launch `CHAIN_POS` merges its result into the running float32
  state of the rows an earlier launch covered (`FIRST[n, h] < CHAIN_POS`; `FIRST` holds the
  chain position of the first launch covering `(n, h)`) and stores it; the `LAST` launch,
  which covers every row, writes the final output in the input dtype instead.
  """
  pid = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  pid_m = pid % M_BLOCKS
  h, seg0, c, rows = _row_geometry(pid // M_BLOCKS, N, H, W, R, H0, NH, PER_HEAD)
  start_m = pid_m * BLOCK_M
  if start_m < rows:
    g = h // (H // HKV)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    first_tok = b * N + seg0 + c  # token index of row 0, batch included
    pos = first_tok + offs_m.to(tl.int64) * R  # [BLOCK_M] token indices
    row_ok = offs_m < rows
    q = tl.load(Q + (pos * H + h)[:, None] * D + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    k_base = K + (first_tok * HKV + g) * D
    v_base = V + (first_tok * HKV + g) * D
    KROW: tl.constexpr = R * HKV * D
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if CAUSAL:
      full_end = start_m  # blocks wholly below the diagonal
      end = tl.minimum(start_m + BLOCK_M, rows)
    else:
      full_end = (rows // BLOCK_N) * BLOCK_N
      end = rows
    for start_n in range(0, full_end, BLOCK_N):
      acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, rows,
                                    KROW, D, BLOCK_N, QK_SCALE, CAUSAL, False)
    for start_n in range(full_end, end, BLOCK_N):
      acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, rows,
                                    KROW, D, BLOCK_N, QK_SCALE, CAUSAL, True)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    stat = pos * H + h  # [BLOCK_M] offsets into lse
    if HAS_PREV:
      seen = row_ok & (tl.load(FIRST + (pos % N) * H + h, mask=row_ok, other=127) < CHAIN_POS)
      o_prev = tl.load(ORUN_IN + stat[:, None] * D + offs_d[None, :], mask=seen[:, None],
                       other=0.0)
      lse_prev = tl.load(LSE_IN + stat, mask=seen, other=float("-inf"))
      top = tl.maximum(lse_prev, lse)
      top = tl.where(top == float("-inf"), 0.0, top)
      w_prev = tl.exp(lse_prev - top)
      w_new = tl.exp(lse - top)
      den = w_prev + w_new
      o = (w_prev[:, None] * o_prev + w_new[:, None] * o) / tl.where(den > 0, den, 1.0)[:, None]
      lse = top + tl.log(den)
    tl.store(LSE + stat, lse, mask=row_ok)
    if LAST:
      tl.store(OUT + stat[:, None] * D + offs_d[None, :], o.to(OUT.dtype.element_ty),
               mask=row_ok[:, None])
    else:
      tl.store(ORUN + stat[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ_IN, DQ,
              N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
              W: tl.constexpr, R: tl.constexpr, H0: tl.constexpr, NH: tl.constexpr,
              PER_HEAD: tl.constexpr, CAUSAL: tl.constexpr, SCALE: tl.constexpr,
              M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
  """dq of one branch for a block of queries, added to the float32 accumulator DQ."""
  pid = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  pid_m = pid % M_BLOCKS
  h, seg0, c, rows = _row_geometry(pid // M_BLOCKS, N, H, W, R, H0, NH, PER_HEAD)
  start_m = pid_m * BLOCK_M
  if start_m < rows:
    g = h // (H // HKV)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    first_tok = b * N + seg0 + c
    pos = first_tok + offs_m.to(tl.int64) * R
    row_ok = offs_m < rows
    stat = pos * H + h
    ptrs = stat[:, None] * D + offs_d[None, :]
    q = tl.load(Q + ptrs, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + ptrs, mask=row_ok[:, None], other=0.0)
    # lse is +inf on padding and on rows that see nothing: p = 0 there.
    lse = tl.load(LSE + stat, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
    k_base = K + (first_tok * HKV + g) * D
    v_base = V + (first_tok * HKV + g) * D
    KROW: tl.constexpr = R * HKV * D
    QK_SCALE: tl.constexpr = SCALE * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    end = tl.minimum(start_m + BLOCK_M, rows) if CAUSAL else rows
    for start_n in range(0, end, BLOCK_N):
      offs_n = start_n + tl.arange(0, BLOCK_N)
      kv_off = offs_n.to(tl.int64)[:, None] * KROW + offs_d[None, :]
      col_ok = offs_n < rows
      k = tl.load(k_base + kv_off, mask=col_ok[:, None], other=0.0)
      v = tl.load(v_base + kv_off, mask=col_ok[:, None], other=0.0)
      qk = tl.dot(q, tl.trans(k)) * QK_SCALE
      visible = col_ok[None, :]
      if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None])
      p = tl.where(visible, tl.math.exp2(qk - lse[:, None]), 0.0)
      dp = tl.dot(do, tl.trans(v))
      ds = p * (dp - delta[:, None])
      dq += tl.dot(ds.to(k.dtype), k)
    prev = tl.load(DQ_IN + ptrs, mask=row_ok[:, None], other=0.0)
    tl.store(DQ + ptrs, prev + dq * SCALE, mask=row_ok[:, None])


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK_IN, DV_IN, DK, DV,
                N: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                W: tl.constexpr, R: tl.constexpr, H0: tl.constexpr, NH: tl.constexpr,
                PER_HEAD: tl.constexpr, CAUSAL: tl.constexpr, SCALE: tl.constexpr,
                N_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
  """dk, dv of one branch for a block of keys of one key/value head, summed over the query
  heads that read it, added to the float32 accumulators DK, DV."""
  pid = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  pid_n = pid % N_BLOCKS
  z = pid // N_BLOCKS  # (kv head, segment, residue): every residue, so all keys are written
  S: tl.constexpr = (N + W - 1) // W
  c = z % R
  s = (z // R) % S
  g = z // (R * S)
  seg0 = s * W
  length = tl.minimum(W, N - seg0)
  rows = tl.maximum((length - c + R - 1) // R, 0)
  start_n = pid_n * BLOCK_N
  if start_n < rows:
    GROUP: tl.constexpr = H // HKV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    first_tok = b * N + seg0 + c
    kpos = first_tok + offs_n.to(tl.int64) * R
    col_ok = offs_n < rows
    kv_ptrs = (kpos * HKV + g)[:, None] * D + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + kv_ptrs, mask=col_ok[:, None], other=0.0)
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
          offs_m = start_m + tl.arange(0, BLOCK_M)
          row_ok = offs_m < rows
          stat = (first_tok + offs_m.to(tl.int64) * R) * H + h
          ptrs = stat[:, None] * D + offs_d[None, :]
          q = tl.load(Q + ptrs, mask=row_ok[:, None], other=0.0)
          do = tl.load(DO + ptrs, mask=row_ok[:, None], other=0.0)
          lse = tl.load(LSE + stat, mask=row_ok, other=float("inf")) * 1.4426950408889634
          delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
          qk_t = tl.dot(k, tl.trans(q)) * QK_SCALE  # [BLOCK_N, BLOCK_M]
          visible = row_ok[None, :] & col_ok[:, None]
          if CAUSAL:
            visible = visible & (offs_n[:, None] <= offs_m[None, :])
          p_t = tl.where(visible, tl.math.exp2(qk_t - lse[None, :]), 0.0)
          dv += tl.dot(p_t.to(do.dtype), do)
          dp_t = tl.dot(v, tl.trans(do))
          ds_t = p_t * (dp_t - delta[None, :])
          dk += tl.dot(ds_t.to(q.dtype), q)
    prev_k = tl.load(DK_IN + kv_ptrs, mask=col_ok[:, None], other=0.0)
    prev_v = tl.load(DV_IN + kv_ptrs, mask=col_ok[:, None], other=0.0)
    tl.store(DK + kv_ptrs, prev_k + dk * SCALE, mask=col_ok[:, None])
    tl.store(DV + kv_ptrs, prev_v + dv, mask=col_ok[:, None])
