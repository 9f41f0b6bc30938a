"""The one log-sum-exp merge: branches, key blocks and ring steps all combine through it."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp


def merge(outs: Sequence[jnp.ndarray], lses: Sequence[jnp.ndarray]):
  """Combines softmax-attention partials over disjoint (multi)sets of keys.

  Each partial is `(o_i, lse_i)`: a normalized attention output `[..., D]` over its keys and
  the log of its softmax denominator `[...]`. The result is the attention over the union:

      lse = logsumexp_i lse_i,   out = sum_i exp(lse_i - lse) * o_i

  A row no partial sees (`lse_i = -inf` for all `i`) gets `out = 0`, `lse = -inf`, never NaN.
  Computed in the dtype of the inputs (callers pass float32 accumulators).

  Example:
    >>> o, lse = merge([o_a, o_b], [lse_a, lse_b])  # doctest: +SKIP
  """
  if len(outs) != len(lses) or not outs:
    raise ValueError(f"merge needs matching, non-empty outs and lses, got {len(outs)=} {len(lses)=}")
  if len(outs) == 1:
    return outs[0], lses[0]
  lse_max = lses[0]
  for lse in lses[1:]:
    lse_max = jnp.maximum(lse_max, lse)
  # A fully masked row has lse_max = -inf; shifting by 0 there keeps exp() finite.
  shift = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  weights = [jnp.exp(lse - shift) for lse in lses]
  den = sum(weights[1:], weights[0])
  lse = shift + jnp.log(den)
  inv = 1.0 / jnp.where(den > 0, den, 1.0)
  out = sum((w * inv)[..., None] * o for w, o in zip(weights, outs))
  return out, lse
