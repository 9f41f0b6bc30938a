"""A token step of dilated decoding in one Pallas Mosaic GPU launch (Hopper, sm_90).

`decode.dilated_attention_step` with one new token per sequence reads, per branch and
key/value head, one slot of the compressed cache: the `n_b = (t % w_b) // r_b + 1` rows of the
new token's residue class in its segment (the new row included, once written). The token's
attention is a single softmax over all those rows of all branches (a key seen by two branches
counts twice, as the pattern's merge counts it), so the step is flash decoding over that set:

- a program owns one (batch, key/value head) and a run of `block_k`-row blocks of the
  branches' slots (`splits` programs share the blocks of one kv head, so that short caches
  still fill the GPU); the query heads of the kv head are the rows of one wgmma tile (padded
  to 64), so GQA reads each cached row once for all of its query heads;
- a producer warpgroup streams the key and value blocks with TMA into a ring of `stages`
  shared-memory buffers; a consumer warpgroup scores them (wgmma), masks rows past `n_b`
  and query heads that do not read the branch at this position (a per-branch row bias of 0
  or -inf), runs an online base-2 softmax and accumulates P V (wgmma);
- each program writes its float32 partial output and log-denominator for the real query
  rows; `merge` combines the splits.

Blocks past `n_b` are neither loaded nor scored, so a step costs the rows it reads. The
function `step` works under `jit` and `vmap` (the batch axis) like the other kernels;
`Config(interpret=True)` runs it in Mosaic GPU interpret mode on a CPU (JAX >= 0.11).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..merge import merge
from .base import YES, Problem, Support, no
from .hopper import (LN2, LOG2E, REGISTERS, SMEM_BYTES, accumulate, aligned, ceil_div, is_hopper,
                     products, run, swizzled)
from .mosaic_pipeline import observe_releases

_ROWS = 64  # query rows of a wgmma tile: the query heads of one kv head, padded
_SMS = 132  # an H100's multiprocessors: programs are sized to fill them twice


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Launch choices of the token-step kernel (keyword-only; None: tuned defaults).

  Attributes:
    block_k: cached rows per pipeline step (64 or 128).
    stages: blocks in flight (2..4).
    splits: programs per (batch, kv head); None: enough to fill the GPU twice.
    interpret: run in Mosaic GPU interpret mode (CPU, JAX >= 0.11; slow: for tests).
  """

  block_k: int | None = None
  stages: int | None = None
  splits: int | None = None
  interpret: bool = False

  def __post_init__(self):
    for name, allowed in (("block_k", (64, 128)), ("stages", (2, 3, 4))):
      value = getattr(self, name)
      if value is not None and (type(value) is not int or value not in allowed):
        raise ValueError(f"{name} must be None or one of {allowed} (an int), got "
                         f"{name}={value!r}")
    if self.splits is not None and (isinstance(self.splits, bool) or
                                    not isinstance(self.splits, int) or self.splits < 1):
      raise ValueError(f"splits must be None or an int >= 1, got splits={self.splits!r}")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"interpret must be a bool, got interpret={self.interpret!r}")


def _smem_bytes(block_k: int, stages: int, head_dim: int, itemsize: int) -> int:
  q = _ROWS * head_dim * itemsize
  kv = 2 * stages * block_k * head_dim * itemsize
  out = _ROWS * head_dim * 4 + _ROWS * 4
  return q + kv + out + 3072  # + row biases, barriers, alignment


def resolved(config: Config | None, head_dim: int, itemsize: int) -> Config:
  """The config with defaults: blocks of 128 rows and 2 stages where they fit, else 64."""
  config = config or Config()
  for bk, stages in ((128, 2), (64, 3), (64, 2)):
    c = dataclasses.replace(config, block_k=config.block_k or bk,
                            stages=config.stages or stages)
    if _smem_bytes(c.block_k, c.stages, head_dim, itemsize) <= SMEM_BYTES:
      return c
  raise ValueError(f"block_k={c.block_k}, stages={c.stages} need "
                   f"{_smem_bytes(c.block_k, c.stages, head_dim, itemsize)} bytes of shared "
                   f"memory at head dim {head_dim} ({SMEM_BYTES} available)")


def supports(problem: Problem) -> Support:
  """A decoding step (`problem.step`; one token: `base.resolve` gives chunks to "xla"):
  Hopper GPUs (or interpret mode), JAX >= 0.11, bf16/f16, head dims 64 and 128, at most 64
  query heads per kv head."""
  if jax.__version_info__ < (0, 11):
    return no(f"the mosaic token step needs JAX >= 0.11, this is {jax.__version__}")
  if not problem.interpret and (problem.platform != "gpu" or not is_hopper()):
    return no("the mosaic token step runs on Hopper GPUs (sm_90) only")
  if not any(problem.dtype == t for t in (jnp.bfloat16, jnp.float16)):
    return no(f"the mosaic token step runs bf16 and f16 caches, got {problem.dtype}")
  if problem.head_dim not in (64, 128):
    return no(f"the mosaic token step needs a head dim of 64 or 128, got {problem.head_dim}")
  group = problem.q_shape[2] // problem.kv_shape[2]
  if group > _ROWS:
    return no(f"the mosaic token step takes at most {_ROWS} query heads per kv head, got "
              f"{group}")
  return YES


def _splits(config: Config, blocks: int, programs: int) -> tuple[int, int]:
  """`(splits, per)`: programs per (batch, kv head) and blocks per program."""
  splits = config.splits or max(1, -(-2 * _SMS // programs))
  per = -(-blocks // min(splits, blocks))
  return -(-blocks // per), per


def step(q, ks, vs, length, branches, scale: float, config: Config | None = None,
         first=None):
  """`(out [B, H, D], lse [B, H])`, float32, of the token at position `length` (whose row is
  already in the caches `ks, vs`: one `[B, Hkv, R_b, rows_b, D]` pair per branch) with query
  `q [B, H, D]`: its attention over every cached row it reads in every branch. `branches`:
  the cache's slot tables (`decode._tables`: `w, r, rows`, `slot [Hkv, r]`, the slot of (kv
  head, residue) or -1, and `takes_part [H, r]`, which query heads read which residue).
  `first` (packed rows, one int32 `[B, r]` array a branch): each residue's cached rows
  before that position are of other documents: a program skips their blocks and masks the
  rest of them."""
  batch, num_heads, d = q.shape
  num_kv = ks[0].shape[1]
  group = num_heads // num_kv
  config = resolved(config, d, q.dtype.itemsize)
  bk, stages = config.block_k, config.stages
  rows_g = -(-group // 8) * 8  # output rows per program: whole tiles of 8
  nb = len(branches)
  blocks = [-(-br.rows // bk) for br in branches]
  block0 = np.cumsum([0] + blocks)  # a program's blocks are a run of this concatenation
  splits, per = _splits(config, int(block0[-1]), batch * num_kv)
  dtype = q.dtype
  qk_scale = scale * LOG2E

  # The token's residue, rows read and slot in each branch, and which query heads read it
  # (the tile rows past the kv head's `group` query heads read nothing).
  t = jnp.asarray(length, jnp.int32)
  # Packed rows: per branch and row, the first cached row the token's slot reads (the rows
  # at or after its residue's `first` position; row j is position seg_start + j r + c).
  packed = first is not None
  meta, bias, rows0 = [], [], []
  for i, br in enumerate(branches):
    c = (t % br.w) % br.r
    slot = jnp.asarray(br.slot)[:, c]                                   # [Hkv]
    count = jnp.where(slot >= 0, (t % br.w) // br.r + 1, 0)            # rows read
    meta.append(jnp.stack([jnp.maximum(slot, 0), count], axis=1))     # [Hkv, 2]
    reads = jnp.asarray(br.takes_part)[:, c].reshape(num_kv, group)
    reads = jnp.pad(reads, ((0, 0), (0, _ROWS - group)))               # [Hkv, 64]
    bias.append(jnp.where(reads, 0.0, -jnp.inf))
    if packed:
      rows0.append(jnp.maximum(-((t // br.w * br.w + c - first[i][:, c]) // br.r), 0))
  meta = jnp.stack(meta).astype(jnp.int32).reshape(-1)                  # [nb * Hkv * 2]
  first_row = (jnp.stack(rows0).astype(jnp.int32).reshape(-1),) if packed else ()  # [nb * B]
  bias = jnp.stack(bias, axis=1).astype(jnp.float32)                    # [Hkv, nb, 64]
  qp = q.reshape(batch, num_kv, group, d)
  qp = jnp.pad(qp, ((0, 0), (0, 0), (0, _ROWS - group), (0, 0)))

  def kernel(origin_ref, meta_ref, first_ref, bias_ref, q_ref, *refs):
    """`first_ref`: None, or packed rows' first cached row read, per branch and row."""
    k_refs, v_refs = refs[:nb], refs[nb:2 * nb]
    o_ref, lse_ref, smem, bars, free = refs[2 * nb:]
    q_smem, k_smem, v_smem, o_smem, lse_smem, bias_smem = smem
    q_bar, k_bar, v_bar = bars
    k_free, v_free = free
    wg = lax.axis_index("wg")
    split = lax.axis_index("row") + origin_ref[0]
    bg = lax.axis_index("bp") + origin_ref[1]
    b, g = lax.div(bg, num_kv), lax.rem(bg, num_kv)
    lo_all = split * per

    def ranges(i):
      """Branch i's slot, rows read `[row0, count)`, and this program's blocks `[lo, hi)`
      of it."""
      at = (i * num_kv + g) * 2
      slot, count = meta_ref[at], meta_ref[at + 1]
      row0 = first_ref[i * batch + b] if packed else None
      lo = jnp.clip(lo_all - int(block0[i]), 0, blocks[i])
      hi = jnp.clip(lo_all + per - int(block0[i]), 0, blocks[i])
      hi = jnp.minimum(hi, ceil_div(count, bk))
      if packed:
        lo = jnp.maximum(lo, lax.div(row0, bk))
      return slot, row0, count, jnp.minimum(lo, hi), hi

    def producer():
      plgpu.set_max_registers(REGISTERS[0], action="decrease")
      n = jnp.int32(0)
      for i in range(nb):
        slot, _, _, lo, hi = ranges(i)

        def load(j, n, i=i, slot=slot):
          buf = lax.rem(n, stages)

          @pl.when(n >= stages)
          def _():
            plgpu.barrier_wait(k_free.at[buf])
            plgpu.barrier_wait(v_free.at[buf])

          rows = pl.ds(aligned(j * bk), bk)
          plgpu.copy_gmem_to_smem(k_refs[i].at[b, g, slot, rows], k_smem.at[buf], k_bar.at[buf])
          plgpu.copy_gmem_to_smem(v_refs[i].at[b, g, slot, rows], v_smem.at[buf], v_bar.at[buf])
          return n + 1

        n = lax.fori_loop(lo, hi, load, n)
      observe_releases((k_free, v_free), n, stages)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      plgpu.copy_gmem_to_smem(q_ref.at[b, g], q_smem, q_bar.at[0])
      plgpu.copy_gmem_to_smem(bias_ref.at[g], bias_smem, q_bar.at[1])
      plgpu.barrier_wait(q_bar.at[0])
      plgpu.barrier_wait(q_bar.at[1])
      row_stat = plgpu.Layout.WGMMA.reduce(1)
      cols = plgpu.broadcasted_iota(jnp.int32, (_ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
      rows_of = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
      acc = plgpu.layout_cast(jnp.zeros((_ROWS, d), jnp.float32), plgpu.Layout.WGMMA)
      m_i = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32), row_stat)
      l_i = plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), row_stat)
      carry = (acc, m_i, l_i, jnp.int32(0))
      for i in range(nb):
        _, row0, count, lo, hi = ranges(i)
        row_bias = plgpu.load(bias_smem.at[i], layout=row_stat)

        def score(j, carry, row0=row0, count=count, row_bias=row_bias):
          acc, m_i, l_i, n = carry
          buf = lax.rem(n, stages)
          plgpu.barrier_wait(k_bar.at[buf])
          s, = products([(q_smem, k_smem.at[buf].T)], (_ROWS, bk))
          plgpu.barrier_arrive(k_free.at[buf])
          read = j * bk + cols < count
          if packed:
            read = read & (j * bk + cols >= row0)
          s = jnp.where(read, s * qk_scale, -jnp.inf)
          s = s + rows_of(row_bias, s.shape)
          m_new = jnp.maximum(m_i, s.max(axis=1))
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet
          alpha = jnp.exp2(m_i - m_use)
          p = jnp.exp2(s - rows_of(m_use, s.shape))
          acc = acc * rows_of(alpha, acc.shape)
          l_i = l_i * alpha + p.sum(axis=1)
          plgpu.barrier_wait(v_bar.at[buf])
          acc, = accumulate([acc], [(p.astype(dtype), v_smem.at[buf])], config.interpret)
          plgpu.barrier_arrive(v_free.at[buf])
          return acc, m_new, l_i, n + 1

        carry = lax.fori_loop(lo, hi, score, carry)
      acc, m_i, l_i, _ = carry
      seen = l_i != 0  # (a NaN row stays NaN)
      l_safe = jnp.where(seen, l_i, 1.0)
      # A row that saw no key gets 0, not acc: its p = 0 times a NaN or inf of a row it
      # does not read (another head's residue) would be NaN.
      o_smem[...] = jnp.where(rows_of(seen, acc.shape), acc / rows_of(l_safe, acc.shape), 0.0)
      lse_smem[...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_g)], o_ref.at[split, bg])
      plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows_g)], lse_ref.at[split, bg])
      plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 0)(consumer)
    pl.when(wg == 1)(producer)

  def entry(origin_ref, meta_ref, bias_ref, q_ref, *refs):
    first_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
    tiles = swizzled(dtype)
    smem = [plgpu.SMEM((_ROWS, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((_ROWS, d), jnp.float32, transforms=swizzled(jnp.float32)),
            plgpu.SMEM((_ROWS,), jnp.float32),
            plgpu.SMEM((nb, _ROWS), jnp.float32)]
    pl.run_scoped(
        lambda smem, bars, free: kernel(origin_ref, meta_ref, first_ref, bias_ref, q_ref,
                                        *refs, smem, bars, free),
        smem,
        (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages)),
        (plgpu.Barrier(num_barriers=stages),) * 2,
        collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((splits, batch * num_kv, rows_g, d), jnp.float32),
              jax.ShapeDtypeStruct((splits, batch * num_kv, rows_g), jnp.float32))
  o, lse = run(entry, out_type, (splits, batch * num_kv),
                (meta, bias, qp, *first_row, *ks, *vs), config.interpret, num_threads=2)
  o, lse = merge(list(o), list(lse))
  o = o.reshape(batch, num_kv, rows_g, d)[:, :, :group].reshape(batch, num_heads, d)
  lse = lse.reshape(batch, num_kv, rows_g)[:, :, :group].reshape(batch, num_heads)
  return o, lse
