"""The one log-sum-exp merge: branches, key blocks and ring steps all combine through it."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp


def _check_shapes(outs, lses):
  """`ValueError` unless the outs share one shape `[..., D]` and every lse is `[...]`."""
  out_shape = jnp.shape(outs[0])
  if not out_shape:
    raise ValueError(f"outs must have a last (feature) axis, got outs[0] of shape {out_shape}")
  for i, o in enumerate(outs):
    if jnp.shape(o) != out_shape:
      raise ValueError(f"outs must all have one shape, got outs[0] of shape {out_shape} and "
                       f"outs[{i}] of shape {jnp.shape(o)}")
  for i, lse in enumerate(lses):
    # Broadcasting would silently mix rows of different partials.
    if jnp.shape(lse) != out_shape[:-1]:
      raise ValueError(f"lses[{i}] must have its out's shape without the last axis, "
                       f"{out_shape[:-1]}, got shape {jnp.shape(lse)}")


def merge(outs: Sequence[jnp.ndarray], lses: Sequence[jnp.ndarray]):
  """Combines softmax-attention partials over disjoint (multi)sets of keys.

  Each partial is `(o_i, lse_i)`: a normalized attention output `[..., D]` over its keys and
  the log of its softmax denominator `[...]`. The result is the attention over the union:

      lse = logsumexp_i lse_i,   out = sum_i exp(lse_i - lse) * o_i

  A row no partial sees (`lse_i = -inf` for all `i`) gets `out = 0`, `lse = -inf`, never NaN,
  and zero gradients with respect to every `o_i` and `lse_i`; a partial with `lse_i = -inf`
  adds nothing to its row, whatever its `o_i` (NaN too), and gets zero gradients there. A
  partial with `lse_i = +inf` (an overflowed denominator) dominates its row: `out` is the mean
  of the `o_i` with `lse_i = +inf`, `lse = +inf`, and the gradient with respect to the `lse_i`
  of that row is zero. (A single partial is returned as it is, and so are its gradients.)
  Computed in the inputs' promoted dtype: float32 where the lses are (16-bit `outs` are
  promoted).

  Args:
    outs: partial outputs, all of one shape `[..., D]`.
    lses: their log-denominators, each of shape `[...]` (its out's shape without `D`).

  Returns:
    `(out [..., D], lse [...])`.

  Example:
    >>> o_a, o_b = jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 1.0]])
    >>> out, lse = merge([o_a, o_b], [jnp.array([0.0]), jnp.array([0.0])])  # equal weights
    >>> out.tolist(), round(float(lse[0]), 4)  # lse = log(1 + 1)
    ([[0.5, 0.5]], 0.6931)
  """
  if len(outs) != len(lses) or not outs:
    raise ValueError(
        f"merge needs matching, non-empty outs and lses, got {len(outs)=} {len(lses)=}")
  _check_shapes(outs, lses)
  if len(outs) == 1:
    return outs[0], lses[0]
  lse_max = lses[0]
  for lse in lses[1:]:
    lse_max = jnp.maximum(lse_max, lse)
  # A row with an lse of +inf keeps only those partials, as lse 0 (the rest -inf): finite
  # weights and gradients. Finite rows pass through every where() unchanged.
  overflow = lse_max == jnp.inf
  lses = [jnp.where(overflow, jnp.where(lse == jnp.inf, 0.0, -jnp.inf), lse) for lse in lses]
  lse_max = jnp.where(overflow, 0.0, lse_max)
  # A fully masked row has lse_max = -inf; shifting by 0 there keeps exp() finite.
  shift = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  weights = [jnp.exp(lse - shift) for lse in lses]
  den = sum(weights[1:], weights[0])
  # Double where: log() only sees den > 0, so a masked row (den = 0) gets lse = -inf with a
  # zero gradient instead of 0 * log'(0) = NaN. (`!= 0`, not `> 0`: a NaN row stays NaN.)
  seen = den != 0
  safe_den = jnp.where(seen, den, 1.0)
  lse = jnp.where(seen, shift + jnp.log(safe_den), -jnp.inf)
  lse = jnp.where(overflow, jnp.inf, lse)
  inv = 1.0 / safe_den
  # A partial that saw no key (lse_i = -inf) adds exactly 0, also where its o_i is NaN or inf:
  # a caller may hide keys by their lse alone (the ring's causal gathers), and weight 0 times
  # a NaN would spread a NaN key to the rows that cannot see it. (Its o_i replaced before the
  # product, so that the gradients do not meet the NaN either.)
  out = sum((w * inv)[..., None] * jnp.where((lse_i == -jnp.inf)[..., None], 0.0, o)
            for w, o, lse_i in zip(weights, outs, lses))
  return out, lse
