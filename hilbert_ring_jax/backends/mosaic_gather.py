"""The "mosaic" backend's gathering ring kernel: full attention of each device's queries over
the keys of every device of a mesh axis, the all-gather done by the kernel itself.

One launch per device, persistent (a program per SM), in two phases over the program's
items:
1. each item over the device's own keys, its result stored; meanwhile each program's producer
   pushes key/value blocks of the device's own into every peer's receive buffers (a TMA load
   into one of two staging tiles, which lands while the other's stores go out through
   `plgpu.remote_ref`), spread evenly over the phase's pipeline steps; then it signals each
   peer's semaphore with the number of blocks it pushed and waits until every block of every
   peer has landed;
2. each item over the peers' keys, read from the receive buffers, its result merged with the
   first phase's in its epilogue (`mosaic_forward.merge_prior`).
So the transfers run beside a quarter of the work (on 4 devices) instead of before all of it,
and a program waits only once the whole first phase is done. The consumers are the forward's
(`mosaic_forward`): two warpgroups of `block_q` query rows taking turns on the tensor cores,
an online base-2 softmax; no mask (every key is visible), so rows of whole blocks only.

The blocks pushed are not dealt to the programs in advance: each producer claims the next
from a counter in global memory (`hopper.fetch_add`) when it is due for one, and claims until
none is left before it waits. Only a running program claims, and it pushes what it claimed
without waiting on anything, so every block goes out as long as each device runs one of the
launch's programs, however few: the launch cannot hang when some of its programs are not
resident (a collective that XLA runs beside it on another stream holding SMs that its other
programs wait for), nor when it has more programs than the GPU holds at once.

The receive buffers, `[B, P, n, Hkv, D]`, hold device `i`'s keys in slot `i` (its own too,
copied by its pushes): an all-gather's result, an output of the launch (the ring's backward
reads them instead of gathering again). The walk's key order, its own device's first, is not
global order, which full non-causal attention does not see.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .hopper import (LN2, LOG2E, REGISTERS, SMEM_BYTES, accumulate, ceil_div, fetch_add,
                     products, run, sm_count, swizzled, turns)
from .mosaic_forward import merge_prior
from .mosaic_pipeline import observe_releases

PUSH_ROWS = 64  # rows of the staging tile a push moves


def smem_bytes(d: int, itemsize: int, block_q: int, block_k: int, stages: int,
               q_buffers: int, out_itemsize: int) -> int:
  """The kernel's shared memory (outputs in the inputs' dtype reuse the query tiles; the
  claimed pushes' two int32s)."""
  tiles = 2 * q_buffers * block_q + 2 * stages * block_k + 2 * PUSH_ROWS
  out = 0 if out_itemsize == itemsize else 2 * block_q * d * out_itemsize
  return tiles * d * itemsize + out + 2 * block_q * 4 + 2 * 4 + 2048


def fits(n: int, d: int, itemsize: int, block_q: int = 64, block_k: int = 128,
         stages: int = 2, out_itemsize: int | None = None) -> bool:
  """Whether the kernel runs a shard of `n` rows at head dim `d`: whole blocks, and its
  tiles in shared memory."""
  smem = smem_bytes(d, itemsize, block_q, block_k, stages, 1, out_itemsize or itemsize)
  return (n % (2 * block_q) == 0 and n % block_k == 0 and n % PUSH_ROWS == 0
          and smem <= SMEM_BYTES)


def gathered_forward(q, k, v, scale: float, *, axis_name, shards: int, block_q: int = 64,
                     block_k: int = 128, stages: int = 2, out_dtype=None,
                     programs: int | None = None):
  """`(out [B, n, H, D], lse [B, n, H], k_all, v_all)`: `q [B, n, H, D]` over the keys
  `k, v [B, n, Hkv, D]` of all `shards >= 2` devices of `axis_name` (inside `shard_map`; a
  semaphore across devices needs two), non-causal, `scale > 0`; `out` in `out_dtype`
  (default q's); `k_all, v_all [B, P n, Hkv, D]` every device's keys and values in natural
  order (an all-gather's result). `programs`: the launch's (default one per SM, at most one
  per item); any number runs, more than the GPU holds at once included."""
  batch, n, num_heads, d = q.shape
  kv_heads = k.shape[2]
  per_kv = num_heads // kv_heads
  dtype = q.dtype
  out_dtype = jnp.dtype(out_dtype or dtype)
  same = out_dtype == dtype
  bq, bk = block_q, block_k
  assert scale > 0 and fits(n, d, dtype.itemsize, bq, bk, stages, out_dtype.itemsize), (
      n, d, bq, bk, stages)
  peers = shards - 1
  q_blocks, k_blocks = n // (2 * bq), n // bk
  items = batch * num_heads * q_blocks
  programs = min(items, programs or sm_count())
  # The pushes: every (k or v, batch row, head, PUSH_ROWS block) of this device, claimed by
  # the programs' producers as they go (about `share` each).
  push_blocks = n // PUSH_ROWS
  pushes = 2 * batch * kv_heads * push_blocks
  share = -(-pushes // programs)
  arrivals = peers * pushes  # the blocks each device waits for, counted by the signals
  qk_scale = scale * LOG2E
  # Two query tiles per consumer where they fit: the next item's queries load meanwhile.
  buffers = 2 if smem_bytes(d, dtype.itemsize, bq, bk, stages, 2,
                            out_dtype.itemsize) <= SMEM_BYTES else 1

  def kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, k_recv, v_recv, smem, bars, free):
    q_smem, k_smem, v_smem, o_smem, lse_smem, stage, claimed = smem
    q_bar, k_bar, v_bar, stage_bar, prior_bars = bars
    (k_free, v_free), turn = free
    wg = lax.axis_index("wg")
    pid = lax.axis_index("row")
    # Two int32s in global memory, zero at launch: the blocks landed from the peers (their
    # signals) and the pushes claimed so far (as a semaphore: another input of the launch
    # would shift the receive buffers among its arguments, which the peers' addresses of them
    # are looked up by).
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((2,)))
    sem, counter = sems.at[0], sems.at[pl.ds(1, 1)]
    me = lax.axis_index(axis_name)
    count = ceil_div(items - pid, programs)

    def decode(i):  # item i of this program: (batch row, head, query block)
      item = pid + i * programs
      return lax.div(item, num_heads * q_blocks), lax.rem(lax.div(item, q_blocks), num_heads), \
          lax.rem(item, q_blocks)

    def producer():
      plgpu.set_max_registers(REGISTERS[0], action="decrease")
      own_steps = count * k_blocks

      def pushed_block(t):
        """`(kind, b, rows, head)` of push `t`: k (0) or v, its box."""
        kind, t = lax.div(t, pushes // 2), lax.rem(t, pushes // 2)
        b, t = lax.div(t, kv_heads * push_blocks), lax.rem(t, kv_heads * push_blocks)
        head, blk = lax.div(t, push_blocks), lax.rem(t, push_blocks)
        return kind, b, pl.ds(blk * PUSH_ROWS, PUSH_ROWS), head

      def by_kind(kind, use):
        """`use(src, recv)` of the k or the v push."""
        for src_kind, refs in enumerate(((k_ref, k_recv), (v_ref, v_recv))):
          pl.when(kind == src_kind)(lambda refs=refs: use(*refs))

      def claim(slot):
        """The next push nobody has claimed (`pushes` once none is left), into `claimed[slot]`
        and, unless none is left, its load into staging tile `slot`, once the stores of the
        tile's last push have read it (at most one push's stores, the last, still reading).
        A program's `i`-th push uses slot `i % 2`."""
        fetch_add(counter, claimed.at[pl.ds(slot, 1)], 0, False)
        t = claimed[slot]

        @pl.when(t < pushes)
        def _():
          kind, b, rows, head = pushed_block(t)
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)
          by_kind(kind, lambda src, _: plgpu.copy_gmem_to_smem(
              src.at[b, rows, head], stage.at[slot], stage_bar.at[slot]))

      def finish(done):
        """This program's push `done` (claimed, its load issued): its stores, once its block
        is in, to its own slot and every peer's, one bulk group; then the next claim."""
        slot = lax.rem(done, 2)
        kind, b, rows, head = pushed_block(claimed[slot])
        plgpu.barrier_wait(stage_bar.at[slot])

        def store(_, recv):
          plgpu.copy_smem_to_gmem(stage.at[slot], recv.at[b, me, rows, head],
                                  commit_group=False)
          for o in range(1, shards):
            dest = plgpu.remote_ref(recv, {axis_name: lax.rem(me + o, shards)})
            plgpu.copy_smem_to_gmem(stage.at[slot], dest.at[b, me, rows, head],
                                    commit_group=o == shards - 1)

        by_kind(kind, store)
        claim(1 - slot)

      claimed_after = lambda done: claimed[lax.rem(done + 1, 2)]  # what `finish(done)` claimed

      def load(step, box):
        """A key block and its values into the ring's next slot (`box(own, recv)`: the box
        of `k` or `v` they come from, given the own ref and the receive buffer)."""
        slot = lax.rem(step, stages)
        for own, recv, smem, bar, free_ in ((k_ref, k_recv, k_smem, k_bar, k_free),
                                            (v_ref, v_recv, v_smem, v_bar, v_free)):
          pl.when(step >= stages)(lambda: plgpu.barrier_wait(free_.at[slot]))
          plgpu.copy_gmem_to_smem(box(own, recv), smem.at[slot], bar.at[slot])

      # Phase 1: every item over the own keys; a push due every `own_steps / share` steps.
      claim(0)

      def own_item(i, carry):
        b, h, _ = decode(i)

        def per_block(jj, carry):
          step, done, t = carry
          load(step, lambda own, _: own.at[b, pl.ds(jj * bk, bk), lax.div(h, per_kv)])
          due = (t < pushes) & (done * own_steps <= step * share)
          pl.when(due)(lambda: finish(done))
          return step + 1, jnp.where(due, done + 1, done), jnp.where(due, claimed_after(done), t)

        return lax.fori_loop(0, k_blocks, per_block, carry)

      step, done, t = lax.fori_loop(0, count, own_item,
                                    (jnp.int32(0), jnp.int32(0), claimed[0]))
      # The pushes left, claimed until none is; their landing; the signals, each peer's
      # semaphore raised by the blocks pushed (a sum of constant increments); then wait for
      # every block of every peer.
      def push(state):
        done, _ = state
        finish(done)
        return done + 1, claimed_after(done)

      done, _ = lax.while_loop(lambda state: state[1] < pushes, push, (done, t))
      plgpu.wait_smem_to_gmem(0)
      for bit in range(pushes.bit_length()):
        @pl.when(lax.rem(lax.div(done, 1 << bit), 2) == 1)
        def _():
          for o in range(1, shards):
            pl.semaphore_signal(sem, 1 << bit, device_id={axis_name: lax.rem(me + o, shards)})
      pl.semaphore_wait(sem, value=arrivals, decrement=False)

      # Phase 2: every item over the peers' keys, as they landed in the receive buffers.
      def peer_item(i, step):
        b, h, _ = decode(i)

        def per_block(j, step):
          device = lax.rem(me + 1 + lax.div(j, k_blocks), shards)
          rows = pl.ds(lax.rem(j, k_blocks) * bk, bk)
          load(step, lambda _, recv: recv.at[b, device, rows, lax.div(h, per_kv)])
          return step + 1

        return lax.fori_loop(0, peers * k_blocks, per_block, step)

      observe_releases((k_free, v_free), lax.fori_loop(0, count, peer_item, step), stages)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      row_stat = plgpu.Layout.WGMMA.reduce(1)
      rows_of = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
      take_turn, give_turn, start_turns, end_turns = turns(turn, wg)
      tile = lambda i: lax.rem(i, buffers) * 2 + wg  # this consumer's query tile of item i

      def load_q(i):
        b, h, qb = decode(i)
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds((2 * qb + wg) * bq, bq), h],
                                q_smem.at[tile(i)], q_bar.at[tile(i)])

      def block(q_tile, carry):
        """One key block: scores, online base-2 softmax, P @ V (no mask: all visible)."""
        acc, m_i, l_i, step = carry
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        s, = products([(q_tile, k_smem.at[slot].T)], (bq, bk), take_turn)
        plgpu.barrier_arrive(k_free.at[slot])
        m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
        alpha = jnp.exp2(m_i - m_new)
        p_ = jnp.exp2(s * qk_scale - rows_of(m_new, s.shape))
        acc = acc * rows_of(alpha, acc.shape)
        l_i = l_i * alpha + p_.sum(axis=1)
        give_turn(lambda: plgpu.barrier_wait(v_bar.at[slot]))
        acc, = accumulate([acc], [(p_.astype(dtype), v_smem.at[slot])], False)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i, step + 1

      def phase(blocks: int, merge: bool, step):
        """Every item over `blocks` key blocks; its result stored, or (`merge`) merged with
        the first phase's (`mosaic_forward.merge_prior`) and stored."""
        if buffers == 2:
          load_q(0)

        def per_item(i, step):
          b, h, qb = decode(i)
          rows = pl.ds((2 * qb + wg) * bq, bq)
          # The stores of the item before have read their tiles (the output's may be the
          # query tile the next item's queries load into).
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if buffers == 2:
            pl.when(i + 1 < count)(lambda: load_q(i + 1))
          else:
            load_q(i)
          q_tile = q_smem.at[tile(i)]
          o_tile = q_tile if same else o_smem.at[wg]
          plgpu.barrier_wait(q_bar.at[tile(i)])
          acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
          m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_stat)
          l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_stat)
          start_turns()
          acc, m_i, l_i, step = lax.fori_loop(0, blocks, lambda _, c: block(q_tile, c),
                                              (acc, m_i, l_i, step))
          end_turns()
          if merge:
            merge_prior((out_ref, lse_ref), types.SimpleNamespace(b=b, cls=0, head=h), rows,
                        o_tile, lse_smem.at[wg], [bar.at[wg] for bar in prior_bars], acc, m_i,
                        l_i, rows_of, row_stat)
          else:
            o_tile[...] = (acc / rows_of(l_i, acc.shape)).astype(o_tile.dtype)
            lse_smem.at[wg][...] = (m_i + jnp.log2(l_i)) * LN2
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_tile, out_ref.at[b, rows, 0, h])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, 0, rows])
          return step

        step = lax.fori_loop(0, count, per_item, step)
        plgpu.wait_smem_to_gmem(0)  # landed: the second phase reads the first's results
        return step

      phase(peers * k_blocks, True, phase(k_blocks, False, jnp.int32(0)))

    pl.when(wg < 2)(consumer)
    pl.when(wg == 2)(producer)

  def entry(origin_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, k_recv, v_recv):
    del origin_ref
    tiles = swizzled(dtype)
    smem = [plgpu.SMEM((2 * buffers, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            None if same else plgpu.SMEM((2, bq, d), out_dtype, transforms=swizzled(out_dtype)),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, PUSH_ROWS, d), dtype, transforms=tiles),
            plgpu.SMEM((2,), jnp.int32)]
    pl.run_scoped(
        lambda smem, bars, free: kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, k_recv, v_recv,
                                        smem, bars, free),
        smem,
        (plgpu.Barrier(num_barriers=2 * buffers), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2),
         (plgpu.Barrier(num_barriers=2),) * 2),
        ((plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
         plgpu.Barrier(num_arrivals=2)),
        collective_axes="wg")

  recv = jax.ShapeDtypeStruct((batch, shards, n, kv_heads, d), dtype)
  # The output and lse as `merge_prior` reads them (the strided views of a stride of 1).
  out_type = (jax.ShapeDtypeStruct((batch, n, 1, num_heads, d), out_dtype),
              jax.ShapeDtypeStruct((batch, num_heads, 1, n), jnp.float32), recv, recv)
  out, lse, k_all, v_all = run(entry, out_type, (programs, 1), (q, k, v), False)
  gathered = lambda x: x.reshape(batch, shards * n, kv_heads, d)
  lse = lse.reshape(batch, num_heads, n).transpose(0, 2, 1)
  return out.reshape(batch, n, num_heads, d), lse, gathered(k_all), gathered(v_all)
