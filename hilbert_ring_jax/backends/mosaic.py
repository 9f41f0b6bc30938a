"""The "mosaic" backend: a Pallas Mosaic GPU forward kernel for Hopper (sm_90).

The forward walks the same host block schedule as the "triton" backend (`schedule.py`): the
branches whose segments nest run in one launch, each (query, key) pair scored once with the
bias `log m` of its multiplicity, causal blocks past the diagonal skipped, GQA by reading the
shared key/value head. What changes is the engine, built from Hopper's own parts:

- a program owns `2 * block_q` positions of one strided query row and runs three warpgroups:
  two consumers (`block_q` query rows each) and one producer that issues the TMA copies of
  the row's key/value blocks into a ring of `stages` shared-memory buffers (full and free
  barriers per buffer), walking the row's pieces in the same order as the consumers;
- dilation is TMA addressing, never a gather: a row of stride `L` is a `[rows, D]` box of
  the free view `[B, N/L, L, H, D]` (row index `p // L`, class `p % L`), a stride-1 key
  piece a box of `[B, N, Hkv, D]`; the tiles land in 128-byte-swizzled shared memory;
- both products are wgmma (QK^T from shared memory, PV with P from registers), with an
  online base-2 softmax in float32 (one fused multiply-add per score: the piece's `log2 m`
  rides in the running maximum); the two consumers take turns on the tensor cores, so one's
  softmax overlaps the other's matrix products; blocks inside a piece and before every query
  of a consumer run without a mask.

The output goes back through shared memory with TMA stores; lse is written as
`[B, H, L, N/L]` (contiguous per row, so TMA can store it) and transposed outside.
Boxes past the end of an input read zeros (the kernel masks keys past each piece's end);
outputs are allocated in whole periods, so that no store runs past their end, and sliced.
Rows must come in whole program blocks (`2 * block_q` positions per row and period), else
`supports` declines; a length that `8 * L` does not divide is zero-padded (a copy, only then:
the views' row axes must be whole tiles of 8).

The backward is the "triton" backend's (the kernel contract makes passes interchangeable);
a Mosaic backward is future work. `Config(interpret=True)` runs the forward in Mosaic GPU
interpret mode on a CPU (JAX >= 0.11), which is how the test suite checks the kernel without
a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..merge import merge
from ..pattern import DilatedPattern, heads_per_kv
from . import schedule
from .base import YES, Problem, Support, batched, no

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_SMEM_BYTES = 232448  # Hopper's shared memory per block (227 KiB)
_MAX_GRID_Y = 65535


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Launch choices of the "mosaic" forward (keyword-only; None: tuned defaults).

  Attributes:
    block_q: query rows per consumer warpgroup (64 or 128; a program takes twice as many).
    block_k: keys per pipeline step (64 or 128).
    stages: key/value blocks in flight (2..4).
    interpret: run in Mosaic GPU interpret mode (CPU, JAX >= 0.11; slow: for tests).
  """

  block_q: int | None = None
  block_k: int | None = None
  stages: int | None = None
  interpret: bool = False

  def __post_init__(self):
    for name, allowed in (("block_q", (64, 128)), ("block_k", (64, 128)),
                          ("stages", (2, 3, 4))):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or value not in allowed):
        raise ValueError(f"{name} must be None or one of {allowed}, got {name}={value!r}")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"interpret must be a bool, got interpret={self.interpret!r}")

  def resolved(self, head_dim: int, itemsize: int = 2, out_itemsize: int = 2) -> Config:
    """This config with the tuned defaults filled in: the first of the preferred tiles whose
    buffers fit in shared memory (float32 outputs take a tile of their own). `ValueError`
    if the chosen tiles do not fit."""
    preferred = [(64, 128 if head_dim <= 128 else 64, 2), (64, 64, 3), (64, 64, 2)]
    for bq, bk, stages in preferred:
      config = dataclasses.replace(self, block_q=self.block_q or bq, block_k=self.block_k or bk,
                                   stages=self.stages or stages)
      if _smem_bytes(config, head_dim, itemsize, out_itemsize) <= _SMEM_BYTES:
        return config
    raise ValueError(
        f"block_q={config.block_q}, block_k={config.block_k}, stages={config.stages} need "
        f"{_smem_bytes(config, head_dim, itemsize, out_itemsize)} bytes of shared memory at "
        f"head dim {head_dim} ({_SMEM_BYTES} available): choose smaller blocks or fewer stages")


def _smem_bytes(config: Config, head_dim: int, itemsize: int, out_itemsize: int) -> int:
  q = 2 * config.block_q * head_dim * itemsize
  kv = 2 * config.stages * config.block_k * head_dim * itemsize
  out = 0 if out_itemsize == itemsize else 2 * config.block_q * head_dim * out_itemsize
  return q + kv + out + 2 * config.block_q * 4 + 3072  # + lse tiles, barriers, alignment


def _is_hopper() -> bool:
  try:
    return any(getattr(d, "compute_capability", None) == "9.0" for d in jax.devices("gpu"))
  except RuntimeError:
    return False


def geometry_problem(pattern: DilatedPattern, n: int, num_heads: int, num_kv_heads: int,
                     branches, config: Config, batch: int = 1) -> str | None:
  """Why the schedule of this problem does not fit the kernel's blocks or grid, or None."""
  rows = 2 * config.block_q
  for fused in schedule.launches(pattern, n, num_heads, branches):
    s = schedule.build(pattern, n, num_heads, num_kv_heads, fused, False)
    if s.period % s.stride or np.any(s.rows[:, schedule.ROW_LENGTH] % rows):
      return (f"the mosaic backend needs query rows of whole blocks of {rows} positions "
              f"(the shortest segment over the rates' lcm a multiple of {rows}); got rows of "
              f"{sorted(set(s.rows[:, schedule.ROW_LENGTH].tolist()))}")
    if s.periods * batch > _MAX_GRID_Y:
      return (f"the mosaic backend launches at most {_MAX_GRID_Y} batch x period programs; "
              f"got {batch} x {s.periods}")
  return None


def supports(problem: Problem) -> Support:
  """Hopper GPUs (sm_90); bf16 and f16; head dims 64, 128 (and 256 where the output is final);
  rows of whole blocks."""
  if problem.platform != "gpu" or not _is_hopper():
    return no("the mosaic backend runs on Hopper GPUs (sm_90) only")
  if jax.__version_info__ < (0, 11):
    return no(f"the mosaic backend needs JAX >= 0.11 (its kernel lowers with 0.11's Mosaic "
              f"GPU); this is {jax.__version__}")
  try:  # the backward is triton's
    from . import triton  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return no(f"the mosaic backend's backward pass is the triton backend's: unavailable ({e})")
  if not (backward := triton.supports(problem)):
    return no(f"the mosaic backend's backward pass is the triton backend's: {backward.reason}")
  if not any(problem.dtype == t for t in (jnp.bfloat16, jnp.float16)):
    return no(f"the mosaic backend runs bf16 and f16, got {problem.dtype}")
  d = problem.head_dim
  if d not in (64, 128, 256):
    return no(f"the mosaic backend needs a head dim of 64, 128 or 256; got {d}")
  b, n, h, _ = problem.q_shape
  launches = schedule.launches(problem.pattern, n, h, problem.branches)
  if d == 256 and (problem.varying or len(launches) > 1):
    return no("the mosaic backend writes float32 partials (ring steps, branch-by-branch "
              "launches) only up to head dim 128: at 256 their tiles exceed shared memory")
  if why := geometry_problem(problem.pattern, n, h, problem.kv_shape[2], problem.branches,
                             Config().resolved(d), b):
    return no(why)
  return YES


def _accumulate(acc, a, b_ref, interpret: bool):
  """`acc + a @ b_ref` with a wgmma (registers `a`, shared-memory `b_ref`). Interpret mode
  runs neither `run_state` nor a wgmma with a register operand: a `jnp.dot` there."""
  if interpret:
    return acc + jnp.dot(a, b_ref[...], preferred_element_type=jnp.float32)

  def update(acc_ref):
    plgpu.wgmma(acc_ref, a, b_ref)

  return pl.run_state(update)(plgpu.ACC.init(acc))


def _cut(first, count, stride, base, n):
  """`count` positions `first, first + stride, ...` of the period at `base`, cut at n."""
  return jnp.minimum(count, lax.div(jnp.maximum(n - base - first + stride - 1, 0), stride))


def _aligned(row):
  """`row` marked as a multiple of 8 (the tiles' rows), which TMA into tiled shared memory
  needs: rows and pieces start at interval starts, multiples of `w0 / L >= 128` rows (the
  geometry `supports` checks), and blocks at multiples of the block."""
  return pl.multiple_of(row, 8)


def _swizzled(dtype):
  minor = 128 // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(128))


def _forward_launch(q, k, v, tables, sched: schedule.Schedule, n: int, causal: bool,
                    scale: float, out_dtype, config: Config):
  """One launch over the padded `q, k, v [B, Np, H(kv), D]`: (out [B, No, H, D], lse
  [B, No, H]), `No >= Np` (whole periods)."""
  batch, n_pad, num_heads, d = q.shape
  num_kv = k.shape[2]
  dtype = q.dtype
  L, period, periods = sched.stride, sched.period, sched.periods
  bq, bk, stages = config.block_q, config.block_k, config.stages
  block_rows = 2 * bq
  row_blocks = sched.row_blocks(block_rows)
  per_kv = heads_per_kv(num_heads, num_kv)
  qk_scale = scale * _LOG2E
  interpret = config.interpret
  rc, pc = schedule.ROW_COLUMNS, schedule.PIECE_COLUMNS

  def kernel(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref,
             v5_ref, out_ref, lse_ref, smem, bars, free):
    """One program: (row block, batch x period) = the grid position plus `origin` (interpret
    mode launches programs one by one)."""
    q_smem, k_smem, v_smem, o_smem, lse_smem = smem
    q_bar, k_bar, v_bar = bars
    (k_free, v_free), turn = free
    wg = lax.axis_index("wg")
    pid = lax.axis_index("row") + origin_ref[0]
    bp = lax.axis_index("bp") + origin_ref[1]
    r = lax.div(pid, row_blocks)
    start = lax.rem(pid, row_blocks) * block_rows
    b = lax.div(bp, periods)
    base = lax.rem(bp, periods) * period
    head = rows_ref[r * rc + schedule.ROW_HEAD]
    first = rows_ref[r * rc + schedule.ROW_FIRST]
    nrows = _cut(first, rows_ref[r * rc + schedule.ROW_LENGTH], L, base, n)
    p0 = rows_ref[r * rc + schedule.ROW_PIECE0]
    p1 = rows_ref[r * rc + schedule.ROW_PIECE1]
    row0 = lax.div(base + first, L)  # the row in the [B, Np/L, L, ...] view, and its class
    cls = lax.rem(base + first, L)
    hi = first + L * (jnp.minimum(start + block_rows, nrows) - 1)  # last query (in period)
    kv_head = lax.div(head, per_kv)

    def piece(p):
      """(first, stride, length cut at n, log2 m, blocks this program visits) of piece p."""
      kf = pieces_ref[p * pc + schedule.PIECE_FIRST]
      ks = pieces_ref[p * pc + schedule.PIECE_STRIDE]
      count = _cut(kf, pieces_ref[p * pc + schedule.PIECE_LENGTH], ks, base, n)
      visible = count
      if causal:
        visible = jnp.where(hi >= kf, jnp.minimum(count, lax.div(hi - kf, ks) + 1), 0)
      return kf, ks, count, bias_ref[p], lax.div(visible + bk - 1, bk)

    def producer():
      plgpu.set_max_registers(40, action="decrease")

      def load(src4, src5, dst, bar, kf, ks, n0):
        at = base + kf
        if L == 1:
          plgpu.copy_gmem_to_smem(src4.at[b, pl.ds(_aligned(at + n0), bk), kv_head], dst, bar)
          return

        @pl.when(ks == 1)
        def _():
          plgpu.copy_gmem_to_smem(src4.at[b, pl.ds(_aligned(at + n0), bk), kv_head], dst, bar)

        @pl.when(ks != 1)
        def _():
          plgpu.copy_gmem_to_smem(src5.at[b, pl.ds(_aligned(lax.div(at, L) + n0), bk),
                                          lax.rem(at, L), kv_head], dst, bar)

      def per_piece(p, step):
        kf, ks, _, _, blocks = piece(p)

        def per_block(j, step):
          slot = lax.rem(step, stages)

          @pl.when(step >= stages)
          def _():
            plgpu.barrier_wait(k_free.at[slot])

          load(k4_ref, k5_ref, k_smem.at[slot], k_bar.at[slot], kf, ks, j * bk)

          @pl.when(step >= stages)
          def _():
            plgpu.barrier_wait(v_free.at[slot])

          load(v4_ref, v5_ref, v_smem.at[slot], v_bar.at[slot], kf, ks, j * bk)
          return step + 1

        return lax.fori_loop(0, blocks, per_block, step)

      steps = lax.fori_loop(p0, p1, per_piece, jnp.int32(0))
      # Wait for the consumers to release the last buffers: every phase of a barrier is
      # observed before the block exits (needed by interpret mode, free on the GPU).
      for i in range(stages):
        step = steps - stages + i

        @pl.when(step >= 0)
        def _():
          plgpu.barrier_wait(k_free.at[lax.rem(step, stages)])
          plgpu.barrier_wait(v_free.at[lax.rem(step, stages)])

    def consumer():
      plgpu.set_max_registers(232, action="increase")
      q_tile = q_smem.at[wg]
      q_start = start + wg * bq
      q_rows = pl.ds(_aligned(row0 + q_start), bq)
      plgpu.copy_gmem_to_smem(q_ref.at[b, q_rows, cls, head], q_tile, q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      rows_iota = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA)
      cols_iota = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
      q_first = first + L * q_start  # this warpgroup's first query (in the period)
      qpos = q_first + L * rows_iota
      row_stat = plgpu.Layout.WGMMA.reduce(1)
      acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
      m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_stat)
      l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_stat)
      rows_of = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

      def take_turn():  # the two consumers take turns on the tensor cores (see below)
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

      def step(carry, kf, ks, count, bias, j, masked: bool):
        """One key block: scores, online softmax (base 2; `m` includes the piece's
        `log2 m` bias, so p is one fused multiply-add and an exp2 per score), P @ V.
        Unmasked blocks (all keys exist and precede every query) skip the mask."""
        acc, m_i, l_i, step = carry
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(k_bar.at[slot])

        def scores(acc_ref):
          plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].T)
          take_turn()  # let the other consumer issue its wgmma while this one waits
          return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:
          key = j * bk + cols_iota
          visible = key < count
          if causal:
            visible = visible & (kf + ks * key <= qpos)
          s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale + bias)
        # Rows that have seen nothing yet (masked blocks only) subtract 0, not -inf.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m_i - m_use)
        p_ = jnp.exp2(s * qk_scale - rows_of(m_use - bias, s.shape))
        acc = acc * rows_of(alpha, acc.shape)
        l_i = l_i * alpha + p_.sum(axis=1)
        p16 = p_.astype(dtype)
        plgpu.barrier_arrive(turn)  # softmax done: the other consumer may go on
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_wait(turn)  # the tensor cores are ours again
        acc = _accumulate(acc, p16, v_smem.at[slot], interpret)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i, step + 1

      def per_piece(p, carry):
        kf, ks, count, bias, blocks = piece(p)
        # Blocks [0, unmasked): every key exists and (causal) precedes this warpgroup's
        # first query; the rest up to `blocks` (the program's) are masked.
        seen_by_all = count
        if causal:
          seen_by_all = jnp.where(q_first >= kf,
                                  jnp.minimum(count, lax.div(q_first - kf, ks) + 1), 0)
        unmasked = jnp.minimum(lax.div(seen_by_all, bk), blocks)
        carry = lax.fori_loop(
            0, unmasked, lambda j, c: step(c, kf, ks, count, bias, j, False), carry)
        return lax.fori_loop(
            unmasked, blocks, lambda j, c: step(c, kf, ks, count, bias, j, True), carry)

      # Ping-pong: consumer 1 starts one turn behind, consumer 0 ends with an extra turn,
      # so while one runs its softmax the other's wgmma runs.
      pl.when(wg == 1)(take_turn)
      acc, m_i, l_i, _ = lax.fori_loop(p0, p1, per_piece, (acc, m_i, l_i, jnp.int32(0)))
      pl.when(wg == 0)(take_turn)
      seen = l_i > 0
      l_safe = jnp.where(seen, l_i, 1.0)
      o_tile = o_smem.at[wg]
      o_tile[...] = (acc / rows_of(l_safe, acc.shape)).astype(o_tile.dtype)
      lse_smem.at[wg][...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_tile, out_ref.at[b, q_rows, cls, head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, head, cls, q_rows])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(start < nrows)
    def _():
      pl.when(wg < 2)(consumer)
      pl.when(wg == 2)(producer)

  out_dtype = jnp.dtype(out_dtype)
  same = out_dtype == dtype  # then the output tile reuses the query tile

  def entry(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref, v5_ref,
            out_ref, lse_ref):
    tiles = _swizzled(dtype)
    smem = [plgpu.SMEM((2, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq), jnp.float32)]
    if not same:
      smem.append(plgpu.SMEM((2, bq, d), out_dtype, transforms=_swizzled(out_dtype)))

    def scoped(smem, bars, free):
      q_smem, k_smem, v_smem, lse_smem = smem[:4]
      o_smem = q_smem if same else smem[4]
      kernel(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref, v5_ref,
             out_ref, lse_ref, (q_smem, k_smem, v_smem, o_smem, lse_smem), bars, free)

    pl.run_scoped(
        scoped, smem,
        (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages)),
        ((plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
         plgpu.Barrier(num_arrivals=2)),
        collective_axes="wg")

  grid = (len(sched.rows) * row_blocks, batch * periods)
  # Outputs cover whole periods (every program's boxes lie inside them): TMA stores that
  # run past the end of an array are not clipped reliably on the GPU (measured: rows of
  # the last, partial period landed at the start), so none is issued.
  n_out = max(n_pad, -(-periods * period // (8 * L)) * 8 * L)
  out_type = (jax.ShapeDtypeStruct((batch, n_out // L, L, num_heads, d), out_dtype),
              jax.ShapeDtypeStruct((batch, num_heads, L, n_out // L), jnp.float32))
  rows, pieces, bias = tables
  view = lambda x: x.reshape(batch, n_pad // L, L, *x.shape[2:])
  args = (rows.reshape(-1), pieces.reshape(-1), bias, view(q), k, view(k), v, view(v))
  launch = functools.partial(
      plgpu.kernel, entry, out_type=out_type, grid_names=("row", "bp"), num_threads=3,
      thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))
  if not interpret:
    out, lse = launch(grid=grid)(jnp.zeros((2,), jnp.int32), *args)
  else:
    # The interpreter runs one block at a time only (barriers of concurrent blocks
    # collide): one launch per program, each writing its own rows into zeroed buffers.
    call = launch(grid=(1, 1), interpret=plgpu.InterpretGPUParams(
        out_of_bounds_reads="uninitialized", uninitialized_memory="zero"))
    out, lse = (jnp.zeros(t.shape, t.dtype) for t in out_type)
    for origin in np.ndindex(*grid):
      o, l = call(jnp.asarray(origin, jnp.int32), *args)
      out, lse = out + o, lse + l
  lse = lse.transpose(0, 3, 2, 1).reshape(batch, n_out, num_heads)
  return out.reshape(batch, n_out, num_heads, d), lse


def forward(q, k, v, pattern: DilatedPattern, scale: float, *, branches=None, config=None,
            out_dtype=None):
  """`(out, lse)` of `branches` (all if None): float32 partials, or `out` in `out_dtype` when
  given (written by the kernel when one launch covers the branches)."""
  multi = len(schedule.launches(pattern, q.shape[1], q.shape[2], branches)) > 1
  out_itemsize = 4 if out_dtype is None or multi else jnp.dtype(out_dtype).itemsize
  config = (config or Config()).resolved(q.shape[-1], q.dtype.itemsize, out_itemsize)
  fn = lambda q, k, v: _forward(q, k, v, pattern, scale, branches, config, out_dtype)
  return batched(fn)(q, k, v)


def _forward(q, k, v, pattern, scale, branches, config, out_dtype):
  batch, n, num_heads, _ = q.shape
  if why := geometry_problem(pattern, n, num_heads, k.shape[2], branches, config, batch):
    raise NotImplementedError(why)
  launches = schedule.launches(pattern, n, num_heads, branches)
  dtype = (out_dtype or jnp.float32) if len(launches) == 1 else jnp.float32
  parts = []
  for fused in launches:
    sched = schedule.build(pattern, n, num_heads, k.shape[2], fused, False)
    # TMA into tiled shared memory needs the row axes of the views in multiples of 8.
    n_pad = -(-n // (8 * sched.stride)) * 8 * sched.stride
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n_pad - n), (0, 0), (0, 0))) if n_pad > n else x
    out, lse = _forward_launch(pad(q), pad(k), pad(v), sched.arrays(), sched, n,
                               pattern.causal, scale, dtype, config)
    parts.append((out[:, :n], lse[:, :n]))
  out, lse = merge([o for o, _ in parts], [lse for _, lse in parts])
  return out.astype(out_dtype or jnp.float32), lse


def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, *,
             branches=None, config=None):
  """float32 `(dq, dk, dv)`: the "triton" backend's kernels (a Mosaic backward is to come)."""
  from . import triton
  return triton.backward(q, k, v, dout, lse, delta, pattern, scale, branches=branches)
