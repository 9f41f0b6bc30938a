"""The forward kernel of the "mosaic" backend: one launch (`launch`), Hopper's own engine.

- a program owns `2 * block_q` positions of one strided query row and runs three warpgroups:
  two consumers (`block_q` query rows each) and one producer that issues the TMA copies of
  the row's key/value blocks into a ring of `stages` shared-memory buffers (full and free
  barriers per buffer), walking the row's pieces in the same order as the consumers
  (`mosaic_pipeline`);
- dilation is TMA addressing, never a gather: a row of stride `L` is a `[rows, D]` box of
  the free view `[B, N/L, L, H, D]` (row index `p // L`, class `p % L`), a stride-1 key
  piece a box of `[B, N, Hkv, D]`; the tiles land in 128-byte-swizzled shared memory;
- both products are wgmma (QK^T from shared memory, PV with P from registers), with an
  online base-2 softmax in float32 (one fused multiply-add per score: the piece's `log2 m`
  rides in the running maximum, taken before scaling); the two consumers take turns on the
  tensor cores, so one's softmax overlaps the other's matrix products; blocks inside a piece
  and before every query of a consumer run without a mask, and a masked block compares each
  score's column with a per-row limit (the last key its query sees, worked out once per
  row: `mosaic_plan.key_limit`), one comparison a score (the key's position worked out per
  score made masked blocks cost far more instructions than unmasked ones, and most of the
  LM's are masked: docs/performance.md); a masked block of 128 keys goes by its halves that
  hold keys the consumer's queries may see (the first consumer's causal diagonal, a
  piece's or a document's edge: half the products), none of them passing without products.

The output goes back through shared memory with TMA stores; lse is written as
`[B, H, L, N/L]` (contiguous per row, so TMA can store it) and transposed outside. A launch
after the first merges the earlier launches' output and lse into its own in its items'
epilogues (`merge_prior`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..pattern import heads_per_kv
from . import schedule
from .hopper import (LN2, LOG2E, REGISTERS, SMEM_BYTES, accumulate, products, run, swizzled,
                     turns)
from .mosaic_pipeline import IdTiles, produce_kv, walk
from .mosaic_plan import Config, Ranges, Work, key_limit, out_length, smem_bytes, strided_view

# Masked key blocks of this size go by halves (`block`): causal LongNet's forward measured 5-7%
# faster, full causal attention and the packed rows of docs/performance.md the same.
HALVED_BLOCK = 128


def merge_prior(prior_refs, prog, rows, o_tile, lse_tile, bars, acc, m_i, l_i, rows_of,
                row_stat):
  """An item's epilogue merging its partial (`acc` unnormalized, base-2 running max `m_i`,
  sum `l_i`) with an earlier `(out, lse)` of its rows (`prior_refs`: `[B, N/L, L, H, D]` and
  `[B, H, L, N/L]`, read at `prog.b`, `prog.cls`, `prog.head`: an earlier launch's, or
  `mosaic_gather`'s first phase), loaded into the output's tiles: `lse = log(e^lse_p +
  e^lse_i)`, `out = (e^lse_p o_p + acc e^m_i) / e^lse` in base 2, a row neither has seen 0
  with lse -inf; written into the same tiles."""
  out_p, lse_p = prior_refs
  plgpu.copy_gmem_to_smem(out_p.at[prog.b, rows, prog.cls, prog.head], o_tile, bars[0])
  plgpu.copy_gmem_to_smem(lse_p.at[prog.b, prog.head, prog.cls, rows], lse_tile, bars[1])
  for bar in bars:
    plgpu.barrier_wait(bar)
  a = plgpu.load(lse_tile, layout=row_stat) * LOG2E  # prior, base 2
  b = jnp.where(l_i != 0, m_i + jnp.log2(jnp.where(l_i != 0, l_i, 1.0)), -jnp.inf)
  top = jnp.maximum(a, b)
  top = jnp.where(top == -jnp.inf, 0.0, top)
  w_p, w_i = jnp.exp2(a - top), jnp.exp2(m_i - top)  # 0 where unseen (-inf)
  den = w_p + w_i * l_i
  seen = den != 0  # (a NaN row stays NaN)
  inv = 1.0 / jnp.where(seen, den, 1.0)
  o_p = plgpu.load(o_tile, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  out = o_p * rows_of(w_p * inv, acc.shape) + acc * rows_of(w_i * inv, acc.shape)
  o_tile[...] = out.astype(o_tile.dtype)
  lse_tile[...] = jnp.where(seen, (top + jnp.log2(jnp.where(seen, den, 1.0))) * LN2, -jnp.inf)


def launch(q, k, v, tables, sched: schedule.Schedule, n: int, causal: bool,
           scale: float, out_dtype, config: Config, prior=None, ids=None):
  """One launch over the padded `q, k, v [B, Np, H(kv), D]`: (out [B, No, H, D], lse
  [B, No, H]), `No >= Np` (whole periods). `prior`: the `(out, lse)` of earlier launches
  (`[B, No, H, D]` in `out_dtype`, `[B, No, H]`), merged into this launch's result in each
  item's epilogue (its tile loaded into the output's tile once the walk is done): one pass
  over the output instead of a partial written and merged apart.

  `ids` (packed rows): `(q_ids [B, X, N], k_ids [B, X', N], windows [4, B, X, N])`, the
  queries' and keys' document ids (X = H, X' = Hkv where each head has its own, else 1)
  and each query's `common.id_windows`: the key positions `[u0, u1]` that may share its
  document, and a run `[r0, r1]` of keys all in it. Per `block_q` query rows of the strided
  view they are reduced to the tile's union and common run (`IdTiles`). The producer
  skips the blocks outside the item's union; a consumer's blocks inside its run run as
  before; the others compare each score's key id with its query's."""
  batch, n_pad, num_heads, d = q.shape
  dtype = q.dtype
  L = sched.stride
  bq, bk, stages = config.block_q, config.block_k, config.stages
  block_rows = 2 * bq
  n_out = out_length(sched, n_pad, block_rows)
  span = 2 * n_out  # exceeds any difference of two positions in a period
  per_kv = heads_per_kv(num_heads, k.shape[2])
  qk_scale = scale * LOG2E
  # Masked scores lie past every score in the order the row maximum is taken in (the
  # minimum for a negative scale), so that `s c` is -inf either way; a zero scale scores
  # every visible key 0 (`part`), with c = 1.
  scale_sign = -1.0 if qk_scale < 0 else 1.0
  scale_c = qk_scale or 1.0
  hidden = -scale_sign * jnp.inf
  interpret = config.interpret
  half = bk // 2
  key_ranges = Ranges(True, n, L, causal, block_rows, bk)
  work = Work.of(sched, batch, config, causal, key_ranges, ids is not None, claims=True)
  out_dtype = jnp.dtype(out_dtype)
  same = out_dtype == dtype  # then the output tile reuses the query tile
  out_itemsize = out_dtype.itemsize
  id_tiles = IdTiles.of(ids, n_out, L, bq)
  packed = id_tiles is not None
  # Query tiles per consumer: two when persistent and they fit, so that the next item's
  # queries load while this one runs.
  buffers = 2 if work.persistent and smem_bytes(
      config, d, dtype.itemsize, out_itemsize, 2, packed) <= SMEM_BYTES else 1

  def kernel(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref,
             v5_ref, id_refs, prior_refs, out_ref, lse_ref, smem, bars, free, claims):
    q_smem, k_smem, v_smem, o_smem, lse_smem, qid_smem, kid_smem = smem
    q_bar, k_bar, v_bar, prior_bars, qid_bar, kid_bar = bars
    (k_free, v_free), turn = free
    wg = lax.axis_index("wg")

    window = packed and functools.partial(id_tiles.window, id_refs[3])
    item_window = lambda prog: window(prog, 0, 1)  # both consumers' union and common run

    def producer():
      produce_kv(work, origin_ref, rows_ref, per_kv, (k4_ref, k5_ref, k_smem, k_bar, k_free),
                 (v4_ref, v5_ref, v_smem, v_bar, v_free),
                 lambda prog: key_ranges(prog, pieces_ref, bias_ref, None,
                                         item_window(prog) if packed else None),
                 L, bk, stages,
                 (*id_refs[1:3], kid_smem, kid_bar, id_tiles) if packed else None, claims)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      first, loop = work.mine(origin_ref, rows_ref, claims)
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
        if packed:
          x = id_tiles.head(prog.head)
          pl.when(prog.busy)(lambda: plgpu.copy_gmem_to_smem(
              id_refs[0].at[prog.b, x, prog.cls, q_rows(prog)], qid_smem.at[tile(i)],
              qid_bar.at[tile(i)]))

      if buffers == 2:
        load_q(0, first)

      def item(i, prog, has_next, next_prog, step):
        # The stores of the item before have read their tiles (the output's may be the query
        # tile the next item's queries load into).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if buffers == 2:
          pl.when(has_next)(lambda: load_q(i + 1, next_prog()))
        else:
          load_q(i, prog)
        q_tile = q_smem.at[tile(i)]
        pl.when(prog.busy)(lambda: plgpu.barrier_wait(q_bar.at[tile(i)]))
        q_first, q_last = prog.ends(wg, bq, L)  # this warpgroup's first and last query
        q_pos = q_first + L * row_iota if causal else None  # this warpgroup's query positions
        if packed:  # this warpgroup's queries' document ids, a row each
          pl.when(prog.busy)(lambda: plgpu.barrier_wait(qid_bar.at[tile(i)]))
          q_ids = plgpu.load(qid_smem.at[tile(i)], layout=row_stat)

        def block(carry, piece, j, masked: bool, visible=None):
          """One key block; a masked one of `HALVED_BLOCK` keys (`visible`: `walk`'s `(x0,
          x1)`, the keys the consumer's queries may see) by its halves that hold such keys:
          both, one (half the products: the causal diagonal of the first consumer, a
          document's start), or none (no products, the turns kept)."""
          if visible is None:
            return part(carry, piece, j, masked, 0, bk)
          x0, x1 = visible
          meets = lambda c0, c1: ((x0 < j * bk + c1) & (x1 > j * bk + c0)).astype(jnp.int32)
          return lax.switch(meets(0, half) + 2 * meets(half, bk), [
              functools.partial(passed, j=j),
              functools.partial(part, piece=piece, j=j, masked=True, c0=0, width=half),
              functools.partial(part, piece=piece, j=j, masked=True, c0=half, width=half),
              functools.partial(part, piece=piece, j=j, masked=True, c0=0, width=bk)], carry)

        def passed(carry, j):
          """A block none of whose keys the consumer's queries see: its turns, no products."""
          acc, m_i, l_i, step = carry
          slot = lax.rem(step, stages)
          if packed:
            plgpu.barrier_wait(kid_bar.at[slot])
          plgpu.barrier_wait(k_bar.at[slot])
          take_turn()
          plgpu.barrier_arrive(k_free.at[slot])
          give_turn(lambda: plgpu.barrier_wait(v_bar.at[slot]))
          plgpu.barrier_arrive(v_free.at[slot])
          return acc, m_i, l_i, step + 1

        def part(carry, piece, j, masked: bool, c0: int, width: int):
          """Keys `[c0, c0 + width)` of one key block: scores, online softmax (base 2; `m`
          includes the piece's `log2 m` bias, so p is one fused multiply-add and an exp2 per
          score), P @ V. Unmasked blocks (all keys exist and precede every query) skip the
          mask.

          The row maximum is taken before scaling (the largest score, or the smallest
          for a negative scale), so each exponent is one rounding of `s c - m`: exact while
          it stays in exp2's range, i.e. for |s c| < 2^27 (docs/SPEC.md, "Numerical
          range"); a maximum taken over the scaled scores, exact for any logits, costs an
          instruction per score (measured slower on full attention's forward:
          docs/performance.md)."""
          acc, m_i, l_i, step = carry
          slot = lax.rem(step, stages)
          keys = lambda ref: ref if width == bk else ref.at[pl.ds(c0, width)]
          if packed:  # every block's ids arrive (the barrier's phases), masked ones read them
            plgpu.barrier_wait(kid_bar.at[slot])
            if masked:
              k_ids = plgpu.load(keys(kid_smem.at[slot]), layout=plgpu.Layout.WGMMA.reduce(0))
          plgpu.barrier_wait(k_bar.at[slot])
          s, = products([(q_tile, keys(k_smem.at[slot]).T)], (bq, width), take_turn)
          plgpu.barrier_arrive(k_free.at[slot])
          if qk_scale == 0:  # every visible score is 0 (and -inf * 0 would be NaN)
            s = jnp.zeros_like(s)
          if masked:
            limit = key_limit(piece, j * bk + c0, q_pos, causal, L, span)
            cols = cols_iota if width == bk else plgpu.broadcasted_iota(
                jnp.int32, (bq, width), 1, layout=plgpu.Layout.WGMMA)
            keep = cols <= (rows_of(limit, s.shape) if causal else limit)
            if packed:
              keep = keep & (lax.broadcast_in_dim(k_ids, s.shape, [1]) == rows_of(q_ids, s.shape))
            s = jnp.where(keep, s, hidden)
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
          acc, = accumulate([acc], [(p16, keys(v_smem.at[slot]))], interpret)
          plgpu.barrier_arrive(v_free.at[slot])
          return acc, m_new, l_i, step + 1

        acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_stat)
        l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_stat)
        pl.when(prog.busy)(start_turns)  # one consumer's softmax beside the other's wgmmas
        # (The blocks this warpgroup cannot see, which its last query and own window give, pass
        # without products where blocks are halved, else are walked masked: `block`.)
        ranges = key_ranges(prog, pieces_ref, bias_ref, (q_first, q_last),
                            (*item_window(prog), *window(prog, wg)) if packed else None)
        acc, m_i, l_i, step = walk(prog, ranges, block, (acc, m_i, l_i, step),
                                   visible=bk == HALVED_BLOCK)

        @pl.when(prog.busy)
        def _():
          end_turns()
          o_tile = q_tile if same else o_smem.at[wg]
          if prior_refs is None:
            seen = l_i != 0  # (a NaN row stays NaN)
            l_safe = jnp.where(seen, l_i, 1.0)
            o_tile[...] = (acc / rows_of(l_safe, acc.shape)).astype(o_tile.dtype)
            lse_smem.at[wg][...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
          else:
            merge_prior(prior_refs, prog, q_rows(prog), o_tile, lse_smem.at[wg],
                        [bar.at[wg] for bar in prior_bars], acc, m_i, l_i, rows_of, row_stat)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_tile, out_ref.at[prog.b, q_rows(prog), prog.cls, prog.head])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                  lse_ref.at[prog.b, prog.head, prog.cls, q_rows(prog)])

        return step

      loop(item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.when(wg < 2)(consumer)
    pl.when(wg == 2)(producer)

  def entry(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref, v5_ref,
            *refs):
    counter_ref, refs = (refs[0], refs[1:]) if work.dynamic else (None, refs)
    id_refs, refs = (refs[:4], refs[4:]) if packed else (None, refs)
    prior_refs, (out_ref, lse_ref) = (None, refs) if prior is None else (refs[:2], refs[2:])
    tiles = swizzled(dtype)
    smem = [plgpu.SMEM((2 * buffers, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq), jnp.float32),
            None if same else plgpu.SMEM((2, bq, d), out_dtype, transforms=swizzled(out_dtype)),
            plgpu.SMEM((2 * buffers, bq), jnp.int32) if packed else None,
            plgpu.SMEM((stages, bk), jnp.int32) if packed else None]

    def scoped(smem, bars, free, claims):
      q_smem, k_smem, v_smem, lse_smem, o_smem, qid_smem, kid_smem = smem
      kernel(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, k4_ref, k5_ref, v4_ref, v5_ref,
             id_refs, prior_refs, out_ref, lse_ref,
             (q_smem, k_smem, v_smem, o_smem, lse_smem, qid_smem, kid_smem), bars, free,
             claims and (counter_ref, *claims, interpret))

    id_bars = ((plgpu.Barrier(num_barriers=2 * buffers), plgpu.Barrier(num_barriers=stages))
               if packed else (None, None))
    pl.run_scoped(
        scoped, smem,
        (plgpu.Barrier(num_barriers=2 * buffers), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages),
         None if prior is None else (plgpu.Barrier(num_barriers=2),) * 2, *id_bars),
        ((plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
         plgpu.Barrier(num_arrivals=2)),
        work.claim_buffers(),
        collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((batch, n_out // L, L, num_heads, d), out_dtype),
              jax.ShapeDtypeStruct((batch, num_heads, L, n_out // L), jnp.float32))
  rows, pieces, bias = tables
  view = functools.partial(strided_view, stride=L)
  args = (work.table(rows), pieces.reshape(-1), bias, view(q), k, view(k), v, view(v),
          *work.counter())
  if packed:
    args += id_tiles.inputs(ids, n_pad)
  if prior is not None:
    out_p, lse_p = prior
    args += (view(out_p), lse_p.reshape(batch, n_out // L, L, num_heads).transpose(0, 3, 2, 1))
  out, lse = run(entry, out_type, work.grid, args, interpret)[:2]  # (the counter after)
  lse = lse.transpose(0, 3, 2, 1).reshape(batch, n_out, num_heads)
  return out.reshape(batch, n_out, num_heads, d), lse
