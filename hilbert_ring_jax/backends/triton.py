"""The "triton" backend: Triton kernels through `jax_triton.triton_call` (CUDA GPUs).

The GPU fast path. Kernels (`_triton_kernels.py`) walk a host-built block schedule
(`schedule.py`): branches whose segments nest are computed together, each (query, key) pair
scored once with the bias `log m` of its multiplicity, so one launch writes the final output
and lse (other patterns run in several launches, each a run of consecutive branches that
qualify together or a single branch: `schedule.launches`, merged). Rows and entries are strided
runs of tokens, so no input is padded, gathered or copied. Backward: a dq kernel over query
rows and a dk/dv kernel over key rows, in float32. Block sizes, warps and stages come from
`Config` when the caller gives them, else from the read-only table `TUNED`, per pass, head
dim and row length (`_choose`). Packed rows (`segment_ids`): each program also reads its
block of rows' document window and run (`common.id_windows`, reduced per block on the device
before the launch: `schedule.Schedule.block_windows`), walks only the blocks the window
reaches, runs those inside the run as without ids, and masks the others by comparing ids.

Importing this module needs `jax_triton` (and `triton`); without them the dispatcher falls
back to the next default ("pallas" on JAX < 0.12, then "xla": `base.candidates`).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import warnings

import jax
import jax.numpy as jnp
import jax_triton as jt

from ..merge import merge
from ..pattern import DilatedPattern
from . import _triton_kernels as kernels
from . import schedule
from .base import YES, Problem, Support, no
from .common import batched, contract_windows, in_32_bits

# jax-triton 0.4 renamed `out_shape=` to `out_type=` (the old name warns); 0.3 knows only the
# former. Aliasing is avoided altogether: the two versions disagree on whether an aliased
# output gets its own kernel parameter, so accumulating launches read the previous result as a
# plain input instead.
_OUT = "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"
# Triton >= 3.7 deprecates the block pointers the kernels use (3.9 removes them; pyproject
# caps triton below it). The warning is ours to act on, not the user's.
warnings.filterwarnings("ignore", message=r"tl\.make_block_ptr is deprecated",
                        category=UserWarning)


_KINDS = ("fwd", "dq", "dkdv")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiles:
  """One kernel's launch: `block_m` query rows by `block_n` keys (powers of two >= 16),
  Triton's `num_warps` and `num_stages`."""

  block_m: int
  block_n: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    for name in ("block_m", "block_n", "num_warps", "num_stages"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    for name in ("block_m", "block_n"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {name}={value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Launch choices of the "triton" backend (keyword-only; None: the tuned table).

  Attributes:
    fwd, dq, dkdv: `Tiles` of the forward, dq and dk/dv kernels (blocks are still capped
      to a row's length, as for the tuned ones).
    compute_capability: the GPU to compile for, e.g. 90 (sm_90); None: the local GPU. Lets
      the kernels be compiled ahead of time, or on a machine without a GPU.
  """

  fwd: Tiles | None = None
  dq: Tiles | None = None
  dkdv: Tiles | None = None
  compute_capability: int | None = None

  def __post_init__(self):
    for kind in _KINDS:
      value = getattr(self, kind)
      if value is not None and not isinstance(value, Tiles):
        raise ValueError(f"{kind} must be a Tiles or None, got {kind}={value!r}")
    cc = self.compute_capability
    if cc is not None and (isinstance(cc, bool) or not isinstance(cc, int) or cc < 1):
      raise ValueError(f"compute_capability must be a positive int or None, got "
                       f"compute_capability={cc!r}")


def _tiles(*rows):
  return {(kind, d): Tiles(block_m=m, block_n=n, num_warps=w, num_stages=st)
          for kind, d, m, n, w, st in rows}


# (pass, head_dim, rows) -> Tiles, rows being "long" (> 1024 positions per row), "short"
# or "causal" (long rows under a causal mask); shrunk further for tiny rows by `_choose`.
# Chosen by benchmarks/tune_triton.py on an H100 (bf16, H = 16, N = 16K; full attention,
# causal, and LongNet's (2048, 4096, 8192) x (1, 2, 4), whose rows are 512 long; the
# measured TFLOP/s: docs/performance.md). float16 shares them; float32 gets smaller blocks
# (`_choose`).
_LONG = _tiles(
    ("fwd", 64, 64, 64, 4, 3),  # best on long, causal and short rows
    ("fwd", 128, 128, 128, 8, 3),
    ("fwd", 256, 64, 64, 4, 3),  # larger tiles exceed shared memory
    ("dq", 64, 64, 64, 4, 3),
    ("dq", 128, 128, 64, 8, 3),
    ("dq", 256, 128, 32, 8, 3),
    ("dkdv", 64, 32, 128, 4, 3),
    ("dkdv", 128, 32, 64, 4, 4),
    ("dkdv", 256, 32, 64, 8, 2),
)
TUNED = types.MappingProxyType({
    **{(kind, d, rows): tiles for (kind, d), tiles in _LONG.items()
       for rows in ("long", "short", "causal")},
    # Faster than 128x128 on rows of 512 and under a causal mask (docs/performance.md).
    ("fwd", 128, "short"): Tiles(block_m=128, block_n=64, num_warps=8, num_stages=3),
    ("fwd", 128, "causal"): Tiles(block_m=64, block_n=64, num_warps=4, num_stages=3),
})


def _choose(kind: str, head_dim: int, rows: int, causal: bool, dtype, config: Config) -> Tiles:
  """The tiles of one launch: `config`'s if it names them, else the tuned ones for the row
  regime (float32: smaller blocks, 2 stages); blocks capped to the row length."""
  itemsize = jnp.dtype(dtype).itemsize
  tiles = getattr(config, kind)
  if tiles is None:
    regime = "short" if rows <= 1024 else "causal" if causal else "long"
    tiles = TUNED[(kind, max(64, head_dim), regime)]
    if itemsize == 4:  # float32 tiles take twice the shared memory: smaller blocks, 2 stages
      tiles = Tiles(block_m=min(tiles.block_m, 64 if head_dim <= 128 else 32),
                    block_n=min(tiles.block_n, 32), num_warps=tiles.num_warps, num_stages=2)
    elif dtype == jnp.float16 and kind == "dq" and head_dim > 128:
      # float16's dq kernel multiplies ds in float32: at head dim 256 three stages ask for
      # 240 KiB of shared memory (H100: 227 KiB); two fit (measured on the H100).
      tiles = dataclasses.replace(tiles, num_stages=min(tiles.num_stages, 2))
  cap = max(16, 1 << (max(rows, 1) - 1).bit_length())  # next power of two >= rows
  return dataclasses.replace(tiles, block_m=min(tiles.block_m, cap),
                             block_n=min(tiles.block_n, cap))


def lowering_problem() -> str | None:
  """Why jax-triton cannot lower kernels with this JAX, or None.

  jax-triton up to 0.4.1 registers a dead-code-elimination rule of two arguments, and JAX 0.12
  calls it with three: every jitted call would fail with a TypeError.
  """
  if jax.__version_info__ >= (0, 12) and jt.__version_info__ < (0, 5):
    return (f"jax-triton {jt.__version__} cannot lower kernels on JAX {jax.__version__} "
            f"(install with the 'triton' extra, which keeps JAX below 0.12)")
  return None


_MAX_GRID_Y = 65535  # CUDA's limit on the grid's second axis (batch x periods)


def supports(problem: Problem) -> Support:
  """CUDA GPUs; bf16, f16, f32; head dims 16..256 (powers of two); a launchable grid."""
  if problem.platform != "gpu":
    return no("the triton backend runs on CUDA GPUs only")
  if why := lowering_problem():
    return no(why)
  d = problem.head_dim
  if d not in (16, 32, 64, 128, 256):
    return no(f"the triton backend needs a head dim of 16..256, a power of two; got {d}")
  if not any(problem.dtype == t for t in (jnp.bfloat16, jnp.float16, jnp.float32)):
    return no(f"the triton backend runs bf16, f16 and f32, got {problem.dtype}")
  b, n, h, _ = problem.q_shape
  for fused in schedule.launches(problem.pattern, n, h, problem.branches):
    periods = schedule.build(problem.pattern, n, h, problem.kv_shape[2], fused, False).periods
    if periods * b > _MAX_GRID_Y:
      return no(f"the triton backend launches at most {_MAX_GRID_Y} batch x period programs; "
                f"got {b} x {periods}")
  return YES


def _precision(q):
  return "ieee" if q.dtype == jnp.float32 else "tf32"  # the latter is unused for 16-bit inputs


def _launch(kind, q, k, fused, pattern, config, ids=None):
  """(tiles, the kernel's schedule tables and ids as arrays, grid, constants) of one launch of
  branches `fused`. `ids`: None, or `_ids`' for packed rows."""
  b, n, h, d = q.shape
  transposed = kind == "dkdv"
  s = schedule.build(pattern, n, h, k.shape[2], fused, transposed)
  tiles = _choose(kind, d, s.longest_row, pattern.causal, q.dtype, config)
  row_block = tiles.block_n if transposed else tiles.block_m
  consts = dict(N=n, H=h, HKV=k.shape[2], D=d, L=s.stride, PERIOD=s.period,
                PERIODS=s.periods, ROW_BLOCKS=s.row_blocks(row_block), CAUSAL=pattern.causal,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PRECISION=_precision(q),
                PACKED=ids is not None)
  if ids is None:  # placeholders no kernel reads
    return tiles, (*s.arrays(), *(jnp.zeros((1,), jnp.int32),) * 3), s.grid(b, row_block), consts
  q_ids, k_ids, windows = ids[0], ids[1], ids[3 if transposed else 2]
  groups = h // k.shape[2] if transposed and windows.shape[-1] > 1 else 1
  if transposed:
    consts["GROUPS"] = groups
  return (tiles, (*s.arrays(), q_ids, k_ids, s.block_windows(windows, n, row_block, groups)),
          s.grid(b, row_block), consts)


def _ids(segment_ids, heads: int, kv_heads: int, keys: bool = False):
  """The contract's `(q_ids, kv_ids)` (`[B, N]`, or per head `[B, N, H]` and `[B, N, Hkv]`)
  as the kernels read them: the queries' ids `[B, N, H]`, the keys' `[B, N, Hkv]` (int32),
  then `common.contract_windows`' of the queries over the keys and (`keys`: the backward) of
  the keys over the queries, `[4, B, N, X]` each."""
  q_ids, k_ids = ((x[:, :, None] if x.ndim == 2 else x) for x in segment_ids)
  per_head = lambda x, count: jnp.broadcast_to(x, x.shape[:2] + (count,))
  windows = [contract_windows(segment_ids)]
  if keys:
    windows.append(contract_windows(segment_ids, keys=True))
  return (per_head(q_ids, heads), per_head(k_ids, kv_heads), *windows)


def _call(kernel, args, out, tiles, grid, config, **consts):
  """One kernel launch: `args` then one parameter per leaf of `out`, which is returned."""
  return jt.triton_call(*args, kernel=kernel, **{_OUT: out}, grid=grid,
                        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                        compute_capability=config.compute_capability, **consts)


@in_32_bits
def forward(q, k, v, pattern: DilatedPattern, scale: float, *, branches=None, config=None,
            out_dtype=None, segment_ids=None):
  """`(out, lse)` of `branches` (all if None): float32 partials, or `out` in `out_dtype` when
  given (written by the kernel when one launch covers the branches). `segment_ids`: the
  backend contract's packed rows."""
  config = config or Config()
  if segment_ids is None:
    fn = lambda q, k, v: _forward(q, k, v, pattern, scale, branches, config, out_dtype)
    return batched(fn)(q, k, v)
  fn = lambda q, k, v, *ids: _forward(q, k, v, pattern, scale, branches, config, out_dtype,
                                      _ids(ids, q.shape[2], k.shape[2]))
  return batched(fn)(q, k, v, *segment_ids)


def _forward(q, k, v, pattern, scale, branches, config, out_dtype, ids=None):
  launches = schedule.launches(pattern, q.shape[1], q.shape[2], branches)
  # One launch writes the output directly; several give float32 partials to merge.
  dtype = (out_dtype or jnp.float32) if len(launches) == 1 else jnp.float32
  parts = []
  for fused in launches:
    tiles, tables, grid, consts = _launch("fwd", q, k, fused, pattern, config, ids)
    parts.append(_call(
        kernels.forward_kernel, (q, k, v, *tables),
        (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)),
        tiles, grid, config, QK_SCALE=scale * kernels.LOG2E, **consts))
  out, lse = merge([o for o, _ in parts], [lse for _, lse in parts])
  return out.astype(out_dtype or jnp.float32), lse


@in_32_bits
def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, *,
             branches=None, config=None, grad_dtype=None, segment_ids=None):
  """float32 `(dq, dk, dv)` of `branches` from the global `lse` and `delta` (whatever
  `grad_dtype`). `segment_ids`: packed rows, as in `forward`."""
  config = config or Config()
  if segment_ids is None:
    fn = lambda *a: _backward(*a, pattern, scale, branches, config)
    return batched(fn)(q, k, v, dout, lse, delta)
  fn = lambda *a: _backward(*a[:6], pattern, scale, branches, config,
                            _ids(a[6:], q.shape[2], k.shape[2], keys=True))
  return batched(fn)(q, k, v, dout, lse, delta, *segment_ids)


def _backward(q, k, v, dout, lse, delta, pattern, scale, branches, config, ids=None):
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse).astype(jnp.float32)  # p = 0 on such rows
  delta = delta.astype(jnp.float32)
  f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
  dq = dk = dv = jnp.zeros((1,), jnp.float32)
  for t, fused in enumerate(schedule.launches(pattern, q.shape[1], q.shape[2], branches)):
    acc = dict(ACCUMULATE=t > 0, SCALE=scale)  # later launches add to the first's
    tiles, tables, grid, consts = _launch("dq", q, k, fused, pattern, config, ids)
    dq = _call(kernels.dq_kernel, (q, k, v, dout, lse, delta, *tables, dq), f32(q),
               tiles, grid, config, **acc, **consts)
    tiles, tables, grid, consts = _launch("dkdv", q, k, fused, pattern, config, ids)
    dk, dv = _call(kernels.dkdv_kernel, (q, k, v, dout, lse, delta, *tables, dk, dv),
                   (f32(k), f32(k)), tiles, grid, config, **acc, **consts)
  return dq, dk, dv
