"""`dilated_attention`: input checks, then the backend `backends.resolve` picks."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from . import backends
from .pattern import DilatedPattern


def _dtypes() -> tuple:
  """The input dtypes every backend computes in: float64 too when JAX runs with x64."""
  wide = (jnp.float64,) if jax.config.read("jax_enable_x64") else ()
  return (jnp.float32, jnp.bfloat16, jnp.float16) + wide


def check_dtype(name: str, dtype) -> jnp.dtype:
  """`dtype` as a `jnp.dtype` if every backend computes in it, else `ValueError` naming
  `name` (an array's, or a dtype argument's) and, for float64 without x64, how to cast."""
  got = name if name.endswith("dtype") else f"{name}.dtype"
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{name} must be float32, bfloat16 or float16, got {got}={dtype!r}") from e
  if not any(dtype == t for t in _dtypes()):
    hint = (" (float64 needs jax.config.update('jax_enable_x64', True); or cast, e.g. "
            "x.astype(jnp.float32))" if dtype == jnp.float64 else "")
    raise ValueError(f"{name} must be float32, bfloat16 or float16 (float64 with x64), got "
                     f"{got}={dtype}{hint}")
  return dtype


def check_inputs(q, k, v, pattern) -> None:
  """Raises `ValueError` naming the argument for anything docs/SPEC.md calls bad input."""
  if not isinstance(pattern, DilatedPattern):
    raise ValueError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise ValueError(f"{name} must be an array (jax or NumPy), got {type(x).__name__}")
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must have rank 4 [B, N, H, D], got {name}.shape={jnp.shape(x)}")
    check_dtype(name, x.dtype)
    if min(x.shape) < 1:
      raise ValueError(f"{name} must have B, N, H and D >= 1, got {name}.shape={x.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {k.shape=} and {v.shape=}")
  for axis, what in ((0, "batch"), (1, "sequence length"), (3, "head dim")):
    if not q.shape[axis] == k.shape[axis]:
      raise ValueError(
          f"q and k/v must have the same {what} (axis {axis}): {q.shape=}, {k.shape=}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"the number of query heads must be a multiple of the key/value heads: "
        f"{q.shape=} has {q.shape[2]} heads, {k.shape=} has {k.shape[2]}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k and v must share a dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")
  pattern.head_ranges(q.shape[2])  # head_groups needs H >= number of branches


def check_segment_ids(segment_ids, q):
  """`segment_ids` as an integer `[B, N]` array matching `q` (or None), else `ValueError`
  naming the argument. Any integer values are valid (checked on shapes and dtypes alone, so
  traced ids under `jit` are checked alike)."""
  if segment_ids is None:
    return None
  if not (hasattr(segment_ids, "shape") and hasattr(segment_ids, "dtype")):
    raise ValueError(f"segment_ids must be None or an integer array [B, N] (jax or NumPy), "
                     f"got {type(segment_ids).__name__}")
  if tuple(segment_ids.shape) != tuple(q.shape[:2]):
    raise ValueError(f"segment_ids must have shape [B, N] = {tuple(q.shape[:2])} (q's batch "
                     f"and sequence length), got segment_ids.shape={tuple(segment_ids.shape)}")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must have an integer dtype (a document id per token), got "
                     f"segment_ids.dtype={segment_ids.dtype}")
  return jnp.asarray(segment_ids)


def check_flag(name: str, value) -> bool:
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be a bool, got {name}={value!r}")
  return value


def check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return head_dim ** -0.5
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
    raise ValueError(f"scale must be a finite Python number or None, got {scale=!r}")
  return float(scale)


@dataclasses.dataclass(frozen=True)
class _Dispatch:
  """The kernel contract of one `dilated_attention` call: backends resolved, config bound."""

  pattern: DilatedPattern
  scale: float
  forward_backend: str
  backward_backend: str
  config: object = None

  def forward(self, q, k, v, **ids):
    backend = backends.load(self.forward_backend)
    return backend.forward(q, k, v, self.pattern, self.scale, out_dtype=q.dtype,
                           config=backends.config_for(backend, self.config), **ids)

  def backward(self, q, k, v, dout, lse, delta, **ids):
    backend = backends.load(self.backward_backend)
    return backend.backward(q, k, v, dout, lse, delta, self.pattern, self.scale,
                            config=backends.config_for(backend, self.config),
                            grad_dtype=q.dtype, **ids)


# Compiled as one program even when called eagerly; inlined under an outer jit.
_attention_jit = jax.jit(backends.attention, static_argnums=3)


def dilated_attention(q, k, v, pattern: DilatedPattern, *, segment_ids=None,
                      scale: float | None = None, return_lse: bool = False,
                      implementation: str | Sequence[str] | None = None, config=None):
  """LongNet dilated attention: every branch of `pattern`, merged by softmax denominators.

  Computes the function of docs/SPEC.md: for query `i` and head `h`, a softmax over the keys
  each branch makes visible (counted once per branch that sees them), in float32.

  Args:
    q: `[B, N, H, D]` queries, in processing order (serialize first for a Hilbert order).
    k, v: `[B, N, Hkv, D]` with `H % Hkv == 0`; query head `h` reads `h // (H // Hkv)`.
    pattern: a `DilatedPattern`.
    segment_ids: None, or an integer `[B, N]` array: the document of each token of rows that
      pack several (packed sequences). Query `i` then sees key `j` only where the pattern
      makes it visible and `segment_ids[b, i] == segment_ids[b, j]`; the pattern's segments
      stay on global positions (docs/SPEC.md, section 3). Every backend runs them.
    scale: score scale, default `D ** -0.5`.
    return_lse: also return the float32 `[B, N, H]` log of the softmax denominator
      (`-inf` where a query sees no key).
    implementation: None (the fastest for the platform), a backend name ("mosaic",
      "triton", "pallas", "xla") or a sequence: the first that supports the configuration
      runs, forward and backward. "xla" supports every valid configuration.
    config: a backend's `Config` (e.g. `hilbert_ring_jax.backends.triton.Config(...)`) to
      run that backend with instead of its tuned defaults; other backends ignore it.

  Returns:
    `out` with q's shape and dtype, or `(out, lse)`. Differentiable (exact gradients, with
    memory linear in N), and usable under `jit` and `vmap`.

  Raises:
    ValueError: bad input (docs/SPEC.md, section 9), naming the argument.
    NotImplementedError: no candidate backend runs the configuration (`NoBackendError`,
      with each backend's reason).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from hilbert_ring_jax import DilatedPattern, dilated_attention
    >>> q = k = v = jnp.ones((1, 64, 4, 16))
    >>> p = DilatedPattern(segment_lengths=(16, 32), dilation_rates=(1, 2))
    >>> dilated_attention(q, k, v, p).shape
    (1, 64, 4, 16)
    >>> docs = jnp.repeat(jnp.arange(4), 16)[None]  # four documents of 16 tokens in one row
    >>> dilated_attention(q, k, v, p, segment_ids=docs).shape
    (1, 64, 4, 16)
  """
  check_inputs(q, k, v, pattern)
  scale = check_scale(scale, q.shape[-1])
  check_flag("return_lse", return_lse)
  segment_ids = check_segment_ids(segment_ids, q)
  names = backends.candidates(implementation)
  backends.check_config(config)
  problem = dataclasses.replace(backends.Problem.of(q, k, pattern),
                                segment_ids=segment_ids is not None)
  forward = backends.resolve(names, problem)
  backward = backends.resolve(names, dataclasses.replace(problem, backward=True))
  kernel = _Dispatch(pattern, scale, forward, backward, config)
  ids = None if segment_ids is None else (segment_ids, segment_ids)
  out, lse = _attention_jit(q, k, v, kernel, ids)
  return (out, lse) if return_lse else out
