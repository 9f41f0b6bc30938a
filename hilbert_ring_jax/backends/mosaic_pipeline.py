"""The pipeline the three "mosaic" kernels share (forward, dq, dk/dv).

Each program runs three warpgroups: a producer that issues the TMA copies of an item's
streamed blocks into rings of shared-memory buffers (full and free barriers per buffer), and
two consumers that walk the same blocks in the same order. Here: the producer's loop over a
program's items (`produce_items`) and over one item's blocks (`produce`; the forward's and the
dq kernel's key/value streams: `produce_kv`), the consumers' matching walk (`walk`), and the
boxes of rows they address, unstrided or through the strided view (`at_rows`; reduce-add
stores into them: `add_rows`). The blocks themselves are `mosaic_plan.Ranges`'.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .common import FAR, reduce_windows
from .hopper import REGISTERS, aligned
from .mosaic_plan import Program, Work

def at_rows(src, strided_src, at, n0, size, stride, L, index, use):
  """`use(box)` on the box of positions `at + stride * (n0 + i)`, i < size: of `src`
  (`[B, N, ...]`) when the stride is 1, else of its strided view `strided_src`
  (`[B, N/L, L, ...]`). `index(rows, cls)` makes the ref index (`cls` None for `src`)."""

  def unit():
    use(src.at[index(pl.ds(aligned(at + n0), size), None)])

  def strided():
    use(strided_src.at[index(pl.ds(aligned(lax.div(at, L) + n0), size), lax.rem(at, L))])

  if L == 1:
    unit()
  else:
    pl.when(stride == 1)(unit)
    pl.when(stride != 1)(strided)


def add_rows(add_at, value, tile, bar, interpret: bool):
  """`box += value` (float32 `[rows, D]`) through the shared-memory `tile`, where
  `add_at(use)` calls `use(box)` (`at_rows`): the value goes to `tile` once (after the
  previous store from it has read it), then a TMA reduce-add store. Interpret mode has no
  reduction stores: it reads, adds and writes back (each consumer into its own
  accumulator)."""
  if interpret:
    def read_add_write(box):
      plgpu.copy_gmem_to_smem(box, tile, bar)
      plgpu.barrier_wait(bar)
      tile[...] = tile[...] + value
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, box)
      plgpu.wait_smem_to_gmem(0)
    add_at(read_add_write)
    return
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  tile[...] = value
  plgpu.commit_smem()
  add_at(lambda box: plgpu.copy_smem_to_gmem(tile, box, reduction_op="add"))


def produce(prog: Program, blocks, streams, stages: int, step):
  """The producer's part of one item: for each piece `p` of the row and block `j` in
  `blocks(p) = (piece, lo, hi)`, for each stream `(free, load)`: wait until the slot is free
  (after the first round), then `load(piece, j, slot)`, which issues the stream's TMA copies.
  The consumers walk the same blocks in the same order (`walk`) and arrive on `free` (two
  arrivals) when done with a buffer. `step`: blocks loaded before (the ring's position);
  returns it after."""

  def per_piece(p, step):
    piece, lo, hi = blocks(p)

    def per_block(j, step):
      slot = lax.rem(step, stages)
      for free, load in streams:
        @pl.when(step >= stages)
        def _():
          plgpu.barrier_wait(free.at[slot])

        load(piece, j, slot)
      return step + 1

    return lax.fori_loop(lo, hi, per_block, step)

  return lax.fori_loop(prog.p0, prog.p1, per_piece, step)


def produce_items(work: Work, origin_ref, rows_ref, item, frees, stages: int, claims=None):
  """The producer warpgroup: `step = item(prog, step)` (a `produce`) over the program's
  items (`claims`: dynamic work's buffers, `Work.mine`), then it waits for the consumers to
  release the last buffers of each ring in `frees`: every phase of a barrier is observed
  before the block exits (needed by interpret mode, free on the GPU)."""
  plgpu.set_max_registers(REGISTERS[0], action="decrease")
  _, loop = work.mine(origin_ref, rows_ref, claims, producer=True)
  observe_releases(frees, loop(lambda i, prog, has_next, next_prog, step: item(prog, step),
                               jnp.int32(0)), stages)


def observe_releases(frees, steps, stages: int):
  """A producer's last act: wait until the consumers release the last buffers of each ring in
  `frees` (`steps` blocks loaded into each): every phase of a barrier is observed before the
  block exits (needed by interpret mode, free on the GPU)."""
  for i in range(stages):
    step = steps - stages + i

    @pl.when(step >= 0)
    def _():
      for free in frees:
        plgpu.barrier_wait(free.at[lax.rem(step, stages)])


def produce_kv(work: Work, origin_ref, rows_ref, per_kv: int, k, v, ranges, L: int,
               bk: int, stages: int, ids=None, claims=None):
  """The producer of the forward and dq kernels: the key and value blocks of each item's
  key pieces (`ranges(prog)`), read from the key/value head of its query head. `k`, `v`:
  (the `[B, N, Hkv, D]` input, its strided view, the shared-memory ring, its full and its
  free barriers). `ids` (packed rows): the keys' document ids `([B, X, N], [B, X, L, N/L],
  ring, full barriers, IdTiles)`, loaded with each key block into a ring of their own
  (`X` = Hkv ids per head, else 1) and freed with it. `claims`: dynamic work's buffers
  (`Work.mine`)."""

  def stream(prog, src4, src5, smem, bar, free, ids=None):
    kv_head = lax.div(prog.head, per_kv)

    def load(piece, j, slot):
      at_rows(src4, src5, prog.base + piece.first, j * bk, bk, piece.stride, L,
              lambda rows, c: (prog.b, rows, kv_head) if c is None else
              (prog.b, rows, c, kv_head),
              lambda box: plgpu.copy_gmem_to_smem(box, smem.at[slot], bar.at[slot]))
      if ids is not None:
        ids1, ids_t, id_smem, id_bar, tiles = ids
        tiles.copy_block(ids1, ids_t, prog, piece, kv_head, j, bk, id_smem.at[slot],
                         id_bar.at[slot])
    return free, load

  def item(prog, step):
    return produce(prog, ranges(prog), [stream(prog, *k, ids=ids), stream(prog, *v)], stages,
                   step)

  produce_items(work, origin_ref, rows_ref, item, [k[-1], v[-1]], stages, claims)


def walk(prog: Program, ranges, block, carry, skip=None, visible=False):
  """A consumer's pass over the blocks `produce` loads: `ranges(p) = (piece, lo, s0, a, b,
  s1, hi, x0, x1)` (`mosaic_plan.Ranges`), blocks `[a, b)` unmasked, the rest of `[lo, hi)`
  masked, `block(carry, piece, j, masked)` (with `visible`, the masked ones `block(carry,
  piece, j, True, (x0, x1))`: the keys or queries of the piece its rows may meet); but with
  `skip`, the blocks of `[lo, s0)` and `[s1, hi)`, where the consumer's rows see nothing, go
  to `skip(carry, piece, j)` instead, which keeps the pipeline's turns (waits, releases)
  without the products."""

  def per_piece(p, carry):
    piece, lo, s0, a, b, s1, hi, x0, x1 = ranges(p)
    masked = ((lambda j, c: block(c, piece, j, True, (x0, x1))) if visible else
              (lambda j, c: block(c, piece, j, True)))
    parts = [(lo, a, masked), (a, b, lambda j, c: block(c, piece, j, False)), (b, hi, masked)]
    if skip is not None:
      passed = lambda j, c: skip(c, piece, j)
      parts = [(lo, s0, passed), (s0, a, masked), parts[1], (b, s1, masked), (s1, hi, passed)]
    for begin, end, body in parts:
      carry = lax.fori_loop(begin, end, body, carry)
    return carry

  return lax.fori_loop(prog.p0, prog.p1, per_piece, carry)


@dataclasses.dataclass(frozen=True)
class IdTiles:
  """A launch's packed rows as its kernel reads them: the ids of the rows it keeps (the
  forward's and dq's queries, dk/dv's keys) and of those it streams, `heads` of row ids
  (`per_head`: ids per head, read at the head's index; else at 0), and per tile of `size`
  rows of the strided view (`tiles` a class, covering the outputs: `n_out`) the windows of
  `common.id_windows` reduced to the tile's union `(min u0, max u1)` and common run
  `(max r0, min r1)`, empty unless every row of the tile is in the one run."""
  heads: int
  per_head: bool
  L: int
  size: int
  tiles: int

  @classmethod
  def of(cls, ids, n_out: int, L: int, size: int) -> IdTiles | None:
    """`ids`: None, or `(row_ids [B, X, N], stream_ids [B, X', N], windows [4, B, X, N])`."""
    if ids is None:
      return None
    heads = ids[0].shape[1]
    return cls(heads, max(heads, ids[1].shape[1]) > 1, L, size, -(-(n_out // L) // size))

  def head(self, h):
    """The ids' head index of head `h` (of the rows or of the streamed blocks)."""
    return h if self.per_head else 0

  def inputs(self, ids, n_pad: int):
    """The kernel's id inputs: the row ids `[B, X, L, Np/L]` (the strided view, transposed:
    a tile's ids are contiguous), the streamed ids `[B, X', Np]` and `[B, X', L, Np/L]`, and
    the tiles' windows `[B, X, L, T, 4]` flat (`window`)."""
    row_ids, stream_ids, windows = ids
    n, L = row_ids.shape[2], self.L
    pad = lambda x, length, value=0: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, length - n)],
                                             constant_values=value)
    view_t = lambda x: x.reshape(*x.shape[:-1], -1, L).swapaxes(-1, -2)  # [..., L, N / L]
    tiles = [view_t(pad(w, self.tiles * self.size * L, fill)).reshape(
        *w.shape[:2], L, self.tiles, self.size) for w, fill in zip(windows, (FAR, -1, FAR, -1))]
    return (view_t(pad(row_ids, n_pad)), pad(stream_ids, n_pad), view_t(pad(stream_ids, n_pad)),
            jnp.stack(reduce_windows(tiles, axis=-1), axis=-1).reshape(-1))

  def copy_block(self, ids, ids_view, prog, piece, head, j: int, size: int, dst, bar):
    """Copies the ids of block `j` (of `size` rows) of a streamed `piece` of head `head`'s
    rows, from the streamed ids `[B, X', Np]` or their strided view, into `dst`."""
    x = self.head(head)
    at_rows(ids, ids_view, prog.base + piece.first, j * size, size, piece.stride, self.L,
            lambda rows, c: (prog.b, x, rows) if c is None else (prog.b, x, c, rows),
            lambda box: plgpu.copy_gmem_to_smem(box, dst, bar))

  def window(self, table_ref, prog, first: int, last: int | None = None):
    """`(u0, u1, r0, r1)` of an item's row tile `first` (0, 1: the consumers' tiles) from
    the `inputs` table; with `last`, of tiles `first..last` together: the union of their
    `[u0, u1]` and the common part of their runs `[r0, r1]`."""

    def read(tile):
      row = lax.div(prog.row0 + prog.start, self.size) + tile
      at = (((prog.b * self.heads + self.head(prog.head)) * self.L + prog.cls) * self.tiles
            + row) * 4
      return [table_ref[at + i] for i in range(4)]

    if last is None:
      return read(first)
    u0, u1, r0, r1 = read(first)
    for tile in range(first + 1, last + 1):
      a, b, c, e = read(tile)
      u0, u1 = jnp.minimum(u0, a), jnp.maximum(u1, b)
      r0, r1 = jnp.maximum(r0, c), jnp.minimum(r1, e)
    return u0, u1, r0, r1
