"""`dilated_attention` and its implementation dispatcher."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from . import backends
from .pattern import DilatedPattern


def check_inputs(q, k, v, pattern) -> None:
  """Raises `ValueError` naming the argument for anything SPEC.md calls bad input."""
  if not isinstance(pattern, DilatedPattern):
    raise ValueError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must have rank 4 [B, N, H, D], got {name}.shape={jnp.shape(x)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must have a floating dtype, got {name}.dtype={x.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {k.shape=} and {v.shape=}")
  for axis, what in ((0, "batch"), (1, "sequence length"), (3, "head dim")):
    if not q.shape[axis] == k.shape[axis]:
      raise ValueError(
          f"q and k/v must have the same {what} (axis {axis}): {q.shape=}, {k.shape=}")
  if q.shape[1] < 1:
    raise ValueError(f"q must hold at least one token, got {q.shape=}")
  if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
    raise ValueError(
        f"the number of query heads must be a multiple of the key/value heads: "
        f"{q.shape=} has {q.shape[2]} heads, {k.shape=} has {k.shape[2]}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k and v must share a dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")
  pattern.head_ranges(q.shape[2])  # head_groups needs H >= number of branches


def check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return head_dim ** -0.5
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
    raise ValueError(f"scale must be a finite Python number or None, got {scale=!r}")
  return float(scale)


def implementation_names(implementation) -> tuple[str, ...]:
  """Resolves `implementation` (None, a name or a sequence of names) to backend names."""
  if implementation is None:
    if jax.default_backend() == "gpu":
      # JAX 0.12 deprecates Pallas's Triton lowering (with a warning): ask for it by name there.
      pallas = ("pallas",) if jax.__version_info__ < (0, 12) else ()
      return ("triton", *pallas, "xla")
    return ("xla",)
  names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  for name in names:
    if name not in backends.NAMES:
      raise ValueError(
          f"implementation must be None, one of {backends.NAMES} or a sequence of them, "
          f"got implementation={implementation!r}")
  if not names:
    raise ValueError("implementation must not be an empty sequence")
  return names


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, pattern, scale, name):
  out, lse = backends.load(name).forward(q, k, v, pattern, scale)
  return out.astype(q.dtype), lse.astype(jnp.float32)


def _attention_fwd(q, k, v, pattern, scale, name):
  out, lse = _attention(q, k, v, pattern, scale, name)
  return (out, lse), (q, k, v, out, lse)


def _attention_bwd(pattern, scale, name, res, cotangents):
  q, k, v, out, lse = res
  dout, dlse = cotangents
  # delta_i = sum_d dout * out - dlse: the one row statistic every backward needs.
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = delta - dlse.astype(jnp.float32)
  grads = backends.load(name).backward(q, k, v, dout, lse, delta, pattern, scale)
  return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


_attention.defvjp(_attention_fwd, _attention_bwd)
# Compiled as one program even when called eagerly; inlined under an outer jit.
_attention_jit = jax.jit(_attention, static_argnums=(3, 4, 5))


def dilated_attention(q, k, v, pattern: DilatedPattern, *, scale: float | None = None,
                      return_lse: bool = False,
                      implementation: str | Sequence[str] | None = None):
  """LongNet dilated attention: every branch of `pattern`, merged by softmax denominators.

  Computes SPEC.md's function: for query `i` and head `h`, a softmax over the keys each
  branch makes visible (counted once per branch that sees them), in float32.

  Args:
    q: `[B, N, H, D]` queries, in processing order (serialize first for a Hilbert order).
    k, v: `[B, N, Hkv, D]` with `H % Hkv == 0`; query head `h` reads `h // (H // Hkv)`.
    pattern: a `DilatedPattern`.
    scale: score scale, default `D ** -0.5`.
    return_lse: also return the float32 `[B, N, H]` log of the softmax denominator
      (`-inf` where a query sees no key).
    implementation: None (the fastest for the platform), a backend name ("triton",
      "pallas", "xla") or a sequence tried in order; a backend that cannot run the
      configuration raises `NotImplementedError` and the next one runs. "xla" always works.

  Returns:
    `out` with q's shape and dtype, or `(out, lse)`. Differentiable (exact gradients, with
    memory linear in N), and usable under `jit` and `vmap`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from hilbert_ring_jax import DilatedPattern, dilated_attention
    >>> q = k = v = jnp.ones((1, 64, 4, 16))
    >>> p = DilatedPattern(segment_lengths=(16, 32), dilation_rates=(1, 2))
    >>> dilated_attention(q, k, v, p).shape
    (1, 64, 4, 16)
  """
  check_inputs(q, k, v, pattern)
  scale = check_scale(scale, q.shape[-1])
  errors = []
  for name in implementation_names(implementation):
    try:
      out, lse = _attention_jit(q, k, v, pattern, scale, name)
    except NotImplementedError as e:
      errors.append(f"{name}: {e}")
      continue
    return (out, lse) if return_lse else out
  raise NotImplementedError("no implementation can run this configuration: " + "; ".join(errors))
