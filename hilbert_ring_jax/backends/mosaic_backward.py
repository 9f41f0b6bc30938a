"""The backward kernels of the "mosaic" backend: dq (`dq_launch`) and dk/dv (`dkdv_launch`).

Both are built like the forward (`mosaic_forward`: producer and consumer warpgroups, TMA
rings, the same block walk, `mosaic_pipeline`), without the turn-taking, which measured
slower there:
- dq over query rows (the forward's schedule): per key block, s = q k^T and dp = dout v^T
  (shared-memory wgmmas issued together), p = exp2(s c + log2 m - lse2), ds = p (dp - delta),
  dq += ds k (registers times shared memory);
- dk/dv over key rows of each key/value head (the transposed schedule): the consumers keep
  their k and v tiles; the producer streams the query pieces of every query head reading that
  head (q, dout, lse, delta: a stride-1 piece from `[B, N, H, ...]`, a strided one from the
  view), s^T = k q^T, dp^T = v dout^T, dv += p^T dout, dk += ds^T q.
Both load the next item's resident rows when a walk ends, while the item's results store
(the fused dk/dv kernel once the other consumer's last dq products, which read this one's k
tile, have settled).
In launches whose queries read at least 1,024 keys a head on average where rows are unstrided
(full attention, stride-1 branches), or 1,900 where they are strided (and `setmaxnreg` moves
the registers; `Config.backward_for`), dq moves into the dk/dv kernel: both consumers put their
ds^T tiles in shared memory, one of them (taking turns) computes the query block's
dq = ds_0 k_0 + ds_1 k_1 and adds it into a zeroed float32 accumulator with a TMA reduce-add
store: five products per block pair instead of seven (measured faster on full attention and
LongNet: docs/performance.md). A strided launch adds its strided pieces into a second
accumulator in the strided view; where its queries read few keys, zeroing and summing the
two costs more than the dq kernel's products, and it keeps the two kernels. The consumers
index their resident tiles through `opaque` inside the walk, so that each tile's wgmma
descriptors are computed per block rather than hoisted and held in registers across the
walk: held, they made the fused kernel spill at head dim 128 (ptxas's counts:
docs/performance.md).
All write through shared memory: float32, or bf16 from the split kernels where the gradients
are final; several launches add up in float32 (each launch's kernels add the earlier
launches' gradients to their own in their epilogues: `_add_prior`).
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
from .hopper import LOG2E, REGISTERS, accumulate, opaque, products, run, swizzled
from .mosaic_pipeline import (IdTiles, add_rows, at_rows, produce, produce_items, produce_kv,
                              walk)
from .mosaic_plan import (BWD_BLOCK, Config, Ranges, Work, key_limit, out_length, query_bounds,
                          strided_view)

def _add_prior(prior_refs, b, rows, cls, head, tiles, bars, wg, grads):
  """An item's epilogue adding the earlier launches' gradients of its rows (`prior_refs`,
  None: none; loaded into the output's `tiles`, whose stores before have read them) to its
  float32 `grads` (a list, updated)."""
  if prior_refs[0] is None:
    return
  for i, (ref, tile) in enumerate(zip(prior_refs, tiles)):
    plgpu.copy_gmem_to_smem(ref.at[b, rows, cls, head], tile, bars[i].at[wg])
  for i, tile in enumerate(tiles):
    plgpu.barrier_wait(bars[i].at[wg])
    grads[i] = grads[i] + plgpu.load(tile, layout=plgpu.Layout.WGMMA).astype(jnp.float32)


def dq_launch(q, k, v, dout, lse2, delta, tables, sched: schedule.Schedule, n: int,
              causal: bool, scale: float, config: Config, out_dtype=jnp.float32, prior=None,
              ids=None):
  """dq of one launch over the padded `[B, Np, ...]` inputs (lse2, delta `[B, H, L, Np/L]`,
  lse2 in base 2, +inf where no key is seen): `[B, No, H, D]` in `out_dtype`, plus `prior`
  (the earlier launches' dq, `[B, No, H, D]` in `out_dtype`), added in the epilogues.
  `ids` (packed rows): as the forward's (`mosaic_forward.launch`), the same skipping and
  masks (its blocks of 64 keys whole, not halved)."""
  batch, n_pad, num_heads, d = q.shape
  dtype = q.dtype
  L = sched.stride
  bq, bk, stages = BWD_BLOCK, BWD_BLOCK, config.backward_stages
  block_rows = 2 * bq
  n_out = out_length(sched, n_pad, block_rows)
  span = 2 * n_out  # exceeds any difference of two positions in a period
  per_kv = heads_per_kv(num_heads, k.shape[2])
  qk_scale = scale * LOG2E
  interpret = config.interpret
  key_ranges = Ranges(True, n, L, causal, block_rows, bk)
  work = Work.of(sched, batch, config, causal, key_ranges, ids is not None)
  id_tiles = IdTiles.of(ids, n_out, L, bq)
  packed = id_tiles is not None

  def kernel(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, do_ref, lse_ref, delta_ref,
             k4_ref, k5_ref, v4_ref, v5_ref, id_refs, prior_ref, dq_ref, smem, bars, free):
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, o_smem, qid_smem, kid_smem = smem
    row_bars, k_bar, v_bar, prior_bar, qid_bar, kid_bar = bars
    k_free, v_free = free
    wg = lax.axis_index("wg")
    window = packed and functools.partial(id_tiles.window, id_refs[3])

    def producer():
      produce_kv(work, origin_ref, rows_ref, per_kv, (k4_ref, k5_ref, k_smem, k_bar, k_free),
                 (v4_ref, v5_ref, v_smem, v_bar, v_free),
                 lambda prog: key_ranges(prog, pieces_ref, bias_ref, None,
                                         window(prog, 0, 1) if packed else None),
                 L, bk, stages, (*id_refs[1:3], kid_smem, kid_bar, id_tiles) if packed else None)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      first, loop = work.mine(origin_ref, rows_ref)
      q_tile, do_tile, o_tile = q_smem.at[wg], do_smem.at[wg], o_smem.at[wg]
      row_stat = plgpu.Layout.WGMMA.reduce(1)
      cols_iota = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
      if causal:
        row_iota = plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_stat)
      rows_of = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])

      def load_rows(prog):
        """This consumer's query rows of item `prog`: q, dout, lse2, delta."""
        b, head, cls, q_rows = prog.b, prog.head, prog.cls, prog.rows(wg, bq)

        @pl.when(prog.busy)
        def _():
          for src, dst, bar in ((q_ref.at[b, q_rows, cls, head], q_tile, row_bars[0]),
                                (do_ref.at[b, q_rows, cls, head], do_tile, row_bars[1]),
                                (lse_ref.at[b, head, cls, q_rows], lse_smem.at[wg], row_bars[2]),
                                (delta_ref.at[b, head, cls, q_rows], delta_smem.at[wg],
                                 row_bars[3])):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])
          if packed:
            plgpu.copy_gmem_to_smem(id_refs[0].at[b, id_tiles.head(head), cls, q_rows],
                                    qid_smem.at[wg], qid_bar.at[wg])

      load_rows(first)

      def item(i, prog, has_next, next_prog, step):
        b, head, cls = prog.b, prog.head, prog.cls
        q_rows = prog.rows(wg, bq)

        @pl.when(prog.busy)
        def _():
          for bar in row_bars + ((qid_bar,) if packed else ()):
            plgpu.barrier_wait(bar.at[wg])

        lse2 = plgpu.load(lse_smem.at[wg], layout=row_stat)
        q_ids = plgpu.load(qid_smem.at[wg], layout=row_stat) if packed else None
        delta_i = plgpu.load(delta_smem.at[wg], layout=row_stat)
        q_first, q_last = prog.ends(wg, bq, L)
        q_pos = q_first + L * row_iota if causal else None

        def block(carry, piece, j, masked: bool):
          """One key block: s = q k^T and dp = dout v^T, p = exp2(s c + log2 m - lse2),
          ds = p (dp - delta), dq += ds k."""
          dq, step = carry
          slot = lax.rem(step, stages)
          if packed:  # every block's ids arrive (the barrier's phases), masked ones read them
            plgpu.barrier_wait(kid_bar.at[slot])
            if masked:
              k_ids = plgpu.load(kid_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.barrier_wait(v_bar.at[slot])
          me = opaque(wg)  # q_tile, do_tile, indexed per block (`opaque`)
          s, dp = products([(q_smem.at[me], k_smem.at[slot].T),
                             (do_smem.at[me], v_smem.at[slot].T)], (bq, bk))
          plgpu.barrier_arrive(v_free.at[slot])
          p = jnp.exp2(jnp.minimum(s * qk_scale - rows_of(lse2 - piece.bias), 0.0))
          if masked:
            limit = key_limit(piece, j * bk, q_pos, causal, L, span)
            keep = cols_iota <= (rows_of(limit) if causal else limit)
            if packed:
              keep = keep & (lax.broadcast_in_dim(k_ids, (bq, bk), [1]) == rows_of(q_ids))
            p = jnp.where(keep, p, 0.0)
          ds = p * (dp - rows_of(delta_i))
          dq, = accumulate([dq], [(ds.astype(dtype), k_smem.at[slot])], interpret)
          plgpu.barrier_arrive(k_free.at[slot])
          return dq, step + 1

        def skip(carry, piece, j):
          """A key block none of this consumer's queries sees: its turn, no products."""
          dq, step = carry
          slot = lax.rem(step, stages)
          for bar in (kid_bar, k_bar, v_bar) if packed else (k_bar, v_bar):
            plgpu.barrier_wait(bar.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
          plgpu.barrier_arrive(k_free.at[slot])
          return dq, step + 1

        dq = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
        ranges = key_ranges(prog, pieces_ref, bias_ref, (q_first, q_last),
                            (*window(prog, 0, 1), *window(prog, wg)) if packed else None)
        dq, step = walk(prog, ranges, block, (dq, step), skip)
        # The next item's rows load during this one's store.
        pl.when(has_next)(lambda: load_rows(next_prog()))

        @pl.when(prog.busy)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the item before's store
          grad = [dq * scale]
          _add_prior([prior_ref], b, q_rows, cls, head, [o_tile], prior_bar, wg, grad)
          o_tile[...] = grad[0].astype(o_tile.dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_tile, dq_ref.at[b, q_rows, cls, head])

        return step

      loop(item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.when(wg < 2)(consumer)
    pl.when(wg == 2)(producer)

  def entry(origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, do_ref, lse_ref, delta_ref,
            k4_ref, k5_ref, v4_ref, v5_ref, *refs):
    id_refs, refs = (refs[:4], refs[4:]) if packed else (None, refs)
    prior_ref, dq_ref = refs if prior is not None else (None, *refs)
    tiles = swizzled(dtype)
    smem = [plgpu.SMEM((2, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq), jnp.float32), plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq, d), out_dtype, transforms=swizzled(out_dtype)),
            plgpu.SMEM((2, bq), jnp.int32) if packed else None,
            plgpu.SMEM((stages, bk), jnp.int32) if packed else None]
    id_bars = ((plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages)) if packed
               else (None, None))
    pl.run_scoped(
        lambda smem, bars, free: kernel(
            origin_ref, rows_ref, pieces_ref, bias_ref, q_ref, do_ref, lse_ref, delta_ref,
            k4_ref, k5_ref, v4_ref, v5_ref, id_refs, prior_ref, dq_ref, smem, bars, free),
        smem,
        ((plgpu.Barrier(num_barriers=2),) * 4, plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages),
         None if prior is None else (plgpu.Barrier(num_barriers=2),), *id_bars),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((batch, n_out // L, L, num_heads, d), out_dtype),)
  rows, pieces, bias = tables
  view = functools.partial(strided_view, stride=L)
  args = (work.table(rows), pieces.reshape(-1), bias, view(q), view(dout), lse2, delta,
          k, view(k), v, view(v),
          *(id_tiles.inputs(ids, n_pad) if packed else ()),
          *([] if prior is None else [view(prior)]))
  dq, = run(entry, out_type, work.grid, args, interpret)
  return dq.reshape(batch, n_out, num_heads, d)


def dkdv_launch(q, k, v, dout, stats, tables, sched: schedule.Schedule, n: int,
                causal: bool, scale: float, config: Config, dq_accs=None,
                out_dtype=jnp.float32, prior=None, ids=None):
  """dk, dv of one launch (the transposed schedule: key rows of each key/value head, query
  pieces of the query heads reading it) over the padded `[B, Np, ...]` inputs (`stats`:
  lse2 and delta as `[B, H, Np]` and `[B, H, L, Np/L]`): `[B, No, Hkv, D]` each, in
  `out_dtype` (float32 when fused: the output tile stages dq too), plus `prior` (the
  earlier launches' `(dk, dv)`, `[B, No, Hkv, D]` in `out_dtype`), added in the epilogues.

  With `dq_accs` (float32 accumulators `[C B, Na, H, D]` and, for L > 1, `[C B, Na/L, L, H,
  D]`, C = 2 in interpret mode, else 1: `hopper.Zeroed` buffers, whose final values follow
  dk and dv in the result) the kernel also adds dq into them: each step both
  consumers put their ds^T in shared memory, and one of them (taking turns) computes the
  dq of the query block from both halves (dq = ds_0 k_0 + ds_1 k_1) and adds it with a TMA
  reduce-add store.

  `ids` (packed rows): `(k_ids [B, X', N], q_ids [B, X, N], windows [4, B, X', N])`, the
  forward's with the roles of queries and keys swapped: each key's windows over the queries
  of every query head reading its key/value head (`mosaic._ids`). The producer skips query
  blocks outside an item's union; the others are masked by comparing ids."""
  batch, n_pad, num_heads, d = q.shape
  num_kv = k.shape[2]
  dtype = q.dtype
  L = sched.stride
  bq, bk, stages = BWD_BLOCK, BWD_BLOCK, config.backward_stages
  block_rows = 2 * bk
  n_out = out_length(sched, n_pad, block_rows)
  span = 2 * n_out  # exceeds any difference of two positions in a period
  qk_scale = scale * LOG2E
  interpret = config.interpret
  fused = dq_accs is not None
  query_ranges = Ranges(False, n, L, causal, block_rows, bq)
  # (not reversed: under a causal mask the first key rows are the heaviest)
  work = Work.of(sched, batch, config, False, query_ranges, ids is not None, claims=True)
  # 16-bit outputs: dk and dv in tiles of their own, in the bytes of the consumer's float32
  # tile (fused: which stages dq between items).
  two_tiles = jnp.dtype(out_dtype).itemsize == 2
  shared_tiles = fused and two_tiles  # one allocation: 2 float32 tiles, or 4 16-bit ones
  id_tiles = IdTiles.of(ids, n_out, L, bk)
  packed = id_tiles is not None

  def kernel(origin_ref, rows_ref, pieces_ref, bias_ref, k_ref, v_ref, q4_ref, q5_ref,
             do4_ref, do5_ref, lse4_ref, lse5_ref, delta4_ref, delta5_ref, id_refs, dq_refs,
             prior_refs, dk_ref, dv_ref, smem, bars, free, claims):
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, o_smem, kid_smem, qid_smem = smem[:9]
    o_smem, o16_smem = o_smem if shared_tiles else (o_smem, o_smem)
    row_bars, q_bar, do_bar, lse_bar, delta_bar, prior_bars, kid_bar, qid_bar = bars[:8]
    ds_smem, ds_bars = (smem[9], bars[8]) if fused else (None, None)
    q_free, do_free, stat_free = free
    wg = lax.axis_index("wg")
    window = packed and functools.partial(id_tiles.window, id_refs[3])

    def stream(prog, src4, src5, smem, bar, stat=False):
      b = prog.b

      def load(piece, j, slot):
        h = piece.head  # the query head (lse, delta: [B, H, N] and [B, H, L, N/L])
        index = ((lambda rows, c: (b, h, rows) if c is None else (b, h, c, rows)) if stat else
                 (lambda rows, c: (b, rows, h) if c is None else (b, rows, c, h)))
        at_rows(src4, src5, prog.base + piece.first, j * bq, bq, piece.stride, L, index,
                lambda box: plgpu.copy_gmem_to_smem(box, smem.at[slot], bar.at[slot]))
      return load

    def id_stream(prog):  # the query blocks' document ids, freed with the queries
      return lambda piece, j, slot: id_tiles.copy_block(
          id_refs[1], id_refs[2], prog, piece, piece.head, j, bq, qid_smem.at[slot],
          qid_bar.at[slot])

    def loads(*streams):
      def load(piece, j, slot):
        for s in streams:
          s(piece, j, slot)
      return load

    def producer():
      def item(prog, step):
        q_stream = stream(prog, q4_ref, q5_ref, q_smem, q_bar)
        return produce(
            prog, query_ranges(prog, pieces_ref, bias_ref, None,
                               window(prog, 0, 1) if packed else None),
            [(q_free, loads(q_stream, id_stream(prog)) if packed else q_stream),
             (stat_free, loads(stream(prog, lse4_ref, lse5_ref, lse_smem, lse_bar, True),
                               stream(prog, delta4_ref, delta5_ref, delta_smem, delta_bar,
                                      True))),
             (do_free, stream(prog, do4_ref, do5_ref, do_smem, do_bar))], stages, step)

      produce_items(work, origin_ref, rows_ref, item, [q_free, stat_free, do_free], stages,
                    claims)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      first, loop = work.mine(origin_ref, rows_ref, claims)
      k_tile, v_tile, o_tile = k_smem.at[wg], v_smem.at[wg], o_smem.at[wg]
      col_stat = plgpu.Layout.WGMMA.reduce(0)
      cols_iota = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 1, layout=plgpu.Layout.WGMMA)
      if causal:
        row_iota = plgpu.broadcasted_iota(jnp.int32, (bk,), 0,
                                          layout=plgpu.Layout.WGMMA.reduce(1))
      cols_of = lambda x: lax.broadcast_in_dim(x, (bk, bq), [1])

      def settle(owed):
        """Observe the other consumer's last turn (`owed`: it took the step before and this
        one has not awaited its `read` since): before overwriting the ds^T or k tile its
        products read."""
        pl.when(owed != 0)(lambda: plgpu.barrier_wait(ds_bars[1].at[1 - wg]))

      def put_ds(ds16, step, owed):
        """Both consumers put ds^T in shared memory (for `add_dq`). `ready[c]`: both tiles
        written for consumer c's turn; `read[c]`: c's products have read them (and the k
        tiles: awaited by the other consumer before it overwrites its tiles)."""
        ready = ds_bars[0]
        settle(owed)
        ds_smem.at[wg][...] = ds16
        plgpu.commit_smem()
        plgpu.barrier_arrive(ready.at[lax.rem(step, 2)])

      def add_dq(prog, piece, j, step):
        """The consumer whose turn it is adds dq = ds_0 k_0 + ds_1 k_1 of the query block."""
        ready, read, acc_bar = ds_bars

        @pl.when(lax.rem(step, 2) == wg)
        def _():
          plgpu.barrier_wait(ready.at[wg])

          def product(acc):
            zero = opaque(jnp.int32(0))
            for i in range(2):
              plgpu.wgmma(acc, ds_smem.at[zero + i].T, k_smem.at[zero + i])
            return acc[...]

          dq = pl.run_scoped(product, plgpu.ACC((bq, d), jnp.float32))
          plgpu.barrier_arrive(read.at[wg])
          h, acc_b = piece.head, prog.b + wg * batch if interpret else prog.b
          add_at = functools.partial(
              at_rows, *dq_refs, prog.base + piece.first, j * bq, bq, piece.stride, L,
              lambda rows, c: (acc_b, rows, h) if c is None else (acc_b, rows, c, h))
          add_rows(add_at, dq, o_tile, acc_bar.at[wg], interpret)

      def load_rows(prog):
        """This consumer's key rows of item `prog`: k and v."""
        b, head, cls, k_rows = prog.b, prog.head, prog.cls, prog.rows(wg, bk)

        @pl.when(prog.busy)
        def _():
          plgpu.copy_gmem_to_smem(k_ref.at[b, k_rows, cls, head], k_tile, row_bars[0].at[wg])
          plgpu.copy_gmem_to_smem(v_ref.at[b, k_rows, cls, head], v_tile, row_bars[1].at[wg])
          if packed:
            plgpu.copy_gmem_to_smem(id_refs[0].at[b, id_tiles.head(head), cls, k_rows],
                                    kid_smem.at[wg], kid_bar.at[wg])

      load_rows(first)  # (each next item's: when a walk ends, before the epilogue)

      def item(i, prog, has_next, next_prog, carry):
        step, owed = carry
        b, head, cls = prog.b, prog.head, prog.cls  # head: the key/value head
        k_rows = prog.rows(wg, bk)

        @pl.when(prog.busy)
        def _():
          plgpu.barrier_wait(row_bars[0].at[wg])
          plgpu.barrier_wait(row_bars[1].at[wg])
          if packed:
            plgpu.barrier_wait(kid_bar.at[wg])

        k_ids = plgpu.load(kid_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1)) if packed \
            else None
        k_first, k_last = prog.ends(wg, bk, L)
        k_pos = k_first + L * row_iota if causal else None

        def block(carry, piece, j, masked: bool):
          """One query block: s^T = k q^T and dp^T = v dout^T, p^T = exp2(s^T c + log2 m -
          lse2), dv += p^T dout, ds^T = p^T (dp^T - delta), dk += ds^T q (and dq)."""
          dk, dv, step, owed = carry
          slot = lax.rem(step, stages)
          plgpu.barrier_wait(q_bar.at[slot])
          if packed:  # every block's ids arrive (the barrier's phases), masked ones read them
            plgpu.barrier_wait(qid_bar.at[slot])
            if masked:
              q_ids = plgpu.load(qid_smem.at[slot], layout=col_stat)
          plgpu.barrier_wait(do_bar.at[slot])
          me = opaque(wg)  # k_tile, v_tile, indexed per block (`opaque`)
          s_t, dp_t = products([(k_smem.at[me], q_smem.at[slot].T),
                                 (v_smem.at[me], do_smem.at[slot].T)], (bk, bq))
          plgpu.barrier_wait(lse_bar.at[slot])
          plgpu.barrier_wait(delta_bar.at[slot])
          lse2 = plgpu.load(lse_smem.at[slot], layout=col_stat)
          delta_j = plgpu.load(delta_smem.at[slot], layout=col_stat)
          plgpu.barrier_arrive(stat_free.at[slot])
          p_t = jnp.exp2(jnp.minimum(s_t * qk_scale - cols_of(lse2 - piece.bias), 0.0))
          if masked:
            lo, hi = query_bounds(piece, j * bq, k_pos, causal, L, span)
            visible = cols_iota < hi
            if causal:
              visible = visible & (cols_iota >= lax.broadcast_in_dim(lo, (bk, bq), [0]))
            if packed:
              visible = visible & (lax.broadcast_in_dim(k_ids, (bk, bq), [0]) == cols_of(q_ids))
            p_t = jnp.where(visible, p_t, 0.0)
          ds16 = (p_t * (dp_t - cols_of(delta_j))).astype(dtype)
          if fused:
            put_ds(ds16, step, owed)
          dv, dk = accumulate([dv, dk], [(p_t.astype(dtype), do_smem.at[slot]),
                                           (ds16, q_smem.at[slot])], interpret)
          plgpu.barrier_arrive(do_free.at[slot])
          plgpu.barrier_arrive(q_free.at[slot])
          if fused:
            add_dq(prog, piece, j, step)
          return dk, dv, step + 1, (lax.rem(step, 2) != wg).astype(jnp.int32)

        def skip(carry, piece, j):
          """A query block that sees none of this consumer's keys: its turn (and, fused, a
          zero ds^T for the block's dq), no products."""
          dk, dv, step, owed = carry
          slot = lax.rem(step, stages)
          for bar in ((q_bar, qid_bar) if packed else (q_bar,)) + (do_bar, lse_bar, delta_bar):
            plgpu.barrier_wait(bar.at[slot])
          plgpu.barrier_arrive(stat_free.at[slot])
          if fused:
            put_ds(plgpu.layout_cast(jnp.zeros((bk, bq), dtype), plgpu.Layout.WGMMA), step,
                   owed)
          plgpu.barrier_arrive(do_free.at[slot])
          plgpu.barrier_arrive(q_free.at[slot])
          if fused:
            add_dq(prog, piece, j, step)
          return dk, dv, step + 1, (lax.rem(step, 2) != wg).astype(jnp.int32)

        zeros = plgpu.layout_cast(jnp.zeros((bk, d), jnp.float32), plgpu.Layout.WGMMA)
        ranges = query_ranges(prog, pieces_ref, bias_ref, (k_first, k_last),
                              (*window(prog, 0, 1), *window(prog, wg)) if packed else None)
        dk, dv, step, owed = walk(prog, ranges, block, (zeros, zeros, step, owed), skip)
        if fused:
          settle(owed)
          owed = jnp.int32(0)
        pl.when(has_next)(lambda: load_rows(next_prog()))

        @pl.when(prog.busy)
        def _():
          if two_tiles:  # dk and dv each in a tile of its own: one wait, two stores
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            grads, tiles = [dk * scale, dv], [o16_smem.at[2 * wg + t] for t in range(2)]
            _add_prior(prior_refs, b, k_rows, cls, head, tiles, prior_bars, wg, grads)
            for tile, grad in zip(tiles, grads):
              tile[...] = grad.astype(out_dtype)
            plgpu.commit_smem()
            for tile, out_ref in zip(tiles, (dk_ref, dv_ref)):
              plgpu.copy_smem_to_gmem(tile, out_ref.at[b, k_rows, cls, head])
            return
          for t, (grad, out_ref) in enumerate(((dk * scale, dk_ref), (dv, dv_ref))):
            # The store before (the item before's dv, dk, a dq block) has read the tile.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            grad = [grad]
            _add_prior(prior_refs[t:t + 1], b, k_rows, cls, head, [o_tile],
                       prior_bars[t:t + 1], wg, grad)
            o_tile[...] = grad[0].astype(o_tile.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_tile, out_ref.at[b, k_rows, cls, head])

        return step, owed

      loop(item, (jnp.int32(0), jnp.int32(0)))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.when(wg < 2)(consumer)
    pl.when(wg == 2)(producer)

  def entry(origin_ref, rows_ref, pieces_ref, bias_ref, k_ref, v_ref, q4_ref, q5_ref, do4_ref,
            do5_ref, lse4_ref, lse5_ref, delta4_ref, delta5_ref, *refs):
    counter_ref, refs = (refs[0], refs[1:]) if work.dynamic else (None, refs)
    id_refs, refs = (refs[:4], refs[4:]) if packed else (None, refs)
    split = len(refs) - 2 - (prior is not None) * 2
    dq_refs, prior_refs, (dk_ref, dv_ref) = refs[:split], refs[split:-2], refs[-2:]
    prior_refs = prior_refs or (None, None)
    if L == 1 and fused:
      dq_refs = (*dq_refs, None)
    tiles = swizzled(dtype)
    out_tiles = plgpu.SMEM((4 if two_tiles else 2, bk, d), out_dtype,
                           transforms=swizzled(out_dtype))
    if shared_tiles:  # the same bytes staging dq (float32) and dk, dv: see `kernel`
      out_tiles = plgpu.RefUnion(
          plgpu.SMEM((2, bk, d), jnp.float32, transforms=swizzled(jnp.float32)), out_tiles)
    smem = [plgpu.SMEM((2, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32),
            out_tiles,
            plgpu.SMEM((2, bk), jnp.int32) if packed else None,
            plgpu.SMEM((stages, bq), jnp.int32) if packed else None]
    bars = [(plgpu.Barrier(num_barriers=2),) * 2, *(plgpu.Barrier(num_barriers=stages),) * 4,
            (None, None) if prior is None else (plgpu.Barrier(num_barriers=2),) * 2,
            plgpu.Barrier(num_barriers=2) if packed else None,
            plgpu.Barrier(num_barriers=stages) if packed else None]
    if fused:
      smem.append(plgpu.SMEM((2, bk, bq), dtype, transforms=tiles))
      bars.append((plgpu.Barrier(num_arrivals=2, num_barriers=2),
                   plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)))
    pl.run_scoped(
        lambda smem, bars, free, claims: kernel(
            origin_ref, rows_ref, pieces_ref, bias_ref, k_ref, v_ref, q4_ref, q5_ref, do4_ref,
            do5_ref, lse4_ref, lse5_ref, delta4_ref, delta5_ref, id_refs, dq_refs, prior_refs,
            dk_ref, dv_ref, smem, bars, free,
            claims and (counter_ref, *claims, interpret)),
        smem, bars,
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 3,
        work.claim_buffers(),
        collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((batch, n_out // L, L, num_kv, d), out_dtype),) * 2
  rows, pieces, bias = tables
  view = functools.partial(strided_view, stride=L)
  counter = work.counter()
  args = (work.table(rows), pieces.reshape(-1), bias, view(k), view(v), q, view(q), dout,
          view(dout), *stats, *counter, *(id_tiles.inputs(ids, n_pad) if packed else ()),
          *(dq_accs or ()), *map(view, prior or ()))
  dk, dv, *zeroed = run(entry, out_type, work.grid, args, interpret)
  accs = zeroed[len(counter):]  # (the counter first)
  return (*(x.reshape(batch, n_out, num_kv, d) for x in (dk, dv)), *accs)
