"""The "triton" backend: Triton kernels through `jax_triton.triton_call` (CUDA GPUs).

The GPU fast path. Kernels (`_triton_kernels.py`) walk a host-built block schedule
(`schedule.py`): branches whose segments nest are computed together, each (query, key) pair
scored once with the bias `log m` of its multiplicity, so one launch writes the final output
and lse (other patterns run branch by branch and are merged). Rows and entries are strided
runs of tokens, so no input is padded, gathered or copied. Backward: a dq kernel over query
rows and a dk/dv kernel over key rows, in float32. Block sizes, warps and stages come from
`_config`, chosen per pass, head dim and row length and kept in code.

Importing this module needs `jax_triton` (and `triton`); without them the dispatcher falls
back to "pallas", then "xla".
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import jax_triton as jt
import numpy as np

from ..merge import merge
from ..pattern import DilatedPattern
from . import _triton_kernels as kernels
from . import schedule

# jax-triton 0.4 renamed `out_shape=` to `out_type=` (the old name warns); 0.3 knows only the
# former. Aliasing is avoided altogether: the two versions disagree on whether an aliased
# output gets its own kernel parameter, so accumulating launches read the previous result as a
# plain input instead.
_OUT = "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"
# Triton >= 3.7 deprecates the block pointers the kernels use (3.9 removes them; pyproject
# caps triton below it). The warning is ours to act on, not the user's.
warnings.filterwarnings("ignore", message=r"tl\.make_block_ptr is deprecated",
                        category=UserWarning)


@dataclasses.dataclass(frozen=True)
class Config:
  block_m: int
  block_n: int
  num_warps: int
  num_stages: int


# (pass, head_dim, rows) -> config, rows being "long" (> 1024 positions per row), "short"
# or "causal" (long rows under a causal mask); shrunk further for tiny rows by `_config`.
# Chosen by benchmarks/tune_triton.py on an H100 (bf16, H = 16, N = 16K; full attention,
# causal, and LongNet's (2048, 4096, 8192) x (1, 2, 4), whose rows are 512 long; see
# benchmarks/RESULTS.md). float16 shares them; float32 gets smaller blocks (`_config`).
_LONG = {
    ("fwd", 64): Config(64, 64, 4, 3),  # 383 TFLOP/s; also best on causal and short rows
    ("fwd", 128): Config(128, 128, 8, 3),  # 460
    ("fwd", 256): Config(64, 64, 4, 3),  # 347; larger tiles exceed shared memory
    ("dq", 64): Config(64, 64, 4, 3),
    ("dq", 128): Config(128, 64, 8, 3),
    ("dq", 256): Config(128, 32, 8, 3),
    ("dkdv", 64): Config(32, 128, 4, 3),
    ("dkdv", 128): Config(32, 64, 4, 4),
    ("dkdv", 256): Config(32, 64, 8, 2),
}
CONFIGS = {(kind, d, rows): cfg for (kind, d), cfg in _LONG.items()
           for rows in ("long", "short", "causal")}
CONFIGS[("fwd", 128, "short")] = Config(128, 64, 8, 3)  # 447 TFLOP/s against 395 (128x128)
CONFIGS[("fwd", 128, "causal")] = Config(64, 64, 4, 3)  # 453 against 413


def _config(kind: str, head_dim: int, rows: int, causal: bool, itemsize: int) -> Config:
  regime = "short" if rows <= 1024 else "causal" if causal else "long"
  cfg = CONFIGS[(kind, max(64, head_dim), regime)]
  if itemsize == 4:  # float32 tiles take twice the shared memory: smaller blocks, 2 stages
    cfg = Config(min(cfg.block_m, 64 if head_dim <= 128 else 32), min(cfg.block_n, 32),
                 cfg.num_warps, 2)
  cap = max(16, 1 << (max(rows, 1) - 1).bit_length())  # next power of two >= rows
  return dataclasses.replace(cfg, block_m=min(cfg.block_m, cap), block_n=min(cfg.block_n, cap))


def lowering_problem() -> str | None:
  """Why jax-triton cannot lower kernels with this JAX, or None.

  jax-triton up to 0.4.1 registers a dead-code-elimination rule of two arguments, and JAX 0.12
  calls it with three: every jitted call would fail with a TypeError.
  """
  if jax.__version_info__ >= (0, 12) and jt.__version_info__ < (0, 5):
    return (f"jax-triton {jt.__version__} cannot lower kernels on JAX {jax.__version__} "
            f"(install with the 'gpu' extra, which keeps JAX below 0.12)")
  return None


def _check(q, k):
  if jax.default_backend() != "gpu":
    raise NotImplementedError("the triton backend runs on CUDA GPUs only")
  if problem := lowering_problem():
    raise NotImplementedError(problem)
  d = q.shape[-1]
  if d not in (16, 32, 64, 128, 256):
    raise NotImplementedError(f"the triton backend needs a head dim of 16..256, a power of "
                              f"two; got {d}")
  if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise NotImplementedError(f"the triton backend runs bf16, f16 and f32, got {q.dtype}")


def _precision(q):
  return "ieee" if q.dtype == jnp.float32 else "tf32"  # the latter is unused for 16-bit inputs


def _launch(kind, q, k, group, pattern, transposed):
  """(config, schedule tables as arrays, grid, constants) of one launch."""
  b, n, h, d = q.shape
  s = schedule.build(pattern, n, h, k.shape[2], group, transposed)
  if s.periods * b > 65535:  # the grid's second axis
    raise NotImplementedError(f"the triton backend launches at most 65535 batch x period "
                              f"programs; got {b} x {s.periods}")
  cfg = _config(kind, d, s.longest_row, pattern.causal, q.dtype.itemsize)
  pieces = s.pieces if len(s.pieces) else np.zeros((1, 4), np.int32)  # never read
  tables = tuple(jnp.asarray(x) for x in (s.rows, pieces, s.bias))
  row_blocks = -(-s.longest_row // (cfg.block_n if transposed else cfg.block_m))
  consts = dict(N=n, H=h, HKV=k.shape[2], D=d, L=s.stride, PERIOD=s.period,
                PERIODS=s.periods, ROW_BLOCKS=row_blocks, CAUSAL=pattern.causal,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISION=_precision(q))
  return cfg, tables, (len(s.rows) * row_blocks, s.periods * b), consts


def _call(kernel, args, out, cfg, grid, **consts):
  """One kernel launch: `args` then one parameter per leaf of `out`, which is returned."""
  return jt.triton_call(*args, kernel=kernel, **{_OUT: out}, grid=grid,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts)


def _batched(fn):
  """`fn(*arrays)` that `vmap` maps by folding the mapped axis into the batch axis 0.

  `triton_call` has no batching rule; all arrays here lead with the batch axis, so a mapped
  axis (moved to the front) merges with it and splits off again afterwards.
  """
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, *args):
    args = [x if mapped else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, mapped in zip(args, in_batched)]
    outs = wrapped(*(x.reshape((-1,) + x.shape[2:]) for x in args))
    outs = jax.tree.map(lambda y: y.reshape((axis_size, -1) + y.shape[1:]), outs)
    return outs, jax.tree.map(lambda _: True, outs)

  return wrapped


def forward(q, k, v, pattern: DilatedPattern, scale: float, branches=None):
  """`(out, lse)` of `branches` (all if None): out in q's dtype, lse float32 `[B, N, H]`."""
  _check(q, k)
  return _batched(lambda q, k, v: _forward(q, k, v, pattern, scale, branches))(q, k, v)


def _forward(q, k, v, pattern, scale, branches):
  groups = schedule.groups(pattern, q.shape[1], branches)
  # One group writes the output directly; several give float32 partials to merge.
  dtype = q.dtype if len(groups) == 1 else jnp.float32
  parts = []
  for group in groups:
    cfg, tables, grid, consts = _launch("fwd", q, k, group, pattern, False)
    parts.append(_call(
        kernels.forward_kernel, (q, k, v, *tables),
        (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)),
        cfg, grid, QK_SCALE=scale * kernels.LOG2E, **consts))
  return merge([o for o, _ in parts], [lse for _, lse in parts])


def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, branches=None):
  """float32 `(dq, dk, dv)` of `branches` from the global `lse` and `delta`."""
  _check(q, k)
  return _batched(lambda *a: _backward(*a, pattern, scale, branches))(q, k, v, dout, lse, delta)


def _backward(q, k, v, dout, lse, delta, pattern, scale, branches):
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse).astype(jnp.float32)  # p = 0 on such rows
  delta = delta.astype(jnp.float32)
  f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
  dq = dk = dv = jnp.zeros((1,), jnp.float32)
  for t, group in enumerate(schedule.groups(pattern, q.shape[1], branches)):
    acc = dict(ACCUMULATE=t > 0, SCALE=scale)  # later groups add to the first's results
    cfg, tables, grid, consts = _launch("dq", q, k, group, pattern, False)
    dq = _call(kernels.dq_kernel, (q, k, v, dout, lse, delta, *tables, dq), f32(q), cfg, grid,
               **acc, **consts)
    cfg, tables, grid, consts = _launch("dkdv", q, k, group, pattern, True)
    dk, dv = _call(kernels.dkdv_kernel, (q, k, v, dout, lse, delta, *tables, dk, dv),
                   (f32(k), f32(k)), cfg, grid, **acc, **consts)
  return dq, dk, dv
