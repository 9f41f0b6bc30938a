"""A dense reference of docs/SPEC.md's function: O(N^2) memory, for checks and small examples."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .api import check_inputs, check_scale, check_segment_ids
from .pattern import DilatedPattern, heads_per_kv


def visibility_counts(pattern: DilatedPattern, n: int, num_heads: int) -> np.ndarray:
  """`m[h, i, j]`: in how many branches key `j` is visible to query `i` for head `h`."""
  return sum(br.visible(num_heads).astype(np.int32) for br in pattern.layout(n, num_heads))


def same_document(segment_ids):
  """`[B, 1, N, N]` bool: query `i` and key `j` are of one document (`segment_ids [B, N]`)."""
  return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def dilated_attention_reference(q, k, v, pattern: DilatedPattern, *, segment_ids=None,
                                scale=None, return_lse=False):
  """Dense `dilated_attention` (same arguments) with explicit multiplicity masks.

  Materializes `[B, H, N, N]` scores: use it to check results at small N. Inputs are
  checked as `dilated_attention` checks them (`ValueError` naming the argument). Computes in
  float32, or float64 for float64 inputs (with `jax_enable_x64`); the tests' float64
  reference is a NumPy twin of it (tests/reference_np.py).
  """
  check_inputs(q, k, v, pattern)
  b, n, h, d = q.shape
  scale = check_scale(scale, d)
  acc = jnp.promote_types(q.dtype, jnp.float32)
  counts = jnp.asarray(visibility_counts(pattern, n, h), acc)  # [H, N, N]
  segment_ids = check_segment_ids(segment_ids, q)
  if segment_ids is not None:  # [B, H, N, N]: only keys of the query's document
    counts = counts * same_document(segment_ids)
  per_kv = heads_per_kv(h, k.shape[2])
  kh = jnp.repeat(k, per_kv, axis=2).astype(acc)
  vh = jnp.repeat(v, per_kv, axis=2).astype(acc)
  # s: [B, H, N, N]
  full = jax.lax.Precision.HIGHEST  # (XLA's default rounds float32 products to TF32 on GPUs)
  s = jnp.einsum("BTHD,BSHD->BHTS", q.astype(acc), kh, precision=full) * scale
  s = jnp.where(counts > 0, s, -jnp.inf)
  mx = jnp.max(s, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = counts * jnp.exp(s - mx)
  den = jnp.sum(e, axis=-1)
  out = jnp.einsum("BHTS,BSHD->BTHD", e / jnp.where(den > 0, den, 1.0)[..., None], vh,
                   precision=full)
  lse = jnp.moveaxis(mx[..., 0] + jnp.log(den), 1, 2)
  out = out.astype(q.dtype)
  return (out, lse.astype(jnp.float32)) if return_lse else out
