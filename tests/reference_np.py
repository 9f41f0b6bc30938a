"""A float64 NumPy reference written from SPEC.md, independent of the library's code."""

import numpy as np


def multiplicity(n, num_heads, segment_lengths, dilation_rates, causal=False, offsets="head",
                 head_groups=False):
  """`m[h, i, j]`: the number of branches in which key j is visible to query i, head h."""
  m = np.zeros((num_heads, n, n), np.float64)
  k = len(segment_lengths)
  if head_groups:
    sizes = [num_heads // k + (1 if b < num_heads % k else 0) for b in range(k)]
    starts = np.cumsum([0] + sizes)
    group_of = {h: b for b in range(k) for h in range(starts[b], starts[b + 1])}
  i = np.arange(n)[:, None]
  j = np.arange(n)[None, :]
  for b, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
    w = min(w, n)
    res_i, res_j = (i % w) % r, (j % w) % r
    seen = (i // w == j // w) & (res_i == res_j)  # what every head of the branch sees, ...
    if causal:
      seen &= j <= i
    for h in range(num_heads):
      if head_groups and group_of[h] != b:
        continue
      m[h] += seen & (res_i == h % r) if offsets == "head" else seen  # ... or its residue's
  return m


def same_document(q_ids, kv_ids=None):
  """`[B, X, N, N]`: 1 where query i and key j are of the same document (packed rows), from
  one `[B, N]` array of ids (X = 1), or the queries' and the keys' (`[B, N]` each, X = 1; or
  per head, `[B, N, H]` and `[B, N, Hkv]`, X = H)."""
  q_ids = np.asarray(q_ids)
  kv_ids = q_ids if kv_ids is None else np.asarray(kv_ids)
  if q_ids.ndim == 2:
    return (q_ids[:, None, :, None] == kv_ids[:, None, None, :]).astype(np.float64)
  kv_ids = np.repeat(kv_ids, q_ids.shape[2] // kv_ids.shape[2], axis=2)
  return (q_ids.transpose(0, 2, 1)[..., :, None] ==
          kv_ids.transpose(0, 2, 1)[..., None, :]).astype(np.float64)


def attention(q, k, v, m, scale, dout=None, dlse=None):
  """Returns out, lse and, given cotangents, (dq, dk, dv), all in float64.

  q: [B, N, H, D]; k, v: [B, N, Hkv, D]; m: [H, N, N] multiplicities, or [B, H, N, N]
  (e.g. times `same_document(segment_ids)`). (`optimize=True`: the batched products go
  through BLAS, ~6x quicker at N = 4096.)
  """
  m = m if m.ndim == 4 else m[None]
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  h, hkv = q.shape[2], k.shape[2]
  kh, vh = (np.repeat(x, h // hkv, axis=2) for x in (k, v))
  s = scale * np.einsum("bihd,bjhd->bhij", q, kh, optimize=True)
  # In place (the [B, H, N, N] passes are most of the time at N = 4096): -inf where a query
  # does not see the key, so that e = m * exp(s - s_max) is 0 there.
  s[~np.broadcast_to(m > 0, s.shape)] = -np.inf
  s_max = s.max(-1, keepdims=True)
  s_max[~np.isfinite(s_max)] = 0.0  # a query that sees no key
  s -= s_max
  e = np.multiply(m, np.exp(s, out=s), out=s)
  den = e.sum(-1)
  with np.errstate(divide="ignore"):
    lse = np.log(den) + s_max[..., 0]  # [B, H, N]
  p = e / np.where(den > 0, den, 1.0)[..., None]  # m * exp(s - lse)
  out = np.einsum("bhij,bjhd->bihd", p, vh, optimize=True)
  lse = np.moveaxis(lse, 1, 2)  # [B, N, H]
  if dout is None:
    return out, lse
  dout = np.asarray(dout, np.float64)
  dlse = np.asarray(dlse, np.float64)
  delta = (dout * out).sum(-1) - dlse  # [B, N, H]
  dp = np.einsum("bihd,bjhd->bhij", dout, vh, optimize=True)
  dp -= np.moveaxis(delta, 1, 2)[..., None]
  ds = np.multiply(p, dp, out=dp)  # p (dp - delta)
  dq = scale * np.einsum("bhij,bjhd->bihd", ds, kh, optimize=True)
  dkh = scale * np.einsum("bhij,bihd->bjhd", ds, q, optimize=True)
  dvh = np.einsum("bhij,bihd->bjhd", p, dout, optimize=True)
  sum_groups = lambda x: x.reshape(*x.shape[:2], hkv, h // hkv, x.shape[-1]).sum(3)
  return out, lse, (dq, sum_groups(dkh), sum_groups(dvh))
