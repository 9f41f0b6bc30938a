"""The "triton" backend: Triton kernels through `jax_triton.triton_call` (CUDA GPUs).

The GPU fast path. Kernels (`_triton_kernels.py`) address dilated rows with strides, so no
input is padded, gathered or copied; ragged segments are masked. Forward: one launch per
branch, chained through a running `(out, lse)` that each launch merges into in place
(`input_output_aliases`); the launch of a branch that covers every row goes last and writes
the output in the input dtype, saving a pass. Backward: per branch a dq kernel and a dk/dv
kernel, accumulating into float32 buffers in place. Block sizes, warps and stages come from
`_config`, chosen per head dim and dilated segment length and kept in code.

Importing this module needs `jax_triton` (and `triton`); without them the dispatcher falls
back to "pallas", then "xla".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import jax_triton as jt

from ..pattern import DilatedPattern
from . import _triton_kernels as kernels


@dataclasses.dataclass(frozen=True)
class Config:
  block_m: int
  block_n: int
  num_warps: int
  num_stages: int


# (pass, head_dim) -> config for long dilated rows; shrunk for short rows by `_config`.
# Chosen by benchmarks/tune_triton.py on an H100 (bf16, H=16, N=16K, full and causal; see
# benchmarks/RESULTS.md): forward 128x128 with 8 warps reached 504 TFLOP/s against 473 for
# 128x64; dq 128x64/8/3 and dk/dv 32x64/4/4 were the fastest backward pair, causal or not.
CONFIGS = {
    ("fwd", 64): Config(128, 64, 4, 3),
    ("fwd", 128): Config(128, 128, 8, 3),
    ("fwd", 256): Config(64, 32, 8, 2),
    ("dq", 64): Config(128, 32, 4, 3),
    ("dq", 128): Config(128, 64, 8, 3),
    ("dq", 256): Config(64, 32, 8, 2),
    ("dkdv", 64): Config(32, 64, 4, 4),
    ("dkdv", 128): Config(32, 64, 4, 4),
    ("dkdv", 256): Config(32, 64, 8, 2),
}


def _config(kind: str, head_dim: int, rows: int) -> Config:
  cfg = CONFIGS[(kind, max(64, head_dim))]
  cap = max(16, 1 << (max(rows, 1) - 1).bit_length())  # next power of two >= rows
  return dataclasses.replace(cfg, block_m=min(cfg.block_m, cap), block_n=min(cfg.block_n, cap))


def _check(q, k):
  if jax.default_backend() != "gpu":
    raise NotImplementedError("the triton backend runs on CUDA GPUs only")
  d = q.shape[-1]
  if d not in (16, 32, 64, 128, 256):
    raise NotImplementedError(f"the triton backend needs a head dim of 16..256, a power of "
                              f"two; got {d}")
  if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise NotImplementedError(f"the triton backend runs bf16, f16 and f32, got {q.dtype}")


def _precision(q):
  return "ieee" if q.dtype == jnp.float32 else "tf32"  # the latter is unused for 16-bit inputs


def _branches(pattern: DilatedPattern, num_heads: int, branches):
  """Branch geometry in launch order; a branch covering every row (if any) goes last."""
  ranges = pattern.head_ranges(num_heads)
  out = []
  for b in range(pattern.num_branches) if branches is None else branches:
    (w, r), (h0, h1) = pattern.branches[b], ranges[b]
    per_head = pattern.offsets == "head" and r > 1
    covers_all = not per_head and (h0, h1) == (0, num_heads)
    out.append((covers_all, w, r, h0, h1, per_head))
  return sorted(out, key=lambda x: x[0])  # stable: covering branches last


def _geometry(n, w, r, h0, h1, per_head):
  w = min(w, n)
  segments, rows = -(-n // w), -(-w // r)
  return w, segments, rows, (h1 - h0) * segments * (1 if per_head else r)


def _first_cover(order, n, num_heads):
  """int8 `[N, H]`: launch position of the first branch covering (token, head), 127 if none."""
  pos, head = jnp.arange(n)[:, None], jnp.arange(num_heads)[None, :]
  first = jnp.full((n, num_heads), 127, jnp.int8)
  for t, (_, w, r, h0, h1, per_head) in reversed(list(enumerate(order))):
    cover = (head >= h0) & (head < h1)
    if per_head:
      cover &= (pos % min(w, n)) % r == head % r
    first = jnp.where(cover, jnp.int8(t), first)
  return first


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
  """`(out, lse)`: out in q's dtype (written by the last launch), lse float32 `[B, N, H]`."""
  _check(q, k)
  return _batched(lambda q, k, v: _forward(q, k, v, pattern, scale, branches))(q, k, v)


def _forward(q, k, v, pattern, scale, branches):
  b, n, h, d = q.shape
  order = _branches(pattern, h, branches)
  first = _first_cover(order, n, h)
  f32 = jnp.float32
  # The running output between launches is kept in the input dtype: with q, k, v and out it
  # is the only full-size buffer, so a LongNet forward needs ~1.25x the bytes of q, k, v, out.
  full_o = jax.ShapeDtypeStruct(q.shape, q.dtype)
  stat = jax.ShapeDtypeStruct(q.shape[:3], f32)
  orun, lse = jnp.zeros((1,), q.dtype), jnp.zeros((1,), f32)
  last_covers = order[-1][0]
  for t, (_, w, r, h0, h1, per_head) in enumerate(order):
    last = last_covers and t == len(order) - 1
    w, segments, rows, items = _geometry(n, w, r, h0, h1, per_head)
    cfg = _config("fwd", d, rows)
    m_blocks = -(-rows // cfg.block_m)
    out_shapes = (full_o if (t > 0 or not last) else jax.ShapeDtypeStruct((1,), q.dtype), stat,
                  jax.ShapeDtypeStruct(q.shape if last else (1,), q.dtype))
    orun, lse, out = jt.triton_call(
        q, k, v, first, orun, lse, kernel=kernels.forward_kernel, out_shape=out_shapes,
        grid=(m_blocks * items, b), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        input_output_aliases={4: 0, 5: 1} if t > 0 else {},
        N=n, H=h, HKV=k.shape[2], D=d, W=w, R=r, H0=h0, PER_HEAD=per_head,
        CAUSAL=pattern.causal, CHAIN_POS=t, HAS_PREV=t > 0, LAST=last,
        QK_SCALE=scale * kernels.LOG2E, M_BLOCKS=m_blocks, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, PRECISION=_precision(q))
  if last_covers:
    return out, lse
  covered = (first < len(order))[None, :, :]
  return (jnp.where(covered[..., None], orun, 0.0),
          jnp.where(covered, lse, -jnp.inf))


def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, branches=None):
  """float32 `(dq, dk, dv)` of `branches` from the global `lse` and `delta`."""
  _check(q, k)
  return _batched(lambda *a: _backward(*a, pattern, scale, branches))(q, k, v, dout, lse, delta)


def _backward(q, k, v, dout, lse, delta, pattern, scale, branches):
  b, n, h, d = q.shape
  hkv = k.shape[2]
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse).astype(jnp.float32)  # p = 0 on such rows
  delta = delta.astype(jnp.float32)
  dq = jnp.zeros(q.shape, jnp.float32)
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for _, w, r, h0, h1, per_head in _branches(pattern, h, branches):
    w, segments, rows, items = _geometry(n, w, r, h0, h1, per_head)
    common = dict(N=n, H=h, HKV=hkv, D=d, W=w, R=r, H0=h0, PER_HEAD=per_head,
                  CAUSAL=pattern.causal, SCALE=scale, PRECISION=_precision(q))
    cfg = _config("dq", d, rows)
    m_blocks = -(-rows // cfg.block_m)
    dq = jt.triton_call(
        q, k, v, dout, lse, delta, dq, kernel=kernels.dq_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32), grid=(m_blocks * items, b),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, input_output_aliases={6: 0},
        M_BLOCKS=m_blocks, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common)
    cfg = _config("dkdv", d, rows)
    n_blocks = -(-rows // cfg.block_n)
    dk, dv = jt.triton_call(
        q, k, v, dout, lse, delta, dk, dv, kernel=kernels.dkdv_kernel,
        out_shape=(jax.ShapeDtypeStruct(k.shape, jnp.float32),) * 2,
        grid=(n_blocks * hkv * segments * r, b), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, input_output_aliases={6: 0, 7: 1}, NH=h1 - h0,
        N_BLOCKS=n_blocks, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common)
  return dq, dk, dv
