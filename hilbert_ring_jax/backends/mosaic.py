"""The "mosaic" backend: Pallas Mosaic GPU kernels for Hopper (sm_90), forward and backward.

The forward walks the same host block schedule as the "triton" backend (`schedule.py`): the
branches whose segments nest run in one launch, each (query, key) pair scored once with the
bias `log m` of its multiplicity, causal blocks past the diagonal skipped, GQA by reading the
shared key/value head. Launches group branches whose rows are at least one program block
long (`mosaic_plan.ROW_BLOCK`, 128 positions), so a pattern whose rows would be short all
together runs as a few launches: LongNet at 8K as examples/lm_real.py first trained it,
`w = (512, 2048, 8192), r = (1, 4, 16)` (rows of 32 all together), as {512/1, 2048/4} (rows
of 128) and {8192/16} (rows of 512).
Each launch after the first merges the earlier launches' output and lse (in the output's
dtype, float32 when none is asked for) into its own in its items' epilogues, so the output is
written once per launch and never merged apart; in the backward, each launch's kernels add
the earlier launches' dq, dk, dv to their own likewise. What changes is the engine, built
from Hopper's own parts: per launch one kernel of three warpgroups (a TMA producer streaming
a row's key/value blocks into a ring of shared-memory buffers, two consumers running wgmma
and an online softmax, taking turns on the tensor cores), persistent over the launch's work
items; in the backward a dq kernel and a dk/dv kernel (or the dk/dv kernel adding dq).

The backend's modules, in reading order:
- `mosaic.py` (this one): `supports`, and `forward` / `backward`, which cut the problem into
  launches, pad it and chain the launches' results;
- `mosaic_plan.py`: the launch choices (`Config`) and their shared-memory budgets, the
  launches and their geometry (`geometry_problem`), the work items and the blocks each
  kernel walks over them (`Work`, `Program`, `Ranges`), with the host's list scheduling;
- `mosaic_pipeline.py`: the producer/consumer pipeline the three kernels share;
- `mosaic_forward.py`: the forward kernel;
- `mosaic_backward.py`: the dq and dk/dv kernels;
- `mosaic_gather.py`: the ring's forward kernel that gathers its keys itself (`gathers`,
  `gathered_forward`; `ring.KERNEL_GATHER`);
- `mosaic_decode.py`: the decoding token step's kernel (`step`).
The Hopper building blocks (limits, tile layouts, wgmma products, turns, the launcher) are
`hopper.py`'s, shared by all of them.

Boxes past the end of an input read zeros (the kernel masks keys past each piece's end);
outputs are allocated in whole periods, so that no store runs past their end, and sliced.
Each launch's rows must come in whole program blocks (`2 * block_q` positions per row and
period, and the backward's 128), else `supports` declines, except in a launch of one segment
over all N (full attention, a ring step), whose rows all end at N: there a partial last block
reads zeros past N and writes into the outputs' padding, so any N runs. A length that `8 * L`
does not divide is zero-padded (a copy, only then: the views' row axes must be whole tiles
of 8). Head dim 256 does not fit the backward (its tiles exceed shared memory): `supports`
declines that backward, and dispatch gives it to the next candidate ("triton" where it runs),
as any backward it declines.
Packed rows (`segment_ids`): every kernel reads its rows' and its streamed blocks' document ids
and skips, runs unmasked or masks blocks by each tile's document windows (`common.id_windows`;
`mosaic_forward` says how).
`Config(interpret=True)` runs the kernels in Mosaic GPU interpret mode on a CPU (JAX >= 0.11),
which is how the test suite checks them without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp

from ..pattern import DilatedPattern
from . import common, mosaic_backward, mosaic_decode, mosaic_forward, mosaic_gather, schedule
from .base import YES, Problem, Support, no
from .common import batched
from .hopper import LOG2E, REGISTERS_MOVE, Zeroed, is_hopper
from .mosaic_plan import (BWD_BLOCK, ROW_BLOCK, Config, geometry_problem, keys_per_query,
                          launches, long_key_rows, out_length)

__all__ = ["Config", "backward", "forward", "gathered_forward", "gathers", "geometry_problem",
           "ring_step_config", "step", "supports"]


def supports(problem: Problem) -> Support:
  """Hopper GPUs (sm_90); bf16 and f16 (the backward bf16 only); head dims 64 and 128, and 256
  for a forward whose output is final (one launch, no ring step); rows of whole blocks, or one
  segment of any length; packed rows (`segment_ids`) in both passes. A decoding step
  (`problem.step`): the token-step kernel's `mosaic_decode.supports` (packed caches too)."""
  if problem.step:
    return mosaic_decode.supports(problem)
  if problem.platform != "gpu" or not is_hopper():
    return no("the mosaic backend runs on Hopper GPUs (sm_90) only")
  if jax.__version_info__ < (0, 11):
    return no(f"the mosaic backend needs JAX >= 0.11 (its kernels lower with 0.11's Mosaic "
              f"GPU); this is {jax.__version__}")
  if not any(problem.dtype == t for t in (jnp.bfloat16, jnp.float16)):
    return no(f"the mosaic backend runs bf16 and f16, got {problem.dtype}")
  d = problem.head_dim
  if d not in (64, 128, 256):
    return no(f"the mosaic backend needs a head dim of 64, 128 or 256; got {d}")
  b, n, h, _ = problem.q_shape
  if problem.backward and problem.dtype == jnp.float16:
    return no("the mosaic backend's backward rounds ds = p (dp - delta) to the inputs' dtype "
              "for its products: float16 can overflow there where every gradient fits, so a "
              "float16 backward goes to the next backend")
  if d == 256 and problem.backward:
    return no("the mosaic backend's backward runs head dims 64 and 128: at 256 its tiles "
              "exceed shared memory")
  groups = launches(problem.pattern, n, h, problem.branches)
  if d == 256 and (problem.varying or len(groups) > 1):
    return no("the mosaic backend writes float32 partials (ring steps, several launches) "
              "only up to head dim 128: at 256 their tiles exceed shared memory")
  config = problem.config if isinstance(problem.config, Config) else Config()
  if why := geometry_problem(problem.pattern, n, h, problem.kv_shape[2], problem.branches,
                             config.resolved(d), b):
    return no(why)
  return YES


def gathers(q_shape, kv_shape, dtype, shards: int, scale: float, causal: bool = False
            ) -> Support:
  """Whether `gathered_forward` runs these shard shapes: Hopper, JAX >= 0.11, bf16 or f16,
  head dim 64 or 128, a positive scale, shards of whole blocks (`mosaic_gather.fits`; causal:
  two chunks of whole blocks), over `shards >= 2` devices."""
  if not is_hopper() or jax.__version_info__ < (0, 11):
    return no("the gathering kernel runs on Hopper GPUs (sm_90) with JAX >= 0.11")
  if not any(jnp.dtype(dtype) == t for t in (jnp.bfloat16, jnp.float16)):
    return no(f"the gathering kernel runs bf16 and f16, got {dtype}")
  n, d = q_shape[1], q_shape[3]
  if (shards < 2 or d not in (64, 128) or not scale > 0 or kv_shape[1] != n
      or not mosaic_gather.fits(n, d, jnp.dtype(dtype).itemsize, causal=causal)):
    return no(f"the gathering kernel needs 2 or more shards of whole blocks, head dim 64 or "
              f"128 and a positive scale; got shards of {n} at head dim {d} over {shards}, "
              f"scale {scale}{', causal' if causal else ''}")
  return YES


@common.in_32_bits
def gathered_forward(q, k, v, scale: float, *, axis_name, shards: int, causal: bool = False,
                     config=None):
  """`(out [B, n, H, D] in q's dtype, lse [B, n, H], (k, v) gathered [B, P n, Hkv, D])`:
  full attention of this device's queries over the keys of all `shards` devices of
  `axis_name` (inside shard_map), gathered inside the kernel (`mosaic_gather`; `gathers`
  says which shapes run). `causal`: the shards in zigzag order (`mosaic_gather`)."""
  del config  # the kernel's blocks are its own
  out, lse, k_all, v_all = mosaic_gather.gathered_forward(q, k, v, scale, axis_name=axis_name,
                                                          shards=shards, causal=causal)
  return out, lse, (k_all, v_all)


def ring_step_config(config: Config | None) -> Config:
  """A ring step's config: `persistent` left unset becomes False, one program per work item.
  The next step's keys travel while a step runs, and NCCL's transfer kernel needs SMs:
  persistent programs hold every SM until the step ends, while programs of one item each
  free SMs all through it (full attention's forward on 4 GPUs went from 62% to 72% of one
  GPU at 8K tokens a GPU, and from 77% to 85% at 32K: docs/performance.md)."""
  config = config or Config()
  if config.persistent is not None:
    return config
  return dataclasses.replace(config, persistent=False)


@common.in_32_bits
def forward(q, k, v, pattern: DilatedPattern, scale: float, *, branches=None, config=None,
            out_dtype=None, segment_ids=None):
  """`(out, lse)` of `branches` (all if None): `out` in float32, or in `out_dtype` when
  given. Several launches chain: each merges the result so far (in `out_dtype`: the earlier
  launches' output rounded once more, at 16 bits about the output's own rounding) into its
  own in float32 registers, in its epilogues (measured on that 8K LongNet's two launches with
  the merge apart: 16-bit partials made the forward faster than float32 ones, the output
  tile taking the query tile's place, so the next item's queries load during this one;
  docs/performance.md). `segment_ids`: the backend contract's packed rows (`mosaic_forward`
  says how the kernel reads them)."""
  config = config or Config()  # resolved per launch (`_forward`)
  if segment_ids is None:
    fn = lambda q, k, v: _forward(q, k, v, pattern, scale, branches, config, out_dtype)
    return batched(fn)(q, k, v)
  fn = lambda q, k, v, qi, ki: _forward(q, k, v, pattern, scale, branches, config, out_dtype,
                                        _ids(qi, ki, q.shape[2] // k.shape[2]))
  return batched(fn)(q, k, v, *segment_ids)


def _ids(q_ids, k_ids, per_kv, keys=False):
  """The contract's ids (`[B, N]`, or per head `[B, N, H]` and `[B, N, Hkv]`) as the kernels
  read them: `(q_ids [B, X, N], k_ids [B, X', N], id_windows [4, B, X, N])` for those over
  query rows (the forward, dq); `keys`: `(k_ids, q_ids, windows [4, B, X', N])` for the
  dk/dv kernel's key rows, each key's windows over the queries of every query head reading
  its key/value head (their union; the run all of them share)."""
  w = jnp.swapaxes(common.contract_windows((q_ids, k_ids), keys), 2, 3)  # [4, B, X, N]
  heads = lambda x: x[:, None] if x.ndim == 2 else x.transpose(0, 2, 1)
  q_ids, k_ids = heads(q_ids), heads(k_ids)
  if not keys:
    return q_ids, k_ids, w
  group = q_ids.shape[1] // k_ids.shape[1]  # query heads reading each key/value id head
  w = w.reshape(4, w.shape[1], k_ids.shape[1], group, w.shape[-1])
  return k_ids, q_ids, jnp.stack(common.reduce_windows(w, axis=2))


def _itemsize(out_dtype) -> int:
  return 4 if out_dtype is None else jnp.dtype(out_dtype).itemsize


def _padded(n, sched):
  """`(Np, pad)`: `pad(x, value, axis)` fills `x`'s position axis up to `Np`, a multiple of
  `8 L` (TMA into tiled shared memory needs the views' row axes in whole tiles of 8); no
  copy when `Np = N`."""
  n_pad = -(-n // (8 * sched.stride)) * 8 * sched.stride

  def pad(x, value=0.0, axis=1):
    if n_pad == n:
      return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n_pad - n)
    return jnp.pad(x, widths, constant_values=value)

  return n_pad, pad


def _to_rows(arrays, rows: int, fills):
  """The earlier launches' results `[B, N', ...]` cut or padded (with `fills`) to a launch's
  `rows`, for its epilogues to merge or add."""
  return tuple(jnp.pad(x[:, :rows], [(0, 0), (0, rows - min(rows, x.shape[1]))]
                       + [(0, 0)] * (x.ndim - 2), constant_values=fill)
               for x, fill in zip(arrays, fills))


def _forward(q, k, v, pattern, scale, branches, config, out_dtype, ids=None):
  batch, n, num_heads, d = q.shape
  resolved = functools.partial(config.resolved, d, q.dtype.itemsize, _itemsize(out_dtype),
                               packed=ids is not None)
  if why := geometry_problem(pattern, n, num_heads, k.shape[2], branches, resolved(), batch):
    raise NotImplementedError(why)
  result = None
  for fused in launches(pattern, n, num_heads, branches):
    sched = schedule.build(pattern, n, num_heads, k.shape[2], fused, False)
    n_pad, pad = _padded(n, sched)
    launch_config = resolved(long_key_rows(sched, pattern.causal))
    if result is not None:  # merged in this launch's epilogues
      result = _to_rows(result, out_length(sched, n_pad, 2 * launch_config.block_q),
                        (0.0, -jnp.inf))
    result = mosaic_forward.launch(pad(q), pad(k), pad(v), sched.arrays(), sched, n,
                                   pattern.causal, scale, out_dtype or jnp.float32,
                                   launch_config, result, ids)
  return result[0][:, :n], result[1][:, :n]


@common.in_32_bits
def backward(q, k, v, dout, lse, delta, pattern: DilatedPattern, scale: float, *,
             branches=None, config=None, grad_dtype=None, segment_ids=None):
  """float32 `(dq, dk, dv)` of `branches` from the global `lse` and `delta`: a dk/dv kernel
  over key rows (the transposed schedule) that also adds dq (`Config.fused_backward`), or
  with a dq kernel over query rows (the forward's schedule); each launch's kernels add the
  earlier launches' gradients to their own in their epilogues (fused: dk, dv; dq added to
  the float32 accumulators' sum). With `grad_dtype` bfloat16 the kernels write dk and dv in
  bfloat16 (the separate ones dq too; no float32 copy; the earlier launches' read in
  bfloat16 and added in float32), and the gradients come back in bfloat16. Head dims 64 and
  128 (`supports`). `segment_ids`: packed rows, as in `forward`."""
  config = (config or Config()).resolved(q.shape[-1], q.dtype.itemsize,
                                         packed=segment_ids is not None)
  if not (REGISTERS_MOVE or config.interpret):
    warnings.warn(
        "Mosaic GPU of JAX >= 0.12 ignores the mosaic backward's register reallocation "
        "(setmaxnreg): it spills and runs at about half cuDNN's speed. Install the 'gpu' "
        "extras (JAX 0.11), or preload the repository's tools/no_nvjitlink.c "
        "(docs/performance.md, 'JAX 0.12').", stacklevel=2)
  final = grad_dtype is not None and jnp.dtype(grad_dtype) == jnp.bfloat16
  if segment_ids is None:
    fn = lambda *a: _backward(*a, pattern, scale, branches, config, final)
    return batched(fn)(q, k, v, dout, lse, delta)
  per_kv = q.shape[2] // k.shape[2]
  fn = lambda *a: _backward(*a[:6], pattern, scale, branches, config, final,
                            (_ids(*a[6:], per_kv), _ids(*a[6:], per_kv, keys=True)))
  return batched(fn)(q, k, v, dout, lse, delta, *segment_ids)


def _backward(q, k, v, dout, lse, delta, pattern, scale, branches, config, final, ids=None):
  """`ids`: None, or the ids as the kernels over query rows and over key rows read them."""
  q_ids, k_ids = ids or (None, None)
  batch, n, num_heads, _ = q.shape
  num_kv = k.shape[2]
  if why := geometry_problem(pattern, n, num_heads, num_kv, branches, config, batch):
    raise NotImplementedError(why)
  dout = dout.astype(q.dtype)
  # lse in base 2, +inf where a query sees no key (p = 0 there); [B, H, N] like delta.
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32)) * LOG2E
  lse2, delta = lse2.transpose(0, 2, 1), delta.astype(jnp.float32).transpose(0, 2, 1)
  out_dtype = jnp.bfloat16 if final else jnp.float32
  grads = None  # the launches' so far, added in the next one's epilogues
  for fused in launches(pattern, n, num_heads, branches):
    sched = schedule.build(pattern, n, num_heads, num_kv, fused, False)
    n_pad, pad = _padded(n, sched)
    L = sched.stride
    x = [pad(t) for t in (q, k, v, dout)]
    flat = (pad(lse2, jnp.inf, 2), pad(delta, 0.0, 2))
    strided = [t.reshape(batch, num_heads, n_pad // L, L).transpose(0, 1, 3, 2) for t in flat]
    transposed = schedule.build(pattern, n, num_heads, num_kv, fused, True)
    stats = (flat[0], strided[0], flat[1], strided[1])
    cfg = config.backward_for(L, q.shape[-1], q.dtype.itemsize, packed=ids is not None,
                              keys=keys_per_query(pattern, n, num_heads, fused),
                              accumulator_bytes=2 * 4 * math.prod(x[0].shape))
    if grads is not None:  # in the dtypes of this launch's outputs (fused: dq in float32)
      dtypes = ((jnp.float32,) if cfg.fused_backward else (out_dtype,)) + (out_dtype,) * 2
      grads = tuple(g.astype(dtype) for g, dtype in zip(
          _to_rows(grads, out_length(sched, n_pad, ROW_BLOCK), (0.0,) * 3), dtypes))
    if cfg.fused_backward:
      dq, dk, dv = _fused_backward(x, stats, transposed, n, pattern.causal, scale, cfg,
                                   out_dtype, grads, k_ids)
    else:
      dq = mosaic_backward.dq_launch(*x, *strided, sched.arrays(), sched, n, pattern.causal,
                                     scale, cfg, out_dtype, None if grads is None else grads[0],
                                     q_ids)
      dk, dv = mosaic_backward.dkdv_launch(*x, stats, transposed.arrays(), transposed, n,
                                           pattern.causal, scale, cfg, out_dtype=out_dtype,
                                           prior=None if grads is None else grads[1:],
                                           ids=k_ids)
    grads = dq, dk, dv
  return tuple(g[:, :n].astype(out_dtype) for g in grads)


def _fused_backward(x, stats, transposed: schedule.Schedule, n, causal, scale, config,
                    out_dtype, prior=None, ids=None):
  """dq, dk, dv of one launch from the dk/dv kernel alone: dq added into zeroed float32
  accumulators (a second one in the strided view when L > 1: TMA cannot address one array
  through both; one per consumer in interpret mode), summed here, in float32; dk, dv in
  `out_dtype`; plus `prior` (`(dq, dk, dv)` of the earlier launches, `[B, No, ...]`, in
  those dtypes)."""
  batch, n_pad, num_heads, d = x[0].shape
  L = transposed.stride
  copies = 2 if config.interpret else 1
  # Query blocks round up past their piece (adding zeros there): one block of slack.
  n_acc = out_length(transposed, n_pad, ROW_BLOCK) + BWD_BLOCK * L
  shapes = [(copies * batch, n_acc, num_heads, d)]
  if L > 1:
    shapes.append((copies * batch, n_acc // L, L, num_heads, d))
  dk, dv, *accs = mosaic_backward.dkdv_launch(
      *x, stats, transposed.arrays(), transposed, n, causal, scale, config,
      dq_accs=[Zeroed(shape, jnp.float32) for shape in shapes], out_dtype=out_dtype,
      prior=None if prior is None else prior[1:], ids=ids)
  dq = sum(acc.reshape(copies, batch, n_acc, num_heads, d).sum(0) for acc in accs)
  dq = dq[:, :dk.shape[1]] * scale
  return dq if prior is None else dq + prior[0], dk, dv


@common.in_32_bits
def step(q, k, v, ks, vs, length, tables, scale: float, *, config=None, first=None):
  """A decoding token step (the contract of `base.py`, one token): one launch of
  `mosaic_decode.step` over every branch's slot, which reads the token's own row from the
  caches (`k`, `v` are not read). `config`: a `mosaic_decode.Config`, or None. `first`
  (packed caches, one `[B, r]` a branch): each residue's rows before it are not read."""
  del k, v
  out, lse = mosaic_decode.step(q[:, 0], ks, vs, length, tables, scale, config, first)
  return out[:, None], lse[:, None]
