"""Hopper building blocks the Pallas Mosaic GPU kernels share ("mosaic" and its token step,
`mosaic_decode`): the chip's limits, shared-memory tile layouts, wgmma products and
accumulation, the consumers' turn-taking, and the launcher (with its interpret mode)."""

from __future__ import annotations

import ctypes
import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .common import vary_like, varying_axes

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SMEM_BYTES = 232448  # Hopper's shared memory per block (227 KiB)


def _nvjitlink_hidden() -> bool:
  """Whether tools/no_nvjitlink.c is preloaded (its marker symbol is in the process)."""
  try:
    return hasattr(ctypes.CDLL(None), "hilbert_ring_jax_no_nvjitlink")
  except (OSError, TypeError):  # no dlopen(NULL) (Windows)
    return False


# Registers per thread of the producer and of each consumer warpgroup (`setmaxnreg`; the
# three warpgroups share 64K registers: 128 * (40 + 2 * 232) <= 65536).
REGISTERS = (40, 232)
# Whether `setmaxnreg` moves them. JAX 0.12's Mosaic GPU compiles a kernel as relocatable code
# and links it (nvJitLink, where it loads), and ptxas then ignores `setmaxnreg` ("(C7504)
# Potential Performance Loss: 'setmaxnreg' ignored to maintain compatibility across compilation
# units"): every warpgroup keeps 168 registers a thread (65536 / 384), and tiles that need more
# spill (docs/performance.md, "JAX 0.12"). JAX 0.11 compiles without linking, and so does 0.12
# with tools/no_nvjitlink.c preloaded: they move.
REGISTERS_MOVE = jax.__version_info__ < (0, 12) or _nvjitlink_hidden()


def is_hopper() -> bool:
  try:
    return any(getattr(d, "compute_capability", None) == "9.0" for d in jax.devices("gpu"))
  except RuntimeError:
    return False


def aligned(row):
  """`row` marked as a multiple of 8 (the tiles' rows), which TMA into tiled shared memory
  needs; the caller knows it is (the attention kernels: rows and pieces start at interval
  starts, multiples of `w0 / L >= 128` rows, and blocks at multiples of the block)."""
  return pl.multiple_of(row, 8)


def swizzled(dtype):
  minor = 128 // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(128))


def ceil_div(a, b):
  return lax.div(a + b - 1, b)


def fetch_add(counter_ref, dst_ref, offset: int, interpret: bool):
  """`dst_ref[0] = counter_ref[0] + offset; counter_ref[0] += 1`, the add atomic (one thread
  of the calling warpgroup; `counter_ref` an int32 `[1]` in global memory, or a slice of one
  semaphore of a launch's own, `dst_ref` an int32 in shared memory, which the whole warpgroup
  may read once this returns). Pallas' own `atomic_add` returns nothing, so the add is Mosaic
  GPU's (`memref.atomic_rmw`). Interpret mode runs one program at a time: a read and a
  write."""
  if interpret:
    old = counter_ref[0]
    dst_ref[0] = old + offset
    counter_ref[0] = old + 1
    return
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, memref  # pylint: disable=import-outside-toplevel
  from jax.experimental.mosaic.gpu import utils  # pylint: disable=import-outside-toplevel

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def add(_, counter, dst):
    zero = arith.constant(ir.IndexType.get(), 0)
    with utils.single_thread(scope=utils.ThreadSubset.WARPGROUP):
      i32 = ir.IntegerType.get_signless(32)
      old = memref.atomic_rmw(arith.AtomicRMWKind.addi, arith.constant(i32, 1), counter, [zero])
      memref.store(arith.addi(old, arith.constant(i32, offset)), dst, [zero])
    utils.warpgroup_barrier()

  add(counter_ref, dst_ref)


def sm_count() -> int:
  try:
    return int(getattr(jax.devices("gpu")[0], "core_count", 0)) or 132
  except RuntimeError:
    return 132


def opaque(x):
  """`x`, through an optimization barrier (side-effecting inline asm): the compiler cannot
  hoist what is computed from it out of a loop. A resident shared-memory tile indexed by it
  inside the walk has its wgmma descriptors computed at each block instead of held in
  registers across the walk (where they spilled)."""
  return lax.optimization_barrier(x)


def accumulate(accs, pairs, interpret: bool):
  """`[acc + a @ b_ref for acc, (a, b_ref) in zip(accs, pairs)]` as wgmmas (registers `a`,
  shared-memory `b_ref`) awaited once. Interpret mode runs neither `run_state` nor a wgmma
  with a register operand: `jnp.dot` there."""
  if interpret:
    return [acc + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
            for acc, (a, b) in zip(accs, pairs)]

  def update(refs):
    for ref, (a, b) in zip(refs, pairs):
      plgpu.wgmma(ref, a, b)

  return list(pl.run_state(update)([plgpu.ACC.init(acc) for acc in accs]))


def products(pairs, shape, between=None):
  """`[a @ b for a, b in pairs]` (shared-memory operands, float32 `shape`), issued together
  as wgmmas and awaited once; `between()` runs while they are in flight."""

  def run(accs):
    for acc, (a, b) in zip(accs, pairs):
      plgpu.wgmma(acc, a, b)
    if between is not None:
      between()
    return [acc[...] for acc in accs]

  return pl.run_scoped(run, [plgpu.ACC(shape, jnp.float32) for _ in pairs])


def turns(turn, wg):
  """Ping-pong of the two consumer warpgroups on the tensor cores through the 2-arrival
  barrier `turn`: `(take, give, start, end)`. A step issues its first products, `take()`s
  (the other consumer may issue its own while these run), computes its elementwise part,
  `give(wait_first)`s and issues its last products; consumer 1 `start()`s one turn behind,
  consumer 0 `end()`s with an extra turn. (The forward gains from it; the backward kernels,
  whose steps are mostly matrix products, measured faster without.)"""

  def take():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  def give(wait_first):
    plgpu.barrier_arrive(turn)
    wait_first()
    plgpu.barrier_wait(turn)

  return take, give, lambda: pl.when(wg == 1)(take), lambda: pl.when(wg == 0)(take)


class Zeroed(typing.NamedTuple):
  """An input of `run`: a buffer of zeros that the kernel updates in place (dq's float32
  accumulators, dynamic work's counter), whose final value `run` returns after the outputs.

  `run` makes it a ref of one `run_state` around the launch. A ref made with `jax.new_ref`
  would do on its own, but not inside the kernel contract's `jax.custom_jvp` halves
  (`base._differentiated_as`), where JAX cannot discharge one that is read after the launch
  ("No state discharge rule implemented for primitive: custom_jvp_call")."""
  shape: tuple
  dtype: typing.Any


def run(entry, out_type, grid, args, interpret: bool, num_threads: int = 3):
  """Launch `entry` over `grid` (names "row", "bp"; `num_threads` warpgroups "wg"); the list
  of its outputs, then the final values of its `Zeroed` inputs, in order. Interpret mode
  runs one block at a time only (barriers of concurrent blocks collide): one launch per
  program, its coordinates as the `origin` input, each writing its own rows into zeroed
  buffers."""
  launch = functools.partial(
      plgpu.kernel, entry, out_type=out_type, grid_names=("row", "bp"), num_threads=num_threads,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0))

  def outputs(args):
    if not interpret:
      return list(launch(grid=grid)(jnp.zeros((2,), jnp.int32), *args))
    call = launch(grid=(1, 1), interpret=plgpu.InterpretGPUParams(
        out_of_bounds_reads="uninitialized", uninitialized_memory="zero"))
    outs = [jnp.zeros(t.shape, t.dtype) for t in out_type]
    for origin in np.ndindex(*grid):
      outs = [a + b for a, b in zip(outs, call(jnp.asarray(origin, jnp.int32), *args))]
    return outs

  zeroed = [a for a in args if isinstance(a, Zeroed)]
  if not zeroed:
    return outputs(args)
  arrays = [a for a in args if not isinstance(a, Zeroed)]
  axes = frozenset().union(*(varying_axes(a) for a in arrays))
  # The outputs' refs vary like the inputs (inside shard_map), as every output then does.
  typed = lambda x: x if varying_axes(x) == axes else vary_like(x, *arrays)

  def body(refs):
    buffers, outs = iter(refs[:len(zeroed)]), refs[len(zeroed):]
    results = outputs([next(buffers) if isinstance(a, Zeroed) else a for a in args])
    for ref, x in zip(outs, results):
      ref[...] = typed(x)

  final = pl.run_state(body)(
      [jnp.zeros(z.shape, z.dtype) for z in zeroed]
      + [typed(jnp.zeros(t.shape, t.dtype)) for t in out_type])
  return [*final[len(zeroed):], *final[:len(zeroed)]]
