"""The "mosaic" backend's gathering ring kernel: full attention of each device's queries over
the keys of every device of a mesh axis, the all-gather done by the kernel itself.

One launch per device, persistent (a program per SM), in two phases over the program's
items:
1. each item over the device's own keys, its result stored; meanwhile each program's producer
   pushes key/value blocks of the device's own into every peer's receive buffers (a TMA load
   into one of two staging tiles, which lands while the other's stores go out through
   `plgpu.remote_ref`), spread evenly over the phase's pipeline steps (its mean length over
   the programs); then it signals each peer's semaphore with the number of blocks it pushed
   and waits until every block of every peer has landed;
2. each item over the peers' keys, read from the receive buffers, its result merged with the
   first phase's in its epilogue (`mosaic_forward.merge_prior`).
So the transfers run beside a quarter of the work (on 4 devices) instead of before all of it,
and a program waits only once the whole first phase is done. The consumers are the forward's
(`mosaic_forward`): two warpgroups of `block_q` query rows taking turns on the tensor cores,
an online base-2 softmax; rows of whole blocks only. Non-causal, every key is visible.
Causal, the shards are in zigzag order (`gathered_forward`): the only masked block is an
item's diagonal one, the last of its first phase, and items differ in cost, so where the
split `p, p + programs, ...` is unbalanced each device's programs walk a list schedule of its
items (`_plan`).

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
global order, which the online softmax does not see.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .hopper import (LN2, LOG2E, REGISTERS, SMEM_BYTES, accumulate, ceil_div, fetch_add,
                     products, run, sm_count, swizzled, turns)
from .mosaic_forward import merge_prior
from .mosaic_plan import list_schedule
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
         stages: int = 2, out_itemsize: int | None = None, causal: bool = False) -> bool:
  """Whether the kernel runs a shard of `n` rows at head dim `d`: whole blocks (causal: two
  chunks of whole key blocks, an item's query rows one key block), and its tiles in shared
  memory."""
  smem = smem_bytes(d, itemsize, block_q, block_k, stages, 1, out_itemsize or itemsize)
  return (n % (2 * block_q) == 0 and n % block_k == 0 and n % PUSH_ROWS == 0
          and smem <= SMEM_BYTES
          and (not causal or (block_k == 2 * block_q and n % (2 * block_k) == 0)))


def _plan(items: int, q_blocks: int, shards: int, programs: int):
  """Which programs walk which causal items on each device: None, the split `p, p +
  programs, ...`, where it is balanced (each device's busiest program within 10% of the mean,
  by the blocks its items walk); else each device's list schedule (`mosaic_plan`), `[P,
  programs + 1 + items]`. Causal items differ in cost (the diagonal's place; late items read
  more of the peers' keys) and by device. Where a head's items do not align with the
  programs, the split deals some programs late items only (busiest 1.8x the mean at 8K tokens
  a GPU on 2 GPUs): the list schedule ran 1.54 against 2.02 ms there, but at 32K, where the
  split is within 4%, 19.2 against 16.9 ms (the split keeps the programs in flight on one
  head's keys, which may be why: not traced; docs/performance.md). Items in launch order:
  (b, h, qb from the last)."""
  k_blocks, half = q_blocks, q_blocks // 2
  qb = q_blocks - 1 - np.arange(items) % q_blocks

  def costs(j):  # key blocks, and each of the two phases' epilogue
    return qb + 1 + j * half + np.where(qb >= half, (shards - 1 - j) * k_blocks, 0) + 2

  by_device = [costs(j) for j in range(shards)]
  split = [[c[p::programs].sum() for p in range(programs)] for c in by_device]
  if all(max(loads) <= 1.1 * np.mean(loads) for loads in split):
    return None
  return jnp.asarray(np.stack([list_schedule(c, programs) for c in by_device]))


def gathered_forward(q, k, v, scale: float, *, axis_name, shards: int, causal: bool = False,
                     block_q: int = 64, block_k: int = 128, stages: int = 2, out_dtype=None,
                     programs: int | None = None):
  """`(out [B, n, H, D], lse [B, n, H], k_all, v_all)`: `q [B, n, H, D]` over the keys
  `k, v [B, n, Hkv, D]` of all `shards >= 2` devices of `axis_name` (inside `shard_map`; a
  semaphore across devices needs two), `scale > 0`; `out` in `out_dtype` (default q's);
  `k_all, v_all [B, P n, Hkv, D]` every device's keys and values in device order (an
  all-gather's result). `programs`: the launch's (default one per SM, at most one per item);
  any number runs, more than the GPU holds at once included.

  `causal`: the shards are in zigzag order, queries and keys alike: device `j` of `P` holds
  chunks `j` and `2P - 1 - j` of the `2P` chunks of `n / 2` positions, and a query sees the
  keys at its position and before. Then an item's own keys are a causal row of its own (the
  two chunks ascend), the diagonal block its last; of a peer `p`'s, the queries of both
  chunks see chunk `p` where `p < j`, and the late chunk sees all of the peer's where `p >
  j`; none of the peers' blocks needs a mask. Every device walks the same number of blocks."""
  batch, n, num_heads, d = q.shape
  kv_heads = k.shape[2]
  per_kv = num_heads // kv_heads
  dtype = q.dtype
  out_dtype = jnp.dtype(out_dtype or dtype)
  same = out_dtype == dtype
  bq, bk = block_q, block_k
  assert scale > 0 and fits(n, d, dtype.itemsize, bq, bk, stages, out_dtype.itemsize,
                            causal), (n, d, bq, bk, stages, causal)
  peers = shards - 1
  q_blocks, k_blocks = n // (2 * bq), n // bk
  half = k_blocks // 2  # causal: a chunk's key blocks (and its items)
  items = batch * num_heads * q_blocks
  programs = min(items, programs or sm_count())
  # The pushes: every (k or v, batch row, head, PUSH_ROWS block) of this device, claimed by
  # the programs' producers as they go (about `share` each).
  push_blocks = n // PUSH_ROWS
  pushes = 2 * batch * kv_heads * push_blocks
  share = -(-pushes // programs)
  # A program's `share` pushes are due over the first `pace` key blocks of its first phase,
  # the phase's mean length over the programs (causal items' first phases differ).
  own_per_head = (q_blocks * (q_blocks + 1) // 2) if causal else q_blocks * k_blocks
  pace = -(-batch * num_heads * own_per_head // programs)
  arrivals = peers * pushes  # the blocks each device waits for, counted by the signals
  qk_scale = scale * LOG2E
  # Two query tiles per consumer where they fit: the next item's queries load meanwhile.
  buffers = 2 if smem_bytes(d, dtype.itemsize, bq, bk, stages, 2,
                            out_dtype.itemsize) <= SMEM_BYTES else 1

  plan = _plan(items, q_blocks, shards, programs) if causal else None

  def kernel(plan_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, k_recv, v_recv, smem, bars,
             free):
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
    if plan is not None:  # this device's plan: its programs' offsets, then their items
      first = plan_ref[me, pid]
      count = plan_ref[me, pid + 1] - first
      item_of = lambda i: plan_ref[me, programs + 1 + first + i]
    else:
      count = ceil_div(items - pid, programs)
      item_of = lambda i: pid + i * programs

    def own_blocks(qb):
      """How many of the own shard's key blocks item `qb` reads, from the first; causal, the
      last of them (block `qb`, the diagonal) masked."""
      return qb + 1 if causal else k_blocks

    def peer_blocks(qb):
      """How many of the peers' key blocks item `qb` reads (`peer_block`)."""
      if not causal:
        return peers * k_blocks
      return me * half + jnp.where(qb >= half, (shards - 1 - me) * k_blocks, 0)

    def peer_block(j):
      """`(device, first row)` of an item's `j`-th block of the peers' keys: the next
      devices' in turn; causal, the first chunks of the devices before this one, then (late
      items) the whole shards of those after it."""
      if not causal:
        return lax.rem(me + 1 + lax.div(j, k_blocks), shards), lax.rem(j, k_blocks) * bk
      before = j < me * half
      after = jnp.maximum(j - me * half, 0)
      device = jnp.where(before, lax.div(j, half), me + 1 + lax.div(after, k_blocks))
      return device, jnp.where(before, lax.rem(j, half), lax.rem(after, k_blocks)) * bk

    def decode(i):  # item i of this program: (batch row, head, query block)
      item = item_of(i)
      qb = lax.rem(item, q_blocks)
      return (lax.div(item, num_heads * q_blocks), lax.rem(lax.div(item, q_blocks), num_heads),
              q_blocks - 1 - qb if causal else qb)

    def producer():
      plgpu.set_max_registers(REGISTERS[0], action="decrease")

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

      # Phase 1: every item over the own keys; a push due every `pace / share` steps.
      claim(0)

      def own_item(i, carry):
        b, h, qb = decode(i)

        def per_block(jj, carry):
          step, done, t = carry
          load(step, lambda own, _: own.at[b, pl.ds(jj * bk, bk), lax.div(h, per_kv)])
          due = (t < pushes) & (done * pace <= step * share)
          pl.when(due)(lambda: finish(done))
          return step + 1, jnp.where(due, done + 1, done), jnp.where(due, claimed_after(done), t)

        return lax.fori_loop(0, own_blocks(qb), per_block, carry)

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
        b, h, qb = decode(i)

        def per_block(j, step):
          device, row = peer_block(j)
          load(step, lambda _, recv: recv.at[b, device, pl.ds(row, bk), lax.div(h, per_kv)])
          return step + 1

        return lax.fori_loop(0, peer_blocks(qb), per_block, step)

      observe_releases((k_free, v_free), lax.fori_loop(0, count, peer_item, step), stages)

    def consumer():
      plgpu.set_max_registers(REGISTERS[1], action="increase")
      row_stat = plgpu.Layout.WGMMA.reduce(1)
      rows_of = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
      if causal:  # the diagonal block: this warpgroup's row i sees columns <= wg bq + i
        cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
        last_col = wg * bq + plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_stat)
      take_turn, give_turn, start_turns, end_turns = turns(turn, wg)
      tile = lambda i: lax.rem(i, buffers) * 2 + wg  # this consumer's query tile of item i

      def load_q(i):
        b, h, qb = decode(i)
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds((2 * qb + wg) * bq, bq), h],
                                q_smem.at[tile(i)], q_bar.at[tile(i)])

      def block(q_tile, carry, masked=False):
        """One key block: scores, online base-2 softmax, P @ V; `masked`: the diagonal block
        (every row sees at least its first key), else every key visible."""
        acc, m_i, l_i, step = carry
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        s, = products([(q_tile, k_smem.at[slot].T)], (bq, bk), take_turn)
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:
          s = jnp.where(cols <= rows_of(last_col, s.shape), s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
        alpha = jnp.exp2(m_i - m_new)
        p_ = jnp.exp2(s * qk_scale - rows_of(m_new, s.shape))
        acc = acc * rows_of(alpha, acc.shape)
        l_i = l_i * alpha + p_.sum(axis=1)
        give_turn(lambda: plgpu.barrier_wait(v_bar.at[slot]))
        acc, = accumulate([acc], [(p_.astype(dtype), v_smem.at[slot])], False)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i, step + 1

      def phase(merge: bool, step):
        """Every item over its own keys (`own_blocks`), its result stored; or (`merge`) over
        the peers' (`peer_blocks`), merged with the first phase's
        (`mosaic_forward.merge_prior`) and stored."""
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
          carry = (acc, m_i, l_i, step)
          if merge:
            carry = lax.fori_loop(0, peer_blocks(qb), lambda _, c: block(q_tile, c), carry)
          else:
            masked = int(causal)  # the diagonal block, last
            carry = lax.fori_loop(0, own_blocks(qb) - masked, lambda _, c: block(q_tile, c),
                                  carry)
            if causal:
              carry = block(q_tile, carry, masked=True)
          acc, m_i, l_i, step = carry
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

      phase(True, phase(False, jnp.int32(0)))

    pl.when(wg < 2)(consumer)
    pl.when(wg == 2)(producer)

  def entry(origin_ref, *refs):
    del origin_ref
    plan_ref, (q_ref, k_ref, v_ref, out_ref, lse_ref, k_recv, v_recv) = (
        (None, refs) if plan is None else (refs[0], refs[1:]))
    tiles = swizzled(dtype)
    smem = [plgpu.SMEM((2 * buffers, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
            None if same else plgpu.SMEM((2, bq, d), out_dtype, transforms=swizzled(out_dtype)),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, PUSH_ROWS, d), dtype, transforms=tiles),
            plgpu.SMEM((2,), jnp.int32)]
    pl.run_scoped(
        lambda smem, bars, free: kernel(plan_ref, q_ref, k_ref, v_ref, out_ref, lse_ref,
                                        k_recv, v_recv, smem, bars, free),
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
  out, lse, k_all, v_all = run(entry, out_type, (programs, 1),
                               (q, k, v) if plan is None else (plan, q, k, v), False)
  gathered = lambda x: x.reshape(batch, shards * n, kv_heads, d)
  lse = lse.reshape(batch, num_heads, n).transpose(0, 2, 1)
  return out.reshape(batch, n, num_heads, d), lse, gathered(k_all), gathered(v_all)
